"""The one matmul main loop every fused kernel is built on, and its tile scheduling.

Each kernel calls `matmul_loop` for its output tile, then applies its own epilogue (bias, activation,
activation derivative, ...) while the accumulator is still in registers.
"""

import triton
import triton.language as tl


@triton.jit
def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map the program id to an output tile, walking GROUP_M row-tiles at a time so the A rows and
    B columns a group reads stay in L2 ("grouped ordering")."""
    pid = tl.program_id(0)
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
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc = A[offs_m, :] @ B[:, offs_n] over the whole K, for A (M, K) and B (K, N) given by strides.

    With TWO_B, a second accumulator gets A @ B2 where B2 starts b2_offset elements after B: the gated
    (GLU) kernels use it for the gate and up halves of one weight, reading each A tile once for both.
    Rows and columns past M and N are wrapped (modulo) instead of masked: loads stay unmasked and the
    caller masks the stores. Only the K tail needs a mask, and only when K % BLOCK_K != 0.
    """
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if TWO_B:
            if EVEN_K:
                b2 = tl.load(b_ptrs + b2_offset)
            else:
                b2 = tl.load(b_ptrs + b2_offset, mask=rk[:, None] < k_left, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc2


def even_k(args):
    """Heuristic: no K-tail mask is needed when BLOCK_K divides K."""
    return args["K"] % args["BLOCK_K"] == 0


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


def launched_block_m(kernel):
    """BLOCK_M of the config the autotuned kernel last ran with."""
    return kernel.best_config.kwargs["BLOCK_M"]
