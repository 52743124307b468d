"""The activations and their derivatives (fused_ops/activations.py) element by element, against float64.

A one-line Triton kernel evaluates each device function on fp32 inputs over the range a pre-activation
takes, tails included; run natively on a GPU, through the interpreter on CPU.
"""

import pytest
import torch
import triton
import triton.language as tl

from fused_ops.activations import (GATED, PLAIN, activation, activation_and_grad, activation_grad, gelu_and_grad_16bit,
                                   silu_and_grad)
from fused_ops.linear_act import linear_act_forward
from model import PLAIN_ACTIVATIONS
from special_values import INF, NAN, SPECIAL_INPUTS, assert_special_values_match, expected, times

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024


@triton.jit
def _evaluate(x_ptr, out_ptr, grad_ptr, n, NAME: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if NAME == "gelu_16bit":
        out, grad = gelu_and_grad_16bit(x)
    elif NAME == "silu_and_grad":
        out, grad = silu_and_grad(x)
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
         "tanh": torch.tanh, "silu_and_grad": torch.nn.functional.silu}[name]
    y = f(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), grad


def inputs():
    """A grid over [-12, 12] (GELU's tails underflow to exactly 0 and x beyond), plus values near 0."""
    x = torch.cat([torch.linspace(-12, 12, 4801), torch.linspace(-1e-3, 1e-3, 201)])
    return x.to(DEVICE, torch.float32)


KERNEL_NAMES = sorted(set(PLAIN) | {name for pair in GATED.values() for name in pair})


@pytest.mark.parametrize("name", KERNEL_NAMES + ["silu_and_grad"])
def test_activation_and_its_derivative(name):
    x = inputs()
    out, grad = evaluate(name, x)
    ref_out, ref_grad = reference(name, x)
    # fp32 math: a few ulps of the value, or of 1 where it crosses 0 (tanh, the gelu's near 0)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6), (out - ref_out).abs().max()
    assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6), (grad - ref_grad).abs().max()


def test_gelu_16bit_is_within_its_documented_error():
    """The fitted GELU of the 16-bit kernels: Φ within ~6e-5 relative in both tails, under a quarter of the
    smallest half-ulp of fp16 (2.4e-4; bf16's is 2e-3), and GELU' as close in absolute terms; finite for huge
    |x| too (where t = 1/d is 0). The reference Φ is float64 erfc: F.gelu's 0.5·(1 + erf) cancels to 0 in the
    lower tail, even in float64."""
    x = torch.cat([inputs(), torch.tensor([1e10, -1e10, 1e30, -1e30], device=DEVICE)])
    out, grad = evaluate("gelu_16bit", x)
    xd = x.double().cpu()
    ref_cdf = 0.5 * torch.special.erfc(-xd / 2 ** 0.5)
    ref_grad = ref_cdf + xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    keep = (xd.abs() > 1e-4) & (ref_cdf > 1e-30)
    cdf = out / xd  # GELU(x) / x = Φ(x), where x != 0
    assert ((cdf - ref_cdf).abs() / ref_cdf)[keep].max() < 7e-5
    assert ((1 - cdf) - (1 - ref_cdf)).abs()[keep].max() < 3.5e-5  # the upper tail, 1 - Φ, in absolute terms
    assert ((out - xd * ref_cdf).abs() <= 1e-5 * xd.abs().clamp_min(1)).all()
    assert (grad - ref_grad).abs().max() < 3.5e-5
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()


# NaN, ±inf and overflow: against the machine-independent table of tests/special_values.py, never against
# eager PyTorch (whose fp32 F.gelu(+inf) is NaN on AVX-512 CPUs and +inf elsewhere; issue 27).
@pytest.mark.parametrize("name", KERNEL_NAMES + ["gelu_16bit", "silu_and_grad"])
def test_special_values_are_the_limits(name):
    """A NaN must reach the loss (train.py stops on it): each function and its derivative give NaN at NaN
    (but identity' and relu', 1), the mathematical limit at ±inf, and the fp32-rounded exact value at
    finite inputs whose powers or exponentials overflow (never inf · 0 = NaN for a finite input). relu and
    relu2 once gave 0 for NaN (tl.maximum drops it); identity's derivative gave NaN for inf; gelu, gelu_tanh
    and silu gave NaN at -inf and their derivatives NaN at ±inf, gelu_tanh's from |x| ~ 1e19."""
    x = torch.tensor(SPECIAL_INPUTS, device=DEVICE)
    ours = evaluate(name, x)
    # the fitted 16-bit GELU is within ~6e-5 of Φ (test above), not fp32's ulps
    tol = dict(rtol=7e-5, atol=7e-5) if name == "gelu_16bit" else {}
    for o, ref, what in zip(ours, expected(name, SPECIAL_INPUTS), ("output", "derivative")):
        assert_special_values_match(o, ref, f"{name} {what} at {SPECIAL_INPUTS}", **tol)


def test_special_value_table_is_the_limit_of_the_finite_reference():
    """The table's ±inf entries are where the finite float64 reference goes at huge |x| (a check of the
    table itself, not of the kernels)."""
    for name in KERNEL_NAMES + ["gelu_16bit", "silu_and_grad"]:
        at_inf, at_minus_inf = expected(name, [INF, -INF])
        huge, minus_huge = expected(name, [1e300, -1e300])
        assert torch.equal(at_inf, huge) and torch.equal(at_minus_inf, minus_huge), name
        assert expected(name, [NAN])[0].isnan().all(), f"{name}: NaN in, NaN out"


