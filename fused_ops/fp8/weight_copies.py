"""Every FP8 weight copy of a model in three kernel launches and a memset (model.GPT, under torch.compile).

Why. Each FP8 GEMM reads its weight as an e4m3 copy made by current scaling (state.py's quantize_weight): the
weight's amax, then W8 = fp8(W · 448/amax) and its transpose W8ᵀ (each GEMM takes its weight K-major). Inside
torch.compile every layer made its own copies at every forward, several kernels a weight; at GPT-2 small's size that
is 48 weights, most of them too small to fill an H200 on their own, and the copies took about twice their bytes'
time (results/glue/README.md: 0.59 ms a step against 0.29 at the copy rate). The bytes hardly move (each weight read
twice, for its amax and for its cast, its copies written, W8 read again for the transpose: 11 bytes a weight); what
can go is the number of launches and their tails. So here all of a model's weights go through the same three
kernels, each one launch over a table of the weights' addresses and shapes (as ../adamw.py's FusedAdamW):

    zero       amax_i = 0 for every weight i                            (a memset)
    amax       amax_i = max |W_i|, NaN counted as inf                   a program a BLOCK of a weight, an atomic max
    cast       scale_i = 448 / amax_i, correctly rounded (1 where amax_i is 0, inf or NaN; at most the largest float),
               W8_i = fp8(W_i · scale_i), a 64 x 64 tile a program; the weight's first tile writes 1/scale_i
    transpose  W8ᵀ_i from W8_i, a tile a program, exactly (kernels.transpose_fp8's way)

which is quantize_weight bit for bit (tests/test_fp8_weight_copies.py): the same amax, the same correctly rounded
divisions, the same cast (../casts.py's quantize: saturating, ±inf and NaN to NaN). The transpose is a pass of its
own, from the FP8 copy, because a tile loaded in fp32 and stored transposed came out wrong on an H200 with Triton 3.6
(half the elements; kernels.py's cast_transpose_kernel found the same), as quantize_weight_fused does it.

The outputs are three tensors for all weights (the operator fused_mlp::fp8_weight_copies returns them, so that
torch.compile sees one node): every W8 end to end in one, every W8ᵀ in another, the 1/scales one 16-byte row a weight
(cuBLAS reads a scale only from a 16-byte aligned address); fp8_weight_copies hands back each weight's views.
"""

import contextlib
import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import env
from ..casts import quantize, to_fp16
from ..ops import fused_op
from ..tuning import LaunchPlan
from .kernels import E4M3, FLOAT32_MAX, FP8_MAX, quantize_weight_fused

W_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
AMAX_BLOCK = 4096  # elements an amax program reads (4 warps: 32 a thread)
TILE = 64  # a cast program's tile, TILE x TILE: the row-major cast's tile of kernels.CAST_TILE
# The kernels take n, the number of weights, unspecialized: the precompile child's one block has 4, GPT-2's 12
# blocks 48, a multiple of 16 that Triton would compile again for (model.compile_kernels).


@triton.jit(do_not_specialize=["n"])
def weight_amax_kernel(table_ptr, block_weight_ptr, block_index_ptr, amax_ptr, n, W_DTYPE: tl.constexpr,
                       BLOCK: tl.constexpr):
    """amax_ptr[i] = max(amax_ptr[i], max |W_i| over this program's block), NaN counted as inf."""
    program = tl.program_id(0)
    i = tl.load(block_weight_ptr + program)
    w_ptr = tl.multiple_of(tl.load(table_ptr + i).to(tl.pointer_type(W_DTYPE)), 16)
    numel = tl.load(table_ptr + n + i) * tl.load(table_ptr + 2 * n + i)
    offs = tl.load(block_index_ptr + program) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    a = tl.where(w == w, tl.abs(w), float("inf"))  # (NaN: either makes the scale 1, as in quantize_weight)
    tl.atomic_max(amax_ptr + i, tl.max(a, axis=0), sem="relaxed")


