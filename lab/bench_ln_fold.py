"""LayerNorm + MLP with the LayerNorm folded into the fused MLP's first matmul (fuse_ln) against
LayerNorm followed by the unfolded fused MLP, the eager pair, and torch.compile of the eager pair.

    python lab/bench_ln_fold.py --out out-bench/ln_fold.json

bf16 modules, then fp32 modules under bf16 autocast (as train.py runs); GPT-2 small size (M = 12288, C = 768); medians of triton.testing.do_bench (GPU + CPU launch
time) and CUDA-graph replays (GPU time alone). Also times the LayerNorm alone: the most the fold can save
is what the separate LayerNorm costs. Ends with a torch.profiler breakdown of the two fused paths.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from model import MLP, GPTConfig


def case(C, M, activation, dtype=torch.bfloat16, autocast=False):
    """autocast=True: fp32 modules and input under bf16 autocast, as train.py runs (the fold then reads fp32 x)."""
    torch.manual_seed(0)
    if autocast:
        dtype = torch.float32
    cfg = GPTConfig(n_embd=C, n_head=12, activation=activation, mlp="fused", fuse_ln=True)
    ln = torch.nn.LayerNorm(C).cuda().to(dtype)
    with torch.no_grad():  # a non-trivial γ, β
        ln.weight.normal_(1.0, 0.2)
        ln.bias.normal_(0.0, 0.2)
    eager = MLP(GPTConfig(n_embd=C, n_head=12, activation=activation)).cuda().to(dtype)
    folded = MLP(cfg).cuda().to(dtype)
    folded.load_state_dict(eager.state_dict())
    unfolded = MLP(GPTConfig(n_embd=C, n_head=12, activation=activation, mlp="fused")).cuda().to(dtype)
    unfolded.load_state_dict(eager.state_dict())
    compiled = torch.compile(lambda x: eager(x, ln))
    x = torch.randn(M, C, device="cuda", dtype=dtype).requires_grad_()
    gy = torch.randn(M, C, device="cuda", dtype=dtype)
    params = [x, ln.weight, ln.bias] + list(eager.parameters()) + list(folded.parameters()) + list(unfolded.parameters())
    paths = {
        "eager LN + eager MLP": lambda: eager(x, ln),
        "torch.compile(LN + MLP)": lambda: compiled(x),
        "LN + fused MLP": lambda: unfolded(x, ln),
        "fused MLP with LN folded": lambda: folded(x, ln),
        "LN alone": lambda: ln(x),
    }
    # Correctness at this size first: each path against a float64 copy.
    x64 = x.detach().double()
    ln64 = torch.nn.LayerNorm(C).cuda().double()
    ln64.load_state_dict(ln.state_dict())
    mlp64 = MLP(GPTConfig(n_embd=C, n_head=12, activation=activation)).cuda().double()  # eager: fp64 reference
    mlp64.load_state_dict(eager.state_dict())
    ref = mlp64(x64, ln64)
    if autocast:
        paths = {name: (lambda fn=fn: _autocast_call(fn)) for name, fn in paths.items()}
    row = {"C": C, "M": M, "activation": activation + (" (bf16 autocast)" if autocast else "")}
    for name, fn in paths.items():
        if name != "LN alone":
            with torch.no_grad():
                y = fn().double()
            row[f"{name} rel err"] = ((y - ref).norm() / ref.norm()).item()
        fwd_bwd = lambda: fn().backward(gy)  # noqa: E731
        row[f"{name} fwd ms"] = do_bench(lambda: fn(), warmup=25, rep=200)
        row[f"{name} fwd+bwd ms"] = do_bench(fwd_bwd, warmup=25, rep=200, grad_to_none=params)
        try:  # GPU time alone: kernels replayed from a CUDA graph, no Python launch cost
            row[f"{name} fwd+bwd graph ms"] = do_bench_cudagraph(fwd_bwd, rep=200)
        except Exception as e:  # noqa: BLE001  (e.g. a path that cannot be captured)
            row[f"{name} fwd+bwd graph ms"] = None
            print(f"{name}: no CUDA-graph timing ({type(e).__name__}: {str(e)[:100]})")
    if activation == "gelu" and not autocast:
        for name in ("LN + fused MLP", "fused MLP with LN folded"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    paths[name]().backward(gy)
                torch.cuda.synchronize()
            print(f"\n--- {name}: GPU time per fwd+bwd by kernel (5 runs averaged) ---")
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
                print(f"{ev.device_time_total / 5 / 1e3:8.3f} ms  {ev.key[:90]}")
    return row


def _autocast_call(fn):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return fn()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out-bench/ln_fold.json")
    args = ap.parse_args()
    rows = [case(768, 12288, act, autocast=ac) for ac in (False, True) for act in ("gelu", "swiglu")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit, "dtype": "bfloat16"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    for r in rows:
        print(f"\nC={r['C']} M={r['M']} {r['activation']}")
        base = r["LN + fused MLP fwd+bwd ms"]
        base_graph = r["LN + fused MLP fwd+bwd graph ms"]
        print(f"{'path':28s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'graph ms':>9s} {'speedup vs LN + fused':>22s} "
              f"{'(graph)':>8s} {'rel err':>9s}")
        for name in ("eager LN + eager MLP", "torch.compile(LN + MLP)", "LN + fused MLP", "fused MLP with LN folded",
                     "LN alone"):
            err, graph = r.get(f"{name} rel err"), r[f"{name} fwd+bwd graph ms"]
            print(f"{name:28s} {r[f'{name} fwd ms']:8.3f} {r[f'{name} fwd+bwd ms']:11.3f} "
                  f"{graph if graph is not None else float('nan'):9.3f} {base / r[f'{name} fwd+bwd ms']:22.2f} "
                  f"{(base_graph / graph) if graph and base_graph else float('nan'):8.2f} {'' if err is None else f'{err:9.2e}'}")


if __name__ == "__main__":
    main()
