"""The fused MLP: autograd Functions over the kernels, and fused_mlp_layers, what model.MLP calls on its
fused path (this package does not import model.py: the model owns the switch and its layers).

Forward:   h, s = linear_act(x, W1, b1)         (Triton: matmul + bias + activation; s = dh/dz, see linear_act.py)
           y = h @ W2.T + b2                     (cuBLAS, bias in its epilogue)
Backward:  dW2 = grad_y.T @ h, db2 = grad_y.sum(0)       (cuBLAS)
           grad_z, db1 = linear_act_dgrad(grad_y, W2, s)  (Triton: matmul * s, bias sums fused)
           dW1 = grad_z.T @ x, dx = grad_z @ W1           (cuBLAS)

With the block's LayerNorm folded in (ln_weight / ln_bias / ln_eps given), x is the raw residual stream,
kept in its own dtype under autocast (fp32: LayerNorm runs in fp32 there, only its output is rounded):
Forward:   h, s, stats = ln_linear_act(x, γ, β, W1, b1)   (Triton: row stats, then LN in the matmul's A loads)
Backward:  grad_ln = grad_z @ W1                           (cuBLAS)
           dx, ln, dγ, dβ = layernorm_backward(x, grad_ln, stats)   (Triton: one pass, recomputes ln = LN(x))
           dW1 = grad_z.T @ ln                              (cuBLAS)
"""

from typing import Optional

import torch
from torch import Tensor

from . import env
from .activations import kernel_activations
from .ops import dgrad_op, fused_op, layernorm_backward_op, linear_act_op, ln_linear_act_op

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: interpreter only


