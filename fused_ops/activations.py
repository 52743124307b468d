"""Activations and their derivatives as Triton device functions, picked by a compile-time name.

The matmul kernels call `activation(x, NAME)` / `activation_grad(x, NAME)` in their epilogues; since
NAME is a `tl.constexpr`, each kernel compiles only the branch it uses. Everything is evaluated in the accumulator dtype (fp32; fp64 under the interpreter's gradcheck).

Model-level names map to kernel names here: a plain activation is one name; a gated one is a pair
(gate activation, up activation), out = gate_act(gate) * up_act(up).
"""

import triton
import triton.language as tl

from . import env

# silu_and_grad (the gated ping-pong epilogue's) uses the GPU's approximate exp2 and reciprocal with subnormals
# flushed: one MUFU instruction each, where tl.exp and a division add range fix-ups for subnormal results (a compare, a
# select and a multiply each): 14% fewer instructions in the gated FP8 forward (a SASS count; git log --
# lab/sass_stats.py). Flushing moves
# only results below 2^-126 (~1e-38). Under the interpreter (CPU), plain Triton.
_FLUSH_ASM = tl.constexpr(not env.INTERPRET)


@triton.jit
def _exp2_ftz(x):
    if _FLUSH_ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@triton.jit
def _reciprocal_ftz(x):
    if _FLUSH_ASM:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return 1.0 / x


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


# NaN, inf and overflow: each function and its derivative give what tests/special_values.py writes down,
# machine-independently (docs/numerics.md): NaN for NaN (except the derivatives of identity, a constant 1,
# and relu, 1 as PyTorch's relu backward), the mathematical limit at ±inf, and for finite x the exact value
# rounded to the output dtype, inf where that overflows (relu2(1e20)). A diverged run's NaN so reaches the
# loss, where train.py stops. Comparisons with NaN are false, so a branch is written to fall through to x
# for NaN: tl.maximum(x, 0) and tl.where(x > 0, x, 0) both give 0 there.
#
# Where a factor that vanishes in a tail multiplies x (GELU's x·Φ(x) and x·φ(x), SiLU's x·σ(x), the tanh
# GELU's x·(1 - t²)·(1 + 3c·x²)), x is clamped to ±TAIL first: beyond it that factor is exactly 0 (or the
# other one exactly 1) in fp32 and fp64 alike, so the clamp changes no finite result, and ±inf (or a finite
# x whose x² overflows) gives the limit instead of inf·0 = NaN. The clamps are where()s, which keep NaN.
#
# tanh and sigmoid are written out through exp where they are used: libdevice's tanh is missing under
# the CPU interpreter, and the interpreter breaks on jit helpers nested two calls deep.
# tanh(x) = 2 / (1 + exp(-2x)) - 1;  sigmoid(x) = 1 / (1 + exp(-x)).
TAIL = tl.constexpr(1000.0)  # exp(-1000) and e^(-1000²/2) are 0 in fp64, so σ(-TAIL), Φ(-TAIL), φ(TAIL) too
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def activation(x, NAME: tl.constexpr):
    if NAME == "identity":
        return x
    elif NAME == "gelu":  # x clamped below: gelu(-inf) = -0, the limit, not -inf · 0
        xl = tl.where(x < -TAIL, -TAIL, x)
        return 0.5 * xl * (1.0 + tl.erf(xl * SQRT_HALF))
    elif NAME == "gelu_tanh":
        xl = tl.where(x < -TAIL, -TAIL, x)
        t = 2.0 / (1.0 + tl.exp((xl + xl * xl * xl * GELU_TANH_C) * (-2.0 * SQRT_2_OVER_PI))) - 1.0
        return 0.5 * xl * (1.0 + t)
    elif NAME == "relu":  # not tl.maximum(x, 0.0), which turns NaN into 0 (see the note above)
        return tl.where(x < 0.0, 0.0, x)
    elif NAME == "relu2":
        r = tl.where(x < 0.0, 0.0, x)
        return r * r
    elif NAME == "silu":
        xl = tl.where(x < -TAIL, -TAIL, x)
        return xl / (1.0 + tl.exp(-xl))
    elif NAME == "sigmoid":
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        tl.static_assert(NAME == "tanh", "unknown activation")
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def activation_grad(x, NAME: tl.constexpr):
    """d activation(x) / dx."""
    if NAME == "identity":  # exactly 1, also at NaN / inf (x * 0 + 1 would be NaN there); where() keeps
        return tl.where(x == x, 1.0, 1.0)  # x's shape and layout, also in the Gluon kernel (pingpong.py)
    elif NAME == "gelu":  # x·φ(x) with x clamped to ±TAIL: 0, not inf · 0, at ±inf
        xc = tl.where(x < -TAIL, -TAIL, tl.where(x > TAIL, TAIL, x))
        return 0.5 * (1.0 + tl.erf(x * SQRT_HALF)) + xc * tl.exp(-0.5 * xc * xc) * INV_SQRT_2PI
    elif NAME == "gelu_tanh":  # clamped as gelu's: x·(1 - t²)·(1 + 3c·x²) was NaN from |x| ~ 1e19 (x² overflows)
        xc = tl.where(x < -TAIL, -TAIL, tl.where(x > TAIL, TAIL, x))
        t = 2.0 / (1.0 + tl.exp((xc + xc * xc * xc * GELU_TANH_C) * (-2.0 * SQRT_2_OVER_PI))) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * (1.0 + xc * xc * (3.0 * GELU_TANH_C)) * SQRT_2_OVER_PI
    elif NAME == "relu":  # 1 at NaN, as PyTorch's relu backward (it zeroes the gradient where relu(x) <= 0)
        return tl.where(x <= 0.0, 0.0, 1.0)
    elif NAME == "relu2":
        return 2.0 * tl.where(x < 0.0, 0.0, x)
    elif NAME == "silu":  # σ(x)·(1 + x·(1 - σ(x))), x clamped: 1 at +inf and -0 at -inf, not inf · 0
        xc = tl.where(x < -TAIL, -TAIL, tl.where(x > TAIL, TAIL, x))
        s = 1.0 / (1.0 + tl.exp(-xc))
        return s * (1.0 + xc * (1.0 - s))
    elif NAME == "sigmoid":
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 - s)
    else:
        tl.static_assert(NAME == "tanh", "unknown activation")
        t = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
        return 1.0 - t * t


