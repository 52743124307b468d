"""The FP8 linear (model.GPTConfig's fp8_reach="blocks"): y = x @ Wᵀ + b with its three GEMMs in FP8, for the
attention's two projections (c_attn, attn.c_proj), with the FP8 MLP's recipe (kernels.py's docstring) and state.
c_attn goes through fp8_linear_qkv, the same linear with q, k and v returned apart (its section below says why).

A linear with no activation has no epilogue to carry a cast, so this is the FP8 MLP's outer half on its own:

    forward    x      -> x8, x8ᵀ (e4m3)                one cast + transpose pass, x's delayed scale (slot X)
               y      =  x8 @ W8ᵀ + b                   FP8 GEMM (torch._scaled_mm), the bias in its epilogue
    backward   gy     -> gy8, gy8ᵀ (e5m2)              one cast + transpose pass, gy's delayed scale (slot GRAD_Y)
               dx     =  gy8 @ W8,  dW = gy8ᵀ @ x8      FP8 GEMMs;  db = the column sums of gy (unquantized)

Each linear has an FP8State of its own (slots X and GRAD_Y; H and GRAD_Z stay unused), calibrated on its first call
and moved on by update_scales after each backward, per process under torchrun, as the MLP's. The weight's copies (W8,
W8ᵀ: each GEMM takes its weight K-major) come from the fp32 master itself under autocast, once per optimizer step
uncompiled and once per forward compiled (autograd.py's docstring says why), and dW comes out in the master's dtype:
no 16-bit copy of W is made either way.

Where the casts sit. x is LayerNorm's output (c_attn) or attention's (c_proj), gy comes out of attention's backward
(c_attn) or the residual stream's sum (c_proj): all of them kernels this repo does not write, so each cast is a
pass of its own, reading the tensor once and writing both FP8 copies. At GPT-2 small's size that is ~2.7 GB a step,
against 1.0 ms the FP8 GEMMs save (docs/performance.md has the arithmetic and the measured step).

Special values: as the MLP's (kernels.py), ±inf in x or gy becomes NaN. Under no_grad (evaluation, sampling) the
16-bit F.linear runs; 32-bit activations outside autocast are an error, as in the MLP.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mlp import _autocast
from ..ops import fused_op
from .autograd import _quantized_rows, _run, _state, _without_autocast
from .kernels import E4M3, GRAD_Y, X, _padded, cast_transpose_parts, update_scales
from .state import _set_current_scale, check_fp8_device, quantize_weight


@_without_autocast
def _forward(x, bias, state, w8, w_inv):
    """(y (M, N), x8ᵀ, the 1/scales x was quantized with) for rows x (M, K) and W's FP8 copy w8 (N, K)."""
    x8, xt8, inv = _quantized_input(x, state)
    y = torch._scaled_mm(x8, w8.t(), scale_a=inv[X, :1], scale_b=w_inv, bias=bias, out_dtype=x.dtype,
                         use_fast_accum=True)
    return y, xt8, inv


def _quantized_input(x, state):
    """(x8, x8ᵀ, the 1/scales x was quantized with: kept for the backward whatever updates come before it, copied by
    x's cast once calibrated)."""
    inv = torch.empty_like(state.inv_scale) if state.calibrated else None
    _, x8, xt8 = _quantized_rows(x, state, X, inv)
    return x8, xt8, (state.inv_scale.clone() if inv is None else inv)


@_without_autocast
def _backward(grad_y, xt8, w_t8, w_inv, inv, w_dtype, state, bias_grad, w_grad):
    """(dx, dW or None, db or None) for rows grad_y (M, N); dW in w_dtype; then the scales move on."""
    gy, gy8, gyt8 = _quantized_rows(grad_y, state, GRAD_Y)
    return _gradient_gemms(gy8, gyt8, gy.sum(0) if bias_grad else None, xt8, w_t8, w_inv, inv, gy.dtype, w_dtype,
                           state, w_grad)


def _gradient_gemms(gy8, gyt8, grad_b, xt8, w_t8, w_inv, inv, dtype, w_dtype, state, w_grad):
    """(dx, dW or None, db) from gy's FP8 copies; then the scales move on."""
    inv_gy = state.slot(GRAD_Y)[2]
    grad_x = torch._scaled_mm(gy8, w_t8.t(), scale_a=inv_gy, scale_b=w_inv, out_dtype=dtype)
    grad_w = torch._scaled_mm(gyt8, xt8.t(), scale_a=inv_gy, scale_b=inv[X, :1], out_dtype=w_dtype) \
        if w_grad else None
    update_scales(state)
    state.calibrated = True
    return grad_x, grad_w, grad_b