def kernels_can_run(x):
    """The Triton kernels take CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    return x.is_cuda or (env.INTERPRET and x.device.type == "cpu")


def check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight=None, ln_bias=None, fold_ln=False,
                   masters=False):
    """Reject what the kernels cannot take with an error naming the argument, before any launch.

    The LayerNorm parameters may keep their own float dtype (fp32 under autocast, as nn.LayerNorm's), and
    with the LayerNorm folded (fold_ln) so may an fp32 x beside 16-bit weights (autocast's LayerNorm input).
    masters: w_fc and w_proj are autocast's masters, of any float dtype (the FP8 MLP reads only their FP8 copies)."""
    _, _, gated = kernel_activations(activation)  # raises on an unknown name
    if not kernels_can_run(x):
        raise ValueError(f"x is on {x.device}: the fused MLP needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "Triton is imported, to run the kernels on CPU); use mlp='eager' or 'auto' instead "
                         "(sample.py / train.py: --mlp=eager)")
    named = {"x": x, "w_fc": w_fc, "b_fc": b_fc, "w_proj": w_proj, "b_proj": b_proj}
    mixed = fold_ln and x.dtype == torch.float32 and w_fc.dtype in (torch.float16, torch.bfloat16)
    for name, t in named.items():
        if t is None:
            continue
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the fused MLP takes {KERNEL_DTYPES}")
        if t.dtype == torch.float64 and t.is_cuda:  # Triton 3.6 does not compile our fp64 dot for CUDA
            raise TypeError(f"{name} is float64 on CUDA: float64 runs only under the CPU interpreter "
                            "(TRITON_INTERPRET=1, used for gradcheck); use float32, float16 or bfloat16")
        if mixed and name != "x" and t.dtype != w_fc.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but w_fc has {w_fc.dtype}: all weights must share one dtype")
        if not mixed and t.dtype != x.dtype and not (masters and name in ("w_fc", "w_proj")):
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}: all tensors must share one dtype")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.dim() < 1:
        raise ValueError(f"x must have shape (..., C) (at least 1 dim), got {tuple(x.shape)}")
    if w_fc.dim() != 2 or w_proj.dim() != 2:
        raise ValueError(f"w_fc and w_proj must be 2-D, got {tuple(w_fc.shape)} and {tuple(w_proj.shape)}")
    C, H = w_proj.shape
    if x.shape[-1] != C or w_fc.shape[1] != C:
        raise ValueError(f"x's last dim ({x.shape[-1]}), w_fc.shape[1] ({w_fc.shape[1]}) and w_proj.shape[0] ({C}) "
                         "must all equal the model width C")
    expected = 2 * H if gated else H
    if w_fc.shape[0] != expected:
        raise ValueError(f"w_fc must have {'2*H' if gated else 'H'} = {expected} rows for activation "
                         f"{activation!r} (H = w_proj.shape[1] = {H}), got {w_fc.shape[0]}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is not None and (t.dtype not in KERNEL_DTYPES or t.device != x.device):
            raise TypeError(f"{name} must be a floating tensor on {x.device} with dtype in {KERNEL_DTYPES}, "
                            f"got {t.dtype} on {t.device}")
    for name, b, n in (("b_fc", b_fc, expected), ("b_proj", b_proj, C), ("ln_weight", ln_weight, C),
                       ("ln_bias", ln_bias, C)):
        if b is not None and tuple(b.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(b.shape)}")
        if b is not None and n > 1 and b.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous (stride 1), got stride {b.stride(0)}; pass {name}.contiguous()")


class LinearActFunction(torch.autograd.Function):
    """out = act(x @ W.T + b) on its own (no following linear to fuse the derivative into)."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        x2 = x.reshape(-1, x.shape[-1])
        needs_grad = any(ctx.needs_input_grad[:3])
        out, saved = linear_act_op(x2, weight, bias, activation, needs_grad)
        ctx.activation = activation
        if needs_grad:
            ctx.save_for_backward(x2, weight, saved)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, saved = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        # saved = dh/dz: act'(z), or [dh/dgate | dh/dup] for a gated activation (both halves scale g)
        if kernel_activations(ctx.activation)[2]:
            grad_pre = (saved.view(g.shape[0], 2, g.shape[1]) * g[:, None, :]).view(saved.shape)
        else:
            grad_pre = g * saved
        grad_x = (grad_pre @ weight).view(*grad_out.shape[:-1], x2.shape[1]) if ctx.needs_input_grad[0] else None
        grad_w = grad_pre.t() @ x2 if ctx.needs_input_grad[1] else None
        grad_b = grad_pre.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _forward(x2, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps, save):
    """(y, h, dh/dz or None, LayerNorm row stats or None) for a 2-D x: the kernel, then cuBLAS."""
    stats = None
    if ln_eps is None:
        h, saved = linear_act_op(x2, w_fc, b_fc, activation, save)
    else:
        h, saved, stats = ln_linear_act_op(x2, ln_weight, ln_bias, ln_eps, w_fc, b_fc, activation, save)
    y = h @ w_proj.t() if b_proj is None else torch.addmm(b_proj, h, w_proj.t())
    return y, h, saved, stats


class FusedMLPFunction(torch.autograd.Function):
    """y = act(x @ W1.T + b1) @ W2.T + b2, with the activation derivative fused into backward's dgrad.

    Given ln_eps (with ln_weight / ln_bias, either may be None), x first goes through LayerNorm, folded
    into the first matmul: the normalized x is never written in forward, and is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight=None, ln_bias=None, ln_eps=None):
        x2 = x.reshape(-1, x.shape[-1])
        needs_grad = any(ctx.needs_input_grad[:5]) or any(ctx.needs_input_grad[6:8])
        y, h, saved, stats = _forward(x2, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps,
                                      needs_grad)
        ctx.activation, ctx.has_bias, ctx.fold_ln = activation, (b_fc is not None, b_proj is not None), ln_eps is not None
        if needs_grad:
            ctx.save_for_backward(x2, w_fc, w_proj, h, saved, ln_weight, ln_bias, stats)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        return _backward(ctx, grad_y)


