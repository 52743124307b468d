"""Where start-up time goes on a GPU: train.py runs of configs/shakespeare_char.py, fused and eager, each with
cold caches (fresh Triton and Inductor cache folders) and then warm (the same folders again), alternated.
Each run's wall-clock time, its start-up line (startup.py) and its median step time are collected.

    python lab/startup/breakdown.py --max_iters=500 --repeats=2
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(mlp, caches, max_iters, extra):
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"), "PYTHONUNBUFFERED": "1"}
    out = tempfile.mkdtemp()
    cmd = [sys.executable, "train.py", "configs/shakespeare_char.py", f"--mlp={mlp}", f"--max_iters={max_iters}",
           f"--lr_decay_iters={max_iters}", "--progress=False", "--plot=False", "--sample_after=False",
           "--log_interval=1", f"--out_dir={out}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mlp}: {proc.stderr[-3000:]}")
    startup = next((l for l in proc.stdout.splitlines() if l.startswith("start-up")), "")
    matches = re.findall(r"^iter (\d+): loss [\d.]+, ([\d.]+) ms", proc.stdout, re.M)
    steps = [float(ms) for it, ms in matches if int(it) >= min(100, max_iters // 2)]
    evals = re.findall(r"val loss [\d.]+ \(([\d.]+) s\)", proc.stdout)
    return wall, statistics.median(steps) if steps else float("nan"), startup, evals


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max_iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[])
    args, rest = p.parse_known_args()
    args.extra += rest  # other --key=value go to train.py
    caches = {mlp: tempfile.mkdtemp(prefix=f"caches-{mlp}-") for mlp in ("eager", "fused")}
    rows = []
    order = [("eager", "cold"), ("fused", "cold")]
    for r in range(args.repeats):
        order += [("fused", "warm"), ("eager", "warm")] if r % 2 == 0 else [("eager", "warm"), ("fused", "warm")]
    for mlp, state in order:
        wall, step, startup, evals = run(mlp, caches[mlp], args.max_iters, args.extra)
        rows.append((mlp, state, wall, step, evals))
        print(f"{mlp} {state}: wall {wall:.1f} s, median step {step:.2f} ms (after iter 100), evals {evals}\n  {startup}",
              flush=True)
    print("\n| run | wall-clock s | median ms/step | evals s |\n|---|---|---|---|")
    for mlp, state, wall, step, evals in rows:
        print(f"| {mlp} {state} | {wall:.1f} | {step:.2f} | {', '.join(evals)} |")


if __name__ == "__main__":
    main()
