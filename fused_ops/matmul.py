"""The one matmul main loop every fused kernel is built on, and its tile scheduling.

Each kernel calls `matmul_loop` for its output tile, then applies its own epilogue (bias, activation,
activation derivative, ...) while the accumulator is still in registers.
"""

import triton
import triton.language as tl


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
def matmul_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, b2_offset,
                ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TWO_B: tl.constexpr,
                INT64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ROW_STATS: tl.constexpr = False):
    """acc = A[offs_m, :] @ B[:, offs_n] over the whole K, for A (M, K) and B (K, N) given by strides.

    With TWO_B, a second accumulator gets A @ B2 where B2 starts b2_offset elements after B: the gated
    (GLU) kernels use it for the gate and up halves of one weight, reading each A tile once for both.
    Rows past M and columns past N are masked (not wrapped with a modulo, which would hide from the
    compiler that offs_n is contiguous and scalarize loads of a row-major B). The K tail is masked only
    when K % BLOCK_K != 0. INT64 switches to 64-bit offsets when some element offset reaches 2**31 (see needs_int64).

    With ROW_STATS (the LayerNorm fold), each row of A is first shifted by its own first element s, and
    the loop also gathers the mean and the sum of squared deviations (M2) of the shifted rows. The shift
    changes nothing for LayerNorm (LN(a) = LN(a - s)) but keeps the products small when rows have a
    large mean, so the later "minus mean times column sums" does not cancel away the signal. Statistics
    are merged block by block with Chan's formula (each block's own mean and M2 first), never as
    E[a^2] - E[a]^2, which cancels badly. Returns (acc, acc2, shift, mean of shifted rows, M2).
    """
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
    mean = tl.zeros((BLOCK_M,), dtype=ACC_DTYPE)
    m2 = tl.zeros((BLOCK_M,), dtype=ACC_DTYPE)
    shift = mean
    if ROW_STATS:
        shift = tl.load(a_ptr + rows * stride_am, mask=offs_m < M, other=0.0).to(ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a_mask, b_mask = m_mask, n_mask
        else:
            k_left = K - k * BLOCK_K
            a_mask, b_mask = m_mask & (rk[None, :] < k_left), n_mask & (rk[:, None] < k_left)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if ROW_STATS:
            in_k = rk < K - k * BLOCK_K
            in_row = m_mask & in_k[None, :]
            y = tl.where(in_row, a.to(ACC_DTYPE) - shift[:, None], 0.0)
            n_seen = k * BLOCK_K * 1.0
            n_block = tl.sum(tl.where(in_k, 1.0, 0.0), axis=0).to(ACC_DTYPE)
            block_mean = tl.sum(y, axis=1) / n_block
            dev = tl.where(in_row, y - block_mean[:, None], 0.0)
            delta = block_mean - mean
            mean += delta * (n_block / (n_seen + n_block))
            m2 += tl.sum(dev * dev, axis=1) + delta * delta * (n_seen * n_block / (n_seen + n_block))
            a = y.to(a.dtype)
        acc = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc, input_precision=PRECISION)
        if TWO_B:
            acc2 = tl.dot(a, tl.load(b_ptrs + b2_offset, mask=b_mask, other=0.0), acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc2, shift, mean, m2


def dot_settings(dtype):
    """(accumulator dtype, tl.dot input precision) for operands of a torch dtype.

    fp32 follows PyTorch's own switch, so the fused path is exactly as precise as the eager one:
    full fp32 ("ieee") unless torch.backends.cuda.matmul.allow_tf32 is set. float64 (gradcheck) accumulates in float64.
    """
    import torch

    if dtype == torch.float64:
        return tl.float64, "ieee"
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return tl.float32, "tf32"
    return tl.float32, "ieee"


def needs_int64(*tensors):
    """64-bit offsets only when some tensor's largest element offset reaches 2**31 (32-bit math is faster)."""
    return any(t is not None and t.numel() > 0 and
               sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2 ** 31 for t in tensors)


def check_buffer(name, t, shape):
    """Output / saved buffers are written with unit column stride: reject anything else up front."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride (rows may be strided), got strides {t.stride()}")