def _backward(ctx, grad_y, traced=False):
    """The gradients of (x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps): FusedMLPFunction's
    backward, and the mlp operator's (the same ctx fields, the same order of inputs). traced: the operator's,
    which AOTAutograd traces with fake tensors, so the kernels go in as their operators (never launched)."""
    dgrad, layernorm_backward = (dgrad_op.op, layernorm_backward_op.op) if traced else (dgrad_op, layernorm_backward_op)
    x2, w_fc, w_proj, h, saved, ln_weight, ln_bias, stats = ctx.saved_tensors
    if not (traced or torch.compiler.is_compiling()):  # (a compiled graph frees its buffers itself)
        # Drop the graph's references now (a no-op under retain_graph=True), so that h and dh/dz are
        # freed at their last use below instead of when backward returns: this keeps the fused MLP's
        # memory peak in backward under eager's (its grad_z and grad_x would otherwise come on top).
        ctx.maybe_clear_saved_tensors()
    # needs_input_grad has one entry per argument given: pad for calls without the LayerNorm ones.
    need_x, need_w_fc, need_b_fc, need_w_proj, need_b_proj, _, need_ln_w, need_ln_b = \
        (tuple(ctx.needs_input_grad) + (False,) * 3)[:8]
    g = grad_y.reshape(-1, grad_y.shape[-1])
    grad_w_proj = g.t() @ h if need_w_proj else None
    del h
    grad_b_proj = g.sum(0) if need_b_proj else None
    bias_grad = ctx.has_bias[0] and need_b_fc
    grad_x = grad_w_fc = grad_b_fc = grad_ln_w = grad_ln_b = None
    if need_x or need_w_fc or bias_grad or need_ln_w or need_ln_b:  # else nothing below the activation needs one
        grad_pre, grad_b_fc = dgrad(g, w_proj, saved, ctx.activation, bias_grad)
        del saved
        grad_b_fc = grad_b_fc.to(grad_pre.dtype) if bias_grad else None
        if ctx.fold_ln:
            grad_x2, ln, grad_ln_w, grad_ln_b = layernorm_backward(x2, grad_pre @ w_fc, ln_weight, ln_bias, stats)
            grad_ln_w, grad_ln_b = (grad_ln_w if need_ln_w else None), (grad_ln_b if need_ln_b else None)
            grad_w_fc = grad_pre.t() @ ln if need_w_fc else None
        else:
            grad_x2 = grad_pre @ w_fc if need_x else None
            grad_w_fc = grad_pre.t() @ x2 if need_w_fc else None
        grad_x = grad_x2.view(*grad_y.shape[:-1], x2.shape[1]) if need_x else None
    return grad_x, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj, None, grad_ln_w, grad_ln_b, None


# Inside torch.compile the MLP is one operator with its own backward (torch.library.register_autograd), not the
# autograd.Function above: a graph holding an autograd.Function (dynamo's autograd_function_apply) is never
# kept in AOTAutograd's on-disk cache, so every run would trace and partition it again (seconds of start-up).
@fused_op("mlp")
def mlp_op(x: Tensor, w_fc: Tensor, b_fc: Optional[Tensor], w_proj: Tensor, b_proj: Optional[Tensor], activation: str,
           ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], ln_eps: Optional[float],
           save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, h, dh/dz, LayerNorm row stats) for a 2-D x; the last three empty unless save (the stats: unless folded)."""
    y, h, saved, stats = _forward(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps, save)
    return y, h if save else x.new_empty(0), saved, x.new_empty(0) if stats is None else stats


@mlp_op.register_fake
def _(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps, save):
    if ln_eps is None:  # the kernels' operators give their fake outputs, the matmul its shape
        h, saved = linear_act_op.op(x, w_fc, b_fc, activation, save)
        stats = x.new_empty(0)
    else:
        h, saved, stats = ln_linear_act_op.op(x, ln_weight, ln_bias, ln_eps, w_fc, b_fc, activation, save)
    return h @ w_proj.t(), h if save else x.new_empty(0), saved, stats


def _setup_context(ctx, inputs, output):
    x2, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps, save = inputs
    _, h, saved, stats = output
    ctx.activation, ctx.has_bias, ctx.fold_ln = activation, (b_fc is not None, b_proj is not None), ln_eps is not None
    ctx.save_for_backward(x2, w_fc, w_proj, h, saved, ln_weight, ln_bias, stats)


def _op_backward(ctx, grad_y, *_):  # no gradient flows into h, dh/dz or the stats: they are saved, not used
    return (*_backward(ctx, grad_y, traced=True), None)


torch.library.register_autograd("fused_mlp::mlp", _op_backward, setup_context=_setup_context)


def _autocast(*tensors):
    """Cast to the autocast dtype when autocast is on, as nn.Linear would (the casts stay differentiable).

    Autocast itself is left on: every tensor the autograd Functions then see already has the autocast
    dtype, so the one cuBLAS call autocast covers (addmm) gets them unchanged, and the kernels ignore it
    (a context that turned it off around each call would cost host time on every call)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def fused_mlp(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight=None, ln_bias=None, ln_eps=None):
    """act(x @ w_fc.T + b_fc) @ w_proj.T + b_proj through the Triton kernels; x of shape (..., C).

    With ln_eps given, x is first normalized by LayerNorm(γ = ln_weight, β = ln_bias, eps = ln_eps), folded
    into the first matmul. γ and β keep their dtype under autocast (LayerNorm runs in fp32 there too)."""
    if ln_eps is None:
        x, w_fc, b_fc, w_proj, b_proj = _autocast(x, w_fc, b_fc, w_proj, b_proj)
    else:  # x is LayerNorm's input: autocast runs LayerNorm in fp32, so x is not rounded to 16 bits here
        w_fc, b_fc, w_proj, b_proj = _autocast(w_fc, b_fc, w_proj, b_proj)
        if x.dtype != w_fc.dtype and x.dtype in (torch.float16, torch.bfloat16) and \
                torch.is_autocast_enabled(x.device.type):
            x = x.float()  # as autocast's LayerNorm would (a 16-bit x of the weights' dtype is read as it is)
    if ln_eps is None and (ln_weight is not None or ln_bias is not None):
        raise ValueError("ln_weight / ln_bias given without ln_eps: pass the LayerNorm's eps to fold it")
    check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, fold_ln=ln_eps is not None)
    compiling, grad = torch.compiler.is_compiling(), torch.is_grad_enabled()
    if compiling or not grad:  # (not grad: evaluation, sampling; no autograd node, no dh/dz written)
        tensors = (x, w_fc, b_fc, w_proj, b_proj, ln_weight, ln_bias)
        save = grad and any(t is not None and t.requires_grad for t in tensors)
        y = mlp_op(x.reshape(-1, x.shape[-1]), w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps,
                   save)[0]
        return y.view(*x.shape[:-1], y.shape[-1])
    # Training outside compile, the host-bound path: straight to the Function (it asks needs_input_grad itself).
    return FusedMLPFunction.apply(x, w_fc, b_fc, w_proj, b_proj, activation, ln_weight, ln_bias, ln_eps)


