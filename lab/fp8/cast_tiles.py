"""Which tile should the FP8 cast + transpose pass use? cast_transpose (fused_ops/fp8.py) over GPT-2 small's h
(12288 x 3072, bf16 in, h8 and h8ᵀ out: the pass after a 16-bit forward) and x (12288 x 768, x8 and x8ᵀ out since
the third stage: the forward's FP8 main loop reads x8; the same pass casts grad_y), for
a few (BLOCK_M, BLOCK_C, warps), rounds alternated: GPU time, the bandwidth it reaches, and whether its outputs
and amax equal the current tile's bit for bit. GPU.

    PYTHONPATH=. python lab/fp8/cast_tiles.py
"""

import statistics

import torch
from triton.testing import do_bench

from fused_ops.fp8 import kernels as fp8, state as fp8_state

TILES = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 64, 2), (32, 128, 4)]


def main():
    torch.manual_seed(0)
    state = fp8_state.FP8State().cuda()
    shapes = {"h 12288x3072 (q + qT)": (torch.randn(12288, 3072, device="cuda", dtype=torch.bfloat16), fp8.H, True),
              "x 12288x768 (q + qT)": (torch.randn(12288, 768, device="cuda", dtype=torch.bfloat16), fp8.X, True)}
    tiles = dict(fp8.CAST_TILE)
    default = (64, 64, 4)  # the tile before this probe
    for name, (t, slot, row_major) in shapes.items():
        ref, times = None, {tile: [] for tile in TILES}
        for tile in TILES:  # compile, and check against the current tile's outputs
            fp8.CAST_TILE = {True: tile, False: tile}
            state.amax.zero_()
            out = fp8.cast_transpose(t, state, slot, row_major)
            got = (out[0], out[1], state.amax[slot].clone())
            if tile == default:
                ref = got
        for tile in TILES:
            fp8.CAST_TILE = {True: tile, False: tile}
            state.amax.zero_()
            out = fp8.cast_transpose(t, state, slot, row_major)
            same = all((a is None and b is None) or torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                                                  b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
                       for a, b in zip((out[0], out[1], state.amax[slot]), ref))
            times[tile].append(same)
        for r in range(4):
            for tile in (TILES if r % 2 == 0 else TILES[::-1]):
                fp8.CAST_TILE = {True: tile, False: tile}
                times[tile].append(1e3 * do_bench(lambda: fp8.cast_transpose(t, state, slot, row_major),
                                                  warmup=25, rep=100, return_mode="median"))
        moved = t.numel() * (2 + (2 if row_major else 1))  # bytes read + written
        print(f"\n{name}: GPU time, us, median of 4 rounds (min-max); GB/s; same outputs as {default}")
        for tile in TILES:
            same, ts = times[tile][0], times[tile][1:]
            med = statistics.median(ts)
            print(f"  {str(tile):16s} {med:7.1f} ({min(ts):.1f}-{max(ts):.1f})  {moved / med / 1e3:6.0f} GB/s  {same}")
    fp8.CAST_TILE = tiles


if __name__ == "__main__":
    main()
