"""What the activations and the fused MLP must give at NaN, ±inf and overflow, written down once and
independent of the machine (issue 27; docs/numerics.md).

Eager PyTorch is no specification there: the same call gives different answers on different CPUs, and
differs from the mathematical limit on all of them. Seen with torch 2.13:
- fp32 F.gelu(+inf) is NaN on AVX-512 CPUs (its vectorized erf), +inf elsewhere and in fp64;
- F.gelu(-inf) and F.silu(-inf) are NaN everywhere (-inf · 0), the limit is 0;
- the autograd derivatives of gelu, gelu_tanh and silu are NaN at ±inf (inf · 0), the limits are 1 and 0;
- fp32 gelu_tanh's derivative is NaN from |x| ~ 1e19 on (x² overflows), a finite input.
So the tests here never read eager's result at a special value. The expectations are:
- activations: LIMITS below at ±inf and NaN; at finite x the exact value, from scalar float64 formulas
  with Python's `math` (one element at a time, not torch's vectorized kernels), rounded to fp32 (inf
  where that overflows: relu2(1e20) = inf).
- NaN in, NaN out: every activation is NaN at NaN, and so is every derivative but identity's (a constant
  1) and relu's (1, as PyTorch's relu backward, which zeroes the gradient only where x <= 0, false for
  NaN; the forward's NaN reaches the loss either way).
- gated activations: gate_act(g) · up_act(u), dh/dg = up_act(u) · gate_act'(g), dh/du = gate_act(g) ·
  up_act'(u), IEEE products of the values above (so 0 · inf = NaN: gelu(-inf) · inf).
- whole MLPs: the same chain of matmuls, sums and elementwise products eager runs, evaluated on those
  activation values with IEEE-754's rules for non-finite terms (ieee_matmul: a sum holding NaN, or both
  +inf and -inf, is NaN; one holding only +inf is +inf; inf · 0 is NaN), whatever a BLAS would skip.
  Only which entries are NaN / +inf / -inf is compared there; finite entries are checked elsewhere.
"""

import math

import numpy as np
import torch

INF, NAN = math.inf, math.nan

# (act(x), act'(x)) at x = +inf, -inf and NaN: the mathematical limits, NaN for NaN.
LIMITS = {
    #               +inf          -inf          NaN
    "identity":  ((INF, 1.0), (-INF, 1.0), (NAN, 1.0)),  # d/dx x = 1, a constant, also at NaN and inf
    "gelu":      ((INF, 1.0), (-0.0, -0.0), (NAN, NAN)),  # x·Φ(x) -> 0; Φ(x) + x·φ(x) -> 1, 0 (from below)
    "gelu_tanh": ((INF, 1.0), (-0.0, -0.0), (NAN, NAN)),
    "relu":      ((INF, 1.0), (0.0, 0.0), (NAN, 1.0)),  # relu'(NaN) = 1: PyTorch's convention, kept
    "relu2":     ((INF, INF), (0.0, 0.0), (NAN, NAN)),
    "silu":      ((INF, 1.0), (-0.0, -0.0), (NAN, NAN)),  # x·σ(x) -> 0; σ(x)·(1 + x·(1 - σ(x))) -> 1, 0
    "sigmoid":   ((1.0, 0.0), (0.0, 0.0), (NAN, NAN)),
    "tanh":      ((1.0, 0.0), (-1.0, 0.0), (NAN, NAN)),
}
LIMITS["gelu_16bit"] = LIMITS["gelu"]  # the 16-bit kernels' fitted GELU: the same function, the same limits
LIMITS["silu_and_grad"] = LIMITS["silu"]  # SiLU and its derivative from one σ (the gated ping-pong epilogue)

GELU_TANH_C = 0.044715
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _exp(v):
    """math.exp, with inf for overflow (math.exp raises OverflowError there)."""
    return math.exp(v) if v < 709.0 else INF


def _sigmoid(v):
    return 1.0 / (1.0 + _exp(-v))