_backward.param_grads = (1, 2)  # (graphs.py: the parameters' gradients, handed out as copies)


class FP8LinearFunction(torch.autograd.Function):
    """y = x @ Wᵀ + b in FP8, outside torch.compile: x and b in 16 bits, W the master (its FP8 copies beside it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, w8, w_t8, w_inv):
        y, xt8, inv = _forward(x, bias, state, w8, w_inv)
        ctx.save_for_backward(xt8, w_t8, w_inv, inv)
        ctx.state, ctx.w_dtype, ctx.has_bias = state, weight.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_x, grad_w, grad_b = _backward(grad_y, *ctx.saved_tensors, ctx.w_dtype, ctx.state,
                                           ctx.has_bias and ctx.needs_input_grad[2], ctx.needs_input_grad[1])
        return grad_x, grad_w, grad_b, None, None, None, None


@fused_op("fp8_linear_forward")
def fp8_linear_forward_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], w8: Tensor, w_t8: Tensor,
                          w_inv: Tensor, state: int) -> tuple[Tensor, Tensor, Tensor]:
    """(y, then what backward needs: x8ᵀ, the 1/scales) for rows x; w8, w_t8, w_inv: W's FP8 copies, made by the
    compiled graph (W is here for autograd: only its copies are read)."""
    state = _state(state)
    return _run(_forward, x, state, x, bias, state, w8, w_inv)


@fp8_linear_forward_op.register_fake
def _(x, weight, bias, w8, w_t8, w_inv, state):
    return (x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[1], _padded(x.shape[0]), dtype=E4M3),
            x.new_empty(4, 4, dtype=torch.float32))


@fused_op("fp8_linear_backward")
def fp8_linear_backward_op(grad_y: Tensor, xt8: Tensor, w_t8: Tensor, w_inv: Tensor, inv: Tensor,
                           w_dtype: torch.dtype, state: int, bias_grad: bool,
                           w_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) for rows grad_y; a gradient not asked for comes back empty."""
    state = _state(state)
    grads = _run(_backward, grad_y, state, grad_y, xt8, w_t8, w_inv, inv, w_dtype, state, bias_grad, w_grad)
    return tuple(grad_y.new_empty(0) if g is None else g for g in grads)