@triton.jit
def _tile(table_ptr, tile_weight_ptr, tile_index_ptr, n, TILE: tl.constexpr):
    """This program's tile: (its weight i, the tile's index in it, the weight's N and K, its copies' offset, the
    tile's rows and columns)."""
    program = tl.program_id(0)
    i = tl.load(tile_weight_ptr + program)
    tile = tl.load(tile_index_ptr + program)
    N = tl.load(table_ptr + n + i).to(tl.int32)
    K = tl.multiple_of(tl.load(table_ptr + 2 * n + i).to(tl.int32), 16)
    offset = tl.multiple_of(tl.load(table_ptr + 3 * n + i), 16)
    tiles_k = tl.cdiv(K, TILE)
    offs_n = (tile // tiles_k) * TILE + tl.arange(0, TILE)
    offs_k = (tile % tiles_k) * TILE + tl.arange(0, TILE)
    return i, tile, N, K, offset, offs_n, offs_k


@triton.jit(do_not_specialize=["n"])
def weight_cast_kernel(table_ptr, tile_weight_ptr, tile_index_ptr, amax_ptr, q_ptr, inv_ptr, n, W_DTYPE: tl.constexpr,
                       FP8_MAX: tl.constexpr, EMULATE: tl.constexpr, TILE: tl.constexpr):
    """One TILE x TILE tile of W_i (N, K) into W8_i (row-major, at its offset in q_ptr), with the weight's current
    scale; its first tile also writes 1/scale into inv_ptr's row i."""
    i, tile, N, K, offset, offs_n, offs_k = _tile(table_ptr, tile_weight_ptr, tile_index_ptr, n, TILE)
    w_ptr = tl.multiple_of(tl.load(table_ptr + i).to(tl.pointer_type(W_DTYPE)), 16)
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n < N)[:, None] & (offs_k < K)[None, :],
                other=0.0).to(tl.float32)
    amax = tl.load(amax_ptr + i)
    usable = (amax > 0.0) & (amax < float("inf"))  # (NaN compares false)
    # correctly rounded divisions, as quantize_weight's (Triton's `/` on fp32 is approximate on a GPU)
    scale = tl.where(usable, tl.math.div_rn(tl.full((), FP8_MAX, tl.float32), tl.where(usable, amax, 1.0)), 1.0)
    scale = tl.minimum(scale, FLOAT32_MAX)  # (as weight_scale_kernel)
    tl.store(q_ptr + offset + offs_n[:, None] * K + offs_k[None, :],
             quantize(w, scale, q_ptr.dtype.element_ty, EMULATE), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])
    if tile == 0:
        tl.store(inv_ptr + 4 * i, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))


@triton.jit(do_not_specialize=["n"])
def weight_transpose_kernel(table_ptr, tile_weight_ptr, tile_index_ptr, q_ptr, qt_ptr, n, EMULATE: tl.constexpr,
                            TILE: tl.constexpr):
    """One TILE x TILE tile of W8_i (N, K) into W8ᵀ_i (K, N), exactly: kernels.transpose_fp8's way, the FP8 tile
    widened, transposed and cast back at scale 1."""
    i, tile, N, K, offset, offs_n, offs_k = _tile(table_ptr, tile_weight_ptr, tile_index_ptr, n, TILE)
    q = tl.load(q_ptr + offset + offs_n[:, None] * K + offs_k[None, :],
                mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0.0)
    if EMULATE:  # (the interpreter's hand encoding would drop -0's sign: its bits are moved instead)
        qt = tl.trans(q.to(tl.uint8, bitcast=True)).to(q.dtype, bitcast=True)
    else:
        qt = quantize(tl.trans(to_fp16(q, False).to(tl.float32)), 1.0, q_ptr.dtype.element_ty, False)
    tl.store(qt_ptr + offset + offs_k[:, None] * N + offs_n[None, :], qt,
             mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])


