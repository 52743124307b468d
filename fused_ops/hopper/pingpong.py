"""Hopper (sm_90) warp-specialized "ping-pong" matmul with a fused epilogue, written in Gluon.

Why a second main loop: in the Triton kernels (../matmul.py) the warps that issue a tile's MMAs also run
its epilogue (bias, GELU and GELU', two stores), so the tensor cores idle through every epilogue, and
Triton's compiler does not overlap the two on Hopper (docs/performance.md). This kernel lays the overlap out
itself. Each SM runs one persistent program of three warp partitions:

  loader      1 warp     TMA loads of the A and B tiles into a ring of STAGES shared-memory slots
  consumer 0  8 warps    wgmma over the ring for the program's even tiles, then their epilogue
  consumer 1  8 warps    the same for its odd tiles
(4 warps a consumer in the plain dgrad: see CONSUMER_WARPS.)

The two consumers take turns at the main loop (the `turn` barriers): while one runs its tile's MMAs the
other runs the previous tile's epilogue on the CUDA cores (CUTLASS calls this schedule ping-pong).
The epilogue is a compile-time choice:
  "act": bias + activation, and the derivative dh/dz backward needs (SAVE): linear_act's forward;
  "mul": times a saved tensor read through TMA, plus this tile's column sums for the bias gradient: the dgrad;
  "lse": the classifier's logits as they are (16-bit), plus each row's log-sum-exp over the tile's columns (of the
         logits as stored, rounded): the classifier's row kernel then reads the logits once, not twice (logits_lse).
Gated activations: in the forward each B tile holds 64 gate rows and 64 up rows of W for the same 64
output columns, so one MMA gives both halves (split in registers); the dgrad multiplies one grad_h tile
by both saved halves. Outputs leave through TMA stores from staging tiles, 32 columns at a time.

For the FP8 MLP (../fp8/), two more compile-time switches (one kernel serves both: its FP8 variants are constexpr
branches of the same code; the FP8_OUT launchers are in ../fp8/hopper.py, which imports this module, never the
reverse; FP8_IN with 16-bit outputs is launched here too, by the gated FP8 forward and dgrad and by logits_lse; the
FP8 epilogue's quantize is ../casts.py's):
  FP8_IN: A and B are FP8 (e4m3, or e5m2 grad_y against e4m3 W2ᵀ: FP8 wgmma takes only K-major operands, and mixes
         the two formats), in K slices of 128 (128 bytes a row, as the 16-bit slices: the same ring); the
         accumulator is multiplied by the two operands' 1/scales before the epilogue (per-tensor scales).
  FP8_OUT: h (or grad_z) leaves quantized, fp8(v · scale) with the delayed scale read from scale_ptr (its amax kept
         per row over all of a consumer's tiles, folded into amax_ptr once with an atomic max), from fp32 registers,
         twice: row-major, and transposed (vᵀ, for the weight gradient's FP8 GEMM) through a permuted copy in shared
         memory; no cast or transpose pass is left. Gated, the forward stages only dh/dgate and dh/dup in 16 bits;
         the dgrad, with no shared memory to spare, writes each part's FP8 tiles into the saved tile it has just
         read.
Its main loop runs at cuBLAS speed and its epilogues cost far less than the Triton kernel's
(docs/performance.md). Only for what TMA and wgmma take: 16-bit operands and outputs of one dtype (or the FP8
ones above), rows 16-byte aligned (gated: N a multiple of 8), a GPU of capability 9.x and Triton's Gluon (3.6 is
what it was built with). The Triton kernels do everything else, and the gated dgrad where they are faster
(takes_dgrad); for the classifier's logits, cuBLAS's GEMM; FUSED_OPS_PINGPONG=0 turns this off (env.py).
dispatch.py hands the core's launchers these kernels (usable() and takes_dgrad() decide). If this kernel fails to
compile or launch (Gluon changes between Triton releases), they take over too, after one FallbackWarning.
"""

import functools
import types
import warnings

import torch

from .. import env, matmul
from ..backends import FallbackWarning
from ..activations import activation, activation_grad, gelu_and_grad_16bit, silu_and_grad
from ..casts import quantize
from ..matmul import split_columns, tile_ids
from ..tuning import _specialization, cdiv

try:  # Gluon is experimental and changes between Triton releases: anything missing turns this kernel off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    import triton.language as tl  # (its PropagateNan, which Gluon does not re-export)
    # Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later
    # versions async_load / async_store (and make the old names raise).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    if not hasattr(gl.shared_memory_descriptor, "reinterpret"):  # (Triton 3.6 names it _reinterpret)
        gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret
    AVAILABLE = hasattr(gl, "warp_specialize") and not env.INTERPRET
