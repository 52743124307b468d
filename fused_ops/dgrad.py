"""dgrad: the input gradient of the MLP's second linear with the activation derivative fused in.

For h = act(z) and y = h @ W2.T, backward needs grad_z = (grad_y @ W2) * dh/dz. Computing
grad_h = grad_y @ W2 in a matmul and multiplying in its epilogue means grad_h is never written to memory
and read back. The forward kernel saved dh/dz (see linear_act.py), so the epilogue is one multiply:
    plain activation:  saved = act'(z),              grad_z = grad_h * saved
    gated activation:  saved = [dh/dg | dh/du],      grad_g = grad_h * dh/dg,  grad_u = grad_h * dh/du
No activation is evaluated here, so one compiled kernel serves every activation.
The first linear's bias gradient (column sums of grad_z) is reduced in the same epilogue: each
tile writes the column sums of its rows to its own row of a small fp32 buffer (deterministic, no
atomics), and a final sum over those rows replaces a whole extra pass over grad_z.
"""

import torch
import triton
import triton.language as tl

from .activations import kernel_activations
from .matmul import (check_buffer, column_offsets, dot_settings, matmul_loop, needs_int64, split_columns,
                     tile_ids, tiles, tma_operands)
from . import backends, tuning
from .tuning import launch_matmul