@fp8_linear_backward_op.register_fake
def _(grad_y, xt8, w_t8, w_inv, inv, w_dtype, state, bias_grad, w_grad):
    (M, N), K = grad_y.shape, w_t8.shape[0]
    return (grad_y.new_empty(M, K), grad_y.new_empty((N, K) if w_grad else (0,), dtype=w_dtype),
            grad_y.new_empty(N if bias_grad else 0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, w8, w_t8, w_inv, state = inputs
    ctx.save_for_backward(output[1], w_t8, w_inv, output[2])
    ctx.state, ctx.w_dtype, ctx.has_bias = state, weight.dtype, bias is not None


def _op_backward(ctx, grad_y, *_):  # (no gradient flows into what the forward returned for backward)
    bias_grad, w_grad = ctx.has_bias and ctx.needs_input_grad[2], ctx.needs_input_grad[1]
    grad_x, grad_w, grad_b = fp8_linear_backward_op.op(grad_y, *ctx.saved_tensors, ctx.w_dtype, ctx.state,
                                                       bias_grad, w_grad)
    return grad_x, grad_w if w_grad else None, grad_b if bias_grad else None, None, None, None, None


torch.library.register_autograd("fused_mlp::fp8_linear_forward", _op_backward, setup_context=_setup_context)


def fp8_linear(x, weight, bias, state, copies=None):
    """F.linear(x, weight, bias) with FP8 GEMMs while training (grad enabled); under no_grad the 16-bit F.linear
    (evaluation losses stay comparable between settings, as the FP8 MLP's). x: (..., K), 16-bit or under autocast;
    weight (N, K) with N and K multiples of 16; state: the linear's own FP8State; copies: W's FP8 copies (W8, W8ᵀ,
    1/scale) where the caller made them (model.GPT under torch.compile: weight_copies.py), else made here."""
    if not torch.is_grad_enabled() or x.numel() == 0:
        return F.linear(x, weight, bias)
    x, bias, x2 = _checked(x, weight, bias, 1)
    if torch.compiler.is_compiling():
        y = fp8_linear_forward_op(x2.contiguous(), weight, bias, *_compiled_copies(weight, copies), state.number)[0]
    else:
        y = FP8LinearFunction.apply(x2, weight, bias, state, *(copies or state.weights(weight)))
    return y.view(*x.shape[:-1], weight.shape[0])


def _compiled_copies(weight, copies):
    """The weight's copies inside torch.compile: the caller's, or made in the graph at every call (inductor fuses
    quantize_weight; autograd.py says why not once per optimizer step)."""
    return copies if copies is not None else quantize_weight(weight)


def _checked(x, weight, bias, parts):
    """(x and bias as the FP8 GEMMs take them, x as rows) after the checks fp8_reach="blocks" needs, each a clear
    error; parts: how many equal outputs the weight's rows make (fp8_linear_qkv: 3)."""
    if not torch.compiler.is_compiling():  # (train.py checks the device before it compiles)
        check_fp8_device(x.device, setting="fp8_reach='blocks'", instead="use fp8_reach='mlp'")
    x, bias = _autocast(x, bias)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8_reach='blocks' needs 16-bit activations (train under autocast, dtype bfloat16 or "
                        f"float16, or with a 16-bit model); x is {x.dtype}")
    N, K = weight.shape
    if N % (16 * parts) or K % 16 or x.shape[-1] != K:
        sizes = "N and K multiples of 16" if parts == 1 else f"N/{parts} and K multiples of 16"
        raise ValueError(f"fp8_reach='blocks' needs a weight (N, K) with {sizes} (FP8 GEMMs take them so) and x of "
                         f"width K; got weight {tuple(weight.shape)}, x {tuple(x.shape)}")
    return x, bias, x.reshape(-1, K)


# ----------------------------------------------------------------------------------------------------------
# The attention's input projection, q, k and v as three outputs.
#
# Why. As one (M, 3C) output split into q, k and v, c_attn's gradient is a concatenation: attention's backward
# leaves dq, dk and dv in three tensors, and the graph would write them side by side into one (M, 3C) grad_y
# (a gather kernel, 0.31 ms a GPT-2 small step on an H200) only for the FP8 cast to read it again. Returned
# apart, q, k and v get their gradients apart, and kernels.cast_transpose_parts casts each straight into its
# columns of gy8 and rows of gy8ᵀ, with the one scale of the layer's GRAD_Y slot. The forward makes them
# with three GEMMs on W's thirds (an output of an operator cannot be a view of another); dx and dW stay one
# GEMM each, on the whole gy8.


@_without_autocast
def _forward_qkv(x, bias, state, w8, w_inv):
    """(q, k, v (M, N/3) each, x8ᵀ, the 1/scales) for rows x (M, K) and W's FP8 copy w8 (N, K)."""
    x8, xt8, inv = _quantized_input(x, state)
    n = w8.shape[0] // 3
    q, k, v = (torch._scaled_mm(x8, w8[i * n:(i + 1) * n].t(), scale_a=inv[X, :1], scale_b=w_inv,
                                bias=None if bias is None else bias[i * n:(i + 1) * n], out_dtype=x.dtype,
                                use_fast_accum=True) for i in range(3))
    return q, k, v, xt8, inv


@_without_autocast
def _backward_qkv(grad_q, grad_k, grad_v, xt8, w_t8, w_inv, inv, w_dtype, state, bias_grad, w_grad):
    """(dx, dW or None, db or None) for the rows of q's, k's and v's gradients (M, N/3) each."""
    parts = [g if g.stride(1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v)]
    if not state.calibrated:  # the slot's scale from the three parts' amax together
        _set_current_scale(state, GRAD_Y, torch.stack([g.detach().abs().amax() for g in parts]))
    gy8, gyt8 = cast_transpose_parts(parts, state, GRAD_Y)
    grad_b = torch.cat([g.sum(0) for g in parts]) if bias_grad else None
    return _gradient_gemms(gy8, gyt8, grad_b, xt8, w_t8, w_inv, inv, parts[0].dtype, w_dtype, state, w_grad)


_backward_qkv.param_grads = (1, 2)


def _present(grads, like):
    """The outputs' gradients, a zero one for any that comes as None. Autograd materializes zeros for an output nobody
    used, so this is a guard, not a path the tests reach. (like: q, which attention's backward holds anyway.)"""
    return [torch.zeros_like(like) if g is None else g for g in grads]


class FP8QKVFunction(torch.autograd.Function):
    """q, k, v = (x @ Wᵀ + b) in thirds, in FP8, outside torch.compile (the arguments as FP8LinearFunction's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, w8, w_t8, w_inv):
        q, k, v, xt8, inv = _forward_qkv(x, bias, state, w8, w_inv)
        ctx.save_for_backward(xt8, w_t8, w_inv, inv, q)
        ctx.state, ctx.w_dtype, ctx.has_bias = state, weight.dtype, bias is not None
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        *saved, q = ctx.saved_tensors
        grad_x, grad_w, grad_b = _backward_qkv(*_present((grad_q, grad_k, grad_v), q), *saved, ctx.w_dtype,
                                               ctx.state, ctx.has_bias and ctx.needs_input_grad[2],
                                               ctx.needs_input_grad[1])
        return grad_x, grad_w, grad_b, None, None, None, None


@fused_op("fp8_linear_qkv_forward")
def fp8_linear_qkv_forward_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], w8: Tensor, w_t8: Tensor,
                              w_inv: Tensor, state: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, then what backward needs: x8ᵀ, the 1/scales); as fp8_linear_forward_op."""
    state = _state(state)
    return _run(_forward_qkv, x, state, x, bias, state, w8, w_inv)


@fp8_linear_qkv_forward_op.register_fake
def _(x, weight, bias, w8, w_t8, w_inv, state):
    n = weight.shape[0] // 3
    return (*(x.new_empty(x.shape[0], n) for _ in range(3)),
            x.new_empty(x.shape[1], _padded(x.shape[0]), dtype=E4M3), x.new_empty(4, 4, dtype=torch.float32))


@fused_op("fp8_linear_qkv_backward")
def fp8_linear_qkv_backward_op(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, xt8: Tensor, w_t8: Tensor,
                               w_inv: Tensor, inv: Tensor, w_dtype: torch.dtype, state: int, bias_grad: bool,
                               w_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) from q's, k's and v's gradients; a gradient not asked for comes back empty."""
    state = _state(state)
    grads = _run(_backward_qkv, grad_q, state, grad_q, grad_k, grad_v, xt8, w_t8, w_inv, inv, w_dtype, state,
                 bias_grad, w_grad)
    return tuple(grad_q.new_empty(0) if g is None else g for g in grads)


@fp8_linear_qkv_backward_op.register_fake
def _(grad_q, grad_k, grad_v, xt8, w_t8, w_inv, inv, w_dtype, state, bias_grad, w_grad):
    M, N, K = grad_q.shape[0], 3 * grad_q.shape[1], w_t8.shape[0]
    return (grad_q.new_empty(M, K), grad_q.new_empty((N, K) if w_grad else (0,), dtype=w_dtype),
            grad_q.new_empty(N if bias_grad else 0))


def _setup_context_qkv(ctx, inputs, output):
    x, weight, bias, w8, w_t8, w_inv, state = inputs
    ctx.save_for_backward(output[3], w_t8, w_inv, output[4], output[0])
    ctx.state, ctx.w_dtype, ctx.has_bias = state, weight.dtype, bias is not None


def _op_backward_qkv(ctx, grad_q, grad_k, grad_v, *_):
    bias_grad, w_grad = ctx.has_bias and ctx.needs_input_grad[2], ctx.needs_input_grad[1]
    *saved, q = ctx.saved_tensors
    grad_x, grad_w, grad_b = fp8_linear_qkv_backward_op.op(*_present((grad_q, grad_k, grad_v), q), *saved,
                                                           ctx.w_dtype, ctx.state, bias_grad, w_grad)
    return grad_x, grad_w if w_grad else None, grad_b if bias_grad else None, None, None, None, None


torch.library.register_autograd("fused_mlp::fp8_linear_qkv_forward", _op_backward_qkv,
                                setup_context=_setup_context_qkv)


def fp8_linear_qkv(x, weight, bias, state, copies=None):
    """F.linear(x, weight, bias).chunk(3, -1) with FP8 GEMMs while training, as fp8_linear (copies too), returning
    q, k and v as three tensors (..., N/3) whose gradients are cast apart (see above); N/3 a multiple of 16."""
    if not torch.is_grad_enabled() or x.numel() == 0:
        return F.linear(x, weight, bias).chunk(3, dim=-1)
    x, bias, x2 = _checked(x, weight, bias, 3)
    if torch.compiler.is_compiling():
        q, k, v = fp8_linear_qkv_forward_op(x2.contiguous(), weight, bias, *_compiled_copies(weight, copies),
                                            state.number)[:3]
    else:
        q, k, v = FP8QKVFunction.apply(x2, weight, bias, state, *(copies or state.weights(weight)))
    return tuple(t.view(*x.shape[:-1], weight.shape[0] // 3) for t in (q, k, v))
