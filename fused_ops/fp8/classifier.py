"""The classifier's FP8 form (model.GPT's classifier="fp8"): ../classifier.py's operator with its three GEMMs in FP8
on Hopper's (or Ada's) FP8 tensor cores, which run at twice bf16's rate.

Per chunk of rows, as in ../classifier.py:

    logits = x8 @ W8ᵀ                       FP8 GEMM, x and W in e4m3, logits out in 16 bits (on Hopper our own, with
                                             each row's log-sum-exp per tile beside them; else torch._scaled_mm)
    the row kernel                           each row's loss and log-sum-exp (from those partials; after
                                             _scaled_mm it reads the row)
    the gradient kernel (below)              reads the logits once, writes g8 = (softmax - one_hot) · 2^15 in e5m2
                                             twice: row-major, and transposed (g8ᵀ, V x rows)
    dx = g8 @ W8 · 1/(n · 2^15)             FP8 GEMM (W8ᵀ, W's transposed copy: FP8 GEMMs take K-major operands)
    dW += g8ᵀ @ x8 · 1/(n · 2^15)           FP8 GEMM over the chunk's rows (x8ᵀ, the chunk's transposed copy),
                                             accumulated in fp32

The gradient kernel. FP8 GEMMs reduce over their operands' contiguous dimension, and the two GEMMs that read the
gradient reduce over different ones: dx over the vocabulary (g8 row by row), dW over the rows (g8ᵀ). The 16-bit
operator has cuBLAS read one gradient both ways; here it must exist in both layouts. The kernel writes both from
the same tile of logits: a program takes BLOCK_R rows and a stretch of the vocabulary, tile by tile (BLOCK_R x
BLOCK_V), each row's log-sum-exp already known (the row kernel's), forms the tile's softmax - one_hot and stores
it quantized twice, the second time at transposed addresses: Triton moves the tile through shared memory so that
both stores are contiguous. 32 rows make each transposed line one 32-byte sector. It writes what the 16-bit
gradient over the logits weighed in bytes (two e5m2 copies instead of a bf16 one), and dW's GEMM runs at FP8's rate.
dW's K (the chunk's rows) is padded to a multiple of 16 with zeros in both operands, as FP8 GEMMs need.

Why these choices:
- The gradient needs no amax. softmax - one_hot lies in [-1, 1] whatever the logits, so one fixed power of two
  (GRAD8_SCALE) fills e5m2's range; the kernel quantizes as it writes, with no history and no second pass.
- x and W use current scaling (their own amax; kernels.quantize_weight_fused: an amax, one cast pass, and for W
  a transposing pass), not the MLP's delayed scales: x is M x C and W is V x C, small next to the M x V logits, so
  the extra read costs little, and there is no state to keep, per process under torchrun or across CUDA graphs.
- dW's chunks add up in fp32 (the first GEMM writes dW, each later one a product that is added): the product
  lies in the logits' buffer, free once the gradient kernel has read it.
- Without grad (evaluation, sampling) the 16-bit operator runs, as the FP8 MLP does: evaluation losses stay
  comparable between settings.

The FP8 GEMMs need C and V multiples of 16 (GPTConfig checks it). Special values: as ../classifier.py's rule, except
that ±inf in x or W becomes NaN when quantized (kernels.py's docstring says why), so its rows' losses are NaN.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import classifier as core
from .. import env
from ..casts import quantize
from ..ops import fused_op
from .kernels import E4M3, E5M2, quantize_weight_fused
from .state import check_fp8_device

BLOCK_R, BLOCK_V, V_SPLITS = 32, 256, 4  # the gradient kernel's tile, and the stretches each row block's V is cut in


@triton.jit
def _gradient_kernel(logits_ptr, stride, lse_ptr, targets_ptr, g8_ptr, g8t_ptr, n, K, V, ignore_index,
                     GRAD8: tl.constexpr, GRAD8_SCALE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_V: tl.constexpr, V_SPLITS: tl.constexpr):
    """Rows [BLOCK_R·i, BLOCK_R·(i+1)) of n, over the j-th of V_SPLITS stretches of the vocabulary: g8 (n x V) and
    g8t (V x K, K >= n: its columns n..K-1 zeros) = (softmax - one_hot(target)) · GRAD8_SCALE in GRAD8; ignored
    rows zeros; a row whose log-sum-exp is +inf NaN (../classifier.py's rule)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    real = rows < n
    lse = tl.load(lse_ptr + rows, mask=real, other=0.0)
    target = tl.load(targets_ptr + rows, mask=real, other=ignore_index).to(tl.int64)
    kept = real & (target != ignore_index)
    stretch = tl.cdiv(tl.cdiv(V, BLOCK_V), V_SPLITS) * BLOCK_V
    first = tl.program_id(1) * stretch
    for start in range(first, tl.minimum(first + stretch, V), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :],
                    mask=real[:, None] & inside[None, :], other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        p = tl.where(kept[:, None], tl.where(lse[:, None] == float("inf"), float("nan"), p), 0.0)
        q = quantize(p, GRAD8_SCALE, GRAD8, EMULATE)
        tl.store(g8_ptr + rows[:, None].to(tl.int64) * V + cols[None, :], q, mask=real[:, None] & inside[None, :])
        tl.store(g8t_ptr + cols[None, :].to(tl.int64) * K + rows[:, None], q,
                 mask=(rows < K)[:, None] & inside[None, :])


def gradients8(logits, lse, targets, ignore_index, g8, g8t, scale=core.GRAD8_SCALE):
    """The gradient kernel over a chunk: logits (n x V), lse (n), targets (n); g8 (n x V) and g8t (V x K) contiguous,
    e5m2, at scale (the GEMMs undo GRAD8_SCALE)."""
    n, V = logits.shape
    grid = (triton.cdiv(g8t.shape[1], BLOCK_R), V_SPLITS)
    _gradient_kernel[grid](logits, logits.stride(0), lse, targets, g8, g8t, n, g8t.shape[1], V, ignore_index,
                           GRAD8=tl.float8e5, GRAD8_SCALE=scale, EMULATE=env.INTERPRET, BLOCK_R=BLOCK_R,
                           BLOCK_V=BLOCK_V, V_SPLITS=V_SPLITS, num_warps=4)


def _contiguous(buffer, *shape):
    """The first elements of a flat buffer as a contiguous tensor of shape."""
    return buffer.view(-1)[:shape[0] * shape[1]].view(shape)


@fused_op("fp8_linear_cross_entropy")
def fp8_linear_cross_entropy_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                                grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """As ../classifier.py's linear_cross_entropy_op, its three GEMMs in FP8 (dtype: the logits' and dx's)."""
    if not grad:
        return core.linear_cross_entropy_op(x, weight, targets, ignore_index, dtype, False)
    (M, C), V = x.shape, weight.shape[0]
    x8, _, inv_x = quantize_weight_fused(x, transposed=False)  # (the chunks' transposed copies are made below)
    w8, w8t, inv_w = quantize_weight_fused(weight)
    count = (targets != ignore_index).sum()
    # g8's scale and the mean's 1/n in one (no target kept: g8 is all zeros, any finite scale will do)
    inv_g = (count.clamp(min=1).float() * core.GRAD8_SCALE).reciprocal().reshape(1)
    losses = []
    dx = torch.empty((M, C), device=x.device, dtype=dtype)
    dw = torch.empty((V, C), device=weight.device, dtype=torch.float32)
    rows = min(core.chunk_rows(M, V), M)
    K = -(-rows // 16) * 16  # dW's reduction, padded to FP8 GEMMs' multiple of 16
    buffer = torch.empty((rows, V), device=x.device, dtype=dtype)
    grad8, grad8t = torch.empty(rows * V, device=x.device, dtype=E5M2), torch.empty(V * K, device=x.device, dtype=E5M2)
    x8t, lse = torch.empty(C * K, device=x.device, dtype=E4M3), torch.empty(rows, device=x.device)
    for start in range(0, M, rows):
        n = min(rows, M - start)
        k = -(-n // 16) * 16
        logits, t, g8, g8t, xt = buffer[:n], targets[start:start + n], grad8[:n * V].view(n, V), \
            _contiguous(grad8t, V, k), _contiguous(x8t, C, k)
        partial = core.logits_and_partials(x8[start:start + n], w8, logits, inv=(inv_x, inv_w))
        losses.append(core.cross_entropy_rows(logits, t, count, ignore_index, False, partial=partial, lse=lse[:n]))
        gradients8(logits, lse[:n], t, ignore_index, g8, g8t)
        torch._scaled_mm(g8, w8t.t(), scale_a=inv_g, scale_b=inv_w, out_dtype=dtype, out=dx[start:start + n])
        xt[:, :n].copy_(x8[start:start + n].t())
        xt[:, n:].zero_()
        if start == 0:
            torch._scaled_mm(g8t, xt.t(), scale_a=inv_g, scale_b=inv_x, out_dtype=torch.float32, out=dw)
        else:  # the product in the logits' buffer where it fits (read by now), else in its own
            fits = buffer.numel() * buffer.element_size() >= dw.numel() * 4
            product = _contiguous(buffer.view(-1).view(torch.float32), V, C) if fits else torch.empty_like(dw)
            dw.add_(torch._scaled_mm(g8t, xt.t(), scale_a=inv_g, scale_b=inv_x, out_dtype=torch.float32,
                                     out=product))
    del buffer, grad8, grad8t  # (freed before dW's conversion below)
    loss = torch.cat(losses).sum() / count if losses else x.new_full((), float("nan"), dtype=torch.float32)
    return loss, dx.to(x.dtype), dw.to(weight.dtype)


@fp8_linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index, dtype, grad):
    return (x.new_empty((), dtype=torch.float32), x.new_empty(x.shape) if grad else x.new_empty(0),
            weight.new_empty(weight.shape) if grad else x.new_empty(0))


FP8LinearCrossEntropyFunction = core.loss_function(fp8_linear_cross_entropy_op)


def fp8_linear_cross_entropy(x, weight, targets, ignore_index=-1):
    """../classifier.py's linear_cross_entropy with its GEMMs in FP8 (under no grad: the 16-bit
    operator). Needs FP8 tensor cores (or the CPU under TRITON_INTERPRET=1) and C, V multiples of 16."""
    if not torch.compiler.is_compiling():  # (as the FP8 MLP: train.py checks the device before it compiles, and
        # dynamo would trace the check's cached capability lookup, with a warning each compile)
        check_fp8_device(x.device, setting="classifier='fp8'", instead="use classifier='fused'")
    if x.shape[-1] % 16 or weight.shape[0] % 16:
        raise ValueError(f"classifier='fp8' needs the width ({x.shape[-1]}) and the vocabulary ({weight.shape[0]}) to "
                         f"be multiples of 16 (FP8 GEMMs' dimensions); use classifier='fused'")
    return core.run_classifier(FP8LinearCrossEntropyFunction, x, weight, targets, ignore_index)