@triton.jit
def silu_and_grad(x):
    """(SiLU(x), SiLU'(x)) = (x·σ(x), σ(x)·(1 + x·(1 - σ(x)))) from one σ: one exp and one reciprocal an element,
    where activation() and activation_grad() take two exps and two divisions (the gated ping-pong epilogue, whose math
    is on its critical path), both flushing subnormal results (see _FLUSH_ASM). Clamped as theirs, with the same
    limits: NaN gives (NaN, NaN), +inf (inf, 1), -inf (-0, -0); a multiply by σ instead of a division by 1 + exp(-x)
    moves the result by at most an ulp or so."""
    xl = tl.where(x < -TAIL, -TAIL, x)
    xc = tl.where(xl > TAIL, TAIL, xl)
    s = _reciprocal_ftz(1.0 + _exp2_ftz(xc * -LOG2E))  # (rcp(inf) = 0: σ(-TAIL) = 0)
    return xl * s, s * (1.0 + xc * (1.0 - s))


# Φ(-|x|) = φ(x) · t · P(t) with t = 1 / (1 + |x| / (2√2)) and P the degree-5 polynomial in
# gelu_and_grad_16bit, fitted to √(2π) · erfcx(|x|/√2) / (2t) by lab/fit_gelu_cdf.py.
GELU_CDF_T = tl.constexpr(0.3535533905932738)  # 1 / (2√2)
NEG_HALF_LOG2E = tl.constexpr(-0.7213475204444817)  # φ(x) = exp2(x² · this + LOG2_INV_SQRT_2PI)
LOG2_INV_SQRT_2PI = tl.constexpr(-1.3257480647361593)


@triton.jit
def gelu_and_grad_16bit(x):
    """(GELU(x), GELU'(x)) = (x·Φ(x), Φ(x) + x·φ(x)) for 16-bit outputs: one approximate reciprocal,
    one exp2 and a degree-5 polynomial an element, where libdevice's erf takes several times as many
    instructions and made the ping-pong kernel's epilogue, not its MMAs, the bottleneck (docs/performance.md).
    NaN gives (NaN, NaN), +inf (inf, 1) and -inf (-0, -0): the limits (tests/special_values.py; eager
    PyTorch gives NaN for all but gelu(+inf), and on AVX-512 CPUs for that too in fp32).
    Φ(-|x|) = φ(x)·t·P(t) (see GELU_CDF_T) is within ~6e-5 of Φ, relative, in both tails: a quarter of
    fp16's smallest half-ulp (2.4e-4) and a thirtieth of bf16's, so the outputs' rounding dominates; not fp32's."""
    # t = 1/d by rcp.approx (one MUFU instruction; an IEEE division adds range fix-ups); d ≥ 1, and
    # d = inf (|x| = inf) gives t = 0, where φ, and so the tail, is 0 whatever t is.
    d = 1.0 + GELU_CDF_T * tl.abs(x)
    t = _reciprocal_ftz(d)
    p = t * -0.112432442 + 0.101619701  # P(t), Horner's rule
    p = p * t + 0.26016567
    p = p * t + 0.295403641
    p = p * t + 0.35495178
    p = p * t + 0.353532801
    # φ(x), 1/√(2π) folded into the exponent. (x·k)·x, not (x·x)·k: as accurate, and in the portable kernel's first
    # tile config ptxas then spills 4 bytes, not 208 (results/portable/gelu_pair_h100.txt)
    phi = tl.exp2((x * NEG_HALF_LOG2E) * x + LOG2_INV_SQRT_2PI)
    tail = phi * t * p  # Φ(-|x|)
    cdf = tl.where(x >= 0.0, 1.0 - tail, tail)
    # x clamped where it multiplies a factor that is 0 beyond ±TAIL (see TAIL): the limits at ±inf, not inf · 0
    xl = tl.where(x < -TAIL, -TAIL, x)
    xc = tl.where(xl > TAIL, TAIL, xl)
    return xl * cdf, cdf + xc * phi


@triton.jit
def activation_and_grad(x, NAME: tl.constexpr, FAST16: tl.constexpr):
    """(activation(x, NAME), activation_grad(x, NAME)) in one go, what an epilogue that saves dh/dz needs.

    FAST16 (the outputs are 16-bit): GELU and SiLU share their transcendental between the value and the derivative
    (gelu_and_grad_16bit, silu_and_grad), within an ulp or so of fp32 and far under a 16-bit output's rounding. In a
    matmul's epilogue the activation math, not the stores, was what the tile waited on: libdevice's erf, evaluated
    twice, costs more instructions an element than the main loop issues (results/portable/). fp32 outputs keep the
    exact pair."""
    if FAST16 and NAME == "gelu":
        return gelu_and_grad_16bit(x)
    elif FAST16 and NAME == "silu":
        return silu_and_grad(x)
    else:
        return activation(x, NAME), activation_grad(x, NAME)