def _finite_reference(name, x):
    """(act(x), act'(x)) for a finite x, in float64 by scalar formulas that stay accurate in the tails
    (the lower tails through erfc and exp, not 1 + erf or 1 + tanh, which cancel to 0 before fp32 does)."""
    if name == "identity":
        return x, 1.0
    if name in ("gelu", "gelu_16bit"):
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if abs(x) < 1e150 else 0.0
        return x * cdf, cdf + x * pdf
    if name == "gelu_tanh":
        u = SQRT_2_OVER_PI * (x + GELU_TANH_C * x ** 3) if abs(x) < 1e100 else math.copysign(INF, x)
        one_plus_t = 2.0 / (1.0 + _exp(-2.0 * u))  # 1 + tanh(u)
        one_minus_t = 2.0 / (1.0 + _exp(2.0 * u))  # 1 - tanh(u)
        # (1 - t²)·x·(1 + 3c·x²) is 0 once 1 - t² underflows; skip it there (x³ would overflow)
        slope = 0.0 if one_plus_t * one_minus_t == 0 else \
            0.5 * x * one_plus_t * one_minus_t * (1 + 3 * GELU_TANH_C * x * x) * SQRT_2_OVER_PI
        return 0.5 * x * one_plus_t, 0.5 * one_plus_t + slope
    if name == "relu":
        return (x if x > 0 else 0.0), (1.0 if x > 0 else 0.0)
    if name == "relu2":
        r = x if x > 0 else 0.0
        return r * r if r < 1e160 else INF, 2.0 * r
    if name in ("silu", "silu_and_grad"):
        s = _sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s)) if x > -700 else -0.0
    if name == "sigmoid":
        s = _sigmoid(x)
        return s, s * (1.0 - s)
    if name == "tanh":
        t = math.tanh(x)
        return t, 1.0 - t * t
    raise ValueError(name)


def expected(name, xs):
    """(act(x), act'(x)) for each x in xs (Python floats) as float64 tensors of fp32-rounded values: the
    LIMITS at ±inf and NaN, the rounded exact value elsewhere."""
    outs, grads = [], []
    for x in xs:
        if math.isnan(x):
            o, g = LIMITS[name][2]
        elif math.isinf(x):
            o, g = LIMITS[name][0 if x > 0 else 1]
        else:
            o, g = _finite_reference(name, x)
        with np.errstate(over="ignore"):  # fp32 rounding, overflow to inf: machine-independent IEEE
            outs.append(float(np.float32(o)))
            grads.append(float(np.float32(g)))
    return torch.tensor(outs, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64)


