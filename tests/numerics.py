"""Shared numerical checks: errors against a float64 reference, and the rule the fused path must meet."""

import torch

from model import GATED_ACTIVATIONS, PLAIN_ACTIVATIONS

# The "tiny epsilon" added to the 2x rule, by dtype: a floor for cases where the eager error is ~0.
EPS = {torch.float64: 1e-13, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def rel_err(x, ref):
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere makes it inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_no_worse_than_eager(fused, eager, ref, what="", compute_dtype=None):
    """The fused result's error is at most about twice the same-dtype eager error (plus a tiny epsilon).

    compute_dtype: the precision the work was done in when it differs from the result's dtype (e.g. an
    fp32 loss computed from bf16 matmuls under autocast); it sets the epsilon.
    """
    e_fused, e_eager = rel_err(fused, ref), rel_err(eager, ref)
    bound = 2 * e_eager + EPS[compute_dtype or fused.dtype]
    assert e_fused <= bound, f"{what}: fused error {e_fused:.3e} > 2 x eager error {e_eager:.3e} + eps"


def poisoned(shape, dtype, device):
    """An output buffer full of NaN: any element a kernel fails to write shows up in the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def eager_act(name, z):
    """The model's eager activation on a pre-activation z ((M, N), or (M, 2N) = [gate | up] when gated)."""
    if name in GATED_ACTIVATIONS:
        return GATED_ACTIVATIONS[name](*z.chunk(2, dim=-1))
    return z if name == "identity" else PLAIN_ACTIVATIONS[name](z)


def check_linear_act(out, pre, x, w, b, act):
    """The forward kernel's outputs against float64 and the same-dtype eager computation."""
    z64 = torch.addmm(b.double(), x.double(), w.double().t())
    z_eager = torch.addmm(b, x, w.t())
    assert_no_worse_than_eager(pre, z_eager, z64, "pre-activation")
    assert_no_worse_than_eager(out, eager_act(act, z_eager), eager_act(act, z64), "output")


def check_dgrad(grad_pre, grad_bias, grad_y, w2, pre, act):
    """The dgrad kernel's outputs against float64 and the same-dtype eager computation."""

    def eager_grad(p, gy, w):
        p = p.detach().requires_grad_()
        (g,) = torch.autograd.grad(eager_act(act, p), p, gy @ w)
        return g

    ref = eager_grad(pre.double(), grad_y.double(), w2.double())
    eager = eager_grad(pre, grad_y, w2)
    assert_no_worse_than_eager(grad_pre, eager, ref, "grad_pre")
    assert_no_worse_than_eager(grad_bias, eager.float().sum(0), ref.sum(0), "bias grad")
