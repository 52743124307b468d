"""The residual add + LayerNorm + FP8 cast pass (fused_ops/fp8/norm.py) against what it replaces, at GPT-2 small's rows.

What it replaces: Inductor's add + LayerNorm (torch.compile of s = x + d; y = LayerNorm(s) in bf16), then the cast
+ transpose pass (kernels.cast_transpose). Both read an fp32 x and a bf16 d; the pass writes s and the two FP8
copies (113 MB at 12288 x 768), the two apart also write y and read it back (151 MB). Times are GPU time in CUDA-graph
replay (do_bench_cudagraph medians), each call walking COPIES distinct inputs (more than L2 holds), rounds alternated;
the floor is the bytes at the copy rate measured in the same run. The pass's tile (norm.TILE: rows a program, columns
a step, warps) is varied, each checked against the product's bit for bit. GPU.

    PYTHONPATH=. python lab/glue/norm_cast.py
"""

import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from fused_ops.fp8 import X, FP8State, kernels as fp8_kernels, norm

M, C, COPIES, ROUNDS = 12288, 768, 8, 5
TILES = [(64, 128, 4), (64, 64, 4), (32, 128, 4), (64, 256, 8), (128, 64, 8), (32, 256, 4)]  # norm.TILE's


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
            norm.TILE, product = tile, norm.TILE
            try:
                for x, d in zip(xs, ds):
                    norm.add_layer_norm_fp8(x, d, w, b, 1e-5, state, torch.bfloat16)
            finally:
                norm.TILE = product
        return run

    # every tile's copies: the transposed one its row-major one's, and how many bytes differ from the first tile's (the
    # statistics merge per column tile: another width can round mean and rstd differently)
    product, want, differ = norm.TILE, None, {}
    for tile in TILES:
        norm.TILE = tile
        _, q, qt, _, _ = norm.add_layer_norm_fp8(xs[0], ds[0], w, b, 1e-5, state, torch.bfloat16)
        assert torch.equal(qt[:, :M].view(torch.uint8), q.t().view(torch.uint8)), tile
        want = q if want is None else want
        differ[tile] = (q.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    norm.TILE = product
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