@pytest.mark.parametrize("act", sorted(GATED))
def test_gated_special_values(act):
    """The gated epilogue (linear_act_forward) at every pair (gate, up) of special values: h = gate_act(g) ·
    up_act(u) and the saved [dh/dg | dh/du] are the IEEE products of the table's values (0 · inf = NaN).
    z = 0 @ W.T + b = b exactly, so the pairs go in through the bias."""
    gate_name, up_name = GATED[act]
    # (not -100: σ(-100) = 3.7e-44 and silu(-100) are fp32 subnormals, which the kernels give as 0, exp(100)
    # having overflowed (and GPUs flush anyway): fine alone, but times inf that is NaN, not ±inf)
    vals = [NAN, INF, -INF, 1e20, -1e20, 100.0, -20.0, 0.0, 1.0]
    g = [a for a in vals for _ in vals]
    u = [b for _ in vals for b in vals]
    n = len(g)
    bias = torch.tensor(g + u, dtype=torch.float32, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    w = torch.zeros(2 * n, 16, device=DEVICE)
    out, saved = linear_act_forward(x, w, bias, act)
    (ga, gd), (ua, ud) = expected(gate_name, g), expected(up_name, u)
    for row in range(2):
        assert_special_values_match(out[row], times(ga, ua), f"{act} h")
        assert_special_values_match(saved[row, :n], times(ua, gd), f"{act} dh/dgate")
        assert_special_values_match(saved[row, n:], times(ga, ud), f"{act} dh/dup")


def test_every_activation_is_zero_at_zero():
    """act(+0) = +0 for every plain kernel activation, and gate(+0) · up(+0) = +0 for every gated pair: the FP8
    ping-pong forward relies on it to leave out its row mask when there is no bias (rows past M, TMA's zeros, must
    give h = 0 for the amax and for hᵀ's zero padding; fused_ops/pingpong.py)."""
    zero = torch.zeros(BLOCK, device=DEVICE)
    for name in PLAIN:
        out = evaluate(name, zero)[0]
        assert (out == 0).all() and not torch.signbit(out).any(), name
    for gate, up in GATED.values():
        h = evaluate(gate, zero)[0] * evaluate(up, zero)[0]
        assert (h == 0).all() and not torch.signbit(h).any(), (gate, up)
    for name in ("gelu_16bit", "silu_and_grad"):  # the ping-pong epilogues' own
        out = evaluate(name, zero)[0]
        assert (out == 0).all() and not torch.signbit(out).any(), name


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "swiglu", "geglu", "sigmoid_tanh"])
def test_16bit_epilogue_special_values(act):
    """The forward epilogue with 16-bit outputs takes the value and its derivative together (activation_and_grad:
    gelu_and_grad_16bit, silu_and_grad): NaN, ±inf and large finite pre-activations give the table's limits
    there too, rounded to fp16. z = 0 @ W.T + b = b exactly, so the values go in through the bias (fp16 holds
    them: 6e4 rather than 1e20)."""
    vals = [NAN, INF, -INF, 6e4, -6e4, 100.0, -20.0, 0.0, 1.0, -1.0]
    gated = act in GATED
    gate_name, up_name = GATED[act] if gated else (act, None)
    g = [a for a in vals for _ in vals] if gated else vals
    u = [b for _ in vals for b in vals] if gated else []
    n = len(g)
    bias = torch.tensor(g + u, dtype=torch.float16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE, dtype=torch.float16)
    w = torch.zeros(bias.numel(), 16, device=DEVICE, dtype=torch.float16)
    out, saved = linear_act_forward(x, w, bias, act)
    tol = dict(rtol=4e-3, atol=4e-3)  # fp16 rounding of the outputs, and the fitted GELU's 6e-5
    ga, gd = (v.half().double() for v in expected(gate_name, g))
    if gated:
        ua, ud = (v.half().double() for v in expected(up_name, u))
        want_h, want_g, want_u = (times(a, b).half() for a, b in ((ga, ua), (ua, gd), (ga, ud)))
    for row in range(2):
        if gated:
            assert_special_values_match(out[row], want_h, f"{act} h", **tol)
            assert_special_values_match(saved[row, :n], want_g, f"{act} dh/dgate", **tol)
            assert_special_values_match(saved[row, n:], want_u, f"{act} dh/dup", **tol)
        else:
            assert_special_values_match(out[row], ga, f"{act} h", **tol)
            assert_special_values_match(saved[row], gd, f"{act} act'", **tol)


@pytest.mark.parametrize("name", ["gelu", "silu", "relu"])
def test_activation_and_grad_is_the_pair(name):
    """activation_and_grad: for 16-bit outputs GELU and SiLU come from their shared forms (gelu_and_grad_16bit,
    silu_and_grad), within 7e-5 of the exact pair; otherwise it is activation() and activation_grad() exactly."""
    x = inputs()
    exact = evaluate(name, x)
    for fast in (False, True):
        out, grad = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        _evaluate_pair[(triton.cdiv(x.numel(), BLOCK),)](x, out, grad, x.numel(), NAME=name, FAST16=fast, BLOCK=BLOCK)
        for ours, ref in zip((out.double().cpu(), grad.double().cpu()), exact):
            if fast and name != "relu":
                assert torch.allclose(ours, ref, rtol=7e-5, atol=7e-5), (name, (ours - ref).abs().max())
            else:
                assert torch.equal(ours, ref), name


@triton.jit
def _evaluate_pair(x_ptr, out_ptr, grad_ptr, n, NAME: tl.constexpr, FAST16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    out, grad = activation_and_grad(tl.load(x_ptr + offs, mask=mask, other=0.0), NAME, FAST16)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(grad_ptr + offs, grad, mask=mask)
