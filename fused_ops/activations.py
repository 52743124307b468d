"""Activations and their derivatives as Triton device functions, picked by a compile-time name.

The matmul kernels call `activation(x, NAME)` / `activation_grad(x, NAME)` in their epilogues; since
NAME is a `tl.constexpr`, each kernel compiles only the branch it uses. Everything is evaluated in the accumulator dtype (fp32; fp64 under the interpreter's gradcheck).

Model-level names map to kernel names here: a plain activation is one name; a gated one is a pair
(gate activation, up activation), out = gate_act(gate) * up_act(up).
"""

import triton
import triton.language as tl

PLAIN = ("identity", "gelu", "gelu_tanh", "relu", "relu2")
GATED = {
    "swiglu": ("silu", "identity"),
    "geglu": ("gelu", "identity"),
    "geglu_tanh": ("gelu_tanh", "identity"),
    "sigmoid_tanh": ("sigmoid", "tanh"),  # a split activation: both halves go through a nonlinearity
}

SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_C = tl.constexpr(0.044715)


def kernel_activations(name):
    """(activation, up_activation, gated) kernel names for a model-level activation name."""
    if name in PLAIN:
        return name, "identity", False
    if name in GATED:
        return GATED[name][0], GATED[name][1], True
    raise ValueError(f"activation must be one of {list(PLAIN) + list(GATED)}, got {name!r}")


# tanh and sigmoid are written out through exp where they are used: libdevice's tanh is missing under
# the CPU interpreter, and the interpreter breaks on jit helpers nested two calls deep.
# tanh(x) = 2 / (1 + exp(-2x)) - 1;  sigmoid(x) = 1 / (1 + exp(-x)).


@triton.jit
def activation(x, NAME: tl.constexpr):
    if NAME == "identity":
        return x
    elif NAME == "gelu":
        return 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))
    elif NAME == "gelu_tanh":
        t = 2.0 / (1.0 + tl.exp((x + x * x * x * GELU_TANH_C) * (-2.0 * SQRT_2_OVER_PI))) - 1.0
        return 0.5 * x * (1.0 + t)
    elif NAME == "relu":
        return tl.maximum(x, 0.0)
    elif NAME == "relu2":
        r = tl.maximum(x, 0.0)
        return r * r
    elif NAME == "silu":
        return x / (1.0 + tl.exp(-x))
    elif NAME == "sigmoid":
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        tl.static_assert(NAME == "tanh", "unknown activation")
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def activation_grad(x, NAME: tl.constexpr):
    """d activation(x) / dx."""
    if NAME == "identity":
        return x * 0.0 + 1.0
    elif NAME == "gelu":
        return 0.5 * (1.0 + tl.erf(x * SQRT_HALF)) + x * tl.exp(-0.5 * x * x) * INV_SQRT_2PI
    elif NAME == "gelu_tanh":
        t = 2.0 / (1.0 + tl.exp((x + x * x * x * GELU_TANH_C) * (-2.0 * SQRT_2_OVER_PI))) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (1.0 + x * x * (3.0 * GELU_TANH_C)) * SQRT_2_OVER_PI
    elif NAME == "relu":
        return tl.where(x > 0.0, 1.0, 0.0)
    elif NAME == "relu2":
        return 2.0 * tl.maximum(x, 0.0)
    elif NAME == "silu":
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    elif NAME == "sigmoid":
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 - s)
    else:
        tl.static_assert(NAME == "tanh", "unknown activation")
        t = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
        return 1.0 - t * t


@triton.jit
def gelu_and_grad_16bit(x):
    """(GELU(x), GELU'(x)) = (x·Φ(x), Φ(x) + x·φ(x)) with Φ from erfc's Chebyshev fit (Numerical Recipes'
    erfcc): one reciprocal, nine FMAs and two exps instead of libdevice's erf. Evaluated in fp32 it is
    within 2.1e-5 of Φ, relative, in both tails: far under the 3.9e-3 (bf16) and 4.9e-4 (fp16) of the
    16-bit outputs it is used for, not under fp32's. In the ping-pong kernel (pingpong.py, 4-warp
    consumers) libdevice's erf alone added 85 us to a 114 us forward (H100, 12288x3072x768)."""
    z = x * SQRT_HALF
    # the fast (not IEEE-rounded) division; its numerator a tensor shaped (and, in Gluon, laid out) like z
    t = tl.fdiv(1.0 + 0.0 * z, 1.0 + 0.5 * tl.abs(z))
    p = t * 0.17087277 - 0.82215223
    p = p * t + 1.48851587
    p = p * t - 1.13520398
    p = p * t + 0.27886807
    p = p * t - 0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t - 1.26551223
    gauss = tl.exp(-z * z)
    half_erfc = 0.5 * t * gauss * tl.exp(p)  # erfc(|z|) / 2
    cdf = tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)
    return x * cdf, cdf + x * gauss * INV_SQRT_2PI
