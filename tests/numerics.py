"""Shared numerical checks: errors against a float64 reference, and the rule the fused path must meet (EPS and
rel_err are the product's, fused_ops/numerics.py; the checks built on them are here)."""

import math

import torch
import torch.nn.functional as F

from fused_ops.mlp import fused_mlp
from fused_ops.numerics import EPS, rel_err  # noqa: F401  (the product's yardstick: bench_mlp.py uses it too)
from model import GATED_ACTIVATIONS, PLAIN_ACTIVATIONS


def assert_no_worse_than_eager(fused, eager, ref, what="", compute_dtype=None):
    """The fused result's error is at most about twice the same-dtype eager error (plus a tiny epsilon).

    compute_dtype: the precision the work was done in when it differs from the result's dtype (e.g. an
    fp32 loss computed from bf16 matmuls under autocast); it sets the epsilon.
    """
    assert torch.isfinite(ref).all(), (f"{what}: the float64 reference is not finite; the 2x rule only measures finite "
                                       "values (compare special values by the NaN rule: tests/special_values.py)")
    assert_within_rule(rel_err(fused, ref), rel_err(eager, ref), EPS[compute_dtype or fused.dtype], what)


def assert_within_rule(e_fused, e_eager, eps, what=""):
    """The 2x rule on errors already measured: e_fused <= 2 * e_eager + eps. Eager's error must be finite: an inf
    (eager overflowed, or NaN in eager or in the reference) would make the bound inf and pass anything, NaN included;
    such cases are the special-value tests' (the NaN rule of docs/numerics.md), not this rule's."""
    assert math.isfinite(e_eager), (f"{what}: eager's error is {e_eager} (eager or the reference not finite): the 2x "
                                    "rule cannot bound it (compare special values by the NaN rule)")
    bound = 2 * e_eager + eps
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
    """dh/dz of the eager activation h = act(z) by PyTorch's autograd: act'(z), or for a gated activation
    (z = [gate | up], h elementwise in each pair) [dh/dgate | dh/dup]."""
    z = z.detach().requires_grad_()
    h = eager_act(name, z)
    (d,) = torch.autograd.grad(h, z, torch.ones_like(h))
    return d


def check_saved(saved, z_eager, z64, act):
    """What the forward kernel saved for backward, dh/dz, given the pre-activation z in the same dtype
    (eager) and in float64."""
    eager, ref = eager_act_grad(act, z_eager), eager_act_grad(act, z64)
    if act == "relu":
        # relu' is a step: where z is within the same-dtype error of 0, its sign (and the step) is a coin toss
        # for the kernel and for eager alike, and one flip more than eager is "twice its error". Compare the rest.
        keep = z64.abs() > 2 * (z_eager.double() - z64).abs().max()
        saved, eager, ref = saved[keep], eager[keep], ref[keep]
    assert_no_worse_than_eager(saved, eager, ref, "dh/dz")


def check_linear_act(out, saved, x, w, b, act):
    """The forward kernel's outputs against float64 and the same-dtype eager computation."""
    z64 = torch.addmm(b.double(), x.double(), w.double().t())
    z_eager = torch.addmm(b, x, w.t())
    check_saved(saved, z_eager, z64, act)
    assert_no_worse_than_eager(out, eager_act(act, z_eager), eager_act(act, z64), "output")


def check_dgrad(grad_z, grad_bias, grad_y, w2, saved, act, bias_grad=True):
    """The dgrad kernel's outputs, grad_z = grad_h * dh/dz with grad_h = grad_y @ w2 (repeated for both
    halves when gated) and dh/dz the saved tensor, against float64 and the same-dtype eager computation;
    the bias gradient too if bias_grad, else that there is none."""

    def eager_grad(s, gy, w):
        grad_h = gy @ w
        return (grad_h.repeat(1, 2) if act in GATED_ACTIVATIONS else grad_h) * s

    ref = eager_grad(saved.double(), grad_y.double(), w2.double())
    eager = eager_grad(saved, grad_y, w2)
    assert_no_worse_than_eager(grad_z, eager, ref, "grad_z")
    if bias_grad:
        assert_no_worse_than_eager(grad_bias, eager.float().sum(0), ref.sum(0), "bias grad")
    else:
        assert grad_bias is None


def eager_ln_mlp(x, w_fc, b_fc, w_proj, b_proj, ln_weight, ln_bias, act, eps=1e-5):
    """The eager Block's second half: LayerNorm over the last dim, then the MLP."""
    h = eager_act(act, F.linear(F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, eps), w_fc, b_fc))
    return F.linear(h, w_proj, b_proj)


def check_ln_mlp_16bit(act, tensors, half, autocast, grad_y, what="", eps=1e-5):
    """fused_mlp with the LayerNorm folded against the same-dtype eager LN + MLP and float64, output and
    the gradients of x, W1, b1, W2, b2, γ, β, under autocast to `half` or (autocast False) as given."""
    for name, e_fused, e_eager in ln_mlp_16bit_errors(act, tensors, half, autocast, grad_y, eps):
        assert_within_rule(e_fused, e_eager, EPS[half], f"{act} {what} {name}")


def ln_mlp_16bit_errors(act, tensors, half, autocast, grad_y, eps=1e-5):
    """[(name, fused error, eager error)] against float64 for check_ln_mlp_16bit's outputs and gradients."""
    return [(name, rel_err(f, r), rel_err(e, r)) for name, f, e, r in ln_mlp_16bit_outputs(act, tensors, half, autocast,
                                                                                           grad_y, eps)]


def ln_mlp_16bit_outputs(act, tensors, half, autocast, grad_y, eps=1e-5):
    """[(name, fused, eager, float64 reference)] for the output and every gradient of check_ln_mlp_16bit."""
    def run(fn, ts, gy, enabled):
        leaves = [t.detach().requires_grad_() if t is not None else None for t in ts]
        with torch.autocast(grad_y.device.type, dtype=half, enabled=enabled):
            y = fn(*leaves)
        y.backward(gy.to(y.dtype))
        return [y] + [t.grad for t in leaves if t is not None]

    fused = run(lambda x, w1, b1, w2, b2, gg, bb: fused_mlp(x, w1, b1, w2, b2, act, gg, bb, eps), tensors, grad_y, autocast)
    eager = run(lambda *t: eager_ln_mlp(*t, act, eps), tensors, grad_y, autocast)
    ref = run(lambda *t: eager_ln_mlp(*t, act, eps), [t.double() if t is not None else None for t in tensors],
              grad_y.double(), False)
    bias = tensors[2] is not None
    names = ["y", "grad_x", "grad_w_fc"] + (["grad_b_fc"] if bias else []) + ["grad_w_proj"] + \
        (["grad_b_proj"] if bias else []) + ["grad_ln_weight"] + (["grad_ln_bias"] if bias else [])
    assert len(fused) == len(names)
    for name, f, e, r in zip(names, fused, eager, ref):
        assert f.shape == r.shape and f.dtype == e.dtype, name
    return list(zip(names, fused, eager, ref))
