"""The two row kernels of the folded LayerNorm (fuse_ln; the matmul itself is in linear_act.py).

Forward, before the matmul: `layernorm_stats` reads each row of x once and writes (3, M) statistics in
fp32 (fp64 for fp64): the mean rounded to the accumulator dtype, 1/std, and the mean's rounding residual
(the exact mean of the row minus row 0, to within the rounding of numbers the size of the spread). The
matmul kernel then normalizes every A tile it loads with them, x̂ = ((x - mean) - residual)·rstd, so
each row's statistics are computed once, not once per output tile.

The statistics are taken in passes over a row held in registers: the mean first, then the mean of the
deviations from it (the residual), then the mean of squared deviations. Rows of the residual stream can
have a mean far larger than their spread, and there
- E[x²] - E[x]² subtracts two nearly equal numbers and loses the variance (tested);
- the mean itself, sum(x)/C in fp32, is off by up to a few ulps *of the mean* (the running sum rounds
  at the size of C·mean), and every x̂ of the row moves by that error times rstd, in the same direction.
  At mean 29 and unit spread that is ~2e-6 of x̂; eager's fp32 LayerNorm has a similar but different
  error, so a row where eager's happened to be small had up to ~10x its error (with identical rows,
  stride 0, nothing averages out over rows in the weight gradients). x - mean is exact for the x near
  the mean (Sterbenz), so sum(x - mean) recovers that error from numbers of the spread's size, and
  subtracting it as well leaves x̂ with only the rounding of x - mean itself: as good as float64 gives
  for fp32 inputs, whatever the mean.

Backward: grad_ln = grad_pre @ W (the gradient at the LayerNorm's output, from cuBLAS) and, in one pass
over the rows, `layernorm_backward`
    - recomputes ln = x̂·γ + β (x̂ = ((x - mean) - residual)·rstd), which the weight gradient grad_pre.T @ ln needs,
    - writes dx = rstd · (g - mean(g) - x̂ · mean(g·x̂)) with g = grad_ln·γ,
    - sums dγ = Σ grad_ln·x̂ and dβ = Σ grad_ln over its rows into its own row of a small fp32 buffer
      (deterministic, no atomics); the launcher adds those rows up.
Both read x in its own dtype (fp32 under autocast) and subtract the mean before anything is rounded.
"""

import torch
import triton
import triton.language as tl

from .tuning import LAYERNORM_ROWS_PER_PROGRAM, cdiv, row_kernel_warps


