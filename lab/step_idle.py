"""Where does a step's GPU idle time go ("the GPU waits 2.5 ms a step on the host")? For each variant, bench.py's
steps two ways: timed one by one from a synchronized start to a synchronized end (bench.py's clock), and back to back
with no synchronization between them (train.py's loop, whose host runs ahead). Under torch.profiler (CPU and CUDA), a
synchronized step's idle GPU time is split into:
- start: from the step's first host line to its first kernel (the host's work before anything reaches the GPU);
- launch gaps: gaps between consecutive kernels shorter than --gap_us (a kernel's launch latency and tail: the GPU's
  own cost of running many small kernels, which no host speed removes; CUDA graphs included);
- host gaps: the longer gaps, each charged to the innermost host operator running when it began (what the GPU waited
  on).

    python lab/step_idle.py configs/gpt2_124m.py --variants=fp8+cls8+compile
    (one variant per process is safest: plain compile and reduce-overhead in one process have crashed an H100)
"""

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import bench


def merged_kernels(events):
    """The CUDA kernels' busy intervals (µs), overlapping ones merged (streams may overlap)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0)
    merged = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def split_idle(prof, gap_us):
    """Per synchronized step (a "step" record_function range): start, launch gaps, host gaps (µs), the kernels'
    count and busy time, and the host operators the host gaps are charged to."""
    events = list(prof.events())
    steps = sorted((e.time_range.start, e.time_range.end) for e in events  # (the host's ranges, not their GPU copies)
                   if e.name == "step" and e.device_type == torch.autograd.DeviceType.CPU)
    kernels = merged_kernels(events)
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
           and not e.name.startswith(("cuda", "cu", "step"))]
    rows, charged = [], collections.Counter()
    ends = [t for t, _ in steps[1:]] + [float("inf")]
    for (s0, _), s1 in zip(steps, ends):  # a step's kernels: those that start before the next step does
        inside = [k for k in kernels if s0 <= k[0] < s1]
        if not inside:
            continue
        row = dict(start=inside[0][0] - s0, launch=0.0, host=0.0, gaps=0, busy=sum(e - s for s, e in inside),
                   span=inside[-1][1] - s0)
        for (_, e), (s, _) in zip(inside, inside[1:]):
            gap = s - e
            if gap < gap_us:
                row["launch"] += gap
            else:
                row["host"] += gap
                row["gaps"] += 1
                around = [o for o in ops if o.time_range.start <= e <= o.time_range.end]
                name = min(around, key=lambda o: o.time_range.end - o.time_range.start).name if around else "(none)"
                charged[name[:70]] += gap / len(steps)
        rows.append(row)
    return rows, charged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--variants", default="fp8+cls8+compile")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, each way")
    ap.add_argument("--profiled", type=int, default=4, help="synchronized steps under the profiler")
    ap.add_argument("--gap_us", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    args = bench.parse_args([a.config])
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    table = {}
    for v in a.variants.split(","):
        mlp, compiled = bench.parse_variant(v)
        model, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
        for i in range(6):
            step(i)
        torch.cuda.synchronize()
        synced, back = [], []
        for r in range(4):  # the two clocks alternated, a quarter of the steps at a time
            for i in range(a.steps // 4):
                t0 = time.perf_counter()
                step(i)
                torch.cuda.synchronize()
                synced.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(a.steps // 4):
                step(i)
            torch.cuda.synchronize()
            back.append((time.perf_counter() - t0) / (a.steps // 4))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(a.profiled):
                torch.cuda.synchronize()
                with torch.profiler.record_function("step"):
                    step(i)
                torch.cuda.synchronize()
        rows, charged = split_idle(prof, a.gap_us)
        med = {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0]}
        table[v] = dict(synced=statistics.median(synced) * 1e3, back=statistics.median(back) * 1e3, **med)
        print(f"\n== {v}: host gaps (>= {a.gap_us:.0f} µs) charged to the host operator running when each began, ms/step:")
        for name, us in charged.most_common(a.top):
            print(f"  {us / 1e3:7.3f}  {name}")
        del model, step
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  batch {batch_size}x{model_args['block_size']}"
          f"  x{args.grad_accum}; ms per step (profiled: medians of {a.profiled} synchronized steps)")
    cols = [("synced", "synced wall"), ("back", "back-to-back"), ("span", "prof. span"), ("busy", "kernels busy"),
            ("start", "start"), ("launch", f"gaps<{a.gap_us:.0f}us"), ("host", "host gaps"), ("gaps", "host gaps (n)")]
    print(f"{'variant':<28}" + "".join(f"{c:>14}" for _, c in cols))
    for v, r in table.items():
        print(f"{v:<28}" + "".join(f"{r[k] * (1e3 if k == 'gaps' else 1):14.2f}" for k, _ in cols))


if __name__ == "__main__":
    main()
