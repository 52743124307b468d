"""The one matmul main loop every fused kernel is built on, and its tile scheduling.

Each kernel calls `matmul_loop` for its output tile, then applies its own epilogue (bias, activation,
activation derivative, ...) while the accumulator is still in registers.
"""

import functools

import torch
import triton
import triton.language as tl

from . import env
from .casts import to_fp16
from .tuning import TensorDescriptor

EMULATE_FP8 = tl.constexpr(env.INTERPRET)  # (to_fp16)


@triton.jit
def tile_ids(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a linear tile index to an output tile, walking GROUP_M row-tiles at a time so the A rows and
    B columns that consecutive tiles read stay in L2 ("grouped ordering")."""
    pid = tile
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_m
    pid_n = (pid % tiles_per_group) // group_m
    return pid_m, pid_n


@triton.jit
def tiles(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many output tiles an (M, N) result has. A kernel walks them as
    `for tile in tl.range(tl.program_id(0), tiles(...), tl.num_programs(0))`: with one program per tile (the
    default grid) that is one trip; with a persistent grid (a config's PERSISTENT programs per SM, see
    tuning._grid_and_args) each program walks several, and the compiler can overlap one tile's epilogue with the
    next one's first loads (tl.range's flatten)."""
    return tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)


@triton.jit
def matmul_loop(a_ptr, b_ptr, off_m, off_n, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, b2_offset,
                ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TWO_B: tl.constexpr,
                INT64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                TMA: tl.constexpr = False, B_KMAJOR: tl.constexpr = False, B_PAIRS: tl.constexpr = False,
                stats_ptr=None, ln_w_ptr=None, ln_b_ptr=None, LAYERNORM: tl.constexpr = False,
                LN_WEIGHT: tl.constexpr = False, LN_BIAS: tl.constexpr = False, UPCAST: tl.constexpr = False):
    """acc = A[off_m:off_m+BLOCK_M, :] @ B[:, off_n:off_n+BLOCK_N] over the whole K, for A (M, K) and B (K, N).

    Two ways to read the operands, chosen at compile time:
    - pointers (the default): a_ptr / b_ptr with element strides, tiles loaded with masks. Takes any
      strides and dtype, and runs everywhere.
    - TMA (Hopper's tensor-memory accelerator): a_ptr / b_ptr are tensor descriptors (see tma_operands);
      the copy engine moves whole tiles into shared memory, fills out-of-bounds rows and K columns with
      zeros, and leaves the warps free to issue MMAs. B is described by a (K, N) descriptor, or with
      B_KMAJOR by the (N, K) matrix it is the transpose of (a row-major weight); strides are unused.
      On Hopper it is the faster of the two loops (results/portable/).

    With B_PAIRS (TMA, B K-major), b_ptr describes the gated weight [Wg; Wu] (2N, K) as (N / h, 2, h, K) blocks of
    h = BLOCK_N / 2 rows (pair_descriptor): one load brings rows off_n .. off_n + h of both halves, which one dot
    multiplies as a single BLOCK_N-wide B tile, so the accumulator holds the gate columns left and the up columns
    right (off_n: in the output's columns, a multiple of h).

    With TWO_B, a second accumulator gets A @ B2 where B2 starts b2_offset elements after B (with TMA:
    b2_offset columns of B further along N, i.e. rows of a K-major weight): the gated
    (GLU) kernels use it for the gate and up halves of one weight, reading each A tile once for both.
    Rows past M and columns past N are masked (not wrapped with a modulo, which would hide from the
    compiler that offs_n is contiguous and scalarize loads of a row-major B). The K tail is masked only
    when K % BLOCK_K != 0. INT64 switches to 64-bit offsets when some element offset reaches 2**31 (see needs_int64).

    With LAYERNORM (the LayerNorm fold), A is the raw input and each A tile is normalized as it is
    loaded: a = ((a - mean) - residual)·rstd·γ + β in the accumulator dtype, with the row statistics from
    stats_ptr ((3, M): means, 1/std, the means' rounding residuals; see layernorm.layernorm_stats) and γ / β from ln_w_ptr / ln_b_ptr (with
    LN_WEIGHT / LN_BIAS). Only the normalized value is rounded to B's dtype for the dot, as eager
    LayerNorm then Linear would round it: rounding the raw row first (to 16 bits, under autocast) would
    keep only the digits of its mean when the mean is large against the spread.

    FP8 operands (fp8/kernels.py's Triton kernels) go to FP8 MMAs as they are where the GPU has them (Ada, Hopper:
    fp8_mma_available; through TMA, B K-major, on Hopper). With UPCAST (elsewhere: Ampere, the interpreter) each tile
    is converted to fp16 before the dot instead: exact (every e4m3 and e5m2 value is an fp16 value), so the products
    are exact as in an FP8 MMA, through the pointer loop. Returns (acc, acc2).
    """
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if TMA:
        tl.static_assert(not LAYERNORM and not UPCAST, "the LayerNorm fold and upcast FP8 operands read through pointers")
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_ptr.load([off_m, k * BLOCK_K])
            if B_PAIRS:
                b = b_ptr.load([off_n // (BLOCK_N // 2), 0, 0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            elif B_KMAJOR:
                acc = tl.dot(a, b_ptr.load([off_n, k * BLOCK_K]).T, acc, input_precision=PRECISION)
                if TWO_B:
                    acc2 = tl.dot(a, b_ptr.load([off_n + b2_offset, k * BLOCK_K]).T, acc2, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b_ptr.load([k * BLOCK_K, off_n]), acc, input_precision=PRECISION)
                if TWO_B:
                    acc2 = tl.dot(a, b_ptr.load([k * BLOCK_K, off_n + b2_offset]), acc2, input_precision=PRECISION)
    else:
        rk = tl.arange(0, BLOCK_K)
        rows, cols = offs_m, offs_n
        if INT64:
            rows, cols = offs_m.to(tl.int64), offs_n.to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + cols[None, :] * stride_bn
        m_mask = (offs_m < M)[:, None]
        n_mask = (offs_n < N)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        if LAYERNORM:  # rows past M get mean 0 and rstd 0: zeros, like the masked rows of A
            row_mean = tl.load(stats_ptr + offs_m, mask=offs_m < M, other=0.0).to(ACC_DTYPE)[:, None]
            row_rstd = tl.load(stats_ptr + M + offs_m, mask=offs_m < M, other=0.0).to(ACC_DTYPE)[:, None]
            row_residual = tl.load(stats_ptr + 2 * M + offs_m, mask=offs_m < M, other=0.0).to(ACC_DTYPE)[:, None]
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a_mask, b_mask = m_mask, n_mask
            else:
                k_left = K - k * BLOCK_K
                a_mask, b_mask = m_mask & (rk[None, :] < k_left), n_mask & (rk[:, None] < k_left)
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            if LAYERNORM:  # columns past K need no mask: B's rows there load as zeros
                a = ((a.to(ACC_DTYPE) - row_mean) - row_residual) * row_rstd
                in_k = rk < K - k * BLOCK_K
                if LN_WEIGHT:
                    a *= tl.load(ln_w_ptr + k * BLOCK_K + rk, mask=in_k, other=0.0).to(ACC_DTYPE)[None, :]
                if LN_BIAS:
                    a += tl.load(ln_b_ptr + k * BLOCK_K + rk, mask=in_k, other=0.0).to(ACC_DTYPE)[None, :]
                a = a.to(b_ptr.dtype.element_ty)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            if UPCAST:
                a, b = to_fp16(a, EMULATE_FP8), to_fp16(b, EMULATE_FP8)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if TWO_B:
                b2 = tl.load(b_ptrs + b2_offset, mask=b_mask, other=0.0)
                acc2 = tl.dot(a, to_fp16(b2, EMULATE_FP8) if UPCAST else b2, acc2, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc, acc2


@triton.jit
def split_columns(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(left half, right half) of a (BLOCK_M, BLOCK_N) tile. Epilogues work on one half at a time: the
    activation's temporaries for half a tile fit in registers beside the accumulator, where a whole
    tile's would spill (a 128x128 GELU tile does on Hopper: docs/performance.md)."""
    return tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def column_offsets(pid_n, BLOCK_N: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """The output columns of part PART of PARTS equal slices of column tile pid_n (split_columns' halves
    are parts 0 and 1 of 2; the whole tile is part 0 of 1)."""
    return pid_n * BLOCK_N + PART * (BLOCK_N // PARTS) + tl.arange(0, BLOCK_N // PARTS)


def tma_available(device):
    """The TMA main loop needs a Hopper (or newer) GPU, or the interpreter when FUSED_OPS_TMA=1 (tests)."""
    if TensorDescriptor is None or env.TMA_MODE == "0":
        return False
    if env.INTERPRET:
        return env.TMA_MODE == "1"
    return device.type == "cuda" and _capability(device.index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index):
    """Compute capability, asked once per device (it sits on every launch's path)."""
    return torch.cuda.get_device_capability(index)


def _tma_readable(t, dtypes=(torch.float16, torch.bfloat16, torch.float32)):
    """A tensor descriptor covers a 2-D tensor with a contiguous last dim, a 16-byte aligned base and
    16-byte aligned row stride, in a dtype the tensor cores take from it (those of the kernel asking)."""
    return (t.dim() == 2 and t.dtype in dtypes and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def fp8_mma_available(device):
    """Whether tl.dot takes FP8 operands as they are, on FP8 tensor cores: Ada and Hopper GPUs (compute capability
    8.9 and up). Elsewhere (Ampere, the interpreter) the FP8 kernels widen each tile to fp16 first (UPCAST)."""
    return device.type == "cuda" and not env.INTERPRET and _capability(device.index) >= (8, 9)


def tma_operands(a, b_kn, dtypes=(torch.float16, torch.bfloat16, torch.float32)):
    """The operands the TMA loop reads, or [] when it cannot (then the pointer loop does).

    For A (M, K) and B (K, N) = b_kn passed as a kernel's first two arguments, returns
    ([(0, A, its block dims), (1, B or B.T, its block dims)], B_KMAJOR). A B whose K dimension is
    contiguous (the row-major (N, K) weight of a linear layer) is described as the (N, K) matrix it is
    the transpose of, and the kernel transposes each loaded tile.
    """
    if not tma_available(a.device) or not _tma_readable(a, dtypes):
        return [], False
    if _tma_readable(b_kn, dtypes) and a.element_size() > 1:  # (FP8 MMAs take B K-major only)
        return [(0, a, ("BLOCK_M", "BLOCK_K")), (1, b_kn, ("BLOCK_K", "BLOCK_N"))], False
    if _tma_readable(b_kn.t(), dtypes):
        return [(0, a, ("BLOCK_M", "BLOCK_K")), (1, b_kn.t(), ("BLOCK_N", "BLOCK_K"))], True
    return [], False


def pair_descriptor(weight, block_n, block_k):
    """The tensor descriptor B_PAIRS reads (see matmul_loop): the gated weight (2N, K), row-major, as (N / h, 2, h, K)
    with h = block_n / 2, block (1, 2, h, block_k). Needs N % h == 0 (pairs_fit)."""
    n, k = weight.shape[0] // 2, weight.shape[1]
    h = block_n // 2
    view = weight.as_strided((n // h, 2, h, k), (h * weight.stride(0), n * weight.stride(0), weight.stride(0), 1))
    return TensorDescriptor.from_tensor(view, [1, 2, h, block_k])


def pairs_fit(n, cfg):
    """Whether a config's tile pairs the gate and up rows of an N-row half (B_PAIRS): h = BLOCK_N / 2 divides N."""
    return n % (cfg.kwargs["BLOCK_N"] // 2) == 0


def dot_settings(dtype):
    """(accumulator dtype, tl.dot input precision) for operands of a torch dtype.

    fp32 follows PyTorch's own switch, so the fused path is exactly as precise as the eager one:
    full fp32 ("ieee") unless torch.backends.cuda.matmul.allow_tf32 is set. float64 (gradcheck) accumulates in float64.
    """
    if dtype == torch.float64:
        return tl.float64, "ieee"
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return tl.float32, "tf32"
    return tl.float32, "ieee"


def needs_int64(*tensors):
    """64-bit offsets only when some tensor's largest element offset reaches 2**31 (32-bit math is faster)."""
    return any(t is not None and _largest_offset(t) >= 2 ** 31 for t in tensors)


def _largest_offset(t):
    if t.is_contiguous():  # the common case, without a Python loop (this runs on every launch)
        return t.numel() - 1
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() > 0 else 0


def check_buffer(name, t, shape):
    """Output / saved buffers are written with unit column stride: reject anything else up front."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride (rows may be strided), got strides {t.stride()}")
