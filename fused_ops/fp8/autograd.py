"""The FP8 MLP's autograd: what runs it, outside torch.compile and inside (kernels.py has the recipe and the kernels,
state.py the scales' state, hopper.py the ping-pong kernel's FP8 outputs).

One computation, _forward and _backward below, reached two ways:
- outside torch.compile, FP8MLPFunction, an autograd.Function over the two;
- inside, two operators, fused_mlp::fp8_mlp_forward and fused_mlp::fp8_mlp_backward, each one opaque node in the
  compiled graph (../ops.py says why operators), the backward attached with torch.library.register_autograd.
The weights' FP8 copies (W1, W1ᵀ, W2, W2ᵀ in e4m3, their 1/scales) come to both as arguments:
- uncompiled, from FP8State.weights: remade once per optimizer step (a host-side check), in place, so that
  ../graphs.py's CUDA graphs (fp8_layers_as_function; ../layers.py's FP8MLP), which skip host work in a replay, read the current ones;
- compiled, made in the graph at every forward: for a whole GPT at once where the model is compiled whole
  (model.GPT.forward, weight_copies.py: three launches for every layer's weights), else by each layer
  (quantize_weight; inductor fuses it). A host check would be skipped by torch.compile's CUDA graphs, so none is
  left. The price: with gradient accumulation, one weight cast per micro-step instead of per optimizer step (~12 MB
  of traffic a layer at GPT-2 small's size).
The operators keep no other host state a replay needs: the scales live in the FP8State's buffers (an operator finds
the state by its number) and move on the GPU; the calibration flag is read once, on the first call, which
torch.compile's CUDA graphs run before they record (and graphs.py's capture only after it). So the FP8 MLP compiles
in every mode, reduce-overhead included (which it needs to be fast: results/fp8_compile_h100.txt). Without
torch.compile's CUDA graphs (its default mode) the operators replay graphs of their own (graphs.py): their bodies'
launches cost the host more than the GPU's work takes.
"""

from typing import Optional

import torch
from torch import Tensor

from ..activations import kernel_activations
from ..hopper import pingpong
from ..mlp import _autocast, check_mlp_args, fused_mlp
from ..ops import fused_op
from . import graphs as op_graphs, hopper as fp8_hopper
from .kernels import (E4M3, E5M2, GRAD_Y, GRAD_Z, H, X, _padded, cast_transpose, fp8_dgrad, fp8_linear_act,
                      update_scales)
from .state import _STATES, _set_current_scale, check_fp8_device, quantize_weight

# Which kernel runs the two GEMMs with epilogues (x8 @ W1ᵀ, gy8 @ W2), best first; each step is taken where it can run:
# - PINGPONG_FP8: Hopper's ping-pong kernels quantize h and gz in their own epilogues (hopper.py's
#   linear_act_forward_fp8 and dgrad_fp8: h8 and h8ᵀ, gz8 and gz8ᵀ out, the amax folded in), with no pass after them
#   (the gated dgrad where its halves meet at a tile's edge: hopper.usable_fp8).
# - SEPARATE_CAST: the ping-pong kernels write h and gz in 16 bits, then one cast + transpose pass quantizes each (its
#   amax folded in): where the FP8 outputs cannot run, or failed (the 16-bit ones keep running).
# - else the Triton kernels (kernels.py) write them quantized: Ada, the CPU interpreter, or a failed ping-pong.
# The ping-pong kernels take the FP8 operands straight into FP8 MMAs; measured at each stage in
# H100 files since removed (git log -- results/fp8_stage1_h100.txt results/fp8_stage3_h100.txt).
PINGPONG_FP8 = {"forward": True, "dgrad": True}
SEPARATE_CAST = {"forward": True, "dgrad": True}