except (ImportError, AttributeError):  # a Triton without (this) Gluon: the Triton kernels do everything
    AVAILABLE = False

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # a consumer's MMA tile: two warpgroups of 64 rows each
PART = 32  # columns per TMA store (and per step of the epilogue's math)
# (EPILOGUE, GATED) -> (ring slots of 32 KB, staging tiles of [BLOCK_M, PART] = 8 KB, half per consumer).
# An H100 block may have 227 KB of shared memory.
SHARED_MEMORY_PLAN = {
    ("act", False): (4, 8),   # 192 KB: h and dh/dz of a part, two parts in flight per consumer
    ("mul", False): (4, 8),   # 192 KB: the saved tile's 4 parts, prefetched while the MMAs run
    ("act", True): (4, 12),   # 224 KB: h, dh/dgate and dh/dup of a part, two parts in flight
    ("mul", True): (3, 16),   # 224 KB: both saved halves' 4 parts prefetched; one ring slot less
    ("lse", False): (4, 8),   # 192 KB: as "act", one store a part
}
# FP8_OUT (4 KB tiles of h8 and h8ᵀ or gz8 and gz8ᵀ beside them, two of each per consumer; 32 KB in all), where the
# plan differs: the gated forward stages only dh/dgate and dh/dup (224 KB); the gated dgrad stores its FP8 parts
# from the spent saved tiles (224 KB). The plain ones: 224 KB.
FP8_SHARED_MEMORY_PLAN = {("act", True): (4, 8)}
GROUP_M = 8  # row tiles walked before the next column tile (tile_ids): A's and B's tiles reused from L2
# The classifier's logits GEMM ("lse"): all of a chunk's row tiles (20 at GPT-2's head) before the next column tile,
# so that each tile of W (50304 x 768: more than L2 holds) is read from memory once a chunk, not three times.
LOGITS_GROUP_M = 64
# A consumer is two warpgroups (8 warps: 64 accumulator registers a thread, 112 in all) or, in the plain dgrad, one
# (4 warps: 128 of 240). The epilogue's math needs the two warps per scheduler that 8 warps give, to hide its latency:
# at 4 the GELU forward took twice as long; the dgrad's, loads and stores with little math, gains from the registers
# (results/glue/consumer_warps_h100.txt).
CONSUMER_WARPS = 8
DGRAD_CONSUMER_WARPS = 4
LOADER_REGS = 24


def registers(consumer_warps):
    """(what every thread may hold at launch, what a consumer's thread holds after setmaxnreg): registers are handed
    out per warpgroup, so the 1-warp loader holds 4 warps' worth until it gives its share to the consumers.
    8 warps: (96, 112); 4: (168, 240)."""
    warps = 2 * consumer_warps + 4
    maxnreg = 65536 // (32 * warps) // 8 * 8
    return maxnreg, (maxnreg * 32 * warps - LOADER_REGS * 128) // (2 * 32 * consumer_warps) // 8 * 8


