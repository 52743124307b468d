"""The FP8 fused MLP (opt-in): all six of the MLP's GEMMs in FP8, every quantization fused into the kernel that
produces the operand where the GPU allows.

Why FP8, and why fused. On Hopper the FP8 tensor cores run at twice bf16's rate, but a GEMM in FP8 needs both
operands quantized (scaled, rounded to 8 bits) and, for the weight-gradient GEMMs that reduce over the tokens,
transposed: Hopper's FP8 MMA takes only K-major operands. Done as separate passes (torchao's float8), the casts,
amax reductions and transposes cost more than FP8 saves at GPT-2's width (docs/performance.md, the FP8 recipe).
Here each quantized operand is written by the kernel that produces it, in the same epilogue, from values still in
registers:

    forward    x      -> x8, x8ᵀ (e4m3)                one cast + transpose pass (x arrives in bf16)
               h, s   =  act(x8 @ W1ᵀ + b1), dh/dz      FP8 GEMM whose epilogue writes h8, h8ᵀ (e4m3) and s in bf16
               y      =  h8 @ W2ᵀ + b2                  FP8 GEMM (torch._scaled_mm, cuBLAS)
    backward   gy     -> gy8, gy8ᵀ (e5m2)              one cast + transpose pass
               gz     =  (gy8 @ W2) * s                 FP8 GEMM whose epilogue writes gz8 and gz8ᵀ (e5m2)
               dW2    =  gy8ᵀ @ h8,  dx = gz8 @ W1,  dW1 = gz8ᵀ @ x8      FP8 GEMMs (cuBLAS)

The weights' copies, W1 and W1ᵀ, W2 and W2ᵀ in e4m3 (quantize_weight: each GEMM takes its weight K-major), are made
once per optimizer step (FP8State.weights). On Hopper the two GEMMs with epilogues run in the ping-pong kernels
(../hopper/pingpong.py, launched by hopper.py here: FP8 main loops, FP8_IN, and FP8 epilogues, FP8_OUT, gated
ones included): 114 and 94 µs at GPT-2
small's size against 123 and 114 for their bf16 versions (an H100 run in git history, results/fp8_stage3_h100.txt;
autograd.PINGPONG_FP8).
Elsewhere (Ada, the CPU interpreter, a ping-pong kernel that failed) this file's Triton kernels run them, their FP8
tiles converted to fp16 (exact) for the dot, and transpose_fp8 writes h8ᵀ. Activations and weights are e4m3 (more
mantissa), gradients e5m2 (more range), TransformerEngine's "hybrid" format; every FP8 GEMM pairs one e4m3 operand
with the other, as cuBLAS asks.

The scaling recipe: per-tensor delayed scaling (TransformerEngine's). A quantized tensor is
fp8(v · scale) with one scale per tensor, scale = fp8_max / amax, and the GEMM multiplies its result by
the two operands' 1/scale. An epilogue writes each tile as soon as it is computed, so it must know the
scale before the tensor's amax exists: the scale comes from the largest amax of the last `history`
micro-steps (FP8State), and each kernel folds its tiles' amax into the current one with an atomic max.
After each backward one tiny kernel moves the current amaxes into the history and computes the next
scales, on the GPU without a host sync (under torch.compile nothing else is host state either, so CUDA graphs
capture it: autograd.py). Under DDP each process keeps its own scales: no collective runs inside the MLP
(docs/numerics.md says why that is exact enough). Values past the range saturate to
±fp8_max (the price of a delayed scale when a tensor grows suddenly); the history's max keeps that rare.
Non-finite amaxes (an overflowed fp16 step, a NaN) are left out of the max.
The first call of each MLP has no history: it calibrates with current scaling, x's and grad_y's scales from
their own amax, and h's and grad_z's by running their kernel twice, the first time only to measure the amax it
folds in (autograd._calibrated); from then on each kernel runs once.
Weights use current scaling, since their FP8 copies are made once per optimizer step (FP8State.weights)
uncompiled, and once per forward by the compiled graph, never from an older amax.
Rows are padded to a multiple of 16 in the transposed copies (zeros), since the GEMMs reducing over the
tokens need K % 16 == 0.

Special values: NaN stays NaN (e4m3 and e5m2 have NaN); ±inf becomes NaN (e4m3 has no inf, and a
saturated inf would hide a diverged run from train.py's loss check); finite values past the range
saturate. Under no_grad (evaluation, sampling) the MLP runs the bf16 fused path.

autograd.py runs all this as an autograd.Function, and inside torch.compile as two operators; state.py holds
FP8State (the scales, the weights' copies).

Under the Triton interpreter (CPU tests), whose float -> FP8 conversion mis-rounds values that carry into
the next binade and turns NaN into 384, the kernels encode FP8 by hand (../casts.py: round to nearest even
in fp32, then the bit fields); on a GPU the hardware conversion (round to nearest even) does it.
"""

