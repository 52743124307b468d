"""Linear + bias + activation forward: out = act(x @ W.T + b), plain or gated (GLU).

Plain:  out = act(x @ W.T + b)                        W: (N, K)
Gated:  out = gate_act(x @ Wg.T + bg) * up_act(x @ Wu.T + bu), with W = [Wg; Wu]: (2N, K)
        Both halves of an output tile are computed by the same program from one read of x (two
        accumulators), so the gate and up projections never travel through global memory separately.
When backward will need it, the kernel also saves the local derivative of the output, dh/dz, and nothing
else: act'(z) for a plain activation; [up_act(u)·gate_act'(g) | gate_act(g)·up_act'(u)] for a gated one
(h = gate_act(g)·up_act(u) depends on g and u elementwise). Computed here, beside h, it shares work with it
(GELU's erf, SiLU's sigmoid), and backward's dgrad kernel only multiplies: no transcendental there, and it
reads exactly as many values as it would read of z.

LayerNorm fold (ln_linear_act_forward): act(LN(x) @ W.T + b) from the raw x. With W' = W·diag(γ),
colsum = W' summed over inputs and b' = b + W β:
        LN(x) @ W.T + b = (x @ W'.T - mean(x)·colsum) / std(x) + b'
The row statistics are gathered in the same K loop as the matmul (see matmul_loop's ROW_STATS), so
the normalized x is never written; the mean and 1/std of each row are saved for backward.
"""

import torch
import triton
import triton.language as tl

from . import pingpong
from .activations import activation, activation_grad, kernel_activations
from .matmul import (check_buffer, column_offsets, dot_settings, matmul_loop, needs_int64, split_columns,
                     tile_ids, tma_operands)
from .tuning import TRANSPOSE_WEIGHT_MIN_M, launch_matmul


