"""LayerNorm backward for the folded LayerNorm (see linear_act.ln_linear_act_forward).

The forward never writes LN(x); it saves each row's mean and 1/std. Backward gets grad_ln = grad_pre @ W
(the gradient at the LayerNorm's output, from cuBLAS) and, in one pass over the rows, this kernel
    - recomputes ln = x̂·γ + β (x̂ = (x - mean)·rstd), which the weight gradient grad_pre.T @ ln needs,
    - writes dx = rstd · (g - mean(g) - x̂ · mean(g·x̂)) with g = grad_ln·γ,
    - sums dγ = Σ grad_ln·x̂ and dβ = Σ grad_ln over its rows into its own row of a small fp32 buffer
      (deterministic, no atomics); the launcher adds those rows up.
"""

import torch
import triton
import triton.language as tl

from .matmul import dot_settings
from .tuning import LAYERNORM_ROWS_PER_PROGRAM, cdiv, row_kernel_warps


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
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
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

    x: (M, C) of any strides; grad_ln: (M, C) with unit column stride; ln_weight / ln_bias: (C,) or None;
    stats: (2, M) row means and 1/std from ln_linear_act_forward. Returns (dx, ln, dγ or None, dβ or None):
    ln is the recomputed LayerNorm output in x's dtype.
    """
    M, C = x.shape
    if grad_ln.shape != (M, C) or (C > 1 and grad_ln.stride(1) != 1):
        raise ValueError(f"grad_ln must have shape {(M, C)} and unit column stride, got {tuple(grad_ln.shape)} "
                         f"with strides {grad_ln.stride()}")
    acc_dtype, _ = dot_settings(x.dtype)
    sum_dtype = stats.dtype
    dx, ln = torch.empty((M, C), device=x.device, dtype=x.dtype), torch.empty((M, C), device=x.device, dtype=x.dtype)
    programs = cdiv(M, LAYERNORM_ROWS_PER_PROGRAM)
    partial_w = torch.zeros((max(programs, 1), C), device=x.device, dtype=sum_dtype)
    partial_b = torch.zeros_like(partial_w)
    if M > 0:
        block_c = triton.next_power_of_2(C)
        layernorm_backward_kernel[(programs,)](
            x, grad_ln, ln_weight if ln_weight is not None else x, ln_bias if ln_bias is not None else x, stats,
            dx, ln, partial_w, partial_b, M, C, x.stride(0), x.stride(1), grad_ln.stride(0), dx.stride(0), ln.stride(0),
            HAS_WEIGHT=ln_weight is not None, HAS_BIAS=ln_bias is not None, ACC_DTYPE=acc_dtype,
            ROWS=LAYERNORM_ROWS_PER_PROGRAM, BLOCK_C=block_c, num_warps=row_kernel_warps(block_c))
    grad_w = partial_w.sum(0).to(ln_weight.dtype) if ln_weight is not None else None
    grad_b = partial_b.sum(0).to(ln_bias.dtype) if ln_bias is not None else None
    return dx, ln, grad_w, grad_b
