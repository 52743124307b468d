"""Where the FP8 MLP's forward + backward graph spends its time, kernel by kernel, and what the kernels it does not
own (cuBLAS's FP8 GEMMs, the casts) would take in other forms. Hopper GPU.

1. The MLP as bench_mlp.py times it (bias-free, fwd + bwd as one CUDA graph), replayed under torch.profiler: each
   kernel's median duration and the gap before it (the graph's launch gaps and tails).
2. The backward's cuBLAS FP8 GEMMs (dW2, dx, dW1) as the product runs them, with fast accumulation, and with the
   operands swapped (the transposed product: cuBLAS picks its tiles for the output's shape), rounds alternated, on
   random FP8 operands.
3. (--parts dx) SwiGLU's dx alone as a graph, in several forms: where cuBLAS's memset before it comes from.
4. The x / grad_y cast (cast_transpose, row-major copy too) at other tiles and warps.

    PYTHONPATH=. python lab/fp8/graph_profile.py [--M 12288 --C 768 --rounds 3]
"""

import collections
import json
import os
import statistics
import tempfile

import torch

import bench_mlp
from fused_ops.fp8 import kernels as fp8, state as fp8_state
from model import MLP, GPTConfig
from lab.fp8.epilogue_probe import alternated, arguments, setup


def kernel_table(replay, replays=20):
    """[(name, median µs, median gap before it µs)] of one replay's kernels, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)  # ~1 ms apart: the replays' kernels fall into separate groups
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events = sorted((e for e in events if "spin_kernel" not in e["name"]), key=lambda e: e["ts"])
    groups, group = [], [events[0]]
    for e in events[1:]:
        if e["ts"] - (group[-1]["ts"] + group[-1]["dur"]) > 200:
            groups.append(group)
            group = []
        group.append(e)
    groups.append(group)
    n = collections.Counter(len(g) for g in groups).most_common(1)[0][0]
    groups = [g for g in groups if len(g) == n]
    rows = []
    for k in range(n):
        durs = [g[k]["dur"] for g in groups]
        gaps = [g[k]["ts"] - (g[k - 1]["ts"] + g[k - 1]["dur"]) if k else 0.0 for g in groups]
        rows.append((groups[0][k]["name"], statistics.median(durs), statistics.median(gaps)))
    spans = [g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"] for g in groups]
    return rows, statistics.median(spans), len(groups)


def profile_mlp(M, C, activation):
    cfg = GPTConfig(n_embd=C, n_head=1, activation=activation, bias=False, mlp="fused", fp8=True)
    m = MLP(cfg).to("cuda", torch.bfloat16)
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # calibrate
        torch.autograd.grad(m(x.requires_grad_()), [x] + list(m.parameters()), dy)
    replay = bench_mlp.graphed_fwd_bwd(m, x.detach(), dy)[0]
    rows, span, n = kernel_table(replay)
    print(f"\n{activation}: one fwd + bwd graph, {n} replays profiled, span {span:.1f} us "
          f"(kernels {sum(r[1] for r in rows):.1f}, gaps {sum(r[2] for r in rows):.1f})")
    print(f"{'kernel':72s} {'us':>7s} {'gap':>6s}")
    for name, dur, gap in rows:
        print(f"{name[:72]:72s} {dur:7.1f} {gap:6.1f}")


def gemms(M, C, gated, rounds):
    H = 2048 if gated else 4 * C
    W = 2 * H if gated else H
    dev, one = "cuda", torch.ones((), device="cuda")
    e4, e5 = fp8.E4M3, fp8.E5M2
    q = lambda *shape, dt=e4: (torch.randn(*shape, device=dev) * 4).to(dt)  # noqa: E731  (random FP8 operands)
    gyt8, ht8, gz8, gzt8, xt8 = q(C, M, dt=e5), q(H, M), q(M, W, dt=e5), q(W, M, dt=e5), q(C, M)
    w1t8 = q(C, W)
    mm = torch._scaled_mm
    rows = {
        "dW2 = gyT h (product)": lambda: mm(gyt8, ht8.t(), one, one, out_dtype=torch.bfloat16),
        "dW2 fast accum": lambda: mm(gyt8, ht8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "dW2 as (hT gy)T": lambda: mm(ht8, gyt8.t(), one, one, out_dtype=torch.bfloat16),
        "dx = gz W1 (product)": lambda: mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16),
        "dx fast accum": lambda: mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "dW1 = gzT x (product)": lambda: mm(gzt8, xt8.t(), one, one, out_dtype=torch.bfloat16),
        "dW1 fast accum": lambda: mm(gzt8, xt8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "dW1 as (xT gz)T": lambda: mm(xt8, gzt8.t(), one, one, out_dtype=torch.bfloat16),
    }
    alternated(rows, rounds, f"{'SwiGLU' if gated else 'GELU'} backward GEMMs (M={M}, C={C}, H={H})")


def dx_forms(M, C):
    """The SwiGLU dx GEMM alone as a CUDA graph, in several forms: which of them brings cuBLAS's memset (and the gap
    after it) that the MLP's graph shows before dx."""
    dev, one = "cuda", torch.ones((), device="cuda")
    W = 4096
    gz8 = (torch.randn(M, W, device=dev) * 4).to(fp8.E5M2)
    w1t8 = (torch.randn(C, W, device=dev) * 4).to(fp8.E4M3)
    gyt8 = (torch.randn(C, M, device=dev) * 4).to(fp8.E5M2)
    ht8 = (torch.randn(W // 2, M, device=dev) * 4).to(fp8.E4M3)
    mm = torch._scaled_mm
    out = torch.empty(M, C, device=dev, dtype=torch.bfloat16)
    forms = {
        "product": lambda: mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16),
        "fast accum": lambda: mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "out= preallocated": lambda: torch._scaled_mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16, out=out),
        "after dW2 (as in the MLP)": lambda: (mm(gyt8, ht8.t(), one, one, out_dtype=torch.bfloat16),
                                              mm(gz8, w1t8.t(), one, one, out_dtype=torch.bfloat16)),
    }
    for name, fn in forms.items():
        rows, span, n = kernel_table(bench_mlp.graphed(fn))
        print(f"\ndx {name}: span {span:.1f} us")
        for kname, dur, gap in rows:
            print(f"  {kname[:70]:70s} {dur:7.1f} {gap:6.1f}")