import torch
import triton
import triton.language as tl

from .. import env
from ..activations import activation_and_grad, kernel_activations
from ..casts import quantize, to_fp16
from ..matmul import column_offsets, fp8_mma_available, matmul_loop, needs_int64, tile_ids, tiles, tma_operands
from ..tuning import _config, _device_shared_memory, cdiv, launch, launch_matmul, shared_memory, tuned_config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# the largest fp32, the weights' largest scale (an amax below 448 / FLOAT32_MAX: finite, as quantize_weight); a
# tl.constexpr instance, the only kind of global Triton 3.6 reads in a kernel
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
X, H, GRAD_Y, GRAD_Z = range(4)  # the slots of FP8State: the tensors quantized with delayed scales
SLOT_DTYPES = (E4M3, E4M3, E5M2, E5M2)
FP8_DTYPES = (E4M3, E5M2)  # what the FP8 main loops read through TMA


# ----------------------------------------------------------------------------------------------------------
# quantization, as the kernels do it


@triton.jit
def _store_quantized(v, offs_m, offs_n, n_ok, M, Mp, q_ptr, stride_q, qt_ptr, stride_qt, scale, amax_ptr,
                     ROW_MAJOR: tl.constexpr, EMULATE: tl.constexpr, INT64: tl.constexpr,
                     TRANSPOSED: tl.constexpr = True):
    """Quantize the tile v (rows offs_m, columns offs_n), fold its amax into amax_ptr, store it row-major (if
    ROW_MAJOR) and transposed (if TRANSPOSED). Rows from M up to the transposed copy's padding Mp are written
    there as zeros.

    The transposed copy is stored from tl.trans(v), so that its contiguous dimension is the tile's last one:
    Triton moves the tile through shared memory and the stores stay coalesced. (Storing v through transposed
    pointers instead wrote wrong values on an H100 with Triton 3.6, besides being slow; tests/test_fp8.py
    compares every transposed copy with its row-major one on the GPU.)"""
    rows = offs_m.to(tl.int64) if INT64 else offs_m
    cols = offs_n.to(tl.int64) if INT64 else offs_n
    v = tl.where((offs_m < M)[:, None], v, 0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(v), axis=1), axis=0), sem="relaxed")
    out = q_ptr.dtype.element_ty
    if ROW_MAJOR:
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], quantize(v, scale, out, EMULATE),
                 mask=(offs_m < M)[:, None] & n_ok[None, :])
    if TRANSPOSED:
        tl.store(qt_ptr + cols[:, None] * stride_qt + rows[None, :], quantize(tl.trans(v), scale, out, EMULATE),
                 mask=n_ok[:, None] & (offs_m < Mp)[None, :])


@triton.jit
def cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, C, Mp, stride_xm, stride_qm, copy_from, copy_to,
                          ROW_MAJOR: tl.constexpr, EMULATE: tl.constexpr, INT64: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, TRANSPOSED: tl.constexpr = True,
                          COPY: tl.constexpr = 0):
    """qt (C, Mp) = fp8(x · scale)ᵀ with zero columns past M (if TRANSPOSED), and (ROW_MAJOR) q (M, C) =
    fp8(x · scale), its rows stride_qm apart (wider than C when q is a column slice: cast_transpose_parts). The
    transposed copy is right for 16-bit x only: from fp32 x it came out wrong on an H100 and
    an H200 with Triton 3.6 (quantize_weight_fused asks for the row-major one only). COPY > 0: the first program
    also copies COPY floats from copy_from to copy_to (the FP8 MLP's forward keeps its scales so, where a copy of
    its own was a graph node with a launch gap after it; git log -- lab/results/fp8_round23.txt)."""
    if COPY > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            offs = tl.arange(0, COPY)
            tl.store(copy_to + offs, tl.load(copy_from + offs))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    cols = (offs_c.to(tl.int64) if INT64 else offs_c)[None, :]
    v = tl.load(x_ptr + rows * stride_xm + cols, mask=(rows < M) & (cols < C), other=0.0)
    if v.dtype.is_fp8():  # (transpose_fp8)
        v = to_fp16(v, EMULATE)
    v = v.to(tl.float32)
    _store_quantized(v, offs_m, offs_c, offs_c < C, M, Mp, q_ptr, stride_qm, qt_ptr, Mp, tl.load(scale_ptr), amax_ptr,
                     ROW_MAJOR, EMULATE, INT64, TRANSPOSED)