if AVAILABLE:
    # What the kernels read must be a constexpr.
    GROUP_M_ = gl.constexpr(GROUP_M)
    LOGITS_GROUP_M_ = gl.constexpr(LOGITS_GROUP_M)
    LOADER_REGS_ = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _column_quarters(x):
        """The tile's four column quarters, left to right (matmul.split_columns twice: no data moves)."""
        BM: gl.constexpr = x.shape[0]
        BN: gl.constexpr = x.shape[1]
        left, right = split_columns(x, BM, BN)
        a, b = split_columns(left, BM, BN // 2)
        c, d = split_columns(right, BM, BN // 2)
        return a, b, c, d

    @gluon.jit
    def _loader(a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_KMAJOR: gl.constexpr,
                GATE_UP_B: gl.constexpr, GROUP: gl.constexpr):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        TN: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]  # output columns per tile
        S: gl.constexpr = a_bufs.type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if GATE_UP_B else 1) * b_desc.block_type.nbytes
        i = 0
        for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, TN), gl.num_programs(0)):
            pid_m, pid_n = tile_ids(tile, M, N, BM, TN, GROUP)
            for k in range(0, K, BK):
                s = i % S
                # A slot is free once the consumer that read it arrived on empty[s]; barriers start
                # with phase 1 complete, so the first pass over the ring does not wait.
                mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma_load(a_desc, [pid_m * BM, k], ready.index(s), a_bufs.index(s))
                if GATE_UP_B:  # the gate rows of W, then the up rows for the same outputs: one [2 TN, BK] tile
                    tma_load(b_desc, [pid_n * TN, k], ready.index(s), b_bufs.index(s).slice(0, TN))
                    tma_load(b2_desc, [pid_n * TN, k], ready.index(s), b_bufs.index(s).slice(TN, TN))
                elif B_KMAJOR:  # B = W.T, read from the row-major (N, K) weight and transposed in shared memory
                    tma_load(b_desc, [pid_n * TN, k], ready.index(s), b_bufs.index(s))
                else:
                    tma_load(b_desc, [k, pid_n * TN], ready.index(s), b_bufs.index(s))
                i += 1

    @gluon.jit
    def _stage_dh(stage_bufs, at, gate, gate_grad, up, up_in, dtype: gl.constexpr, UP_ACTIVATION: gl.constexpr,
                  GATE_UP_B: gl.constexpr):
        """dh/dz of one part into stage_bufs[at] (gated: dh/dgate = up · gate', dh/dup = gate · up', into at, at + 1)."""
        if GATE_UP_B:
            stage_bufs.index(at).store((up * gate_grad).to(dtype))
            stage_bufs.index(at + 1).store((gate * activation_grad(up_in, UP_ACTIVATION)).to(dtype))
        else:
            stage_bufs.index(at).store(gate_grad.to(dtype))

    @gluon.jit
    def _bias_row(bias_ptr, off_n, N, BN: gl.constexpr, TN: gl.constexpr, layout: gl.constexpr, EVEN: gl.constexpr):
        """The bias of a tile's BN accumulator columns. Gated: column c is output off_n + c % TN of the gate (c < TN)
        or the up half (N further)."""
        c = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        cols = off_n + c % TN
        if EVEN:
            return gl.load(bias_ptr + cols + (c // TN) * N)
        return gl.load(bias_ptr + cols + (c // TN) * N, mask=cols < N, other=0.0)

    @gluon.jit
    def _act_epilogue(acc, off_m, off_n, M, N, bias, partial_ptr, out_desc, out2_desc, aux_desc, aux2_desc,
                      stage_bufs, base, q_bufs, qt_bufs, q_base, scale, row_amax, ACTIVATION: gl.constexpr,
                      UP_ACTIVATION: gl.constexpr, GATE_UP_B: gl.constexpr, HAS_BIAS: gl.constexpr,
                      SAVE: gl.constexpr, FP8_OUT: gl.constexpr, LSE: gl.constexpr, EVEN: gl.constexpr):
        """out = act(acc + bias) (bias: _bias_row's, if HAS_BIAS) and, if SAVE, dh/dz (see linear_act.py) for one
        tile, through TMA stores of [BM, PART] parts. Gated: acc's columns are [gate | up] for the tile's TN output columns.
        FP8_OUT: out quantized, staged in q_bufs[q_base:], and its transpose through qt_bufs to out2_desc (rows
        M..Mp of it zeros); the staging tiles hold only dh/dz (always saved). LSE (the "lse" epilogue: identity, no
        bias): also each row's log-sum-exp over the tile's columns into partial_ptr (_row_lse). Returns row_amax,
        each row's amax so far (rows past M: 0) with this tile's folded in."""
        BM: gl.constexpr = acc.shape[0]
        BN: gl.constexpr = acc.shape[1]
        TN: gl.constexpr = BN // 2 if GATE_UP_B else BN
        PART: gl.constexpr = out_desc.block_type.shape[1]
        # staging buffers of one part: [h,] dh/dz or dh/dgate[, dh/dup]; AUX: where dh/dz or dh/dgate is
        PER_PART: gl.constexpr = (2 if FP8_OUT else 3) if GATE_UP_B else 2
        AUX: gl.constexpr = 0 if FP8_OUT and GATE_UP_B else 1
        # The gated FP8 forward stages dh/dgate and dh/dup before h is quantized: up and gate' then die first and ptxas
        # spills nothing (36 bytes the other way round, 1.5 µs slower); the GELU forward was 1 µs slower in that order
        # and keeps its own (git log -- lab/results/fp8_round23.txt).
        DH_FIRST: gl.constexpr = FP8_OUT and GATE_UP_B
        STORES: gl.constexpr = (2 + PER_PART - AUX) if FP8_OUT else 1 + (PER_PART - 1) * SAVE  # one part's TMA stores
        if HAS_BIAS:
            acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
        # A part's worth of columns at a time (a split within each thread's registers): the activation
        # math on more of the fp32 tile at once spills.
        if GATE_UP_B:
            z, z_up = split_columns(acc, BM, BN)
            gates = split_columns(z, BM, TN)
            ups = split_columns(z_up, BM, TN)
        else:
            gates = _column_quarters(acc)
            ups = gates
        if FP8_OUT and HAS_BIAS and not EVEN:
            rows_ok = gl.expand_dims(off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, gates[0].type.layout)) < M, 1)
        for p in gl.static_range(TN // PART):
            # parts alternate between two sets of staging buffers: the stores of the part before this
            # one may still be reading the other set, those of two parts ago must have left this one
            bufs = base + (p % 2) * PER_PART
            tma.store_wait(STORES)
            if ACTIVATION == "gelu":
                gate, gate_grad = gelu_and_grad_16bit(gates[p])
            elif ACTIVATION == "silu":
                gate, gate_grad = silu_and_grad(gates[p])
            else:
                gate = activation(gates[p], ACTIVATION)
                gate_grad = activation_grad(gates[p], ACTIVATION)
            col = off_n + p * PART
            if GATE_UP_B:
                up = activation(ups[p], UP_ACTIVATION)
                h = gate * up
            else:
                h = gate
                up = gate  # (no up half: _stage_dh does not read it)
            if SAVE and DH_FIRST:
                _stage_dh(stage_bufs, bufs + AUX, gate, gate_grad, up, ups[p], aux_desc.dtype, UP_ACTIVATION, GATE_UP_B)
            if FP8_OUT:
                # Rows past M (x's rows there are TMA's zeros) hold act(bias): zeroed, for the amax and hᵀ's padding
                # (TMA clips h's stores). Without a bias they hold act(0) = 0 already, for every activation here
                # (gated: the up half's identity(0) or tanh(0) = 0), and the select is left out.
                if HAS_BIAS and not EVEN:
                    h = gl.where(rows_ok, h, 0.0)
                row_amax = gl.maximum(row_amax, gl.convert_layout(gl.max(gl.abs(h), axis=1), row_amax.type.layout))
                q = quantize(h, scale, out_desc.dtype, False)
                q_bufs.index(q_base + p % 2).store(q)
                qt_bufs.index(q_base + p % 2).store(gl.permute(q, (1, 0)))
            else:
                stage_bufs.index(bufs).store(h.to(out_desc.dtype))
            if SAVE and not DH_FIRST:
                _stage_dh(stage_bufs, bufs + AUX, gate, gate_grad, up, ups[p], aux_desc.dtype, UP_ACTIVATION, GATE_UP_B)
            fence_async_shared()  # the warps' shared-memory writes, before the copy engine reads them
            if FP8_OUT:
                tma_store(out_desc, [off_m, col], q_bufs.index(q_base + p % 2))
                tma_store(out2_desc, [col, off_m], qt_bufs.index(q_base + p % 2))
            else:
                tma_store(out_desc, [off_m, col], stage_bufs.index(bufs))
            if SAVE:
                tma_store(aux_desc, [off_m, col], stage_bufs.index(bufs + AUX))
                if GATE_UP_B:
                    tma_store(aux2_desc, [off_m, col], stage_bufs.index(bufs + AUX + 1))
        if LSE:  # after the stores are issued, so that they leave while it runs
            _row_lse(gates, off_m, off_n, M, N, partial_ptr, out_desc.dtype, TN)
        return row_amax

    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _row_lse(parts, off_m, off_n, M, N, partial_ptr, dtype: gl.constexpr, TN: gl.constexpr):
        """Each row's log-sum-exp over the tile's columns (its parts, fp32), of the values as stored in dtype, into
        partial_ptr[row, tile column] (rows below M; columns past N count as -inf): every part's row max (NaN
        propagating), then every part's sum of exponentials (independent of each other, so their latencies overlap;
        one pass with a running max was as slow and two passes with a compare per element slower:
        lab/classifier/lse_gemm_probe.py), then the classifier's rule once a row: NaN if a value was NaN, ±inf if
        the max was. The row kernel later reduces a row's partials by the same rule."""
        BM: gl.constexpr = parts[0].shape[0]
        PART_: gl.constexpr = parts[0].shape[1]
        P: gl.constexpr = TN // PART_
        LOG2E: gl.constexpr = 1.4426950408889634
        rows_layout: gl.constexpr = gl.SliceLayout(1, parts[0].type.layout)
        cols = gl.arange(0, PART_, layout=gl.SliceLayout(0, parts[0].type.layout))
        m = gl.full([BM], float("-inf"), gl.float32, rows_layout)
        for p in gl.static_range(P):
            x = gl.where(gl.expand_dims(off_n + p * PART_ + cols < N, 0), parts[p].to(dtype).to(gl.float32),
                         float("-inf"))
            m = gl.maximum(m, gl.reduce(x, 1, _max_nan), propagate_nan=tl.PropagateNan.ALL)
        finite = (m > float("-inf")) & (m < float("inf"))  # (NaN is neither)
        shift = gl.expand_dims(gl.where(finite, m, 0.0), 1)
        s = gl.zeros([BM], gl.float32, rows_layout)
        for p in gl.static_range(P):
            x = gl.where(gl.expand_dims(off_n + p * PART_ + cols < N, 0), parts[p].to(dtype).to(gl.float32),
                         float("-inf"))
            s = s + gl.sum(gl.exp2((x - shift) * LOG2E), axis=1)  # (not x·log2e - m·log2e: m·log2e overflows
            # for a finite bf16 max above 2.4e38)
        lse = gl.where(finite, m + gl.log(s), m)
        rows = off_m + gl.arange(0, BM, layout=rows_layout)
        gl.store(partial_ptr + rows * gl.cdiv(N, TN) + off_n // TN, lse, mask=rows < M)

    @gluon.jit
    def _mul_epilogue(acc, off_m, off_n, pid_m, N, partial_ptr, out_desc, out2_desc, stage_bufs, base, q_bufs, qt_bufs,
                      q_base, scale, row_amax, GATED: gl.constexpr, HAS_BIAS: gl.constexpr,
                      FP8_OUT: gl.constexpr):
        """grad = acc * saved for one tile, the saved parts already in stage_bufs[base:] (gated: the
        dh/dgate parts, then the dh/dup parts), written back there and stored; with HAS_BIAS each
        column's sum over the tile's rows to row pid_m of the bias-gradient partials. FP8_OUT: grad quantized
        part by part to out_desc and, transposed, out2_desc (both over the whole [gate | up] width when gated),
        its rows' amax folded into row_amax, which is returned (rows past M are zeros: grad_y's are); staged through
        q_bufs / qt_bufs (two of each per consumer, alternating), or, gated, in the spent saved tile itself (its 8 KB
        hold the part's 4 KB q and 4 KB qᵀ: the gated kernel has no shared memory left for more)."""
        PART: gl.constexpr = out_desc.block_type.shape[1]
        HALVES: gl.constexpr = 2 if GATED else 1
        parts = _column_quarters(acc)
        if FP8_OUT:
            for half in gl.static_range(HALVES):
                for p in gl.static_range(4):
                    buf = stage_bufs.index(base + 4 * half + p)
                    grad = parts[p] * buf.load(parts[p].type.layout).to(gl.float32)
                    if HAS_BIAS:
                        offs = off_n + p * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, grad.type.layout))
                        gl.store(partial_ptr + pid_m * HALVES * N + half * N + offs, gl.sum(grad, axis=0), mask=offs < N)
                    row_amax = gl.maximum(row_amax,
                                          gl.convert_layout(gl.max(gl.abs(grad), axis=1), row_amax.type.layout))
                    q = quantize(grad, scale, out_desc.dtype, False)
                    if GATED:
                        q_buf = buf.reinterpret(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout).index(0)
                        qt_buf = buf.reinterpret(out2_desc.dtype, [2] + out2_desc.block_type.shape,
                                                 out2_desc.layout).index(1)
                    else:
                        tma.store_wait(2)  # (the part before this one's two stores may still read the other buffers)
                        q_buf = q_bufs.index(q_base + p % 2)
                        qt_buf = qt_bufs.index(q_base + p % 2)
                    q_buf.store(q)
                    qt_buf.store(gl.permute(q, (1, 0)))
                    fence_async_shared()
                    col = half * N + off_n + p * PART
                    tma_store(out_desc, [off_m, col], q_buf)
                    tma_store(out2_desc, [col, off_m], qt_buf)
        else:
            for half in gl.static_range(HALVES):
                for p in gl.static_range(4):
                    buf = stage_bufs.index(base + 4 * half + p)
                    grad = parts[p] * buf.load(parts[p].type.layout).to(gl.float32)
                    buf.store(grad.to(out_desc.dtype))
                    if HAS_BIAS:  # rows past M were loaded as zeros
                        offs = off_n + p * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, grad.type.layout))
                        gl.store(partial_ptr + pid_m * HALVES * N + half * N + offs, gl.sum(grad, axis=0), mask=offs < N)
            fence_async_shared()
            for p in gl.static_range(4):
                tma_store(out_desc, [off_m, off_n + p * PART], stage_bufs.index(base + p))
                if GATED:
                    tma_store(out2_desc, [off_m, off_n + p * PART], stage_bufs.index(base + 4 + p))
        return row_amax

    @gluon.jit
    def _consumer(a_desc, b_desc, out_desc, out2_desc, aux_desc, aux2_desc, a_bufs, b_bufs, stage_bufs, q_bufs,
                  qt_bufs, ready, empty, aux_bar, turn, bias_ptr, partial_ptr, scale_ptr, amax_ptr, a_inv_ptr, b_inv_ptr,
                  M, N, K, WHO: gl.constexpr, B_KMAJOR: gl.constexpr, EPILOGUE: gl.constexpr,
                  ACTIVATION: gl.constexpr, UP_ACTIVATION: gl.constexpr, GATED: gl.constexpr,
                  GATE_UP_B: gl.constexpr, HAS_BIAS: gl.constexpr, SAVE: gl.constexpr, FP8_OUT: gl.constexpr,
                  FP8_IN: gl.constexpr, GROUP: gl.constexpr, WARPS: gl.constexpr, EVEN: gl.constexpr):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        TN: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]  # output columns per tile
        BN: gl.constexpr = 2 * TN if GATE_UP_B else TN  # the MMA's width
        PART: gl.constexpr = out_desc.block_type.shape[1]
        S: gl.constexpr = a_bufs.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BN, 32 if FP8_IN else 16])
        base = WHO * (stage_bufs.type.shape[0] // 2)  # this consumer's half of the staging buffers
        bar = aux_bar.index(WHO)
        k_steps = gl.cdiv(K, BK)
        i = 0  # ring position of this tile's first K slice (both consumers walk the whole ring)
        t = 0  # this program's tile count
        # FP8_OUT: the amax of each of the tile rows' outputs over all tiles so far (each row's 4 lanes reduce their
        # part; one thread holds 2 rows), reduced across the warps and folded into amax_ptr once, after the last tile:
        # a reduction across warps goes through shared memory and barriers that stall all 8 warps, so not at every
        # part or tile (git log -- lab/fp8/round22_probe.py). A maximum does not depend on the order it is taken in.
        row_amax = gl.zeros([BM], gl.float32, gl.SliceLayout(1, acc_layout))
        # The scalars every tile uses, loaded once: a global load at each tile's epilogue stalls it until the value
        # comes back from L1 or L2 (Nsight Compute's stall reasons; git log -- lab/results/fp8_round23.txt).
        scale = 1.0
        if FP8_OUT:
            scale = gl.load(scale_ptr)
        if FP8_IN:
            ab_inv = gl.load(a_inv_ptr) * gl.load(b_inv_ptr)
        for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, TN), gl.num_programs(0)):
            if t % 2 == WHO:
                pid_m, pid_n = tile_ids(tile, M, N, BM, TN, GROUP)
                off_m = pid_m * BM
                off_n = pid_n * TN
                bias = 0.0
                if HAS_BIAS and EPILOGUE == "act":  # loaded before the MMAs: at the epilogue, its latency stalled it
                    bias = _bias_row(bias_ptr, off_n, N, BN, TN, acc_layout, EVEN)
                if EPILOGUE == "mul":  # fetch the saved tile(s) now; they land while the MMAs run
                    if GATED or not FP8_OUT:  # (the last tile's stores leave from these buffers, but FP8_OUT's
                        tma.store_wait(0)     # from q_bufs where not gated)
                    mbarrier.expect(bar, (2 if GATED else 1) * (TN // PART) * aux_desc.block_type.nbytes)
                    for p in gl.static_range(TN // PART):
                        tma_load(aux_desc, [off_m, off_n + p * PART], bar, stage_bufs.index(base + p))
                        if GATED:
                            tma_load(aux2_desc, [off_m, off_n + p * PART], bar, stage_bufs.index(base + 4 + p))
                # Take the main-loop turn from the other consumer (it arrives once it has waited for its
                # last K slice). Barrier waits compare only a phase's parity, so a consumer that ran more
                # than one ring pass ahead of the loader would take an old slice for a new one.
                j = t // 2
                mbarrier.wait(turn.index(WHO), (j + 1 - WHO) & 1, pred=j + WHO > 0)
                acc = gl.zeros([BM, BN], gl.float32, acc_layout)
                for kk in range(k_steps):
                    s = (i + kk) % S
                    mbarrier.wait(ready.index(s), ((i + kk) // S) & 1)
                    b = b_bufs.index(s)
                    if B_KMAJOR:
                        b = b.permute((1, 0))
                    acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                    # keep one MMA in flight; the one before it is done, so its slot can be refilled
                    acc = warpgroup_mma_wait(1, deps=(acc, ))
                    mbarrier.arrive(empty.index((i + kk + S - 1) % S), pred=kk > 0)
                mbarrier.arrive(turn.index(1 - WHO))
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(empty.index((i + k_steps - 1) % S))
                if FP8_IN:  # the product of two quantized operands, times their 1/scales: the GEMM's value
                    acc = acc * ab_inv

                if EPILOGUE == "act" or EPILOGUE == "lse":
                    row_amax = _act_epilogue(acc, off_m, off_n, M, N, bias, partial_ptr, out_desc, out2_desc,
                                             aux_desc, aux2_desc, stage_bufs, base, q_bufs, qt_bufs, 2 * WHO, scale,
                                             row_amax, ACTIVATION, UP_ACTIVATION, GATE_UP_B, HAS_BIAS, SAVE, FP8_OUT,
                                             EPILOGUE == "lse", EVEN)
                else:
                    mbarrier.wait(bar, j & 1)
                    row_amax = _mul_epilogue(acc, off_m, off_n, pid_m, N, partial_ptr, out_desc, out2_desc, stage_bufs,
                                             base, q_bufs, qt_bufs, 2 * WHO, scale, row_amax, GATED, HAS_BIAS,
                                             FP8_OUT)
            i += k_steps
            t += 1
        if FP8_OUT:
            gl.atomic_max(amax_ptr, gl.max(row_amax, axis=0), sem="relaxed")
        tma.store_wait(0)

    @gluon.jit
    def pingpong_kernel(a_desc, b_desc, b2_desc, out_desc, out2_desc, aux_desc, aux2_desc, bias_ptr, partial_ptr,
                        scale_ptr, amax_ptr, a_inv_ptr, b_inv_ptr, M, N, K, B_KMAJOR: gl.constexpr,
                        EPILOGUE: gl.constexpr, ACTIVATION: gl.constexpr, UP_ACTIVATION: gl.constexpr,
                        GATED: gl.constexpr, HAS_BIAS: gl.constexpr, SAVE: gl.constexpr, STAGES: gl.constexpr,
                        STAGING: gl.constexpr, FP8_OUT: gl.constexpr, FP8_IN: gl.constexpr,
                        CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, EVEN: gl.constexpr):
        # The gated forward's B tile holds the gate rows and the up rows of W for the same output columns.
        GATE_UP_B: gl.constexpr = GATED and EPILOGUE == "act"
        GROUP: gl.constexpr = LOGITS_GROUP_M_ if EPILOGUE == "lse" else GROUP_M_
        b_shape: gl.constexpr = [b_desc.block_type.shape[0] * (2 if GATE_UP_B else 1), b_desc.block_type.shape[1]]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_shape, b_desc.layout)
        if FP8_OUT:  # the 16-bit staging tiles hold dh/dz (forward) or the saved parts (dgrad); the FP8 parts and
            # their transposes get two small tiles of each per consumer (but in the gated dgrad, the saved parts')
            stage_bufs = gl.allocate_shared_memory(aux_desc.dtype, [STAGING] + aux_desc.block_type.shape,
                                                   aux_desc.layout)
            if GATED and EPILOGUE == "mul":
                q_bufs = stage_bufs
                qt_bufs = stage_bufs
            else:
                q_bufs = gl.allocate_shared_memory(out_desc.dtype, [4] + out_desc.block_type.shape, out_desc.layout)
                qt_bufs = gl.allocate_shared_memory(out2_desc.dtype, [4] + out2_desc.block_type.shape,
                                                    out2_desc.layout)
        else:
            stage_bufs = gl.allocate_shared_memory(out_desc.dtype, [STAGING] + out_desc.block_type.shape,
                                                   out_desc.layout)
            q_bufs = stage_bufs
            qt_bufs = stage_bufs
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        aux_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for w in gl.static_range(2):
            mbarrier.init(aux_bar.index(w), count=1)
            mbarrier.init(turn.index(w), count=1)
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, out_desc, out2_desc, aux_desc, aux2_desc, a_bufs, b_bufs, stage_bufs,
                         q_bufs, qt_bufs, ready, empty, aux_bar, turn, bias_ptr, partial_ptr, scale_ptr, amax_ptr,
                         a_inv_ptr, b_inv_ptr, M, N, K, 0, B_KMAJOR, EPILOGUE, ACTIVATION, UP_ACTIVATION, GATED,
                         GATE_UP_B, HAS_BIAS, SAVE, FP8_OUT, FP8_IN, GROUP, CONSUMER_WARPS, EVEN)),
            (_consumer, (a_desc, b_desc, out_desc, out2_desc, aux_desc, aux2_desc, a_bufs, b_bufs, stage_bufs,
                         q_bufs, qt_bufs, ready, empty, aux_bar, turn, bias_ptr, partial_ptr, scale_ptr, amax_ptr,
                         a_inv_ptr, b_inv_ptr, M, N, K, 1, B_KMAJOR, EPILOGUE, ACTIVATION, UP_ACTIVATION, GATED,
                         GATE_UP_B, HAS_BIAS, SAVE, FP8_OUT, FP8_IN, GROUP, CONSUMER_WARPS, EVEN)),
            (_loader, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_KMAJOR, GATE_UP_B, GROUP)),
        ], (CONSUMER_WARPS, 1), (CONSUMER_REGS, LOADER_REGS_))