def _on_device(tensors, device):
    """tensors copied to device outside any CUDA-graph pool. While torch.compile's CUDA graphs warm a graph up, the
    thread's allocations go to that graph's pool, and a plan kept past the warm-up would be memory the pool does not
    track (cudagraph trees refuse to record then): the copies are made by a thread of their own, once per plan."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    out = []  # (copies from pageable memory: done when .to returns)
    thread = threading.Thread(target=lambda: out.extend(t.to(device) for t in tensors))
    thread.start()
    thread.join()
    if len(out) != len(tensors):
        raise RuntimeError("fp8_weight_copies: could not copy its launch table to the GPU")
    return out


class _Plan:
    """One set of weights' launches: the device table (addresses, N, K, the copies' offsets) and, per program, which
    weight and which block or tile of it is its own. Kept per set of addresses, shapes and dtype (the parameters of
    a model stay where they are)."""

    def __init__(self, weights):
        self.device = weights[0].device
        shapes = [tuple(w.shape) for w in weights]
        numels = [N * K for N, K in shapes]
        offsets = [0]
        for m in numels[:-1]:
            offsets.append(offsets[-1] + m)  # (N and K are multiples of 16: every offset is 16-byte aligned)
        n = len(weights)
        host = torch.tensor([[w.data_ptr() for w in weights], [N for N, _ in shapes], [K for _, K in shapes], offsets],
                            dtype=torch.int64).reshape(-1)
        blocks = [triton.cdiv(m, AMAX_BLOCK) for m in numels]
        tiles = [triton.cdiv(N, TILE) * triton.cdiv(K, TILE) for N, K in shapes]
        maps = []
        for counts in (blocks, tiles):
            maps += [torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(counts)),
                     torch.cat([torch.arange(c, dtype=torch.int32) for c in counts])]
        self.table, *maps = _on_device([host, *maps], self.device)
        self.maps = [(maps[0], maps[1], len(maps[0])), (maps[2], maps[3], len(maps[2]))]
        w_dtype = W_DTYPES[weights[0].dtype]
        self.amax_plan = LaunchPlan(weight_amax_kernel, triton.Config({}, num_warps=4, num_stages=1),
                                    dict(W_DTYPE=w_dtype, BLOCK=AMAX_BLOCK))
        self.cast_plan = LaunchPlan(weight_cast_kernel, triton.Config({}, num_warps=4, num_stages=1),
                                    dict(W_DTYPE=w_dtype, FP8_MAX=FP8_MAX[E4M3], EMULATE=env.INTERPRET, TILE=TILE))
        self.transpose_plan = LaunchPlan(weight_transpose_kernel, triton.Config({}, num_warps=4, num_stages=1),
                                         dict(EMULATE=env.INTERPRET, TILE=TILE))

    def run(self, weights):
        (q, qt, inv), n = _outputs(weights), len(weights)
        amax = torch.zeros(n, device=self.device, dtype=torch.float32)
        (bw, bi, blocks), (tw, ti, tiles) = self.maps
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.amax_plan.launch_grid((blocks,), [self.table, bw, bi, amax, n])
            self.cast_plan.launch_grid((tiles,), [self.table, tw, ti, amax, q, inv, n])
            self.transpose_plan.launch_grid((tiles,), [self.table, tw, ti, q, qt, n])
        return q, qt, inv


# By the weights' addresses, shapes and dtype. Never dropped: a CUDA graph that captured a plan's launches reads its
# tables at every replay (a few hundred KB a model).
_plans = {}


def can_run(weights):
    """Whether fp8_weight_copies takes these weights: at least one; each (N, K) with N and K multiples of 16 and fewer
    than 2**31 elements (32-bit offsets), contiguous; all of one dtype (float32, bfloat16 or float16) and on one
    device, a GPU or the CPU under the interpreter. (Also asked inside torch.compile's trace: nothing here reads an
    address.)"""
    return len(weights) > 0 and all(  # (not bool(weights): torch 2.11's Dynamo cannot trace bool of a list)
        w.dim() == 2 and w.dtype == weights[0].dtype and w.dtype in W_DTYPES and w.is_contiguous()
        and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0 and w.numel() < 2**31 and w.device == weights[0].device
        and (w.is_cuda or (env.INTERPRET and w.device.type == "cpu")) for w in weights)


def _check(weights):
    """can_run's conditions, and 16-byte aligned addresses (the kernels load 16 bytes at a time), else one error."""
    if not can_run(weights) or any(w.data_ptr() % 16 for w in weights):
        found = sorted({f"{w.dtype} {tuple(w.shape)} on {w.device}" for w in weights})[:4]
        raise ValueError("fp8_weight_copies takes weights (N, K) with N and K multiples of 16, contiguous and 16-byte "
                         "aligned, all float32, all bfloat16 or all float16, on one GPU (the CPU under the "
                         f"interpreter); got {len(weights)}: {', '.join(found) or 'none'}")


@fused_op("fp8_weight_copies")
def fp8_weight_copies_op(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(every W8 end to end, every W8ᵀ end to end, the 1/scales (n, 4), each weight's in column 0)."""
    _check(weights)
    key = (weights[0].dtype, weights[0].device, *((w.data_ptr(), *w.shape) for w in weights))
    plan = _plans.get(key)
    if plan is None and weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return _one_by_one(weights)
    if plan is None:
        plan = _plans[key] = _Plan([w.detach() for w in weights])
    return plan.run(weights)


def _one_by_one(weights):
    """The same outputs, each weight through kernels.quantize_weight_fused (the same bits; no table to upload): for
    weights first seen while a CUDA graph is being captured (a graph re-recorded for moved parameters), where the
    tables cannot be copied to the GPU. The graph then replays these launches."""
    outputs = _outputs(weights)
    for w, copies in zip(weights, _views(*outputs, weights)):
        quantize_weight_fused(w, copies)
    return outputs


def _outputs(weights):
    """(every W8 end to end, every W8ᵀ end to end, the 1/scales one 16-byte row a weight), unwritten."""
    q = torch.empty(sum(w.numel() for w in weights), device=weights[0].device, dtype=E4M3)
    return q, torch.empty_like(q), torch.empty((len(weights), 4), device=q.device, dtype=torch.float32)


def _views(q, qt, inv, weights):
    """Each weight's (W8 (N, K), W8ᵀ (K, N), 1/scale (1,)) in the three outputs."""
    views, start = [], 0
    for i, w in enumerate(weights):
        (N, K), end = w.shape, start + w.numel()
        views.append((q[start:end].view(N, K), qt[start:end].view(K, N), inv[i, :1]))
        start = end
    return views


fp8_weight_copies_op.register_fake(_outputs)


def fp8_weight_copies(weights):
    """[(W8 (N, K), W8ᵀ (K, N), 1/scale (1,)) for each weight]: quantize_weight of each, bit for bit, in three
    launches for all of them (see above). weights: the masters (fp32 under autocast, or a 16-bit model's), as
    can_run says."""
    return _views(*fp8_weight_copies_op([w.detach() for w in weights]), weights)
