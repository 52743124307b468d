"""The classifier's FP8 form (model.GPT's classifier="fp8"): ../classifier.py's operator with two of its three GEMMs
in FP8 on Hopper's (or Ada's) FP8 tensor cores, which run at twice bf16's rate.

Per chunk of rows, as in ../classifier.py:

    logits = x8 @ W8ᵀ                       FP8 GEMM, x and W in e4m3, logits out in 16 bits (on Hopper our own, with
                                             each row's log-sum-exp per tile beside them; else torch._scaled_mm)
    the row kernel                           reads the logits once (twice after _scaled_mm); writes d(mean
                                             loss)/d(logits) over them in 16 bits, and g8 = (softmax - one_hot) · 2^15
                                             in e5m2 beside them
    dx = g8 @ W8 · 1/(n · 2^15)             FP8 GEMM (W8ᵀ, W's transposed copy: FP8 GEMMs take K-major operands)
    dW += dlogitsᵀ @ x                       16-bit GEMM, fp32 accumulation

Why these choices:
- The gradient needs no amax. softmax - one_hot lies in [-1, 1] whatever the logits, so one fixed power of two
  (GRAD8_SCALE) fills e5m2's range; the row kernel quantizes as it writes, with no history and no second pass.
- x and W use current scaling (their own amax; kernels.quantize_weight_fused: an amax, one cast pass, and for W
  a transposing pass), not the MLP's delayed scales: x is M x C and W is V x C, small next to the M x V logits, so
  the extra read costs little, and there is no state to keep, per process under torchrun or across CUDA graphs.
- dW stays in 16 bits: in FP8 it would reduce over the tokens, which Hopper's FP8 GEMMs need contiguous, i.e.
  dlogits transposed: one more pass over the largest tensor of the step.
- Without grad (evaluation, sampling) the 16-bit operator runs, as the FP8 MLP does: evaluation losses stay
  comparable between settings.

The FP8 GEMMs need C and V multiples of 16 (GPTConfig checks it). Special values: as ../classifier.py's rule, except
that ±inf in x or W becomes NaN when quantized (kernels.py's docstring says why), so its rows' losses are NaN.
"""

import torch
from torch import Tensor

from .. import classifier as core
from ..ops import fused_op
from .kernels import E5M2, quantize_weight_fused
from .state import check_fp8_device

# Logits per chunk: twice the 16-bit operator's. At GPT-2's head (results/classifier_chunks/) 2^29 took 3.5% less
# time than 2^28 alone and 0.23 ms less in the step, for 0.29 GiB more; in 16 bits 2^29 gained 1% alone, nothing in
# the step.
CHUNK_LOGITS = 2 ** 29


@fused_op("fp8_linear_cross_entropy")
def fp8_linear_cross_entropy_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                                grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """As ../classifier.py's linear_cross_entropy_op, the logits' and dx's GEMMs in FP8 (dtype: their outputs')."""
    if not grad:
        return core.linear_cross_entropy_op(x, weight, targets, ignore_index, dtype, False)
    M, V = x.shape[0], weight.shape[0]
    x8, _, inv_x = quantize_weight_fused(x, transposed=False)  # (only the logits' GEMM reads it, row-major)
    w8, w8t, inv_w = quantize_weight_fused(weight)
    xc = x.to(dtype)
    count = (targets != ignore_index).sum()
    # g8's scale and the mean's 1/n in one (no target kept: g8 is all zeros, any finite scale will do)
    inv_g = (count.clamp(min=1).float() * core.GRAD8_SCALE).reciprocal().reshape(1)
    losses = []
    dx = torch.empty((M, x.shape[1]), device=x.device, dtype=dtype)
    dw = torch.empty(weight.shape, device=weight.device, dtype=torch.float32)
    rows = core.chunk_rows(M, V, CHUNK_LOGITS)
    buffer = logits = torch.empty((min(rows, M), V), device=x.device, dtype=dtype)
    grad8 = torch.empty((min(rows, M), V), device=x.device, dtype=E5M2)
    for start in range(0, M, rows):
        n = min(rows, M - start)
        logits = buffer[:n]
        partial = core.logits_and_partials(x8[start:start + n], w8, logits, inv=(inv_x, inv_w))
        losses.append(core.cross_entropy_rows(logits, targets[start:start + n], count, ignore_index, True,
                                              grad8=grad8[:n], grad8_scale=core.GRAD8_SCALE, partial=partial))
        torch._scaled_mm(grad8[:n], w8t.t(), scale_a=inv_g, scale_b=inv_w, out_dtype=dtype, out=dx[start:start + n])
        core._accumulate(dw, logits.t(), xc[start:start + n], first=start == 0)
    del buffer, logits, grad8  # (freed before dW's conversion below)
    loss = torch.cat(losses).sum() / count if losses else x.new_full((), float("nan"), dtype=torch.float32)
    return loss, dx.to(x.dtype), dw.to(weight.dtype)


@fp8_linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index, dtype, grad):
    return (x.new_empty((), dtype=torch.float32), x.new_empty(x.shape) if grad else x.new_empty(0),
            weight.new_empty(weight.shape) if grad else x.new_empty(0))


FP8LinearCrossEntropyFunction = core.loss_function(fp8_linear_cross_entropy_op)


def fp8_linear_cross_entropy(x, weight, targets, ignore_index=-1):
    """../classifier.py's linear_cross_entropy with the logits' and dx's GEMMs in FP8 (under no grad: the 16-bit
    operator). Needs FP8 tensor cores (or the CPU under TRITON_INTERPRET=1) and C, V multiples of 16. As there, the
    loss is float32 whatever the inputs' dtype (the gradients keep theirs), and a target outside [0, V) that is not
    ignore_index raises nothing: the mean loss is NaN, the gradients finite (its row's: softmax / n, quantized)."""
    if not torch.compiler.is_compiling():  # (as the FP8 MLP: train.py checks the device before it compiles, and
        # dynamo would trace the check's cached capability lookup, with a warning each compile)
        check_fp8_device(x.device, setting="classifier='fp8'", instead="use classifier='fused'")
    if x.shape[-1] % 16 or weight.shape[0] % 16:
        raise ValueError(f"classifier='fp8' needs the width ({x.shape[-1]}) and the vocabulary ({weight.shape[0]}) to "
                         f"be multiples of 16 (FP8 GEMMs' dimensions); use classifier='fused'")
    return core.run_classifier(FP8LinearCrossEntropyFunction, x, weight, targets, ignore_index)