# The gated dgrad has only 3 ring slots (both saved halves are prefetched into shared memory, see
# SHARED_MEMORY_PLAN) and reduces the bias gradient over 8 parts. On an H100 the Triton dgrad beats it once K
# (the model width) passes 768, or whenever the bias gradient is asked for (lab/results/pingpong_h100.txt in git), so
# the gated dgrad runs here only below that. The plain dgrad is as fast as the Triton one or faster at every
# width measured.
GATED_DGRAD_MAX_K = 768


def takes_dgrad(gated, K, bias_grad):
    """Whether the dgrad should run here rather than in the Triton kernel, where usable() allows both."""
    return not gated or (K <= GATED_DGRAD_MAX_K and not bias_grad)


SIXTEEN_BIT = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def usable(a, matrices, vectors=(), split=None):
    """Whether the ping-pong kernel can run out = epilogue(a @ B) for these operands (else the Triton
    kernels do): a Hopper GPU with the TMA paths on (FUSED_OPS_TMA), all matrices TMA-readable, contiguous
    vectors (bias) on the same device, and the dtypes: one 16-bit dtype for a and every matrix; or FP8 inputs
    (the FP8 MLP), a and the first matrix (B, passed K-major) in e4m3 or e5m2 and the rest (saved tensors) 16-bit.
    split: a gated op's column count N, where its [gate | up] matrices are cut in two (each half's start
    16-byte aligned)."""
    fp8_in = a.dtype in FP8_DTYPES
    if not (AVAILABLE and env.PINGPONG and (a.dtype in SIXTEEN_BIT or fp8_in) and a.is_cuda):
        return False
    device = a.device
    if not (matmul.tma_available(device) and matmul._capability(device.index)[0] == 9):
        return False
    for i, m in enumerate((a, *matrices)):
        dtypes = (FP8_DTYPES if i < 2 else SIXTEEN_BIT) if fp8_in else (a.dtype,)
        if m is not None and (m.dtype not in dtypes or not matmul._tma_readable(m, dtypes)):
            return False
    for v in vectors:
        if v is not None and not (v.is_contiguous() and v.device == device):
            return False
    return split is None or split * 2 % 16 == 0  # (the split halves are 16-bit: outputs, or saved tensors)


