"""The activations and their derivatives (fused_ops/activations.py) element by element, against float64.

A one-line Triton kernel evaluates each device function on fp32 inputs over the range a pre-activation
takes, tails included; run natively on a GPU, through the interpreter on CPU.
"""

import pytest
import torch
import triton
import triton.language as tl

from fused_ops.activations import GATED, PLAIN, activation, activation_grad, gelu_and_grad_16bit
from model import PLAIN_ACTIVATIONS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024


@triton.jit
def _evaluate(x_ptr, out_ptr, grad_ptr, n, NAME: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if NAME == "gelu_16bit":
        out, grad = gelu_and_grad_16bit(x)
    else:
        out, grad = activation(x, NAME), activation_grad(x, NAME)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(grad_ptr + offs, grad, mask=mask)


def evaluate(name, x):
    out, grad = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    _evaluate[(triton.cdiv(x.numel(), BLOCK),)](x, out, grad, x.numel(), NAME=name, BLOCK=BLOCK)
    return out.double().cpu(), grad.double().cpu()


def reference(name, x):
    """(act(x), act'(x)) in float64 by autograd through PyTorch's own functions."""
    x = x.double().cpu().requires_grad_()
    # the model's eager activations, and the halves the gated ones are built from
    f = {**PLAIN_ACTIVATIONS, "identity": lambda v: v, "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid,
         "tanh": torch.tanh}[name]
    y = f(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), grad


def inputs():
    """A grid over [-12, 12] (GELU's tails underflow to exactly 0 and x beyond), plus values near 0."""
    x = torch.cat([torch.linspace(-12, 12, 4801), torch.linspace(-1e-3, 1e-3, 201)])
    return x.to(DEVICE, torch.float32)


KERNEL_NAMES = sorted(set(PLAIN) | {name for pair in GATED.values() for name in pair})


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_activation_and_its_derivative(name):
    x = inputs()
    out, grad = evaluate(name, x)
    ref_out, ref_grad = reference(name, x)
    # fp32 math: a few ulps of the value, or of 1 where it crosses 0 (tanh, the gelu's near 0)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6), (out - ref_out).abs().max()
    assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6), (grad - ref_grad).abs().max()


def test_gelu_16bit_is_within_its_documented_error():
    """The fitted GELU of the 16-bit kernels: Φ within ~1e-5 relative in both tails, far under bf16/fp16
    rounding (3.9e-3 / 4.9e-4), and GELU' as close in absolute terms; finite for huge |x| too (where t's
    d² overflows). The reference Φ is float64 erfc: F.gelu's 0.5·(1 + erf) cancels to 0 in the lower tail,
    even in float64."""
    x = torch.cat([inputs(), torch.tensor([1e10, -1e10, 1e30, -1e30], device=DEVICE)])
    out, grad = evaluate("gelu_16bit", x)
    xd = x.double().cpu()
    ref_cdf = 0.5 * torch.special.erfc(-xd / 2 ** 0.5)
    ref_grad = ref_cdf + xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    keep = (xd.abs() > 1e-4) & (ref_cdf > 1e-30)
    cdf = out / xd  # GELU(x) / x = Φ(x), where x != 0
    assert ((cdf - ref_cdf).abs() / ref_cdf)[keep].max() < 2e-5
    assert ((1 - cdf) - (1 - ref_cdf)).abs()[keep].max() < 5e-6  # the upper tail, 1 - Φ, in absolute terms
    assert ((out - xd * ref_cdf).abs() <= 1e-6 * xd.abs().clamp_min(1)).all()
    assert (grad - ref_grad).abs().max() < 2e-5
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()


SPECIAL = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 100.0, -100.0, 0.0, -0.0, 1.0]


def eager_same_dtype(name, x):
    """(act(x), act'(x)) by PyTorch's autograd in x's own dtype and device: where NaN and inf come out."""
    x = x.detach().requires_grad_()
    f = {**PLAIN_ACTIVATIONS, "identity": lambda v: v, "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid,
         "tanh": torch.tanh, "gelu_16bit": PLAIN_ACTIVATIONS["gelu"]}[name]
    y = f(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    return y.detach().double().cpu(), grad.double().cpu()


@pytest.mark.parametrize("name", KERNEL_NAMES + ["gelu_16bit"])
def test_nan_and_inf_come_out_where_eager_gives_them(name):
    """A NaN must reach the loss (train.py stops on it): each function and its derivative give NaN, +inf
    and -inf exactly where PyTorch's eager activation does, on NaN, inf and values whose powers overflow.
    relu and relu2 once gave 0 for NaN (tl.maximum drops it); identity's derivative gave NaN for inf."""
    x = torch.tensor(SPECIAL, device=DEVICE)
    for ours, ref, what in zip(evaluate(name, x), eager_same_dtype(name, x), ("output", "derivative")):
        assert torch.equal(ours.isnan(), ref.isnan()), f"{name} {what}: NaN at {x[ours.isnan()].tolist()}, " \
                                                       f"eager at {x[ref.isnan()].tolist()}"
        assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()]), \
            f"{name} {what}: inf {ours.tolist()} vs eager {ref.tolist()}"
