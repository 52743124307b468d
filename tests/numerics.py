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


def eager_act_grad(name, z):
    """The eager activation's derivative at z, by PyTorch's autograd (plain activations)."""
    z = z.detach().requires_grad_()
    (d,) = torch.autograd.grad(eager_act(name, z), z, torch.ones_like(z))
    return d


def check_saved(saved, z_eager, z64, act):
    """What the forward kernel saved for backward, given the pre-activation z in the same dtype (eager)
    and in float64: [z_gate | z_up] for a gated activation, act'(z) for a plain one."""
    if act in GATED_ACTIVATIONS:
        assert_no_worse_than_eager(saved, z_eager, z64, "pre-activation")
    else:
        assert_no_worse_than_eager(saved, eager_act_grad(act, z_eager), eager_act_grad(act, z64), "act'(z)")


def check_linear_act(out, saved, x, w, b, act):
    """The forward kernel's outputs against float64 and the same-dtype eager computation."""
    z64 = torch.addmm(b.double(), x.double(), w.double().t())
    z_eager = torch.addmm(b, x, w.t())
    check_saved(saved, z_eager, z64, act)
    assert_no_worse_than_eager(out, eager_act(act, z_eager), eager_act(act, z64), "output")


def check_dgrad(grad_z, grad_bias, grad_y, w2, saved, act):
    """The dgrad kernel's outputs against float64 and the same-dtype eager computation, given the saved
    tensor: for a plain activation that is act'(z) itself, so the reference multiplies by it."""

    def eager_grad(s, gy, w):
        if act not in GATED_ACTIVATIONS:
            return (gy @ w) * s
        s = s.detach().requires_grad_()
        (g,) = torch.autograd.grad(eager_act(act, s), s, gy @ w)
        return g

    ref = eager_grad(saved.double(), grad_y.double(), w2.double())
    eager = eager_grad(saved, grad_y, w2)
    assert_no_worse_than_eager(grad_z, eager, ref, "grad_z")
    assert_no_worse_than_eager(grad_bias, eager.float().sum(0), ref.sum(0), "bias grad")
