"""The residual add, the LayerNorm and the FP8 cast of its output, in one pass (model.Block's ln_2 before an FP8 MLP,
inside a GPT compiled whole).

Why. Before an FP8 GEMM the block does three things to the residual stream: s = x + delta (the attention's output
added in), y = LayerNorm(s), and the FP8 copies of y that the GEMMs read (y8 row-major for the forward, y8ᵀ for the
weight gradient). Inductor fuses the first two into one kernel, but our MLP operator is opaque to it, so y went to
memory in 16 bits and a cast + transpose pass (kernels.cast_transpose) read it back:

    before   read x (fp32), delta (bf16); write s (fp32), y (bf16)      Inductor's add + LayerNorm
             read y; write y8, y8ᵀ                                       cast_transpose
    here     read x, delta; write s, y8, y8ᵀ                             this kernel

At GPT-2 small's size (12288 x 768 rows under autocast) that is 37.7 MB a LayerNorm less, 151 against 113 MB. The
FP8 recipe makes one pass possible: the cast's scale is the slot's delayed one (kernels.py's docstring), known
before y exists, and the kernel folds y's amax into the slot with an atomic max, as every other cast does.

How. A program takes BLOCK_M whole rows (the row held in registers, its width padded to a power of two), so s, its
mean and variance and y come from one read of x and delta; y is quantized in fp32 (where the separate pass quantized
its bf16 copy: one rounding fewer) and stored twice, row-major and, through tl.trans of the FP8 tile, transposed
(the transposed copy is stored from the quantized tile: stored from fp32 tiles, transposed copies came out wrong on
H100s and H200s with Triton 3.6, kernels.py). Rows past M up to the transposed copy's padding are written as zeros.
mean and rstd are kept for the backward, which is not a kernel here: layer_norm_grads below writes it in PyTorch
ops, so that torch.compile traces it and Inductor fuses it with the residual stream's gradient, as before.

Special values: as LayerNorm, a NaN or inf in a row makes the row's y NaN (its mean or variance is); y8 then holds
NaN (kernels.py: ±inf becomes NaN too).
"""

import torch
import triton
import triton.language as tl

