"""The residual add + LayerNorm + FP8 cast in one pass, against what it would replace, at GPT-2 small's rows.

Tried as a product fusion and not kept (results/glue/README.md, "The add, LayerNorm and cast in one pass"): before
the FP8 MLP, s = x + delta and y = LayerNorm(s) run in Inductor's kernel, which writes y in bf16, and the cast +
transpose pass (kernels.cast_transpose) reads y back to write y8 and y8ᵀ. One pass that writes s, y8 and y8ᵀ moves
113 MB at 12288 x 768 (x fp32, delta bf16) where the two move 151 MB; the delayed scale (kernels.py's docstring) is
known before y exists, so one pass is possible. The kernel below walks 64-row blocks in column tiles: the statistics
(Chan et al.'s merge, tile by tile), then y, its casts and stores, x and delta reloaded from L2. A first form held
whole rows in registers (32 x 1024 padded, 16 warps: git show e163bd7:fused_ops/fp8/norm.py). Times are GPU time
in CUDA-graph replay (do_bench_cudagraph medians), each call walking COPIES distinct inputs (more than L2 holds),
rounds alternated; the floor is the bytes at the rate of an elementwise copy in the same run. Each tile's copies are
checked: the transposed copy equal to the row-major one, and the bytes that differ from the first tile's counted
(the statistics merge per column tile, so another width can round mean and rstd differently). GPU.

    PYTHONPATH=. python lab/glue/norm_cast.py
"""

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from fused_ops.casts import quantize
from fused_ops.fp8 import X, FP8State, kernels as fp8_kernels
from fused_ops.tuning import cdiv, launch

M, C, COPIES, ROUNDS = 12288, 768, 8, 5
TILES = [(64, 128, 4), (64, 64, 4), (32, 128, 4), (64, 256, 8), (128, 64, 8), (32, 256, 4)]  # (BLOCK_M, BLOCK_C, warps)


@triton.jit
def add_layer_norm_fp8_kernel(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, q_ptr, qt_ptr, mean_ptr, rstd_ptr, scale_ptr,
                              amax_ptr, M, C, Mp, eps,
                              HAS_DELTA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              Y_DTYPE: tl.constexpr, EMULATE: tl.constexpr, INT64: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """For rows offs_m of x (M, C): s = x + delta (stored, in s's dtype, if HAS_DELTA), y = LayerNorm(s) · w + b,
    q (M, C) and qt (C, Mp) = fp8(y · scale) of y rounded to Y_DTYPE, mean and rstd (M,). Two walks over the row
    block's BLOCK_C-wide column tiles: the statistics (each tile's mean and sum of squared deviations, merged as
    Chan et al.'s parallel variance), then y, its casts and stores. The second walk reloads x and delta (from L2),
    not s: this program's own stores of s are not ordered before its loads."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
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


def add_layer_norm_fp8(x, delta, weight, bias, eps, state, tile):
    """(s, y8 (M, C), y8ᵀ (C, Mp)) for rows x (M, C) and delta, y rounded to bf16 and quantized with slot X's scale."""
    Mp = -(-x.shape[0] // 16) * 16
    s = torch.empty_like(x)
    q = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    qt = torch.empty((x.shape[1], Mp), device=x.device, dtype=torch.float8_e4m3fn)
    mean, rstd = (torch.empty(x.shape[0], device=x.device) for _ in range(2))
    bm, bc, warps = tile
    scale, amax = state.slot(X)[:2]
    launch(add_layer_norm_fp8_kernel, (cdiv(Mp, bm),),
           (x, delta, weight, bias, s, q, qt, mean, rstd, scale, amax, *x.shape, Mp, eps),
           dict(HAS_DELTA=True, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, Y_DTYPE=tl.bfloat16,
                EMULATE=False, INT64=False, BLOCK_M=bm, BLOCK_C=bc), warps)
    return s, q, qt


def main():
    dev = "cuda"
    g = torch.Generator(dev).manual_seed(0)
    xs = [torch.randn(M, C, device=dev, generator=g) for _ in range(COPIES)]
    ds = [torch.randn(M, C, device=dev, generator=g).bfloat16() for _ in range(COPIES)]
    w, b = torch.randn(C, device=dev) * 0.1 + 1, None
    state = FP8State().to(dev)
    state.scale[X] = 448.0 / 6
    state.calibrated = True

    @torch.compile
    def add_ln(x, d):
        s = x + d
        return s, F.layer_norm(s, (C,), w, b, 1e-5).bfloat16()

    def apart():
        for x, d in zip(xs, ds):
            s, y = add_ln(x, d)
            fp8_kernels.cast_transpose(y, state, X, row_major=True)

    def fused(tile):
        def run():
            for x, d in zip(xs, ds):
                add_layer_norm_fp8(x, d, w, b, 1e-5, state, tile)
        return run

    want, differ = None, {}
    for tile in TILES:
        _, q, qt = add_layer_norm_fp8(xs[0], ds[0], w, b, 1e-5, state, tile)
        assert torch.equal(qt[:, :M].view(torch.uint8), q.t().view(torch.uint8)), tile
        want = q if want is None else want
        differ[tile] = (q.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    big = torch.empty(2**28, device=dev)
    # an elementwise kernel's copy (in a CUDA graph copy_ is a memcpy node, which the slower copy engine runs)
    copy = lambda: torch.mul(big[2**27:], 1.0, out=big[: 2**27])  # noqa: E731  (512 MiB read, 512 MiB written)
    variants = {"apart (Inductor add+LN, cast_transpose)": apart,
                **{f"fused {t[0]} x {t[1]}, {t[2]} warps": fused(t) for t in TILES}}
    times = {k: [] for k in variants}
    rate = []
    for r in range(ROUNDS):
        order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
        for name, fn in order:
            times[name].append(do_bench_cudagraph(fn, rep=200) * 1e3 / COPIES)
        rate.append(2**30 / (do_bench_cudagraph(copy, rep=200) * 1e-3) / 1e9)
    gbs = statistics.median(rate)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy rate {gbs:.0f} GB/s  M={M} C={C}")
    floors = {"apart": (4 + 2 + 4 + 2 + 2 + 2) * M * C, "fused": (4 + 2 + 4 + 2) * M * C}
    print(f"floors: apart {floors['apart'] / gbs / 1e3:.1f} µs ({floors['apart'] / 1e6:.0f} MB), "
          f"fused {floors['fused'] / gbs / 1e3:.1f} µs ({floors['fused'] / 1e6:.0f} MB)")
    print("y8 bytes differing from the first tile's:", {f"{t}": n for t, n in differ.items()})
    print(f"{'variant':44s} {'µs a call (median, min-max)':>28s}  x its floor")
    for name, t in times.items():
        floor = floors["apart" if name.startswith("apart") else "fused"] / gbs / 1e3
        print(f"{name:44s} {statistics.median(t):8.1f} ({min(t):.1f}-{max(t):.1f})        {statistics.median(t) / floor:.2f}")


if __name__ == "__main__":
    main()