def _first_linear(x8, w8, inv, bias, activation, state, dtype):
    """(h8, h8ᵀ, dh/dz in dtype) for h = act(x8 @ w8.T · inv[0] · inv[1] + bias), h quantized with the H slot's scale
    and its amax folded into the slot's."""
    act, up_act, gated = kernel_activations(activation)
    M, rows = x8.shape[0], w8.shape[0]
    hidden = rows // 2 if gated else rows
    saved = torch.empty((M, rows), device=x8.device, dtype=dtype)
    if PINGPONG_FP8["forward"] and fp8_hopper.usable_fp8(x8, (w8,), (bias,), hidden, hidden if gated else None):
        h8 = torch.empty((M, hidden), device=x8.device, dtype=E4M3)
        h8t = torch.empty((hidden, _padded(M)), device=x8.device, dtype=E4M3)
        if fp8_hopper.linear_act_forward_fp8(x8, w8, inv, bias, act, h8, h8t, saved, *state.slot(H)[:2],
                                           up_act, gated):
            return h8, h8t, saved
    if SEPARATE_CAST["forward"] and pingpong.usable(x8, (w8,), (bias,), hidden if gated else None):
        h = torch.empty((M, hidden), device=x8.device, dtype=dtype)
        if pingpong.linear_act_forward(x8, w8, bias, act, up_act, gated, True, h, saved, inv=inv):
            return (*cast_transpose(h, state, H, row_major=True), saved)
    return fp8_linear_act(x8, w8, inv, bias, activation, state, dtype)


def _second_dgrad(gy8, w2t8, inv, saved, activation, state, bias_grad):
    """(gz8, gz8ᵀ, the first linear's bias gradient or None) for grad_z = (gy8 @ w2t8.T · inv[0] · inv[1]) * saved
    (W2ᵀ = w2t8), grad_z quantized with the GRAD_Z slot's scale, its amax folded in."""
    gated = kernel_activations(activation)[2]
    M, width = gy8.shape[0], saved.shape[1]
    split = w2t8.shape[0] if gated else None
    if PINGPONG_FP8["dgrad"] and fp8_hopper.usable_fp8(gy8, (w2t8, saved), (), width, split, dgrad=True):
        gz8 = torch.empty((M, width), device=gy8.device, dtype=E5M2)
        gz8t = torch.empty((width, _padded(M)), device=gy8.device, dtype=E5M2)
        ok, grad_b_fc = fp8_hopper.dgrad_fp8(gy8, w2t8, inv, saved, gz8, gz8t, bias_grad,
                                           *state.slot(GRAD_Z)[:2], gated)
        if ok:
            return gz8, gz8t, grad_b_fc
    if SEPARATE_CAST["dgrad"] and pingpong.usable(gy8, (w2t8, saved), split=split):
        gz = torch.empty_like(saved)
        ok, grad_b_fc = pingpong.dgrad(gy8, w2t8, saved, gz, gated, bias_grad, inv=inv)
        if ok:
            return (*cast_transpose(gz, state, GRAD_Z, row_major=True), grad_b_fc)
    return fp8_dgrad(gy8, w2t8.t(), inv, saved, activation, state, bias_grad)


def _calibrated(run, state, slot, *args):
    """run(*args)'s result. On an MLP's first call (no history yet) run goes twice: the first time only to measure the
    amax of the tensor it quantizes, which then sets the slot's scale (current scaling, once)."""
    if not state.calibrated:
        run(*args)
        _set_current_scale(state, slot)
    return run(*args)