@triton.jit
def update_scales_kernel(history_ptr, position_ptr, amax_ptr, scale_ptr, inv_scale_ptr, fp8_max_ptr,
                         HISTORY: tl.constexpr):
    """For one slot: write the current amax into the history ring, reset it, and set the next scale from the
    largest finite amax of the history (kept as it was when there is none: nothing measured yet)."""
    slot = tl.program_id(0)
    offs = tl.arange(0, HISTORY)
    position = tl.load(position_ptr + slot)
    current = tl.load(amax_ptr + slot)
    history = tl.load(history_ptr + slot * HISTORY + offs)
    history = tl.where(offs == position, current, history)
    tl.store(history_ptr + slot * HISTORY + position, current)
    tl.store(position_ptr + slot, (position + 1) % HISTORY)
    tl.store(amax_ptr + slot, 0.0)
    amax = tl.max(tl.where(history < float("inf"), history, 0.0), axis=0)  # NaN < inf is false too
    usable = amax > 0.0
    scale = tl.where(usable, tl.load(fp8_max_ptr + slot) / tl.where(usable, amax, 1.0), tl.load(scale_ptr + slot))
    tl.store(scale_ptr + slot, scale)
    tl.store(inv_scale_ptr + slot * 4, 1.0 / scale)


@triton.jit
def weight_scale_kernel(amax_ptr, scale_ptr, inv_ptr, FP8_MAX: tl.constexpr):
    """A weight's current scale from its amax (1 where that is 0, inf or NaN) into scale_ptr[0], and its 1/scale:
    quantize_weight's; scale_ptr[2] = 1 (the unit scale of the transposing pass after it)."""
    amax = tl.load(amax_ptr)
    usable = (amax > 0.0) & (amax < float("inf"))  # (NaN compares false)
    # correctly rounded divisions, as torch's (Triton's `/` on fp32 is approximate on a GPU)
    scale = tl.where(usable, tl.math.div_rn(tl.full((), FP8_MAX, tl.float32), tl.where(usable, amax, 1.0)), 1.0)
    scale = tl.minimum(scale, FLOAT32_MAX)
    tl.store(scale_ptr, scale)
    tl.store(scale_ptr + 2, 1.0)
    tl.store(inv_ptr, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))


# ----------------------------------------------------------------------------------------------------------
# the two epilogue kernels: bf16 main loops (matmul.matmul_loop), FP8 outputs