@functools.lru_cache(maxsize=None)
def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv",
              torch.float8_e5m2: "float8e5"}


@functools.lru_cache(maxsize=None)
def _shared_layout(rows, cols, dtype):
    """The swizzled shared-memory layout of a [rows, cols] tile (asked once: it sits on every launch's path)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, _GL_DTYPES[dtype]))


class _Address:
    """A cached descriptor's base in place of its tensor, so that the cache keeps no activation alive: the
    launcher reads only its data_ptr(); the descriptor's checks and the JIT's type string read its dtype."""
    __slots__ = ("address", "dtype")

    def __init__(self, t):
        self.address, self.dtype = t.data_ptr(), t.dtype

    def data_ptr(self):
        return self.address


_descriptors = {}  # (address, shape, strides, dtype, block) -> descriptor; see _descriptor
MAX_DESCRIPTORS = 4096  # more than a training step's distinct ones; the cache is emptied when it fills up


def _descriptor(t, block):
    """A host-side TMA descriptor of the 2-D tensor t in `block` tiles. It is a function of t's address,
    shape, strides and dtype only, so one made earlier for a tensor at the same address and layout is the
    same descriptor: a training step allocates its activations at the same addresses as the step before.
    The cache saves building and checking the Python object. Triton's launcher still encodes each
    descriptor it is passed at every launch (a measurable host cost: docs/performance.md), which is why the
    kernel is passed None for the ones it does not use."""
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, block)
    desc = _descriptors.get(key)
    if desc is None:
        if len(_descriptors) >= MAX_DESCRIPTORS:
            _descriptors.clear()
        desc = _descriptors[key] = GluonDescriptor(_Address(t), list(t.shape), list(t.stride()), list(block),
                                                   _shared_layout(*block, t.dtype))
    return desc


@functools.lru_cache(maxsize=None)
def _blocks_and_consts(b_kmajor, EPILOGUE, ACTIVATION, UP_ACTIVATION, GATED, HAS_BIAS, SAVE, FP8_OUT=False,
                       FP8_IN=False, EVEN=False):
    """(block of each descriptor in the kernel's order, output columns per tile, all the constexprs) of a
    variant: fixed per variant, so worked out once. FP8 operands take K slices twice as long (128 bytes a
    row, as 16-bit ones: the same ring slots). EVEN: M and N are whole tiles (see _launch)."""
    gate_up_b = GATED and EPILOGUE == "act"
    tn = BLOCK_N // 2 if gate_up_b else BLOCK_N
    bk = 2 * BLOCK_K if FP8_IN else BLOCK_K
    b_block = (tn, bk) if b_kmajor else (bk, tn)
    part = (BLOCK_M, PART)
    stages, staging = (FP8_SHARED_MEMORY_PLAN.get((EPILOGUE, GATED)) if FP8_OUT else None) or \
        SHARED_MEMORY_PLAN[EPILOGUE, GATED]
    out2 = (PART, BLOCK_M) if FP8_OUT else part  # (FP8_OUT: out2 is outᵀ)
    warps = DGRAD_CONSUMER_WARPS if EPILOGUE == "mul" and not GATED else CONSUMER_WARPS  # (the gated dgrad: not tried)
    consts = types.MappingProxyType(dict(  # read-only: every launch of the variant shares it
        B_KMAJOR=b_kmajor, EPILOGUE=EPILOGUE, ACTIVATION=ACTIVATION, UP_ACTIVATION=UP_ACTIVATION, GATED=GATED,
        HAS_BIAS=HAS_BIAS, SAVE=SAVE, STAGES=stages, STAGING=staging, FP8_OUT=FP8_OUT, FP8_IN=FP8_IN,
        CONSUMER_WARPS=warps, CONSUMER_REGS=registers(warps)[1], EVEN=EVEN))
    return ((BLOCK_M, bk), b_block, b_block, part, out2, part, part), tn, consts


_compiled = {}  # (dtype, constexprs, which descriptors are None, specialization) -> compiled kernel (see _run)


def _launch(a, b, out, aux, bias, partial, b_kmajor, b2=None, out2=None, aux2=None, scale=None, amax=None, inv=None,
            n=None, **consts):
    """out = epilogue(a @ B) with B = b.T (b_kmajor) or b. Gated, the second half of each pair (b2: the up
    rows of W, out2 / aux2: the up half of grad / saved) is its own tensor, a view cut at N. What a variant
    does not read or write is None (aux when the forward saves nothing, the halves when not gated): fewer
    descriptors for the launcher to encode. inv: (a's 1/scale, b's 1/scale) where a and b are FP8. n: the GEMM's N
    where out is wider (the gated FP8 dgrad's, both halves)."""
    M, K = a.shape
    N = n or out.shape[1]
    # Whole tiles (the usual case: M = batch · context): the forward's epilogue then masks neither the bias load nor
    # the rows past M: 8% fewer instructions in the FP8 forward, and its spills gone
    # (results/glue/epilogue_steps_h100.txt).
    even = M % BLOCK_M == 0 and N % BLOCK_N == 0
    blocks, tn, consts = _blocks_and_consts(b_kmajor, **consts, FP8_IN=inv is not None, EVEN=even)
    descs = [None if t is None else _descriptor(t, block) for t, block in zip((a, b, b2, out, out2, aux, aux2), blocks)]
    a_inv, b_inv = inv or (None, None)
    _run((*descs, bias, partial, scale, amax, a_inv, b_inv, M, N, K), consts, cdiv(M, BLOCK_M) * cdiv(N, tn), a.device)


def _run(args, consts, tiles, device):
    """Launch on min(tiles, SMs) persistent programs, compiling on the first call of a specialization."""
    grid = (min(tiles, _num_sms(device)), 1, 1)
    # descriptors are typed by their dtype (or None) and block (fixed by the constexprs); the rest as Triton
    # specializes them
    key = (tuple(consts.values()), tuple(None if d is None else d.base.dtype for d in args[:7]), _specialization(args[7:]))
    compiled = _compiled.get(key)
    if compiled is not None:
        compiled[grid](*args, *consts.values())
    else:
        warps = consts["CONSUMER_WARPS"]
        _compiled[key] = pingpong_kernel[grid](*args, **consts, num_warps=warps, maxnreg=registers(warps)[0])


FAILURE = None  # the exception that turned the ping-pong kernel off for this process, if one did
LOGITS_FAILURE = None  # the one that turned off its logits GEMM only (logits_lse), if one did


def _fails(error):
    """Turn the kernel off for the rest of the process, with one warning: a Gluon that moved (its API is
    experimental) or a GPU the kernel does not fit must cost speed, never a training run. (What the host
    sees: compile and launch errors. A fault inside a running kernel is not recoverable this way.)"""
    global FAILURE
    FAILURE = error
    warnings.warn(f"the Hopper ping-pong kernel failed ({type(error).__name__}: {error}); the portable kernels "
                  f"(Triton's, cuBLAS's) run instead for the rest of this process (FUSED_OPS_PINGPONG=0 skips it)",
                  FallbackWarning, stacklevel=3)


def linear_act_forward(x, weight, bias, activation, up_activation, gated, save, out, saved, inv=None):
    """out = act(x @ weight.T + bias) and, if save, saved = dh/dz (see linear_act.py), for 2-D x.
    Gated: weight (2N, K) = [gate; up], bias (2N,), saved (M, 2N) = [dh/dgate | dh/dup].
    inv: (x's 1/scale, weight's 1/scale) where x and weight are FP8 (the FP8 MLP's gated forward).
    Returns False if the kernel failed, now or earlier in this process (see _fails): the caller then runs
    the Triton kernel, which writes every output."""
    if FAILURE is not None:
        return False
    consts = dict(EPILOGUE="act", ACTIVATION=activation, UP_ACTIVATION=up_activation, GATED=gated,
                  HAS_BIAS=bias is not None, SAVE=save)
    try:
        if gated:
            N = out.shape[1]
            _launch(x, weight[:N], out, saved[:, :N] if save else None, bias, None, True, b2=weight[N:],
                    aux2=saved[:, N:] if save else None, inv=inv, **consts)
        else:
            _launch(x, weight, out, saved if save else None, bias, None, True, inv=inv, **consts)
    except Exception as e:  # compiling or launching: see _fails
        _fails(e)
        return False
    return True


def logits_lse(x, weight, out, inv=None):
    """The classifier's logits GEMM (../classifier.py): out = x @ weight.T for x (M, K) and weight (V, K), 16-bit, or
    FP8 with inv = (x's 1/scale, weight's 1/scale), out 16-bit; returns each row's log-sum-exp of the stored logits
    over each BLOCK_N of their columns, (M, cdiv(V, BLOCK_N)) in fp32; or None if the kernel failed (now, or earlier
    in this process: one FallbackWarning, and only this variant is turned off)."""
    global LOGITS_FAILURE
    if FAILURE is not None or LOGITS_FAILURE is not None:
        return None
    partial = torch.empty((x.shape[0], cdiv(out.shape[1], BLOCK_N)), device=out.device, dtype=torch.float32)
    try:
        _launch(x, weight, out, None, None, partial, True, inv=inv, EPILOGUE="lse", ACTIVATION="identity",
                UP_ACTIVATION="identity", GATED=False, HAS_BIAS=False, SAVE=False)
    except Exception as e:  # this variant only: the MLP's kernels keep running
        LOGITS_FAILURE = e
        warnings.warn(f"the Hopper ping-pong kernel's logits GEMM failed ({type(e).__name__}: {e}); the classifier "
                      "runs cuBLAS's GEMM instead for the rest of this process", FallbackWarning, stacklevel=3)
        return None
    return partial


def dgrad(grad_y, w2, saved, out, gated, bias_grad, inv=None):
    """out = (grad_y @ w2) * saved (see dgrad.py). Returns (True, the column sums of out in fp32 if
    bias_grad else None), or (False, None) if the kernel failed (see linear_act_forward).
    Gated: saved and out are (M, 2N) = [gate | up] halves, each multiplied by the same grad_y @ w2.
    inv: (grad_y's 1/scale, w2's 1/scale) where grad_y and w2 are FP8 (the FP8 MLP's gated dgrad); w2 is then
    passed as W2ᵀ (N, K), K-major, as FP8 operands must be."""
    if FAILURE is not None:
        return False, None
    M, N = grad_y.shape[0], (w2.shape[0] if inv else w2.shape[1])
    partial = (torch.empty((cdiv(M, BLOCK_M), out.shape[1]), device=out.device, dtype=torch.float32)
               if bias_grad else None)
    consts = dict(EPILOGUE="mul", ACTIVATION="identity", UP_ACTIVATION="identity", GATED=gated,
                  HAS_BIAS=bias_grad, SAVE=False)
    b_kmajor = inv is not None
    try:
        if gated:
            _launch(grad_y, w2, out[:, :N], saved[:, :N], None, partial, b_kmajor, out2=out[:, N:], aux2=saved[:, N:],
                    inv=inv, **consts)
        else:
            _launch(grad_y, w2, out, saved, None, partial, b_kmajor, inv=inv, **consts)
    except Exception as e:
        _fails(e)
        return False, None
    return True, (partial.sum(0) if bias_grad else None)