def casts(M, C, rounds):
    d = setup(M, C, False)
    x, state = d["x"], d["state"]
    rows = {"x.clone() (same bytes read, 2/1 written)": lambda: x.clone()}
    keep = fp8.CAST_TILE[True]
    for tile in ((64, 64, 2), (64, 64, 4), (32, 64, 2), (64, 128, 4), (128, 64, 4), (64, 32, 2), (32, 128, 4),
                 (128, 128, 8)):
        def run(tile=tile):
            fp8.CAST_TILE[True] = tile
            try:
                fp8.cast_transpose(x, state, fp8.X, row_major=True)
            finally:
                fp8.CAST_TILE[True] = keep
        rows[f"cast {tile}" + (" (product)" if tile == keep else "")] = run
    alternated(rows, rounds, f"x cast + transpose, row-major copy too ({M} x {C})")


def main():
    p = arguments()
    p.add_argument("--parts", default="profile,gemms,casts")
    a = p.parse_args()
    parts = a.parts.split(",")
    print(torch.cuda.get_device_name(), torch.__version__)
    if "profile" in parts:
        for activation in ("gelu", "swiglu"):
            profile_mlp(a.M, a.C, activation)
    if "gemms" in parts:
        for gated in (False, True):
            gemms(a.M, a.C, gated, a.rounds)
    if "dx" in parts:
        dx_forms(a.M, a.C)
    if "casts" in parts:
        casts(a.M, a.C, a.rounds)


if __name__ == "__main__":
    main()
