"""Linear + bias + activation forward: out = act(x @ W.T + b), plain or gated (GLU).

Plain:  out = act(x @ W.T + b)                        W: (N, K)
Gated:  out = gate_act(x @ Wg.T + bg) * up_act(x @ Wu.T + bu), with W = [Wg; Wu]: (2N, K)
        Both halves of an output tile are computed by the same program from one read of x (two
        accumulators), so the gate and up projections never travel through global memory separately.
The pre-activation (both halves for GLU) is written only when backward will need it.
"""

import torch
import triton
import triton.language as tl

from .activations import activation, kernel_activations
from .matmul import check_buffer, dot_settings, matmul_loop, needs_int64, tile_ids
from .tuning import TRANSPOSE_WEIGHT_MIN_M, launch_matmul


@triton.jit
def linear_act_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, pre_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_pm,
    ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # B = W.T: step along K with W's column stride, along N with its row stride. The up half starts N rows down.
    z, z_up = matmul_loop(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                          N * stride_wn, ACC_DTYPE, PRECISION, EVEN_K, GATED, INT64, BLOCK_M, BLOCK_N, BLOCK_K)

    # Epilogue, on the tile in registers.
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
        if GATED:
            z_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    if SAVE_PRE:
        pre_ptrs = pre_ptr + rows * stride_pm + offs_n[None, :]
        tl.store(pre_ptrs, z.to(pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(pre_ptrs + N, z_up.to(pre_ptr.dtype.element_ty), mask=mask)
    out = activation(z, ACTIVATION)
    if GATED:
        out = out * activation(z_up, UP_ACTIVATION)
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def linear_act_forward(x, weight, bias, activation, save_pre=True, out=None, pre=None):
    """Launch the kernel on a 2-D x (M, K) of any strides. Returns (out (M, N), pre or None).

    weight: (N, K), or (2N, K) = [gate; up] for a gated activation; bias: matching (N,) / (2N,) or None.
    out / pre: optional preallocated outputs with unit column stride (tests poison them to catch
    unwritten elements). Arguments are assumed validated (see fused_ops.mlp.check_mlp_args).
    """
    act, up_act, gated = kernel_activations(activation)
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype) if out is None else out
    if save_pre and pre is None:
        pre = torch.empty((M, weight.shape[0]), device=x.device, dtype=x.dtype)
    check_buffer("out", out, (M, N))
    if save_pre:
        check_buffer("pre", pre, (M, weight.shape[0]))
    if M == 0:
        return out, (pre if save_pre else None)
    if x.is_cuda and M >= TRANSPOSE_WEIGHT_MIN_M and weight.stride(1) == 1:
        # The tensor cores are fed faster from an N-major B = W.T; a row-major (N, K) weight is K-major.
        # One transposed copy of W (a few us) saves more than that in the main loop once M is large
        # (measured on an H100 only, M=12288, C=768, H=3072: a plain Triton matmul 1.42x -> 1.17x cuBLAS).
        weight = weight.t().contiguous().t()
    acc_dtype, precision = dot_settings(x.dtype)
    args = (x, weight, bias if bias is not None else weight, out, pre if save_pre else out, M, N, K,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), pre.stride(0) if save_pre else 0)
    consts = dict(ACTIVATION=act, UP_ACTIVATION=up_act, GATED=gated, HAS_BIAS=bias is not None, SAVE_PRE=save_pre,
                  ACC_DTYPE=acc_dtype, PRECISION=precision, INT64=needs_int64(x, weight, out, pre))
    key = ("linear_act", N, K, x.dtype, weight.stride(), x.device, *consts.values())
    launch_matmul(linear_act_kernel, M, N, K, args, consts, gated, x.device, key)
    return out, (pre if save_pre else None)
