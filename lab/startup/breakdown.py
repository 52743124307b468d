"""Where start-up time goes on a GPU, and what a whole run costs: train.py runs of one config under named settings,
each with cold caches (fresh Triton, Inductor and fused_ops tuning caches) and then warm (the same folders again),
alternated. Each run's wall-clock time (the process, Python's start included), its start-up and whole-run lines
(helpers/timing.py), torch.compile's time by phase (dynamo's compile_times), its median step time and its
evaluations' seconds are collected, then a table with each setting's median and range.

    python lab/startup/breakdown.py configs/gpt2_124m.py --max_iters=200 --repeats=1 \\
        --settings "eager+compile=--mlp=eager --compile=True" \\
                   "fastest=--mlp=fused --fp8=True --fp8_reach=blocks --classifier=fp8 --compile=reduce-overhead"
    python lab/startup/breakdown.py configs/shakespeare_char.py --max_iters=500   # fused against eager

A setting is name=train.py flags (FUSED_OPS_*=value entries among them go to the environment). Other --key=value
go to every run's train.py. ms/step: the median of the logged steps after iteration 100 (or the second half), each
train.py's mean of log_interval steps, host included.
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
# train.py in this process's child, then torch.compile's phases as dynamo kept them (seconds, summed over graphs)
TRAIN = ("import runpy, sys\n"
         "sys.argv = ['train.py', *sys.argv[1:]]\n"
         "try:\n"
         "    runpy.run_path('train.py', run_name='__main__')\n"
         "finally:\n"
         "    from torch._dynamo.utils import compilation_time_metrics as m\n"
         "    top = sorted(((sum(v), k) for k, v in m.items()), reverse=True)[:8]\n"
         "    print('compile phases: ' + ', '.join(f'{k} {s:.1f} s' for s, k in top), flush=True)\n")


def run(flags, caches, config, max_iters, extra):
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "FUSED_OPS_TUNING_CACHE": os.path.join(caches, "tuning.json"), "PYTHONUNBUFFERED": "1"}
    env.update(f.split("=", 1) for f in flags if f.startswith("FUSED_OPS_"))
    out = tempfile.mkdtemp()
    cmd = [sys.executable, "-c", TRAIN, config, f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}",
           "--progress=False", "--plot=False", "--sample_after=False", f"--out_dir={out}",
           *(f for f in flags if not f.startswith("FUSED_OPS_")), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{flags}: {proc.stderr[-3000:]}")
    startup = "\n  ".join(l for l in proc.stdout.splitlines() if l.startswith(("start-up", "run ", "compile phases")))
    matches = re.findall(r"^iter (\d+): loss [\d.]+, ([\d.]+) ms", proc.stdout, re.M)
    steps = [float(ms) for it, ms in matches if int(it) >= min(100, max_iters // 2)]
    first = re.search(r"start-up ([\d.]+) s to the first step", proc.stdout)
    evals = re.findall(r"val loss [\d.]+ \(([\d.]+) s\)", proc.stdout)
    val = re.findall(r"val loss ([\d.]+)", proc.stdout)
    return dict(wall=wall, step=statistics.median(steps) if steps else float("nan"), startup=startup,
                first=float(first.group(1)) if first else float("nan"), evals=evals, val=val[-1] if val else "?")


def spread(values):
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default="configs/shakespeare_char.py")
    p.add_argument("--max_iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=2, help="warm runs of each setting, alternated")
    p.add_argument("--settings", nargs="+", default=["eager=--mlp=eager", "fused=--mlp=fused"])
    args, extra = p.parse_known_args()  # other --key=value go to train.py
    settings = dict(s.split("=", 1) for s in args.settings)
    names = list(settings)
    caches = {name: tempfile.mkdtemp(prefix=f"caches-{name}-") for name in names}
    order = [(name, "cold") for name in names]
    for r in range(args.repeats):  # warm: the other order first, then alternating
        order += [(name, "warm") for name in (names[::-1] if r % 2 == 0 else names)]
    rows = []
    for name, state in order:
        r = run(settings[name].split(), caches[name], args.config, args.max_iters, extra)
        rows.append((name, state, r))
        print(f"{name} {state}: wall {r['wall']:.1f} s, median step {r['step']:.2f} ms, final val {r['val']}, "
              f"evals {r['evals']}\n  {r['startup']}", flush=True)
    print(f"\n{args.config}, {args.max_iters} iterations; settings: {settings}\n\n"
          "| run (in order) | wall-clock s | to the first step s | median ms/step | final val loss | evals s |\n"
          "|---|---|---|---|---|---|")
    for name, state, r in rows:
        print(f"| {name} {state} | {r['wall']:.1f} | {r['first']:.1f} | {r['step']:.2f} | {r['val']} | "
              f"{', '.join(r['evals']) or '-'} |")
    print("\n| setting | wall-clock s, median (range) | to the first step s | ms/step | runs |\n|---|---|---|---|---|")
    for name in names:
        for state in ("cold", "warm"):
            sel = [r for n, s, r in rows if n == name and s == state]
            if sel:
                print(f"| {name} {state} | {spread([r['wall'] for r in sel])} | {spread([r['first'] for r in sel])} "
                      f"| {spread([r['step'] for r in sel])} | {len(sel)} |")


if __name__ == "__main__":
    main()