def linear_act(x, weight, bias, activation):
    """act(x @ weight.T + bias) through the Triton kernel; x of shape (..., K)."""
    x, weight, bias = _autocast(x, weight, bias)
    _, _, gated = kernel_activations(activation)
    if x.dim() < 1 or weight.dim() != 2 or (gated and weight.shape[0] % 2):
        raise ValueError(f"linear_act needs x of shape (..., K) and weight of shape (N, K) (an even N = 2*H of "
                         f"[gate; up] rows when gated); got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    # Reuse the MLP's checks with a stand-in (n_out, n) projection shape.
    check_mlp_args(x, weight, bias, weight.new_empty(x.shape[-1], n), None, activation)
    return LinearActFunction.apply(x, weight, bias, activation)


def fused_mlp_layers(x, c_fc, c_proj, activation, norm=None, fuse_ln=False):
    """The MLP of two nn.Linear layers, c_proj(act(c_fc(x))), through the kernels (model.MLP's fused path).

    norm: the block's LayerNorm, applied to x first, or with fuse_ln folded into the first matmul."""
    fn, tensors = layers_as_function(c_fc, c_proj, activation, norm, fuse_ln, x.shape[-1])
    return fn(x, *tensors)


def layers_as_function(c_fc, c_proj, activation, norm=None, fuse_ln=False, width=None):
    """fused_mlp_layers as (fn, tensors): fn(x, *tensors) computes the MLP from the tensors it is given, the layers'
    own or stand-ins sharing their memory (graphs.py captures it with such stand-ins, see there)."""
    if fuse_ln and norm is not None and (not isinstance(norm, torch.nn.LayerNorm) or
                                         tuple(norm.normalized_shape) != (width or c_fc.in_features,)):
        raise ValueError(f"fuse_ln folds an nn.LayerNorm over the last dim ({width or c_fc.in_features}); got {norm}")
    layer_norm = isinstance(norm, torch.nn.LayerNorm)
    tensors = (c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias, *((norm.weight, norm.bias) if layer_norm else ()))

    def fn(x, w_fc, b_fc, w_proj, b_proj, ln_weight=None, ln_bias=None):
        ln = {}
        if norm is not None and fuse_ln:
            ln = dict(ln_weight=ln_weight, ln_bias=ln_bias, ln_eps=norm.eps)
        elif layer_norm:
            x = torch.nn.functional.layer_norm(x, norm.normalized_shape, ln_weight, ln_bias, norm.eps)
        elif norm is not None:  # another normalization: as its module computes it
            x = norm(x)
        return fused_mlp(x, w_fc, b_fc, w_proj, b_proj, activation, **ln)
    return fn, tensors
