"""Linear + bias + activation forward: out = act(x @ W.T + b), plain or gated (GLU).

Plain:  out = act(x @ W.T + b)                        W: (N, K)
Gated:  out = gate_act(x @ Wg.T + bg) * up_act(x @ Wu.T + bu), with W = [Wg; Wu]: (2N, K)
        Both halves of an output tile are computed by the same program from one read of x, so the gate
        and up projections never travel through global memory separately: through TMA as one accumulator
        whose B tile pairs h gate rows with the h up rows beside them (matmul_loop's B_PAIRS), through
        pointers as two accumulators.
When backward will need it, the kernel also saves the local derivative of the output, dh/dz, and nothing
else: act'(z) for a plain activation; [up_act(u)·gate_act'(g) | gate_act(g)·up_act'(u)] for a gated one
(h = gate_act(g)·up_act(u) depends on g and u elementwise). Computed here, beside h, it shares work with it
(GELU's erf, SiLU's sigmoid), and backward's dgrad kernel only multiplies: no transcendental there, and it
reads exactly as many values as it would read of z.

LayerNorm fold (ln_linear_act_forward): act(LN(x) @ W.T + b) from the raw x, without writing LN(x).
A small row kernel first computes each row's mean and 1/std (layernorm.layernorm_stats, once per row);
the matmul then normalizes every A tile as it loads it, ((x - mean) - residual)·rstd·γ + β in fp32
(residual: the mean's own rounding error, see layernorm.py), and rounds only
that to the weight's dtype: the values eager LayerNorm then Linear multiply. x itself is never rounded
(under autocast it stays fp32): in 16 bits, a row whose mean is large against its spread keeps little
more than the mean's digits. Normalizing before the dot, rather than folding γ, β into W and
subtracting mean·colsum(W) from its result, also leaves no cancellation after the fact.
"""

import functools

import torch
import triton
import triton.language as tl

from . import backends, env
from .activations import activation, activation_and_grad, kernel_activations
from .layernorm import layernorm_stats
from .matmul import (check_buffer, column_offsets, dot_settings, matmul_loop, needs_int64, pair_descriptor, pairs_fit,
                     split_columns, tile_ids, tiles, tma_operands)
from .tuning import TRANSPOSE_WEIGHT_MIN_M, launch_matmul, matmul_configs


