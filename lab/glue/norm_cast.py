"""The residual add + LayerNorm + FP8 cast pass (fused_ops/fp8/norm.py) against what it replaces, at GPT-2 small's rows.

What it replaces: Inductor's add + LayerNorm (torch.compile of s = x + d; y = LayerNorm(s) in bf16), then the cast
+ transpose pass (kernels.cast_transpose). Both read an fp32 x and a bf16 d; the pass writes s and the two FP8
copies (113 MB at 12288 x 768), the two apart also write y and read it back (151 MB). Times are GPU time in CUDA-graph
replay (do_bench_cudagraph medians), each call walking COPIES distinct inputs (more than L2 holds), rounds alternated;
the floor is the bytes at the copy rate measured in the same run. The pass's tile (rows a program: ROW_ELEMENTS /
the padded width; warps) is varied, each checked against the product's bit for bit. GPU.

    PYTHONPATH=. python lab/glue/norm_cast.py
"""

import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from fused_ops.fp8 import X, FP8State, kernels as fp8_kernels, norm

M, C, COPIES, ROUNDS = 12288, 768, 8, 5
TILES = [(32768, 16), (32768, 8), (16384, 8), (16384, 4), (65536, 16)]  # (ROW_ELEMENTS, warps)


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
            norm.ROW_ELEMENTS, warps = tile
            old = norm._tile
            norm._tile = lambda c: (*old(c)[:2], warps)
            try:
                for x, d in zip(xs, ds):
                    norm.add_layer_norm_fp8(x, d, w, b, 1e-5, state, torch.bfloat16)
            finally:
                norm._tile = old
        return run

    # every tile's copies against the first's, bit for bit
    want = None
    for tile in TILES:
        norm.ROW_ELEMENTS = tile[0]
        out = norm.add_layer_norm_fp8(xs[0], ds[0], w, b, 1e-5, state, torch.bfloat16)
        if want is None:
            want = out
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)
                   for a, e in zip(out, want)), tile
    big = torch.empty(2**28, device=dev)
    copy = lambda: big[: 2**27].copy_(big[2**27:])  # noqa: E731  (1 GiB read + written)
    variants = {"apart (Inductor add+LN, cast_transpose)": apart,
                **{f"fused {t[0]} elements, {t[1]} warps": fused(t) for t in TILES}}
    times = {k: [] for k in variants}
    rate = []
    for r in range(ROUNDS):
        order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
        for name, fn in order:
            times[name].append(do_bench_cudagraph(fn, rep=200) * 1e3 / COPIES)
        rate.append(2**31 / (do_bench_cudagraph(copy, rep=200) * 1e-3) / 1e9)
    gbs = statistics.median(rate)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy rate {gbs:.0f} GB/s  M={M} C={C}")
    floors = {"apart": (4 + 2 + 4 + 2 + 2 + 2) * M * C, "fused": (4 + 2 + 4 + 2) * M * C}
    print(f"floors: apart {floors['apart'] / gbs / 1e3:.1f} µs ({floors['apart'] / 1e6:.0f} MB), "
          f"fused {floors['fused'] / gbs / 1e3:.1f} µs ({floors['fused'] / 1e6:.0f} MB)")
    print(f"{'variant':44s} {'µs a call (median, min-max)':>28s}  x its floor")
    for name, t in times.items():
        floor = floors["apart" if name.startswith("apart") else "fused"] / gbs / 1e3
        print(f"{name:44s} {statistics.median(t):8.1f} ({min(t):.1f}-{max(t):.1f})        {statistics.median(t) / floor:.2f}")


if __name__ == "__main__":
    main()