@triton.jit
def fp8_act_epilogue(z, z_up, inv, offs_m, offs_n, M, Mp, N, b_ptr, h8_ptr, saved_ptr, scale_ptr, amax_ptr,
                     stride_sm, ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, INT64: tl.constexpr, EMULATE: tl.constexpr):
    """h = act(z · inv) (gated: gate_act(z · inv)·up_act(z_up · inv)) quantized to h8, and dh/dz in 16 bits; inv:
    the product of the FP8 operands' 1/scales."""
    n_mask = offs_n < N
    z = z * inv
    if GATED:
        z_up = z_up * inv
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
        if GATED:
            z_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(ACC_DTYPE)[None, :]
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    cols = (offs_n.to(tl.int64) if INT64 else offs_n)[None, :]
    gate, gate_grad = activation_and_grad(z, ACTIVATION, True)  # (dh/dz is saved in 16 bits)
    up, up_grad = gate, gate_grad
    if GATED:
        up, up_grad = activation_and_grad(z_up, UP_ACTIVATION, True)
    # hᵀ is written by a second pass (transpose_fp8): stored from this epilogue it came out wrong on an H100
    # with Triton 3.6 (tl.trans of the accumulator's tile), where the dgrad epilogue's is right.
    _store_quantized(gate * up if GATED else gate, offs_m, offs_n, n_mask, M, Mp, h8_ptr, N, h8_ptr, Mp,
                     tl.load(scale_ptr), amax_ptr, True, EMULATE, INT64, TRANSPOSED=False)
    mask = (rows < M) & n_mask[None, :]
    saved_ptrs = saved_ptr + rows * stride_sm + cols
    if GATED:
        tl.store(saved_ptrs, (up * gate_grad).to(saved_ptr.dtype.element_ty), mask=mask)
        tl.store(saved_ptrs + N, (gate * up_grad).to(saved_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(saved_ptrs, gate_grad.to(saved_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_linear_act_kernel(
    x_ptr, w_ptr, b_ptr, h8_ptr, saved_ptr, scale_ptr, amax_ptr, x_inv_ptr, w_inv_ptr, M, Mp, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sm,
    ACTIVATION: tl.constexpr, UP_ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    TMA: tl.constexpr, B_KMAJOR: tl.constexpr, EMULATE: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    """linear_act.linear_act_kernel's main loop on FP8 x and W (FP8 MMAs, or upcast where the GPU has none: see
    matmul_loop), with fp8_act_epilogue."""
    tl.static_assert(not SPLIT_EPILOGUE, "fp8_configs: whole-tile epilogues")
    inv = tl.load(x_inv_ptr) * tl.load(w_inv_ptr)
    for tile in tl.range(tl.program_id(0), tiles(M, N, BLOCK_M, BLOCK_N), tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        z, z_up = matmul_loop(
            x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
            N if TMA else N * stride_wn, ACC_DTYPE, PRECISION, EVEN_K, GATED, INT64, BLOCK_M, BLOCK_N, BLOCK_K,
            TMA=TMA, B_KMAJOR=B_KMAJOR, UPCAST=UPCAST)
        fp8_act_epilogue(z, z_up, inv, offs_m, column_offsets(pid_n, BLOCK_N, 0, 1), M, Mp, N, b_ptr, h8_ptr,
                         saved_ptr, scale_ptr, amax_ptr, stride_sm, ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS,
                         ACC_DTYPE, INT64, EMULATE)


@triton.jit
def fp8_dgrad_epilogue(grad_h, offs_m, offs_n, pid_m, M, Mp, N, saved_ptr, gz8_ptr, gzt8_ptr, dbias_ptr, scale_ptr,
                       amax_ptr, stride_sm, stride_dbm, GATED: tl.constexpr, BIAS_GRAD: tl.constexpr,
                       ACC_DTYPE: tl.constexpr, INT64: tl.constexpr, EMULATE: tl.constexpr):
    """grad_z = grad_h · dh/dz for columns offs_n (both halves when gated), quantized to gz8 and gz8ᵀ, and the
    column sums of the unquantized grad_z (the first linear's bias gradient, as dgrad.py sums them)."""
    n_mask = offs_n < N
    rows = (offs_m.to(tl.int64) if INT64 else offs_m)[:, None]
    cols = (offs_n.to(tl.int64) if INT64 else offs_n)[None, :]
    width = 2 * N if GATED else N
    scale = tl.load(scale_ptr)
    for half in tl.static_range(2 if GATED else 1):
        saved = tl.load(saved_ptr + rows * stride_sm + cols + half * N, mask=(rows < M) & n_mask[None, :], other=0.0)
        grad = grad_h * saved.to(ACC_DTYPE)
        _store_quantized(grad, offs_m, offs_n + half * N, n_mask, M, Mp, gz8_ptr, width, gzt8_ptr, Mp, scale,
                         amax_ptr, True, EMULATE, INT64)
        if BIAS_GRAD:
            tl.store(dbias_ptr + pid_m * stride_dbm + half * N + offs_n, tl.sum(grad, axis=0), mask=n_mask)


@triton.jit
def fp8_dgrad_kernel(
    g_ptr, w_ptr, saved_ptr, gz8_ptr, gzt8_ptr, dbias_ptr, scale_ptr, amax_ptr, g_inv_ptr, w_inv_ptr, M, Mp, N, K,
    stride_gm, stride_gk, stride_wk, stride_wn, stride_sm, stride_dbm,
    GATED: tl.constexpr, BIAS_GRAD: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, INT64: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr, EMULATE: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    """dgrad.dgrad_kernel's main loop on FP8 grad_y and W2 (grad_h = grad_y @ W2: FP8 MMAs, or upcast, see
    matmul_loop), with fp8_dgrad_epilogue."""
    tl.static_assert(not SPLIT_EPILOGUE, "fp8_configs: whole-tile epilogues")
    inv = tl.load(g_inv_ptr) * tl.load(w_inv_ptr)
    for tile in tl.range(tl.program_id(0), tiles(M, N, BLOCK_M, BLOCK_N), tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        grad_h = matmul_loop(g_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_gm, stride_gk,
                             stride_wk, stride_wn, 0, ACC_DTYPE, PRECISION, EVEN_K, False, INT64,
                             BLOCK_M, BLOCK_N, BLOCK_K, TMA=TMA, B_KMAJOR=B_KMAJOR, UPCAST=UPCAST)[0]
        fp8_dgrad_epilogue(grad_h * inv, offs_m, column_offsets(pid_n, BLOCK_N, 0, 1), pid_m, M, Mp, N, saved_ptr,
                           gz8_ptr, gzt8_ptr, dbias_ptr, scale_ptr, amax_ptr, stride_sm, stride_dbm, GATED,
                           BIAS_GRAD, ACC_DTYPE, INT64, EMULATE)


# ----------------------------------------------------------------------------------------------------------
# the launchers (FP8State, the scales' state they read and update, is in state.py)


def quantize_weight_fused(w, out=None, transposed=True):
    """quantize_weight, bit for bit, in four kernels (the amax, the scale, one cast pass, one transposing pass over
    the FP8 result) where it runs eagerly (FP8State.weights), instead of about ten elementwise ops over the weight and
    a transposing copy (45 µs of GPU time for GPT-2 small's two MLP weights, results/fp8_weight_copies_h100.txt).
    out: (q, qᵀ, 1/scale) to write into. transposed=False skips the transposing pass (qᵀ None): for a tensor that
    only one GEMM reads, row-major (the classifier's x). Inside torch.compile, quantize_weight runs instead (inductor
    fuses it; a raw kernel launch would break the trace)."""
    w = w.detach()
    N, K = w.shape
    q, qt, inv = out or (torch.empty((N, K), device=w.device, dtype=E4M3),
                         torch.empty((K, N), device=w.device, dtype=E4M3) if transposed else None,
                         torch.empty(1, device=w.device))
    amax = torch.linalg.vector_norm(w, float("inf"), dtype=torch.float32).reshape(1)  # (NaN if any is NaN)
    scale = torch.empty(4, device=w.device)  # the scale, a scratch amax, 1, a scratch amax
    launch(weight_scale_kernel, (1,), (amax, scale, inv), dict(FP8_MAX=FP8_MAX[E4M3]), num_warps=1)
    _cast_transpose_into(w if w.stride(1) == 1 else w.contiguous(), q, q, scale, scale[1:], True, N, transposed=False)
    if transposed:
        _cast_transpose_into(q, qt, qt, scale[2:], scale[3:], False, N)  # (exact: at scale 1)
    return q, qt, inv


def update_scales(state):
    """After a backward: every slot's amax into its history, the next scales from the histories."""
    launch(update_scales_kernel, (4,), (state.history, state.position, state.amax, state.scale, state.inv_scale,
                                        state.fp8_max), dict(HISTORY=state.history.shape[1]), num_warps=1)


def _padded(m):
    return -(-m // 16) * 16


# cast_transpose_kernel's tile and warps (BLOCK_M, BLOCK_C, num_warps), by whether it also writes the row-major
# copy: with it (h, gz: 12288 x 3072) 2 warps took 60 µs against 74 with 4; without (x, gy: 12288 x 768) 4 warps
# were best (on an H200; git log -- results/fp8_cast_tiles_h200.txt).
CAST_TILE = {True: (32, 32, 4), False: (32, 32, 4)} if env.INTERPRET else {True: (64, 64, 2), False: (64, 64, 4)}


def cast_transpose(x2, state, slot, row_major=False, inv_scales=None):
    """(q (M, C) if row_major else None, qt (C, Mp)): x2 quantized with the slot's scale, its amax folded in; and, if
    inv_scales is given (a tensor like state.inv_scale), every slot's 1/scale copied into it as they are now."""
    M, C = x2.shape
    qt = torch.empty((C, _padded(M)), device=x2.device, dtype=SLOT_DTYPES[slot])
    q = torch.empty((M, C), device=x2.device, dtype=qt.dtype) if row_major else qt
    copy = (state.inv_scale, inv_scales) if inv_scales is not None else ()
    _cast_transpose_into(x2, q, qt, *state.slot(slot)[:2], row_major, qt.shape[1], copy=copy)
    return (q if row_major else None), qt


def cast_transpose_parts(parts, state, slot):
    """(q (M, C), qt (C, Mp)) of the column-wise concatenation of parts ((M, C_i) each, unit column stride, any row
    stride), quantized with the slot's one scale, without the concatenation ever being written: each part is cast
    straight into its columns of q and its rows of qt (the attention's q, k and v gradients: linear.fp8_linear_qkv)."""
    M, C = parts[0].shape[0], sum(p.shape[1] for p in parts)
    qt = torch.empty((C, _padded(M)), device=parts[0].device, dtype=SLOT_DTYPES[slot])
    q = torch.empty((M, C), device=qt.device, dtype=qt.dtype)
    start = 0
    for part in parts:
        end = start + part.shape[1]
        _cast_transpose_into(part, q[:, start:end], qt[start:end], *state.slot(slot)[:2], True, qt.shape[1])
        start = end
    return q, qt


def _cast_transpose_into(x2, q, qt, scale, amax, row_major, Mp, transposed=True, copy=()):
    """cast_transpose_kernel: qt (C, Mp) if transposed and, if row_major, q (M, C) = x2 quantized with scale[0], amax
    folded in; copy: (source, destination), two contiguous fp32 tensors of 16 elements, or none."""
    M, C = x2.shape
    bm, bc, warps = CAST_TILE[row_major]
    source, destination = copy or (None, None)
    launch(cast_transpose_kernel, (cdiv(Mp, bm), cdiv(C, bc)),
           (x2, q, qt, scale, amax, M, C, Mp, x2.stride(0), q.stride(0), source, destination),
           dict(ROW_MAJOR=row_major, EMULATE=env.INTERPRET, INT64=needs_int64(x2, q, qt), BLOCK_M=bm, BLOCK_C=bc,
                TRANSPOSED=transposed, COPY=source.numel() if copy else 0), warps)


def transpose_fp8(q, Mp, state):
    """qᵀ (N, Mp) of an FP8 q (M, N), zero columns past M: cast_transpose_kernel at scale 1 (exact), its amax
    folded into a scratch slot (q's own amax was taken when q was made)."""
    qt = torch.empty((q.shape[1], Mp), device=q.device, dtype=q.dtype)
    _cast_transpose_into(q, qt, qt, state.unit, state.unit[1:], False, Mp)
    return qt


def fp8_configs(gated, dtype, shared_limit=None):
    """The FP8 kernels' candidate tiles, best first on an H200 (results/portable/): whole-tile epilogues, at most
    128x128 (the transposed copy goes through shared memory, tl.trans, and on an H100 with Triton 3.6 tl.trans of
    a half tile from split_columns stored wrong values), K steps of 128 one-byte elements (one 128-byte row of
    shared memory, what the FP8 MMAs read), and those that fit the GPU's shared memory (tuning.matmul_configs)."""
    if env.INTERPRET:
        return [_config(32, 32, 32, 4, 1, group_m=2, split=False, persistent=1)]
    configs = [
        _config(128, 128, 128, 8, 4, split=False, persistent=1, flatten=True),
        _config(128, 64, 128, 4, 4, split=False),
        _config(128, 128, 128, 8, 3, split=False),
        _config(128, 128, 64, 4, 3, split=False),
    ]
    limit = shared_limit or _device_shared_memory()
    configs = [c for c in configs if shared_memory(c, 1, gated) <= limit and (env.PERSISTENT or not c.kwargs["PERSISTENT"])]
    return configs if env.AUTOTUNE else configs[:1]


def fp8_linear_act(x8, w8, inv, bias, activation, state, dtype):
    """(h8 (M, N), h8ᵀ (N, Mp), dh/dz (M, weight rows) in dtype) for act(x8 @ w8.T · inv[0] · inv[1] + bias), x8 and
    w8 in e4m3: see fp8_act_epilogue."""
    act, up_act, gated = kernel_activations(activation)
    M, K = x8.shape
    N = w8.shape[0] // 2 if gated else w8.shape[0]
    Mp = _padded(M)
    h8 = torch.empty((M, N), device=x8.device, dtype=E4M3)
    saved = torch.empty((M, w8.shape[0]), device=x8.device, dtype=dtype)
    args = (x8, w8, bias if bias is not None else saved, h8, saved, *state.slot(H)[:2], *inv,
            M, Mp, N, K, x8.stride(0), x8.stride(1), w8.stride(0), w8.stride(1), saved.stride(0))
    native = fp8_mma_available(x8.device)
    descriptors, b_kmajor = tma_operands(x8, w8.t(), FP8_DTYPES) if native else ([], True)
    consts = dict(ACTIVATION=act, UP_ACTIVATION=up_act, GATED=gated, HAS_BIAS=bias is not None, ACC_DTYPE=tl.float32,
                  PRECISION="ieee", INT64=needs_int64(x8, w8, saved, h8), TMA=bool(descriptors), B_KMAJOR=b_kmajor,
                  EMULATE=env.INTERPRET, UPCAST=not native)
    key = ("fp8_linear_act", N, K, dtype, w8.stride(), x8.device, *consts.values())
    launch_matmul(fp8_linear_act_kernel, M, N, K, args, consts, gated, dtype, key, descriptors=descriptors,
                  configs=fp8_configs(gated, dtype))
    return h8, transpose_fp8(h8, Mp, state), saved


def fp8_dgrad(gy8, w2, inv, saved, activation, state, bias_grad):
    """(gz8 (M, W), gz8ᵀ (W, Mp), the bias gradient or None) for gz = (gy8 @ w2 · inv[0] · inv[1]) * saved, gy8 in
    e5m2 and w2 (K, N) in e4m3 (any strides: the K-major copy's transposed view), W = saved's width."""
    gated = kernel_activations(activation)[2]
    M, K = gy8.shape
    N, width = w2.shape[1], saved.shape[1]
    Mp = _padded(M)
    gz8 = torch.empty((M, width), device=saved.device, dtype=E5M2)
    gzt8 = torch.empty((width, Mp), device=saved.device, dtype=E5M2)
    native = fp8_mma_available(gy8.device)
    descriptors, b_kmajor = tma_operands(gy8, w2, FP8_DTYPES) if native else ([], False)
    consts = dict(GATED=gated, BIAS_GRAD=bias_grad, ACC_DTYPE=tl.float32, PRECISION="ieee",
                  INT64=needs_int64(gy8, w2, saved, gzt8), TMA=bool(descriptors), B_KMAJOR=b_kmajor,
                  EMULATE=env.INTERPRET, UPCAST=not native)
    key = ("fp8_dgrad", N, K, saved.dtype, w2.stride(), gy8.device, *consts.values())
    cfg = tuned_config(key)  # one row of column sums per row-tile (before tuning: of the smallest BLOCK_M)
    configs = fp8_configs(False, saved.dtype)
    block_m = cfg.kwargs["BLOCK_M"] if cfg else min(c.kwargs["BLOCK_M"] for c in configs)
    partial = torch.empty((cdiv(M, block_m), width), device=saved.device, dtype=torch.float32) if bias_grad else gz8
    args = (gy8, w2, saved, gz8, gzt8, partial, *state.slot(GRAD_Z)[:2], *inv, M, Mp, N, K,
            gy8.stride(0), gy8.stride(1), w2.stride(0), w2.stride(1), saved.stride(0), partial.stride(0))
    cfg = launch_matmul(fp8_dgrad_kernel, M, N, K, args, consts, False, saved.dtype, key, descriptors=descriptors,
                        configs=configs)
    return gz8, gzt8, (partial[: cdiv(M, cfg.kwargs["BLOCK_M"])].sum(0) if bias_grad else None)