def _acc_dtype(dtype):
    """Row statistics and the LayerNorm arithmetic: fp32, or fp64 for fp64 (the interpreter's gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


STATS_BLOCK = 4096  # elements one statistics program holds: whole rows, as many as fit (at least one)


@triton.jit
def layernorm_stats_kernel(x_ptr, stats_ptr, M, C, stride_xm, stride_xc, eps,
                           ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(ACC_DTYPE)
    mean = tl.sum(x, axis=1) / C
    dev = tl.where(mask, x - mean[:, None], 0.0)  # exact where x is within 2x of the mean
    residual = tl.sum(dev, axis=1) / C  # the rounding error of mean, from deviation-sized numbers
    dev = tl.where(mask, dev - residual[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(dev * dev, axis=1) / C + eps)
    tl.store(stats_ptr + rows, mean, mask=rows < M)
    tl.store(stats_ptr + M + rows, rstd, mask=rows < M)
    tl.store(stats_ptr + 2 * M + rows, residual, mask=rows < M)


def layernorm_stats(x, eps):
    """(3, M) tensor of each row's mean, 1 / sqrt(var + eps) and the mean's residual (exact mean - row 0,
    see the module docstring) for a 2-D x of any strides."""
    M, C = x.shape
    stats = torch.empty((3, M), device=x.device, dtype=_acc_dtype(x.dtype))
    if M > 0:
        block_c = triton.next_power_of_2(C)
        block_m = min(triton.next_power_of_2(M), max(1, STATS_BLOCK // block_c))
        layernorm_stats_kernel[(cdiv(M, block_m),)](
            x, stats, M, C, x.stride(0), x.stride(1), eps,
            ACC_DTYPE=tl.float64 if x.dtype == torch.float64 else tl.float32,
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=row_kernel_warps(block_m * block_c))
    return stats


@triton.jit
def layernorm_backward_kernel(
    x_ptr, grad_ptr, w_ptr, b_ptr, stats_ptr, dx_ptr, ln_ptr, dw_ptr, db_ptr, M, C,
    stride_xm, stride_xc, stride_gm, stride_dxm, stride_lnm,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < C
    w, b = 1.0, 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(ACC_DTYPE)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(ACC_DTYPE)
    dw = tl.zeros((BLOCK_C,), dtype=ACC_DTYPE)
    db = tl.zeros((BLOCK_C,), dtype=ACC_DTYPE)
    for r in range(ROWS):
        row = pid * ROWS + r
        in_rows = row < M
        mask = col_mask & (cols * 0 + row < M)
        row64 = row.to(tl.int64)
        x = tl.load(x_ptr + row64 * stride_xm + cols * stride_xc, mask=mask, other=0.0).to(ACC_DTYPE)
        mean = tl.load(stats_ptr + row, mask=in_rows, other=0.0)
        rstd = tl.load(stats_ptr + M + row, mask=in_rows, other=0.0)
        residual = tl.load(stats_ptr + 2 * M + row, mask=in_rows, other=0.0)
        x_hat = tl.where(mask, ((x - mean) - residual) * rstd, 0.0)
        grad = tl.load(grad_ptr + row64 * stride_gm + cols, mask=mask, other=0.0).to(ACC_DTYPE)
        tl.store(ln_ptr + row64 * stride_lnm + cols, (x_hat * w + b).to(ln_ptr.dtype.element_ty), mask=mask)
        dw += grad * x_hat
        db += grad
        g = grad * w
        dx = (g - tl.sum(g, axis=0) / C - x_hat * (tl.sum(g * x_hat, axis=0) / C)) * rstd
        tl.store(dx_ptr + row64 * stride_dxm + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * C + cols, dw, mask=col_mask)
    tl.store(db_ptr + pid * C + cols, db, mask=col_mask)


def layernorm_backward(x, grad_ln, ln_weight, ln_bias, stats):
    """Gradients of LN(x) = x̂·γ + β from grad_ln (the gradient at its output) and the saved row stats.

    x: (M, C) of any strides; grad_ln: (M, C) with unit column stride, in the dtype the matmul ran in;
    ln_weight / ln_bias: (C,) or None; stats: (3, M) from layernorm_stats. Returns (dx in x's dtype,
    ln in grad_ln's dtype, dγ or None, dβ or None): under autocast x is fp32 and the matmul 16-bit, and
    ln is what eager's linear layer would have saved, the LayerNorm output rounded to the matmul's dtype.
    """
    M, C = x.shape
    if grad_ln.shape != (M, C) or (C > 1 and grad_ln.stride(1) != 1):
        raise ValueError(f"grad_ln must have shape {(M, C)} and unit column stride, got {tuple(grad_ln.shape)} "
                         f"with strides {grad_ln.stride()}")
    if stats.shape != (3, M):
        raise ValueError(f"stats must have shape {(3, M)} (row means, 1/std, mean residuals), got {tuple(stats.shape)}")
    dx = torch.empty((M, C), device=x.device, dtype=x.dtype)
    ln = torch.empty((M, C), device=x.device, dtype=grad_ln.dtype)
    programs = cdiv(M, LAYERNORM_ROWS_PER_PROGRAM)
    partial_w = torch.zeros((max(programs, 1), C), device=x.device, dtype=stats.dtype)
    partial_b = torch.zeros_like(partial_w)
    if M > 0:
        block_c = triton.next_power_of_2(C)
        layernorm_backward_kernel[(programs,)](
            x, grad_ln, ln_weight if ln_weight is not None else x, ln_bias if ln_bias is not None else x, stats,
            dx, ln, partial_w, partial_b, M, C, x.stride(0), x.stride(1), grad_ln.stride(0), dx.stride(0), ln.stride(0),
            HAS_WEIGHT=ln_weight is not None, HAS_BIAS=ln_bias is not None,
            ACC_DTYPE=tl.float64 if stats.dtype == torch.float64 else tl.float32,
            ROWS=LAYERNORM_ROWS_PER_PROGRAM, BLOCK_C=block_c, num_warps=row_kernel_warps(block_c))
    grad_w = partial_w.sum(0).to(ln_weight.dtype) if ln_weight is not None else None
    grad_b = partial_b.sum(0).to(ln_bias.dtype) if ln_bias is not None else None
    return dx, ln, grad_w, grad_b