from .. import env
from ..casts import quantize
from ..matmul import needs_int64
from ..tuning import cdiv, launch
from .kernels import SLOT_DTYPES, X, _padded
from .state import _set_current_scale

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def add_layer_norm_fp8_kernel(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, q_ptr, qt_ptr, mean_ptr, rstd_ptr, scale_ptr,
                              amax_ptr, copy_from, copy_to, M, C, Mp, eps,
                              HAS_DELTA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              Y_DTYPE: tl.constexpr, EMULATE: tl.constexpr, INT64: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, COPY: tl.constexpr):
    """For rows offs_m of x (M, C): s = x + delta (stored, in s's dtype, if HAS_DELTA), y = LayerNorm(s) · w + b,
    q (M, C) and qt (C, Mp) = fp8(y · scale) of y rounded to Y_DTYPE, mean and rstd (M,). Two walks over the row
    block's BLOCK_C-wide column tiles: the statistics (each tile's mean and sum of squared deviations, merged as
    Chan et al.'s parallel variance), then y, its casts and stores. The second walk reloads x and delta (from L2),
    not s: this program's own stores of s are not ordered before its loads. COPY > 0: the first program also copies
    COPY floats from copy_from to copy_to (the 1/scales the FP8 operators keep for the backward, as
    cast_transpose_kernel)."""
    pid = tl.program_id(0)
    if COPY > 0:
        if pid == 0:
            offs = tl.arange(0, COPY)
            tl.store(copy_to + offs, tl.load(copy_from + offs))
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64) if INT64 else offs_m
    m_ok = offs_m < M
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = m_ok[:, None] & (offs_c < C)[None, :]
        v = _summed(x_ptr, d_ptr, s_ptr, rows[:, None] * C + offs_c[None, :], ok, HAS_DELTA, True)
        n, n_c = c0 * 1.0, tl.minimum(C - c0, BLOCK_C) * 1.0  # (columns before this tile, in it)
        mean_c = tl.sum(v, axis=1) / n_c
        dev = tl.where(ok, v - mean_c[:, None], 0.0)
        step = mean_c - mean
        mean += step * (n_c / (n + n_c))
        m2 += tl.sum(dev * dev, axis=1) + step * step * (n * n_c / (n + n_c))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(m2 / C + eps))
    tl.store(mean_ptr + offs_m, mean, mask=m_ok)
    tl.store(rstd_ptr + offs_m, rstd, mask=m_ok)
    scale = tl.load(scale_ptr)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        ok = m_ok[:, None] & c_ok[None, :]
        at = rows[:, None] * C + offs_c[None, :]
        y = (_summed(x_ptr, d_ptr, s_ptr, at, ok, HAS_DELTA, False) - mean[:, None]) * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        # rounded to the MLP's 16-bit dtype first, as the separate pass quantized LayerNorm's output cast to it (rows
        # past M: zeros in the transposed copy's padding)
        y = tl.where(ok, y.to(Y_DTYPE).to(tl.float32), 0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        y8 = quantize(y, scale, q_ptr.dtype.element_ty, EMULATE)
        tl.store(q_ptr + at, y8, mask=ok)
        cols = (offs_c.to(tl.int64) if INT64 else offs_c)[:, None]
        tl.store(qt_ptr + cols * Mp + rows[None, :], tl.trans(y8), mask=c_ok[:, None] & (offs_m < Mp)[None, :])
    tl.atomic_max(amax_ptr, tl.max(amax, axis=0), sem="relaxed")


@triton.jit
def _summed(x_ptr, d_ptr, s_ptr, at, ok, HAS_DELTA: tl.constexpr, STORE: tl.constexpr):
    """s = x + delta at `at`, rounded to s's dtype (as stored, and as the LayerNorm reads it), in fp32; stored if
    STORE."""
    v = tl.load(x_ptr + at, mask=ok, other=0.0)
    if HAS_DELTA:
        v = (v.to(tl.float32) + tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        if STORE:
            tl.store(s_ptr + at, v, mask=ok)
    return tl.where(ok, v.to(tl.float32), 0.0)


# (BLOCK_M, BLOCK_C, warps): 64 rows a program, so that the transposed copy's stores are 64 bytes long (the cast
# pass's tile: kernels.CAST_TILE)
TILE = (16, 32, 4) if env.INTERPRET else (64, 128, 4)


def _tile(C):
    return TILE


def add_layer_norm_fp8(x, delta, weight, bias, eps, state, dtype, inv_scales=None):
    """(s = x + delta, or None without delta; y8 (M, C) and y8ᵀ (C, Mp) in e4m3, y = LayerNorm(s) · weight + bias
    rounded to dtype (the MLP's 16 bits, where the separate pass read it) and quantized with the slot X's scale, its
    amax folded in; mean and rstd (M, 1), fp32) for rows x (M, C) contiguous.
    inv_scales: as cast_transpose's. On the state's calibrating call the kernel runs twice, the first time only to
    measure y's amax, which sets X's scale (current scaling, once: autograd._calibrated)."""
    M, C = x.shape
    Mp = _padded(M)
    s = torch.empty_like(x) if delta is not None else None
    q = torch.empty((M, C), device=x.device, dtype=SLOT_DTYPES[X])
    qt = torch.empty((C, Mp), device=x.device, dtype=SLOT_DTYPES[X])
    mean, rstd = (torch.empty((M, 1), device=x.device, dtype=torch.float32) for _ in range(2))
    bm, bc, warps = _tile(C)
    scale, amax = state.slot(X)[:2]

    def run(copy):
        source, destination = copy or (None, None)
        launch(add_layer_norm_fp8_kernel, (cdiv(Mp, bm),),
               (x, delta, weight, bias, s, q, qt, mean, rstd, scale, amax, source, destination, M, C, Mp, eps),
               dict(HAS_DELTA=delta is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                    Y_DTYPE=TL_DTYPES[dtype], EMULATE=env.INTERPRET, INT64=needs_int64(x, qt), BLOCK_M=bm, BLOCK_C=bc,
                    COPY=source.numel() if copy else 0), warps)
    if not state.calibrated:
        run(())
        _set_current_scale(state, X)
    run((state.inv_scale, inv_scales) if inv_scales is not None else ())
    return s, q, qt, mean, rstd


def layer_norm_grads(grad_y, s, mean, rstd, weight, bias, grad_s=None, needs=(True, True)):
    """(the gradient into s, with grad_s, s's own gradient from further on, added; weight's; bias's: each None where
    needs says no or there is none) of y = LayerNorm(s) · weight + bias, from mean and rstd as add_layer_norm_fp8 kept
    them, in fp32. PyTorch ops (what torch's decomposition of native_layer_norm_backward does): under torch.compile
    Inductor fuses them, and the add, as it fused LayerNorm's own backward before."""
    g, s_hat = grad_y.float(), (s.float() - mean) * rstd
    gw = g * weight.float() if weight is not None else g
    grad_in = rstd * (gw - gw.mean(-1, keepdim=True) - s_hat * (gw * s_hat).mean(-1, keepdim=True))
    grad_in = (grad_in if grad_s is None else grad_in + grad_s.float()).to(s.dtype)
    grad_w = (g * s_hat).sum(0).to(weight.dtype) if weight is not None and needs[0] else None
    grad_b = g.sum(0).to(bias.dtype) if bias is not None and needs[1] else None
    return grad_in, grad_w, grad_b