def _quantized_rows(t, state, slot, inv_scales=None):
    """(t as rows (M, C) with a contiguous last dim, its FP8 copy, its FP8 transposed copy) with the slot's scale (on
    the calibrating call: t's own); the 1/scales copied into inv_scales if given (see cast_transpose)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(1) != 1:
        t2 = t2.contiguous()
    if not state.calibrated:
        _set_current_scale(state, slot, t2)
    return (t2, *cast_transpose(t2, state, slot, row_major=True, inv_scales=inv_scales))


def _without_autocast(fn):
    """Run fn with autocast off: the tensors come already cast, and _scaled_mm's rounding of y must not depend on
    whether autocast is on around it (it is in FP8MLPFunction, not inside a compiled graph, which bakes the casts
    in and runs with it off; on CPU the two differed by one fp16 step). Where it is off, fn runs as it is (the
    context costs the host µs a call)."""
    def run(*args):
        if not torch.is_autocast_enabled(args[0].device.type):
            return fn(*args)
        with torch.autocast(args[0].device.type, enabled=False):
            return fn(*args)
    run.__doc__ = fn.__doc__
    return run


@_without_autocast
def _forward(x, b_fc, b_proj, activation, state, w_fc8, w_fc_inv, w_proj8, w_proj_inv):
    """(y (M, C), xᵀ in e4m3, hᵀ in e4m3, dh/dz, the 1/scales x and h were quantized with) for rows x (M, C); the
    weights come as their FP8 copies only."""
    # inv: the 1/scales x and h are quantized with, kept for the backward whatever updates come before it; copied by
    # x's cast (the calibrating call sets H's scale after it: a copy of its own there)
    inv = torch.empty_like(state.inv_scale) if state.calibrated else None
    x2, x8, xt8 = _quantized_rows(x, state, X, inv)
    inv_x = state.slot(X)[2]
    h8, ht8, saved = _calibrated(_first_linear, state, H, x8, w_fc8, (inv_x, w_fc_inv), b_fc, activation, state,
                                 x.dtype)
    if inv is None:
        inv = state.inv_scale.clone()
    y = torch._scaled_mm(h8, w_proj8.t(), scale_a=inv[H, :1], scale_b=w_proj_inv, bias=b_proj,
                         out_dtype=x.dtype, use_fast_accum=True)
    return y, xt8, ht8, saved, inv


@_without_autocast
def _backward(grad_y, xt8, ht8, saved, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv, w_dtype, activation, state,
              bias_grad, proj_bias_grad, w_fc_grad=True, w_proj_grad=True):
    """(dx, dW1 or None, db1 or None, dW2 or None, db2 or None) for rows grad_y (M, C), the weights' gradients in
    w_dtype, each only where it is asked for (a frozen weight's GEMM is skipped); then the scales move on
    (update_scales)."""
    gy, gy8, gyt8 = _quantized_rows(grad_y, state, GRAD_Y)
    inv_gy = state.slot(GRAD_Y)[2]
    gz8, gzt8, grad_b_fc = _calibrated(_second_dgrad, state, GRAD_Z, gy8, w_proj_t8, (inv_gy, w_proj_inv), saved,
                                       activation, state, bias_grad)
    del saved
    inv_gz = state.slot(GRAD_Z)[2]
    grad_w_proj = torch._scaled_mm(gyt8, ht8.t(), scale_a=inv_gy, scale_b=inv[H, :1], out_dtype=w_dtype) \
        if w_proj_grad else None
    grad_b_proj = gy.sum(0) if proj_bias_grad else None
    grad_x = torch._scaled_mm(gz8, w_fc_t8.t(), scale_a=inv_gz, scale_b=w_fc_inv, out_dtype=gy.dtype)
    grad_w_fc = torch._scaled_mm(gzt8, xt8.t(), scale_a=inv_gz, scale_b=inv[X, :1], out_dtype=w_dtype) \
        if w_fc_grad else None
    update_scales(state)
    state.calibrated = True
    grad_b_fc = grad_b_fc.to(gy.dtype) if bias_grad else None
    return grad_x, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj


# The parameters' gradients among _backward's outputs: graphs.py hands them out as copies (autograd keeps a leaf's
# first gradient as its .grad, which the next replay would overwrite)
_backward.param_grads = (1, 2, 3, 4)


class FP8MLPFunction(torch.autograd.Function):
    """y = act(x @ W1ᵀ + b1) @ W2ᵀ + b2 with the FP8 GEMMs of kernels.py's docstring, outside torch.compile. x and the
    biases come in 16 bits (autocast's copies), the weights as the masters (dW in their dtype); the weights' FP8 copies
    (FP8State.weights) come beside them, not differentiated."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, activation, state, w_fc8, w_fc_t8, w_fc_inv, w_proj8, w_proj_t8,
                w_proj_inv):
        y, xt8, ht8, saved, inv = _forward(x, b_fc, b_proj, activation, state, w_fc8, w_fc_inv, w_proj8, w_proj_inv)
        ctx.save_for_backward(xt8, ht8, saved, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv)
        ctx.activation, ctx.state, ctx.x_shape, ctx.w_dtype = activation, state, x.shape, w_proj.dtype
        ctx.has_bias = (b_fc is not None, b_proj is not None)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        bias_grad = ctx.has_bias[0] and ctx.needs_input_grad[2]
        grads = _backward(grad_y, *ctx.saved_tensors, ctx.w_dtype, ctx.activation, ctx.state, bias_grad,
                          ctx.has_bias[1] and ctx.needs_input_grad[4], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        return (grads[0].view(ctx.x_shape), *grads[1:]) + (None,) * 8


def _state(number):
    state = _STATES[number]()
    if state is None:
        raise RuntimeError(f"FP8State number {number} no longer exists (a compiled graph outlived its model)")
    return state


def _run(body, x, state, *args):
    """body(*args), replayed from the layer's CUDA graphs where they can run (graphs.py: under torch.compile
    without CUDA graphs of its own), else as it is."""
    if state.calibrated and op_graphs.usable(x):
        if state.op_graphs is None:
            state.op_graphs = op_graphs.OpGraphs()
        return state.op_graphs(body, *args)
    return body(*args)


@fused_op("fp8_mlp_forward")
def fp8_forward_op(x: Tensor, w_fc: Tensor, b_fc: Optional[Tensor], w_proj: Tensor, b_proj: Optional[Tensor],
                   w_fc8: Tensor, w_fc_t8: Tensor, w_fc_inv: Tensor, w_proj8: Tensor, w_proj_t8: Tensor,
                   w_proj_inv: Tensor, activation: str, state: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, then what backward needs: xᵀ8, hᵀ8, dh/dz, the 1/scales) for rows x; w_fc8 ... w_proj_inv: the weights'
    FP8 copies (quantize_weight), made by the compiled graph. (W1 and W2 are here for autograd: only their copies
    are read.)"""
    state = _state(state)
    return _run(_forward, x, state, x, b_fc, b_proj, activation, state, w_fc8, w_fc_inv, w_proj8, w_proj_inv)


@fp8_forward_op.register_fake
def _(x, w_fc, b_fc, w_proj, b_proj, w_fc8, w_fc_t8, w_fc_inv, w_proj8, w_proj_t8, w_proj_inv, activation, state):
    M, C = x.shape
    hidden, Mp, f32 = w_proj.shape[1], _padded(x.shape[0]), torch.float32
    return (x.new_empty(M, C), x.new_empty(C, Mp, dtype=E4M3), x.new_empty(hidden, Mp, dtype=E4M3),
            x.new_empty(M, w_fc.shape[0]), x.new_empty(4, 4, dtype=f32))


@fused_op("fp8_mlp_backward")
def fp8_backward_op(grad_y: Tensor, xt8: Tensor, ht8: Tensor, saved: Tensor, w_fc_t8: Tensor, w_fc_inv: Tensor,
                    w_proj_t8: Tensor, w_proj_inv: Tensor, inv: Tensor, w_dtype: torch.dtype, activation: str,
                    state: int, bias_grad: bool, proj_bias_grad: bool, w_fc_grad: bool,
                    w_proj_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW1, db1, dW2, db2) for rows grad_y; a gradient not asked for comes back empty."""
    state = _state(state)
    grads = _run(_backward, grad_y, state, grad_y, xt8, ht8, saved, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv,
                 w_dtype, activation, state, bias_grad, proj_bias_grad, w_fc_grad, w_proj_grad)
    return tuple(grad_y.new_empty(0) if g is None else g for g in grads)


@fp8_backward_op.register_fake
def _(grad_y, xt8, ht8, saved, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv, w_dtype, activation, state, bias_grad,
      proj_bias_grad, w_fc_grad, w_proj_grad):
    (M, C), rows, hidden = grad_y.shape, saved.shape[1], w_proj_t8.shape[0]
    return (grad_y.new_empty(M, C), grad_y.new_empty((rows, C) if w_fc_grad else (0,), dtype=w_dtype),
            grad_y.new_empty(rows if bias_grad else 0), grad_y.new_empty((C, hidden) if w_proj_grad else (0,),
                                                                          dtype=w_dtype),
            grad_y.new_empty(C if proj_bias_grad else 0))


def _setup_context(ctx, inputs, output):
    x, w_fc, b_fc, w_proj, b_proj, w_fc8, w_fc_t8, w_fc_inv, w_proj8, w_proj_t8, w_proj_inv, activation, state = inputs
    _, xt8, ht8, saved, inv = output
    ctx.save_for_backward(xt8, ht8, saved, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv)
    ctx.activation, ctx.state, ctx.has_bias = activation, state, (b_fc is not None, b_proj is not None)
    ctx.w_dtype = w_proj.dtype


def _op_backward(ctx, grad_y, *_):  # (no gradient flows into what the forward returned for backward)
    bias_grad, proj_bias_grad = ctx.has_bias[0] and ctx.needs_input_grad[2], ctx.has_bias[1] and ctx.needs_input_grad[4]
    w_fc_grad, w_proj_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    grad_x, grad_w_fc, grad_b_fc, grad_w_proj, grad_b_proj = fp8_backward_op.op(
        grad_y, *ctx.saved_tensors, ctx.w_dtype, ctx.activation, ctx.state, bias_grad, proj_bias_grad, w_fc_grad,
        w_proj_grad)
    return (grad_x, grad_w_fc if w_fc_grad else None, grad_b_fc if bias_grad else None,
            grad_w_proj if w_proj_grad else None, grad_b_proj if proj_bias_grad else None) + (None,) * 8


torch.library.register_autograd("fused_mlp::fp8_mlp_forward", _op_backward, setup_context=_setup_context)


def fp8_mlp(x, c_fc, c_proj, activation, state, copies=None):
    """model.MLP's FP8 path: c_proj(act(c_fc(x))) with FP8 GEMMs while training (grad enabled); under no_grad
    (evaluation, sampling) the bf16 fused path. x: (..., C), 16-bit or under autocast. copies: the two weights' FP8
    copies (W1 8, W1ᵀ 8, 1/scale, then W2's) where the caller made them (model.GPT under torch.compile:
    weight_copies.py), else made here."""
    return _fp8_mlp(x, c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias, activation, state, copies)


def fp8_layers_as_function(c_fc, c_proj, activation, norm, state):
    """fp8_mlp(norm(x), ...) as (fn, tensors), as mlp.layers_as_function: what graphs.py captures. The weights' FP8
    copies are among the tensors: FP8State.weights, asked here (outside any replay: a host-side check), remakes them
    once per optimizer step in place, where the captured graphs read them."""
    copies = state.weights(c_fc.weight, c_proj.weight)
    tensors = (c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias, *copies,
               *((norm.weight, norm.bias) if norm is not None else ()))

    def fn(x, w_fc, b_fc, w_proj, b_proj, *rest):
        copies, (ln_weight, ln_bias) = rest[:6], (rest[6:] or (None, None))
        if norm is not None:
            x = torch.nn.functional.layer_norm(x, norm.normalized_shape, ln_weight, ln_bias, norm.eps)
        return _fp8_mlp(x, w_fc, b_fc, w_proj, b_proj, activation, state, copies)
    return fn, tensors


def _fp8_mlp(x, w_fc, b_fc, w_proj, b_proj, activation, state, copies=None):
    if not torch.is_grad_enabled() or x.numel() == 0:
        return fused_mlp(x, w_fc, b_fc, w_proj, b_proj, activation)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # (train.py checks the device before it compiles)
        check_fp8_device(x.device)
    # The weights go in as the parameters themselves (fp32 under autocast), never autocast's 16-bit copies: their FP8
    # copies are made from them, and dW comes out in their dtype, with no rounding to 16 bits and no convert after.
    x, b_fc, b_proj = _autocast(x, b_fc, b_proj)
    check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, activation, masters=torch.is_autocast_enabled(x.device.type))
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8=True needs 16-bit activations (train under autocast, dtype bfloat16 or float16, or "
                        f"with a 16-bit model); x is {x.dtype}")
    C, hidden = w_proj.shape
    if C % 16 or hidden % 16:
        raise ValueError(f"fp8=True needs the model width ({C}) and the MLP's hidden size ({hidden}) to be multiples "
                         "of 16 (FP8 GEMMs take K and N in multiples of 16)")
    if copies is None and compiling:  # made here, every call (see the top of this file); inductor fuses them
        copies = (*quantize_weight(w_fc), *quantize_weight(w_proj))
    elif copies is None:  # (given: graphs.py's, see fp8_layers_as_function, or model.GPT's under torch.compile)
        copies = state.weights(w_fc, w_proj)
    if compiling:
        x2 = x.reshape(-1, C).contiguous()
        y = fp8_forward_op(x2, w_fc, b_fc, w_proj, b_proj, *copies, activation, state.number)[0]
        return y.view(*x.shape[:-1], C)
    return FP8MLPFunction.apply(x, w_fc, b_fc, w_proj, b_proj, activation, state, *copies)