@triton.jit
def linear_act_epilogue(z, z_up, offs_m, offs_n, M, N, b_ptr, out_ptr, saved_ptr, stride_om, stride_sm,
                        ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, ACC_DTYPE: tl.constexpr, INT64: tl.constexpr,
                        FAST16: tl.constexpr):
    """Bias, activation and the stores for output columns offs_n of a tile still in registers."""
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
        if GATED:
            z_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    if SAVE:  # the value and its derivative together: they share their transcendentals (activation_and_grad)
        gate, gate_grad = activation_and_grad(z, ACTIVATION, FAST16)
        up, up_grad = gate, gate_grad
        if GATED:
            up, up_grad = activation_and_grad(z_up, UP_ACTIVATION, FAST16)
    else:
        gate = activation(z, ACTIVATION)
        up = activation(z_up, UP_ACTIVATION) if GATED else gate
    out = gate * up if GATED else gate
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    if SAVE:  # dh/dz, what backward needs (see the module docstring)
        saved_ptrs = saved_ptr + rows * stride_sm + offs_n[None, :]
        if GATED:
            tl.store(saved_ptrs, (up * gate_grad).to(saved_ptr.dtype.element_ty), mask=mask)
            tl.store(saved_ptrs + N, (gate * up_grad).to(saved_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(saved_ptrs, gate_grad.to(saved_ptr.dtype.element_ty), mask=mask)


@triton.jit
def linear_act_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, saved_ptr, stats_ptr, ln_w_ptr, ln_b_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_sm,
    ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, FAST16: tl.constexpr,
    LN_FOLD: tl.constexpr, LN_WEIGHT: tl.constexpr, LN_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    TMA: tl.constexpr, B_KMAJOR: tl.constexpr, PAIRED: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    # PAIRED: gated, through TMA: one accumulator, gate columns left, up columns right (matmul_loop's B_PAIRS). Its
    # epilogue is whole on the two halves (SPLIT_EPILOGUE is not read: a split and a whole config are one kernel).
    if PAIRED:
        for tile in tl.range(tl.program_id(0), tiles(M, N, BLOCK_M, BLOCK_N // 2), tl.num_programs(0),
                             flatten=FLATTEN):
            pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N // 2, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            acc = matmul_loop(x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * (BLOCK_N // 2), M, N, K, stride_xm, stride_xk,
                              stride_wk, stride_wn, 0, ACC_DTYPE, PRECISION, EVEN_K, False, INT64, BLOCK_M, BLOCK_N,
                              BLOCK_K, TMA=True, B_KMAJOR=True, B_PAIRS=True)[0]
            z, z_up = split_columns(acc, BLOCK_M, BLOCK_N)
            linear_act_epilogue(z, z_up, offs_m, column_offsets(pid_n, BLOCK_N // 2, 0, 1), M, N, b_ptr, out_ptr,
                                saved_ptr, stride_om, stride_sm, ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE,
                                ACC_DTYPE, INT64, FAST16)
    else:
        # One output tile per loop trip: one trip per program, or with a persistent grid (PERSISTENT, see
        # matmul.tiles) a program walks tiles grid-stride, and with FLATTEN the compiler pipelines the next tile's
        # loads under this tile's epilogue.
        for tile in tl.range(tl.program_id(0), tiles(M, N, BLOCK_M, BLOCK_N), tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # B = W.T: step along K with W's column stride, along N with its row stride. The up half starts N rows
            # down. With LN_FOLD, x is the raw input and each A tile is normalized as it is loaded (see matmul_loop).
            z, z_up = matmul_loop(
                x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                N if TMA else N * stride_wn, ACC_DTYPE, PRECISION, EVEN_K, GATED, INT64, BLOCK_M, BLOCK_N, BLOCK_K,
                TMA=TMA, B_KMAJOR=B_KMAJOR, stats_ptr=stats_ptr, ln_w_ptr=ln_w_ptr, ln_b_ptr=ln_b_ptr,
                LAYERNORM=LN_FOLD, LN_WEIGHT=LN_WEIGHT, LN_BIAS=LN_BIAS)
            if SPLIT_EPILOGUE:  # the epilogue on one half of the tile's columns at a time
                z_left, z_right = split_columns(z, BLOCK_M, BLOCK_N)
                up_left, up_right = z_left, z_right
                if GATED:
                    up_left, up_right = split_columns(z_up, BLOCK_M, BLOCK_N)
                linear_act_epilogue(z_left, up_left, offs_m, column_offsets(pid_n, BLOCK_N, 0, 2), M, N, b_ptr,
                                    out_ptr, saved_ptr, stride_om, stride_sm, ACTIVATION, UP_ACTIVATION, GATED,
                                    HAS_BIAS, SAVE, ACC_DTYPE, INT64, FAST16)
                linear_act_epilogue(z_right, up_right, offs_m, column_offsets(pid_n, BLOCK_N, 1, 2), M, N, b_ptr,
                                    out_ptr, saved_ptr, stride_om, stride_sm, ACTIVATION, UP_ACTIVATION, GATED,
                                    HAS_BIAS, SAVE, ACC_DTYPE, INT64, FAST16)
            else:
                linear_act_epilogue(z, z_up, offs_m, offs_n, M, N, b_ptr, out_ptr, saved_ptr, stride_om, stride_sm,
                                    ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE, ACC_DTYPE, INT64, FAST16)


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


def ln_linear_act_forward(x, ln_weight, ln_bias, eps, weight, bias, activation, save=True, out=None, saved=None):
    """act(LayerNorm(x) @ weight.T + bias) with the LayerNorm folded into the matmul (γ = ln_weight and
    β = ln_bias may be None). x may be fp32 while the weights are 16-bit (autocast: LayerNorm runs in fp32);
    out and saved then take the weights' dtype. Returns (out, saved or None, stats or None), saved as in
    linear_act_forward; stats (3, M) holds each row's mean, 1/std and the mean's rounding residual in fp32
    (fp64 for fp64), what the LayerNorm backward needs."""
    stats = layernorm_stats(x, eps)
    out, saved, _ = _launch(x, weight, bias, activation, save, out, saved, ln=(ln_weight, ln_bias, stats))
    return out, saved, (stats if save else None)


def _launch(x, weight, bias, activation, save, out, saved, ln=None):
    act, up_act, gated = kernel_activations(activation)
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if out is None:  # the weights' dtype: x's, except for an fp32 x under the LayerNorm fold
        out = torch.empty((M, N), device=x.device, dtype=weight.dtype)
    else:
        check_buffer("out", out, (M, N))
    if save and saved is None:
        saved = torch.empty((M, weight.shape[0]), device=x.device, dtype=weight.dtype)
    elif save:
        check_buffer("saved", saved, (M, weight.shape[0]))
    ln_weight, ln_bias, stats = ln if ln is not None else (None, None, None)
    if M == 0:
        return out, (saved if save else None), stats
    if ln is None and backends.run("linear_act", x, weight, bias, act, up_act, gated, save, out,
                                   saved) is not NotImplemented:
        return out, (saved if save else None), stats  # a fast backend ran it (Hopper, 16-bit: hopper/dispatch.py)
    # The TMA loop reads x and W.T through descriptors, in either orientation of W at the same speed
    # (git log -- lab/results/profile_mlp_h100.txt).
    # The LayerNorm fold normalizes x's tiles in registers, so it keeps the pointer loop.
    descriptors, b_kmajor = tma_operands(x, weight.t()) if ln is None else ([], False)
    if not descriptors and x.is_cuda and M >= TRANSPOSE_WEIGHT_MIN_M and weight.stride(1) == 1:
        # The pointer loop feeds the tensor cores faster from an N-major B = W.T; a row-major (N, K) weight
        # is K-major. One transposed copy of W costs less than that saves in the main loop once M is large.
        weight = weight.t().contiguous().t()
    # Gated, through TMA: the gate and up rows paired by the descriptor (matmul_loop's B_PAIRS), so that one dot of a
    # plain tile makes both halves, on the plain tiles whose half divides N (faster than two accumulators:
    # results/portable/sweep_paired_h200.txt).
    tile_dtype = x.dtype if x.element_size() > weight.element_size() else weight.dtype
    paired = _paired_configs(N, tile_dtype) if gated and descriptors and b_kmajor and env.GATE_PAIRS else []
    if paired:
        descriptors = [descriptors[0], (1, lambda meta: pair_descriptor(weight, meta["BLOCK_N"], meta["BLOCK_K"]), None)]
    acc_dtype, precision = dot_settings(weight.dtype)  # the dot's operands have the weight's dtype
    args = (x, weight, bias if bias is not None else weight, out, saved if save else out,
            stats if stats is not None else out, ln_weight if ln_weight is not None else weight,
            ln_bias if ln_bias is not None else weight, M, N, K,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), saved.stride(0) if save else 0)
    consts = dict(ACTIVATION=act, UP_ACTIVATION=up_act, GATED=gated, HAS_BIAS=bias is not None, SAVE=save,
                  FAST16=weight.dtype in (torch.float16, torch.bfloat16), LN_FOLD=ln is not None, LN_WEIGHT=ln_weight is not None, LN_BIAS=ln_bias is not None,
                  ACC_DTYPE=acc_dtype, PRECISION=precision,
                  INT64=needs_int64(x, weight, out, saved), TMA=bool(descriptors), B_KMAJOR=b_kmajor,
                  PAIRED=bool(paired))
    key = ("linear_act", N, K, x.dtype, weight.dtype, weight.stride(), x.device, *consts.values())
    # Tiles sized for the wider operand (tile_dtype): an fp32 x (the fold under autocast) takes twice the shared
    # memory per A tile of a 16-bit one. Paired, a tile's BLOCK_N spans both halves: the grid counts 2N columns.
    launch_matmul(linear_act_kernel, M, 2 * N if paired else N, K, args, consts, gated and not paired, tile_dtype,
                  key, descriptors=descriptors, configs=paired or None)
    return out, (saved if save else None), stats


@functools.lru_cache(maxsize=None)  # (on the launch path: the list is built once a shape)
def _paired_configs(n, dtype):
    """The plain tiles that pair an n-row gated half (pairs_fit), each tile once: the paired kernel does not read
    SPLIT_EPILOGUE, so a config that differs from another only there is the same kernel and is not timed twice."""
    configs, seen = [], set()
    for c in matmul_configs(False, dtype):
        kernel = (tuple(sorted((k, v) for k, v in c.kwargs.items() if k != "SPLIT_EPILOGUE")), c.num_warps,
                  c.num_stages, c.maxnreg)
        if pairs_fit(n, c) and kernel not in seen:
            seen.add(kernel)
            configs.append(c)
    return configs
