"""Where start-up time goes on a GPU, and what a whole run costs: train.py runs of configs/shakespeare_char.py,
fused and eager, each with cold caches (fresh Triton, Inductor and fused_ops tuning caches) and then warm (the
same folders again), alternated. Each run's wall-clock time, its start-up line (helpers/timing.py), its median step
time and its evaluations' seconds are collected, then a table with each variant's median and range.

    python lab/startup/breakdown.py --max_iters=500 --repeats=2
    python lab/startup/breakdown.py --max_iters=5000 --cold_order=fused,eager --repeats=2   # issue 28's runs

The config is run as it is (log_interval 10, as a user runs it): ms/step is the median of the logged steps
after iteration 100, each the mean of 10 steps with the host included.
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
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "FUSED_OPS_TUNING_CACHE": os.path.join(caches, "tuning.json"), "PYTHONUNBUFFERED": "1"}
    out = tempfile.mkdtemp()
    cmd = [sys.executable, "train.py", "configs/shakespeare_char.py", f"--mlp={mlp}", f"--max_iters={max_iters}",
           f"--lr_decay_iters={max_iters}", "--progress=False", "--plot=False", "--sample_after=False",
           f"--out_dir={out}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mlp}: {proc.stderr[-3000:]}")
    startup = "\n  ".join(l for l in proc.stdout.splitlines() if l.startswith(("start-up", "run ")))
    matches = re.findall(r"^iter (\d+): loss [\d.]+, ([\d.]+) ms", proc.stdout, re.M)
    steps = [float(ms) for it, ms in matches if int(it) >= min(100, max_iters // 2)]
    evals = re.findall(r"val loss [\d.]+ \(([\d.]+) s\)", proc.stdout)
    val = re.findall(r"val loss ([\d.]+)", proc.stdout)
    return wall, statistics.median(steps) if steps else float("nan"), startup, evals, val[-1] if val else "?"


def spread(values):
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max_iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=2, help="warm runs of each variant, alternated")
    p.add_argument("--cold_order", default="eager,fused")
    p.add_argument("--extra", nargs="*", default=[])
    args, rest = p.parse_known_args()
    args.extra += rest  # other --key=value go to train.py
    cold = args.cold_order.split(",")
    caches = {mlp: tempfile.mkdtemp(prefix=f"caches-{mlp}-") for mlp in cold}
    order = [(mlp, "cold") for mlp in cold]
    for r in range(args.repeats):  # warm: the other order first, then alternating
        order += [(mlp, "warm") for mlp in (cold[::-1] if r % 2 == 0 else cold)]
    rows = []
    for mlp, state in order:
        wall, step, startup, evals, val = run(mlp, caches[mlp], args.max_iters, args.extra)
        rows.append((mlp, state, wall, step, evals, val))
        print(f"{mlp} {state}: wall {wall:.1f} s, median step {step:.2f} ms (after iter 100), final val {val}, "
              f"evals {evals}\n  {startup}", flush=True)
    print("\n| run (in order) | wall-clock s | median ms/step | final val loss | evals s (first, median of rest) |\n"
          "|---|---|---|---|---|")
    for mlp, state, wall, step, evals, val in rows:
        rest = f"{statistics.median(map(float, evals[1:])):.2f}" if len(evals) > 1 else "-"
        print(f"| {mlp} {state} | {wall:.1f} | {step:.2f} | {val} | {evals[0] if evals else '-'}, {rest} |")
    print("\n| variant | wall-clock s, median (range) | ms/step, median (range) | runs |\n|---|---|---|---|")
    for mlp in cold:
        for state in ("cold", "warm"):
            sel = [r for r in rows if r[0] == mlp and r[1] == state]
            print(f"| {mlp} {state} | {spread([r[2] for r in sel])} | {spread([r[3] for r in sel])} | {len(sel)} |")


if __name__ == "__main__":
    main()