@triton.jit
def dgrad_epilogue(grad_h, offs_m, offs_n, pid_m, M, N, saved_ptr, out_ptr, dbias_ptr, stride_sm, stride_om,
                   stride_dbm, GATED: tl.constexpr, BIAS_GRAD: tl.constexpr, ACC_DTYPE: tl.constexpr,
                   INT64: tl.constexpr):
    """grad_z for output columns offs_n of a tile (both halves when gated), and their column sums."""
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    saved_ptrs = saved_ptr + rows * stride_sm + offs_n[None, :]
    out_ptrs = out_ptr + rows * stride_om + offs_n[None, :]
    dbias_ptrs = dbias_ptr + pid_m * stride_dbm + offs_n
    for half in tl.static_range(2 if GATED else 1):  # gated: the gate half, then the up half N columns on
        grad = grad_h * tl.load(saved_ptrs + half * N, mask=mask, other=0.0).to(ACC_DTYPE)
        tl.store(out_ptrs + half * N, grad.to(out_ptr.dtype.element_ty), mask=mask)
        if BIAS_GRAD:  # this tile's column sums; rows past M are zeros (their saved values load as 0)
            tl.store(dbias_ptrs + half * N, tl.sum(grad, axis=0).to(dbias_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def dgrad_kernel(
    g_ptr, w_ptr, saved_ptr, out_ptr, dbias_ptr, M, N, K,
    stride_gm, stride_gk, stride_wk, stride_wn, stride_sm, stride_om, stride_dbm,
    GATED: tl.constexpr, BIAS_GRAD: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, INT64: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    # grad_h (M, N) = grad_y (M, K) @ W2 (K, N); here K is the model width and N the hidden size.
    # One output tile per loop trip (see matmul.tiles: one trip per program unless the grid is persistent).
    for tile in tl.range(tl.program_id(0), tiles(M, N, BLOCK_M, BLOCK_N), tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        grad_h = matmul_loop(g_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_gm, stride_gk,
                             stride_wk, stride_wn, 0, ACC_DTYPE, PRECISION, EVEN_K, False, INT64,
                             BLOCK_M, BLOCK_N, BLOCK_K, TMA=TMA, B_KMAJOR=B_KMAJOR)[0]
        # The saved tensor is read after the main loop: held in registers across it, it would push the tile
        # over the register file and spill.
        if SPLIT_EPILOGUE:  # one half of the tile's columns at a time
            left, right = split_columns(grad_h, BLOCK_M, BLOCK_N)
            dgrad_epilogue(left, offs_m, column_offsets(pid_n, BLOCK_N, 0, 2), pid_m, M, N, saved_ptr, out_ptr,
                           dbias_ptr, stride_sm, stride_om, stride_dbm, GATED, BIAS_GRAD, ACC_DTYPE, INT64)
            dgrad_epilogue(right, offs_m, column_offsets(pid_n, BLOCK_N, 1, 2), pid_m, M, N, saved_ptr, out_ptr,
                           dbias_ptr, stride_sm, stride_om, stride_dbm, GATED, BIAS_GRAD, ACC_DTYPE, INT64)
        else:
            dgrad_epilogue(grad_h, offs_m, column_offsets(pid_n, BLOCK_N, 0, 1), pid_m, M, N, saved_ptr, out_ptr,
                           dbias_ptr, stride_sm, stride_om, stride_dbm, GATED, BIAS_GRAD, ACC_DTYPE, INT64)


def linear_act_dgrad(grad_y, w2, saved, activation, bias_grad=True, out=None):
    """grad_z = (grad_y @ w2) * dh/dz from what linear_act_forward saved, and the bias gradient
    sum(grad_z, 0) if bias_grad.

    grad_y: (M, C) of any strides; w2: (C, H) of any strides; saved: dh/dz with unit column stride, (M, H)
    for a plain activation, (M, 2H) = [dh/dgate | dh/dup] for a gated one (activation only says which).
    Returns (grad_z shaped like saved, bias gradient (saved.shape[1],) in fp32/fp64 or None).
    """
    gated = kernel_activations(activation)[2]
    M, K = grad_y.shape
    N = w2.shape[1]
    check_buffer("saved", saved, (M, (2 if gated else 1) * N))
    if out is None:
        out = torch.empty(saved.shape, device=saved.device, dtype=saved.dtype)
    else:
        check_buffer("out", out, saved.shape)
    acc_dtype, precision = dot_settings(grad_y.dtype)
    sum_dtype = torch.float64 if grad_y.dtype == torch.float64 else torch.float32
    if M == 0:
        return out, (torch.zeros(saved.shape[1], device=saved.device, dtype=sum_dtype) if bias_grad else None)
    grad_bias = backends.run("dgrad", grad_y, w2, saved, out, gated, bias_grad)  # Hopper: hopper/dispatch.py
    if grad_bias is not NotImplemented:  # (else no backend takes it, or it failed: the Triton kernel below runs)
        return out, grad_bias
    descriptors, b_kmajor = tma_operands(grad_y, w2)
    consts = dict(GATED=gated, BIAS_GRAD=bias_grad,
                  ACC_DTYPE=acc_dtype, PRECISION=precision, INT64=needs_int64(grad_y, w2, saved, out),
                  TMA=bool(descriptors), B_KMAJOR=b_kmajor)
    key = ("dgrad", N, K, grad_y.dtype, w2.stride(), grad_y.device, *consts.values())
    # One row of column sums per row-tile of the tuned config (before tuning: of the smallest BLOCK_M any
    # config may use), read back only as far as the config that ran wrote.
    cfg = tuning.tuned_config(key)
    block_m = (cfg.kwargs["BLOCK_M"] if cfg
               else min(c.kwargs["BLOCK_M"] for c in tuning.matmul_configs(False, grad_y.dtype)))
    partial = torch.empty((tuning.cdiv(M, block_m), saved.shape[1]), device=saved.device, dtype=sum_dtype) \
        if bias_grad else out
    args = (grad_y, w2, saved, out, partial, M, N, K, grad_y.stride(0), grad_y.stride(1), w2.stride(0), w2.stride(1),
            saved.stride(0), out.stride(0), partial.stride(0))
    cfg = launch_matmul(dgrad_kernel, M, N, K, args, consts, False, grad_y.dtype, key,
                        descriptors=descriptors)
    if not bias_grad:
        return out, None
    return out, partial[: tuning.cdiv(M, cfg.kwargs["BLOCK_M"])].sum(0)