def times(a, b):
    """a · b elementwise for expected() values, rounded to fp32 as the kernels' fp32 product is (numpy's
    float32 multiply: IEEE, inf on overflow, 0 · inf = NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy((a.numpy().astype(np.float32) * b.numpy().astype(np.float32)).astype(np.float64))


# Special inputs and overflow-ish finite ones: x² overflows fp32 from ~1.8e19, x³ from ~7e12, exp(x) from 88.7.
SPECIAL_INPUTS = [NAN, INF, -INF, 3e38, -3e38, 1e30, -1e30, 1e20, -1e20, 1e13, -1e13, 1e5, -1e5, 100.0, -100.0,
                  89.0, -89.0, 0.0, -0.0, 1.0]


def assert_special_values_match(ours, ref, what, rtol=1e-5, atol=1e-6):
    """NaN where ref has NaN, ±inf where ref has it (same sign), and the finite values close."""
    ours, ref = ours.double().cpu(), ref.double().cpu()
    assert torch.equal(ours.isnan(), ref.isnan()), f"{what}: NaN at {ours.isnan().nonzero().flatten().tolist()}, " \
                                                   f"expected at {ref.isnan().nonzero().flatten().tolist()}"
    assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()]), \
        f"{what}: {ours.tolist()} vs expected {ref.tolist()}"
    fin = ref.isfinite()
    assert torch.allclose(ours[fin], ref[fin], rtol=rtol, atol=atol), f"{what}: {ours.tolist()} vs {ref.tolist()}"


# ---- whole-MLP expectations: where NaN / ±inf must come out -----------------------------------------

def act_values(name, z):
    """(act(z), act'(z)) elementwise on a float64 tensor: LIMITS at its non-finite entries; at finite ones
    any accurate finite value will do (only the non-finite pattern is compared), so torch's float64
    functions are used there, on finite inputs only."""
    fin = z.isfinite()
    zf = torch.where(fin, z, torch.zeros_like(z)).detach().requires_grad_()
    f = {"identity": lambda v: v, "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"), "relu": torch.relu,
         "relu2": lambda v: torch.relu(v).square(), "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid,
         "tanh": torch.tanh}[name]
    out = f(zf)
    (grad,) = torch.autograd.grad(out.sum(), zf)
    out, grad = out.detach(), grad.detach()
    for value, (o, g) in zip((INF, -INF, NAN), LIMITS[name]):
        where = z.isnan() if value != value else z == value
        out = torch.where(where, torch.full_like(out, o), out)
        grad = torch.where(where, torch.full_like(grad, g), grad)
    return out, grad


def ieee_matmul(a, b):
    """a @ b in float64 with IEEE-754's rules for every term, also where a BLAS would skip a zero or reorder:
    an entry is NaN if a term is NaN (NaN · anything, inf · 0) or its terms hold both +inf and -inf, ±inf if
    they hold only that infinity, else the (finite) sum. Counts come from 0/1 matmuls, exact."""
    a, b = a.double(), b.double()
    fa, fb = a.isfinite(), b.isfinite()
    out = torch.where(fa, a, 0.0) @ torch.where(fb, b, 0.0)
    one = lambda m: m.double()  # noqa: E731
    pos_a, neg_a, pos_b, neg_b = a > 0, a < 0, b > 0, b < 0  # (infinities included)
    nan = (a.isnan().any(-1, keepdim=True) | b.isnan().any(0, keepdim=True)
           | (one(a.isinf()) @ one(b == 0) > 0) | (one(a == 0) @ one(b.isinf()) > 0))
    pinf = (one(a == INF) @ one(pos_b) + one(a == -INF) @ one(neg_b)
            + one(pos_a & fa) @ one(b == INF) + one(neg_a & fa) @ one(b == -INF)) > 0
    ninf = (one(a == INF) @ one(neg_b) + one(a == -INF) @ one(pos_b)
            + one(pos_a & fa) @ one(b == -INF) + one(neg_a & fa) @ one(b == INF)) > 0
    out = torch.where(pinf, INF, out)
    out = torch.where(ninf, -INF, out)
    return torch.where(nan | (pinf & ninf), NAN, out)


def ieee_sum(t, dim):
    """t.sum(dim) of a 2-D tensor with ieee_matmul's rules."""
    ones = torch.ones(t.shape[dim], 1, dtype=torch.float64, device=t.device)
    return (ieee_matmul(t, ones) if dim == 1 else ieee_matmul(t.t(), ones)).flatten()


def mlp_expected(x, w_fc, b_fc, w_proj, b_proj, act, grad_y, gated_pair=None, ln=None):
    """[y, grad_x, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj (, grad_ln_weight, grad_ln_bias)] of
    y = act(LN?(x) @ W1.T + b1) @ W2.T + b2 for a 2-D x, in float64 with the rules above: the expectation of
    where NaN and ±inf come out. gated_pair: (gate name, up name) for a gated activation (w_fc = [gate; up]),
    else act is a kernel name. ln: (γ, β, eps) to put the block's LayerNorm in front. Elementwise + and ·
    run in torch (IEEE-exact on every machine); sums and matmuls through ieee_matmul; activations act_values."""
    x, w_fc, w_proj, grad_y = (t.detach().double() for t in (x, w_fc, w_proj, grad_y))
    b_fc, b_proj = (t.detach().double() if t is not None else None for t in (b_fc, b_proj))
    a = x
    if ln is not None:
        gamma, beta, eps = ln
        gamma, beta = gamma.detach().double(), beta.detach().double()
        C = x.shape[1]
        mean = ieee_sum(x, 1)[:, None] / C
        dev = x - mean
        rstd = 1.0 / torch.sqrt(ieee_sum(dev * dev, 1)[:, None] / C + eps)
        x_hat = dev * rstd
        a = x_hat * gamma + beta
    z = ieee_matmul(a, w_fc.t()) + (b_fc if b_fc is not None else 0.0)
    if gated_pair is None:
        h, dh = act_values(act, z)
    else:
        g, u = z.chunk(2, dim=1)
        (ga, gd), (ua, ud) = act_values(gated_pair[0], g), act_values(gated_pair[1], u)
        h, dh = ga * ua, torch.cat([ua * gd, ga * ud], dim=1)
    y = ieee_matmul(h, w_proj.t()) + (b_proj if b_proj is not None else 0.0)
    grad_w_proj = ieee_matmul(grad_y.t(), h)
    grad_b_proj = ieee_sum(grad_y, 0)
    grad_h = ieee_matmul(grad_y, w_proj)
    grad_z = (grad_h.repeat(1, 2) if gated_pair is not None else grad_h) * dh
    grad_b_fc = ieee_sum(grad_z, 0)
    grad_w_fc = ieee_matmul(grad_z.t(), a)
    grad_a = ieee_matmul(grad_z, w_fc)
    if ln is None:
        return [y, grad_a, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj]
    gg = grad_a * gamma
    grad_x = (gg - ieee_sum(gg, 1)[:, None] / C - x_hat * (ieee_sum(gg * x_hat, 1)[:, None] / C)) * rstd
    return [y, grad_x, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj, ieee_sum(grad_a * x_hat, 0), ieee_sum(grad_a, 0)]


def assert_nonfinite_pattern(ours, ref, what):
    """NaN, +inf and -inf in exactly the places ref has them (finite values are not compared)."""
    ours, ref = ours.detach().double().cpu().reshape(ref.shape), ref.double().cpu()
    assert torch.equal(ours.isnan(), ref.isnan()), \
        f"{what}: NaN in {int(ours.isnan().sum())} places, expected {int(ref.isnan().sum())}"
    assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()]), \
        f"{what}: inf in {int(ours.isinf().sum())} places, expected {int(ref.isinf().sum())} (or signs differ)"
