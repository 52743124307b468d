"""The classifier: the LM head and the cross-entropy as one operator, forward and backward.

A GPT's last step turns each of M positions' C features into V logits (x @ W.T, V = 50304 for GPT-2) and takes the
cross-entropy against the next token. Written as two PyTorch calls it stores the M x V logits (1.2 GB in bf16 at
12 x 1024 positions), an fp32 copy for the log-softmax, its output, and then the same again for the gradient. Only
three things are needed: the loss, and the gradients of x and W. And the gradient of the mean loss with respect to
a logit is known as soon as its row's softmax is: (softmax - one_hot(target)) / n, with n the number of positions
not ignored. So, llm.c's classifier and Liger's fused linear cross-entropy, in chunks of rows:

1. logits = x_chunk @ W.T, one GEMM (cuBLAS's; on Hopper our own, see 2) into a chunk-sized buffer (in the compute
   dtype: bf16 under autocast);
2. one Triton kernel per row (below) reads the row twice: first its running max and sum of exponentials (the
   log-sum-exp, online as in flash attention), then it writes the gradient of the mean loss over the logits, in
   place, and the row's loss (for the FP8 form, fp8/classifier.py, also softmax - one_hot in e5m2 beside them).
   On Hopper the GEMM is our own (hopper/pingpong.py's "lse" epilogue, reached through backends.py): while the
   tile is in registers it also writes each row's log-sum-exp over the tile's 128 columns, and the row kernel
   reduces those ~V/128 partials instead of reading the logits a first time: one read of the logits, not two;
3. dx_chunk = dlogits @ W and dW += dlogits.T @ x_chunk, two more GEMMs (dW accumulated in fp32).

All of it happens in the forward, where the logits are at hand; the backward only scales dx and dW by the loss's
incoming gradient (1 in training). The logits never exist at full size, in any dtype: the memory above the inputs
is one chunk of logits, dx and the fp32 dW. Without grad (evaluation), step 3 is skipped and the kernel writes
only the losses. `chunk_rows` picks the chunk: about 2^28 logits (512 MiB in bf16), cut into equal chunks of whole
128-row tiles.
Where its time goes against the floor (the GEMMs, one read and one write of the logits): docs/performance.md.

Targets equal to `ignore_index` (-1, nanoGPT's) count for neither the loss nor n; if every target is ignored the
mean is 0/0 = NaN, as F.cross_entropy's. A target outside [0, V) that is not ignore_index gives a NaN loss and
finite gradients (checking it on the host would wait for the GPU every step; F.cross_entropy raises instead): see
linear_cross_entropy. The loss is float32 (float64 for float64 inputs) whatever the GEMMs' dtype.

Special values, by the math: a NaN logit makes its row's loss and gradient NaN; a -inf logit has probability 0
(exactly); a +inf logit makes the log-sum-exp +inf, so the row's loss is +inf (NaN if the target's own logit is
+inf: inf - inf), and its gradient NaN (the softmax of an infinite logit is not formed by these exponentials).
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import backends, env
from .casts import quantize
from .mlp import kernels_can_run
from .ops import fused_op

CHUNK_LOGITS = 2 ** 28  # logits per chunk (512 MiB in bf16): 2^27 took 7% longer at GPT-2's head, 2^29 1% less
TILE_ROWS = 128  # a chunk's rows fill whole tiles of this height (the GEMMs' row tiles: ours, and cuBLAS's)
BLOCK_V = 2048  # logits a program reads at a time (its registers hold one block)
# The FP8 form's gradient (fp8/classifier.py): softmax - one_hot lies in [-1, 1], so one fixed power of two puts it
# in e5m2's range with nothing that matters underflowing (a probability p >= 2^-29 stays normal): no amax needed.
GRAD8_SCALE = 2.0 ** 15
_TL_DTYPES = {torch.float8_e5m2: tl.float8e5, torch.float8_e4m3fn: tl.float8e4nv}


@triton.jit
def _row_log_sum_exp(ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """The log-sum-exp of ptr[0:n] in ACC: each lane keeps a running max m and sum s of exp(x - m) over the blocks
    it sees (online, as in flash attention); a lane that has seen only -inf keeps s = 0."""
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, ACC)
    s = tl.zeros([BLOCK], ACC)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n, other=neg_inf).to(ACC)
        m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
        s = tl.where(m_new == neg_inf, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    m_row = tl.where(tl.max((m != m).to(tl.int32), 0) > 0, float("nan"), tl.max(m, 0))  # (tl.max skips NaN)
    s_row = tl.sum(tl.where(m == neg_inf, 0.0, s * tl.exp(m - m_row)), 0)
    return tl.where(m_row == float("inf"), float("inf"), m_row + tl.log(s_row))


@triton.jit
def _cross_entropy_kernel(logits_ptr, stride, targets_ptr, loss_ptr, count_ptr, grad8_ptr, partial_ptr, T, V,
                          ignore_index, WRITE_GRAD: tl.constexpr, GRAD8: tl.constexpr, GRAD8_SCALE: tl.constexpr,
                          PARTIALS: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """One row: its loss into loss_ptr[row]; with WRITE_GRAD its logits replaced by the mean loss's gradient, and
    with GRAD8 (an FP8 dtype) also softmax - one_hot, times GRAD8_SCALE, quantized into grad8_ptr's row.
    PARTIALS: the row's log-sum-exps over T tiles of its logits are in partial_ptr's row (T floats a row)."""
    row = tl.program_id(0)
    ptr = logits_ptr + row.to(tl.int64) * stride
    acc_dtype = tl.float64 if logits_ptr.dtype.element_ty == tl.float64 else tl.float32
    # Pass 1: the row's log-sum-exp, from its logits or from their tiles' (a log-sum-exp of log-sum-exps is the
    # row's, special values included: NaN if any is NaN, +inf if any is +inf, -inf if all are -inf).
    if PARTIALS:
        lse = _row_log_sum_exp(partial_ptr + row.to(tl.int64) * T, T, acc_dtype, BLOCK)
    else:
        lse = _row_log_sum_exp(ptr, V, acc_dtype, BLOCK)

    target = tl.load(targets_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(ptr + target, mask=in_range & ~ignored, other=0.0).to(acc_dtype)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, tl.where(in_range, lse - x_target, float("nan"))))
    if WRITE_GRAD:
        # Pass 2: d(mean loss)/d(logit) = (softmax - one_hot(target)) / n; a +inf logit gives NaN (the rule above).
        scale = 1.0 / tl.load(count_ptr).to(acc_dtype)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(acc_dtype)
            p = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            p = tl.where(ignored, 0.0, tl.where(lse == float("inf"), float("nan"), p))
            grad = tl.where(ignored, 0.0, p * scale)  # (every target ignored: scale = 1/0)
            tl.store(ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < V)
            if GRAD8 is not None:
                tl.store(grad8_ptr + row.to(tl.int64) * V + cols, quantize(p, GRAD8_SCALE, GRAD8, EMULATE),
                         mask=cols < V)


def cross_entropy_rows(logits, targets, count, ignore_index, write_grad, grad8=None, grad8_scale=GRAD8_SCALE,
                       partial=None):
    """Each row's loss (float32, or float64 for float64 logits); with write_grad the logits are overwritten by the
    gradient of sum(losses) / count (count: a 0-d tensor on the logits' device, so no host sync), and grad8 (a
    contiguous FP8 tensor of the logits' shape, or None) gets (softmax - one_hot) · grad8_scale. partial: each
    row's log-sum-exps over tiles of its logits (M, T), contiguous (from logits_and_partials), or None."""
    M, V = logits.shape
    loss = torch.empty(M, device=logits.device, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if M:
        _cross_entropy_kernel[(M,)](logits, logits.stride(0), targets, loss, count, logits if grad8 is None else grad8,
                                    logits if partial is None else partial, 0 if partial is None else partial.shape[1],
                                    V, ignore_index, WRITE_GRAD=write_grad,
                                    GRAD8=None if grad8 is None else _TL_DTYPES[grad8.dtype], GRAD8_SCALE=grad8_scale,
                                    PARTIALS=partial is not None, EMULATE=env.INTERPRET,
                                    BLOCK=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8)
    return loss


def logits_and_partials(x, weight, out, inv=None):
    """out = x @ weight.T (x, weight 16-bit; or FP8 with inv their 1/scales, for fp8/classifier.py), and each row's
    log-sum-exps over tiles of out's columns where a backend's GEMM writes them (Hopper's), else None (cuBLAS's
    GEMM; the row kernel then reads the logits twice). Without inv, any dtype."""
    partial = backends.run("logits_lse", x, weight, out, inv)  # Hopper: hopper/dispatch.py
    if partial is not NotImplemented:
        return partial
    if inv is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch._scaled_mm(x, weight.t(), scale_a=inv[0], scale_b=inv[1], out_dtype=out.dtype, out=out)
    return None


def chunk_rows(M, V, logits=None):
    """Rows per chunk: about `logits` logits (default CHUNK_LOGITS), the M rows cut into equal chunks, rounded up to
    whole GEMM tiles of TILE_ROWS (at 2^27 logits a chunk GPT-2's 12288 rows went in five chunks of 2458, each of
    whose GEMMs ended on a tile one fifth full: 4% of the logits' and dx's GEMM work spent on nothing; now four of
    2560 and one of 2048; at 2^28 three of 4096, at 2^29 two of 6144)."""
    chunks = max(1, math.ceil(M * V / (logits or CHUNK_LOGITS)))
    rows = max(1, math.ceil(M / chunks))
    return rows if rows <= TILE_ROWS else math.ceil(rows / TILE_ROWS) * TILE_ROWS


def _accumulate(dw, a, b, first):
    """dw (fp32) = a @ b, or += a @ b, with the sum kept in fp32 (cuBLAS does it in the GEMM on CUDA)."""
    if a.dtype == dw.dtype:
        return torch.mm(a, b, out=dw) if first else dw.addmm_(a, b)
    if dw.is_cuda:
        return torch.mm(a, b, out_dtype=dw.dtype, out=dw) if first else \
            torch.addmm(dw, a, b, out_dtype=dw.dtype, out=dw)
    product = torch.mm(a, b).to(dw.dtype)  # (the CPU has no mixed-dtype GEMM)
    return dw.copy_(product) if first else dw.add_(product)


@fused_op("linear_cross_entropy")
def linear_cross_entropy_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                            grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(mean cross-entropy of (x @ weight.T) against targets, and with grad dx and dW of that mean, else empty
    tensors), the GEMMs in dtype. x: (M, C); weight: (V, C); targets: (M,) integers."""
    M, V = x.shape[0], weight.shape[0]
    xc, wc = x.to(dtype), weight.to(dtype)
    count = (targets != ignore_index).sum()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    losses = []
    dx = torch.empty_like(xc) if grad else x.new_empty(0)
    dw = torch.empty(weight.shape, device=weight.device, dtype=acc) if grad else x.new_empty(0)
    rows = chunk_rows(M, V)
    buffer = logits = torch.empty((min(rows, M), V), device=x.device, dtype=dtype)
    for start in range(0, M, rows):
        xs = xc[start:start + rows]
        logits = buffer[:xs.shape[0]]
        partial = logits_and_partials(xs, wc, logits)
        losses.append(cross_entropy_rows(logits, targets[start:start + rows], count, ignore_index, grad,
                                         partial=partial))
        if grad:  # logits now hold d(mean loss)/d(logits)
            torch.mm(logits, wc, out=dx[start:start + rows])
            _accumulate(dw, logits.t(), xs, first=start == 0)
    del buffer, logits  # (freed before dW's conversion below: the two are not held at once)
    loss = torch.cat(losses).sum() / count if losses else x.new_full((), float("nan"), dtype=acc)
    if grad:
        return loss, dx.to(x.dtype), dw.to(weight.dtype)
    return loss, dx, dw


@linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index, dtype, grad):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.new_empty((), dtype=acc), x.new_empty(x.shape) if grad else x.new_empty(0),
            weight.new_empty(weight.shape) if grad else x.new_empty(0))


def loss_function(op):
    """The autograd.Function over op (this module's operator, or its FP8 form): the forward computes the loss and,
    while the logits are at hand, dx and dW; the backward only scales them."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, targets, ignore_index, dtype):
            loss, dx, dw = op(x, weight, targets, ignore_index, dtype, True)
            ctx.save_for_backward(dx, dw)
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            dx, dw = ctx.saved_tensors
            if dx.dtype == dw.dtype:  # one vectorized launch for both (a 0-d tensor broadcast alone is a slow kernel)
                dx, dw = torch._foreach_mul((dx, dw), grad_loss.to(dx.dtype))
            else:
                dx, dw = dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype)
            return dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None, None

    return Function


LinearCrossEntropyFunction = loss_function(linear_cross_entropy_op)


def run_classifier(function, x, weight, targets, ignore_index):
    """The argument checks, then function.apply where a gradient is wanted, else the operator without grad (the loss
    alone; this module's, the FP8 form's too)."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, {x.shape[-1]}) for x of shape {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)}")
    if targets.shape != x.shape[:-1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integers of shape {tuple(x.shape[:-1])}, got {targets.dtype} of shape "
                         f"{tuple(targets.shape)}")
    if not kernels_can_run(x) or x.device != weight.device or x.device != targets.device:
        raise ValueError(f"the fused classifier needs x, weight and targets on one CUDA device (or the CPU under "
                         f"TRITON_INTERPRET=1), got {x.device}, {weight.device}, {targets.device}")
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    x2, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1).contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        loss = function.apply(x2, weight, t, ignore_index, dtype)
    else:
        loss = linear_cross_entropy_op(x2, weight, t, ignore_index, dtype, False)[0]
    return loss  # float32 (float64 for float64): a mean of fp32 terms, never rounded to 16 bits (see below)


def linear_cross_entropy(x, weight, targets, ignore_index=-1):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index) (the mean over targets not ignored), without
    storing the logits. x: (..., C); weight: (V, C); targets: x's leading shape. Under autocast the GEMMs run in
    autocast's dtype, as nn.Linear's would; x and weight keep their dtypes, and so do their gradients.

    The loss is float32 whatever the inputs' dtype (float64 for float64 inputs): each row's term is computed in fp32
    and so is their mean, as eager fp32 cross-entropy (F.cross_entropy under autocast), Liger's and Cut
    Cross-Entropy's; rounded to bf16 it would be off by up to 2^-8 of itself (10.875 for 10.8638 at GPT-2's head).

    A target outside [0, V) that is not ignore_index raises nothing (F.cross_entropy raises an IndexError, or a
    device-side assert on a GPU; a check would make the host wait for the GPU every step): it makes the mean loss
    NaN, with grad or without. The gradients stay finite and give no sign of it: that row counts in n and its
    gradient is softmax / n, with no one-hot term. train.py checks every batch's ids on the host instead."""
    return run_classifier(LinearCrossEntropyFunction, x, weight, targets, ignore_index)