@triton.jit
def linear_act_epilogue(z, z_up, offs_m, offs_n, M, N, b_ptr, out_ptr, saved_ptr, stride_om, stride_sm,
                        ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, ACC_DTYPE: tl.constexpr, INT64: tl.constexpr):
    """Bias, activation and the stores for output columns offs_n of a tile still in registers."""
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
        if GATED:
            z_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    gate = activation(z, ACTIVATION)
    up = activation(z_up, UP_ACTIVATION) if GATED else gate
    out = gate * up if GATED else gate
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    if SAVE:  # dh/dz, what backward needs (see the module docstring)
        saved_ptrs = saved_ptr + rows * stride_sm + offs_n[None, :]
        if GATED:
            dh_dgate = up * activation_grad(z, ACTIVATION)
            dh_dup = gate * activation_grad(z_up, UP_ACTIVATION)
            tl.store(saved_ptrs, dh_dgate.to(saved_ptr.dtype.element_ty), mask=mask)
            tl.store(saved_ptrs + N, dh_dup.to(saved_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(saved_ptrs, activation_grad(z, ACTIVATION).to(saved_ptr.dtype.element_ty), mask=mask)


@triton.jit
def linear_act_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, saved_ptr, colsum_ptr, stats_ptr, eps, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_sm,
    ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, LN_FOLD: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    TMA: tl.constexpr, B_KMAJOR: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # B = W.T: step along K with W's column stride, along N with its row stride. The up half starts N rows down.
    z, z_up, shift, mean, m2 = matmul_loop(
        x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
        N if TMA else N * stride_wn, ACC_DTYPE, PRECISION, EVEN_K, GATED, INT64, BLOCK_M, BLOCK_N, BLOCK_K,
        ROW_STATS=LN_FOLD, TMA=TMA, B_KMAJOR=B_KMAJOR)

    if LN_FOLD:  # z = (x - s) @ W'.T: subtract mean(x - s) * colsum and divide by the row's std
        n_mask = offs_n < N
        rstd = 1.0 / tl.sqrt(m2 / K + eps)
        z = (z - mean[:, None] * tl.load(colsum_ptr + offs_n, mask=n_mask, other=0.0)[None, :]) * rstd[:, None]
        if GATED:
            colsum_up = tl.load(colsum_ptr + N + offs_n, mask=n_mask, other=0.0)
            z_up = (z_up - mean[:, None] * colsum_up[None, :]) * rstd[:, None]
        if SAVE and pid_n == 0:  # one program per row-tile saves the row statistics backward needs
            tl.store(stats_ptr + offs_m, shift + mean, mask=offs_m < M)
            tl.store(stats_ptr + M + offs_m, rstd, mask=offs_m < M)
    if SPLIT_EPILOGUE:  # the epilogue on one half of the tile's columns at a time
        z_left, z_right = split_columns(z, BLOCK_M, BLOCK_N)
        up_left, up_right = z_left, z_right
        if GATED:
            up_left, up_right = split_columns(z_up, BLOCK_M, BLOCK_N)
        linear_act_epilogue(z_left, up_left, offs_m, column_offsets(pid_n, BLOCK_N, 0, 2), M, N, b_ptr, out_ptr,
                            saved_ptr, stride_om, stride_sm, ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE,
                            ACC_DTYPE, INT64)
        linear_act_epilogue(z_right, up_right, offs_m, column_offsets(pid_n, BLOCK_N, 1, 2), M, N, b_ptr, out_ptr,
                            saved_ptr, stride_om, stride_sm, ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE,
                            ACC_DTYPE, INT64)
    else:
        linear_act_epilogue(z, z_up, offs_m, offs_n, M, N, b_ptr, out_ptr, saved_ptr, stride_om, stride_sm,
                            ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE, ACC_DTYPE, INT64)


def linear_act_forward(x, weight, bias, activation, save=True, out=None, saved=None):
    """Launch the kernel on a 2-D x (M, K) of any strides. Returns (out (M, N), saved or None).

    weight: (N, K), or (2N, K) = [gate; up] for a gated activation; bias: matching (N,) / (2N,) or None.
    saved (if save): dh/dz, what backward needs, shaped like the pre-activation (M, weight.shape[0]):
    act'(z) for a plain activation, [dh/dz_gate | dh/dz_up] for a gated one (see the module docstring).
    out / saved: optional preallocated outputs with unit column stride (tests poison them to catch
    unwritten elements). Arguments are assumed validated (see fused_ops.mlp.check_mlp_args).
    """
    out, saved, _ = _launch(x, weight, bias, activation, save, out, saved)
    return out, saved


def fold_layernorm(weight, bias, ln_weight, ln_bias):
    """(W' = W·diag(γ) in W's dtype, colsum = W' summed over inputs, b' = b + W β), the last two in fp32
    (fp64 for fp64). colsum is summed from the rounded W' the kernel multiplies with, so the mean term
    cancels exactly what the matmul added."""
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    with torch.autocast(weight.device.type, enabled=False):  # W β in fp32, not in the autocast dtype
        w_folded = weight if ln_weight is None else (weight.to(acc) * ln_weight.to(acc)).to(weight.dtype)
        colsum = w_folded.to(acc).sum(1)
        b_folded = torch.zeros(weight.shape[0], device=weight.device, dtype=acc) if bias is None else bias.to(acc)
        if ln_bias is not None:
            b_folded = b_folded + weight.to(acc) @ ln_bias.to(acc)
    return w_folded, colsum, b_folded


def ln_linear_act_forward(x, ln_weight, ln_bias, eps, weight, bias, activation, save=True, out=None, saved=None):
    """act(LayerNorm(x) @ weight.T + bias) with the LayerNorm folded into the matmul (γ = ln_weight and
    β = ln_bias may be None). Returns (out, saved or None, stats or None), saved as in linear_act_forward;
    stats (2, M) holds each row's mean and 1/std in fp32 (fp64 for fp64), what the LayerNorm backward needs."""
    w_folded, colsum, b_folded = fold_layernorm(weight, bias, ln_weight, ln_bias)
    return _launch(x, w_folded, b_folded, activation, save, out, saved, ln=(colsum, eps))


def _launch(x, weight, bias, activation, save, out, saved, ln=None):
    act, up_act, gated = kernel_activations(activation)
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    else:
        check_buffer("out", out, (M, N))
    if save and saved is None:
        saved = torch.empty((M, weight.shape[0]), device=x.device, dtype=x.dtype)
    elif save:
        check_buffer("saved", saved, (M, weight.shape[0]))
    colsum, eps = ln if ln is not None else (None, 0.0)
    stats = torch.empty((2, M), device=x.device, dtype=colsum.dtype) if ln is not None and save else None
    if M == 0:
        return out, (saved if save else None), stats
    if (ln is None and pingpong.usable(x, (weight, out, saved if save else None), (bias,), N if gated else None)
            and pingpong.linear_act_forward(x, weight, bias, act, up_act, gated, save, out, saved)):
        return out, (saved if save else None), stats  # Hopper, 16-bit (False if that kernel failed: Triton's below)
    # The TMA loop reads x and W.T through descriptors, in either orientation of W at the same speed
    # (H100, results/profile_mlp_h100.txt). The LayerNorm fold shifts x's rows in registers, so it keeps
    # the pointer loop.
    descriptors, b_kmajor = tma_operands(x, weight.t()) if ln is None else ([], False)
    if not descriptors and x.is_cuda and M >= TRANSPOSE_WEIGHT_MIN_M and weight.stride(1) == 1:
        # The pointer loop feeds the tensor cores faster from an N-major B = W.T; a row-major (N, K) weight
        # is K-major. One transposed copy of W (a few us) saves more than that in the main loop once M is
        # large (H100, M=12288, C=768, H=3072: a plain Triton matmul 1.42x -> 1.17x cuBLAS).
        weight = weight.t().contiguous().t()
    acc_dtype, precision = dot_settings(x.dtype)
    args = (x, weight, bias if bias is not None else weight, out, saved if save else out,
            colsum if ln is not None else weight, stats if stats is not None else out, eps, M, N, K,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), saved.stride(0) if save else 0)
    consts = dict(ACTIVATION=act, UP_ACTIVATION=up_act, GATED=gated, HAS_BIAS=bias is not None, SAVE=save,
                  LN_FOLD=ln is not None, ACC_DTYPE=acc_dtype, PRECISION=precision,
                  INT64=needs_int64(x, weight, out, saved), TMA=bool(descriptors), B_KMAJOR=b_kmajor)
    key = ("linear_act", N, K, x.dtype, weight.stride(), x.device, *consts.values())
    launch_matmul(linear_act_kernel, M, N, K, args, consts, gated, x.dtype, key,
                  descriptors=descriptors)
    return out, (saved if save else None), stats
