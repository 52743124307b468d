"""Why is the FP8 step slower than bf16 fused's outside CUDA graphs (0.88x uncompiled, 0.99x compiled) when
its kernels take less GPU time? For each variant, a few training steps of bench.py's (no synchronization between
them) under torch.profiler, CPU and CUDA: the step's wall time against the GPU's busy time, the CUDA runtime calls
that can stall the host or the GPU (synchronizations, allocations, copies) with their count and host time, and the
GPU's idle gaps longer than --gap_us, each charged to the innermost host operator running when it began: what the
GPU waited on.

    PYTHONPATH=. python lab/fp8/step_gaps.py configs/gpt2_124m.py --variants=fused,fp8,fused+compile,fp8+compile
    (--weight_graphs=0,1: FP8State's weight remake with and without its CUDA graph, as extra fp8 variants)
"""

import argparse
import collections
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import bench
from fused_ops.fp8 import state as fp8_state

RUNTIME = ("Synchronize", "Malloc", "Free", "Memcpy", "Memset", "GraphLaunch", "HostAlloc", "EventQuery",
           "StreamWaitEvent", "EventRecord")


def analyse(prof, steps, gap_us):
    cuda = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0)
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    busy, gaps, end = 0.0, [], None
    for s, e in cuda:  # merged busy intervals (streams may overlap) and the gaps between them
        if end is not None and s > end + gap_us:
            gaps.append((end, s))
        if end is None or s > end:
            busy += e - s
        elif e > end:
            busy += e - end
        end = e if end is None else max(end, e)
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in cpu:
        if e.name.startswith("cuda") and any(k in e.name for k in RUNTIME):
            runtime[e.name][0] += 1
            runtime[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    ops = [e for e in cpu if not e.name.startswith(("cuda", "cu"))]
    charged = collections.Counter()
    for s, e in gaps:  # the innermost (shortest) host operator running when the GPU went idle
        around = [o for o in ops if o.time_range.start <= s <= o.time_range.end]
        name = min(around, key=lambda o: o.time_range.end - o.time_range.start).name if around else "(none)"
        charged[name[:60]] += (e - s) / 1e3
    span = (cuda[-1][1] - cuda[0][0]) / 1e3 if cuda else 0.0
    return dict(span=span / steps, busy=busy / 1e3 / steps, idle=sum(e - s for s, e in gaps) / 1e3 / steps,
                gaps=len(gaps) / steps, runtime=runtime, charged=charged, inside=inside(cpu))


def inside(cpu, prefix="fused_mlp::"):
    """Per call of each of our operators (names starting with prefix): its host time, and the host time of what runs
    inside it by name (the outermost events only; what is left is Python and launches the profiler does not name)."""
    out = {}
    cpu = sorted(cpu, key=lambda e: (e.time_range.start, -e.time_range.end))
    for i, op in enumerate(cpu):
        if not op.name.startswith(prefix):
            continue
        s, e = op.time_range.start, op.time_range.end
        row = out.setdefault(op.name, dict(calls=0, total=0.0, children=collections.Counter(),
                                           counts=collections.Counter()))
        row["calls"] += 1
        row["total"] += (e - s) / 1e3
        covered_to = s
        for c in cpu[i + 1:]:
            if c.time_range.start >= e:
                break
            if c.time_range.start < covered_to:  # nested in an earlier child
                continue
            row["children"][c.name[:50]] += (c.time_range.end - c.time_range.start) / 1e3
            row["counts"][c.name[:50]] += 1
            covered_to = c.time_range.end
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--variants", default="fused,fp8,fused+compile,fp8+compile")
    ap.add_argument("--weight_graphs", default="1", help="fp8 variants with FP8State's weight graph on (1) / off (0)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gap_us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--gc_freeze", action="store_true", help="gc.freeze() after the warm-up steps")
    ap.add_argument("--cprofile", type=int, default=0, help="also this many of fused_ops' functions by own host time")
    a = ap.parse_args()
    args = bench.parse_args([a.config])
    args.warmup = 6
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    rows = {}
    for v in a.variants.split(","):
        mlp, compiled = bench.parse_variant(v)
        for wg in (a.weight_graphs.split(",") if mlp == "fp8" else ["1"]):
            fp8_state.WEIGHT_GRAPHS = wg == "1"
            name = v + ("" if mlp != "fp8" or a.weight_graphs == "1" else f" wg={wg}")
            model, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
            for i in range(args.warmup):
                step(i)
            if a.gc_freeze:
                gc.freeze()  # what is alive now (the model, the compiled code) is never scanned again
            torch.cuda.synchronize()
            collections_ = collections.Counter()  # the garbage collector's time in the timed steps, by generation
            started = {}

            def timer(phase, info):
                if phase == "start":
                    started["t"] = time.perf_counter()
                else:
                    collections_[info["generation"]] += time.perf_counter() - started["t"]
            gc.callbacks.append(timer)
            t0 = time.perf_counter()
            for i in range(10):
                step(i)
            host = (time.perf_counter() - t0) / 10
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 10
            gc.callbacks.remove(timer)
            graphs = [b.mlp.fp8.op_graphs for b in model.transformer.h if b.mlp.fp8 is not None]
            if any(g is not None for g in graphs):  # the compiled operators' own CUDA graphs (fused_ops/fp8/graphs.py)
                replays = sum(c.replays for g in graphs if g is not None for c in g.graphs.values())
                calls = sum(g.calls for g in graphs if g is not None)
                print(f"\n{name}: the FP8 operators' graphs replayed {replays} of {calls} calls so far")
            print(f"\n{name}: garbage collection in the 10 timed steps, ms per step by generation: "
                  + ", ".join(f"{g}: {1e3 * t / 10:.2f}" for g, t in sorted(collections_.items())))
            if a.cprofile:  # (host-bound variants only: a full launch queue would charge its waits to the launches)
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.enable()
                for i in range(10):
                    step(i)
                torch.cuda.synchronize()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats("fused_ops|_ops.py|autograd", a.cprofile)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for i in range(a.steps):
                    step(i)
                torch.cuda.synchronize()
            r = rows[name] = analyse(prof, a.steps, a.gap_us)
            r["wall"], r["host"] = wall * 1e3, host * 1e3
            print(f"\n== {name}: wall {r['wall']:.2f} ms/step (host enqueue of 10 steps {r['host']:.2f}); profiled: GPU "
                  f"span {r['span']:.2f}, busy {r['busy']:.2f}, idle in {r['gaps']:.0f} gaps > {a.gap_us:.0f} us "
                  f"{r['idle']:.2f} ms/step")
            print("  runtime calls per step (count, host ms):")
            for k, (n, ms) in sorted(r["runtime"].items(), key=lambda kv: -kv[1][1])[:a.top]:
                print(f"    {n / a.steps:8.1f} {ms / a.steps:8.3f}  {k}")
            print("  GPU idle charged to the host operator running when it began (ms/step):")
            for k, ms in r["charged"].most_common(a.top):
                print(f"    {ms / a.steps:8.3f}  {k}")
            for op, row in r["inside"].items():
                n = row["calls"]
                named = sum(row["children"].values())
                print(f"  {op}: {n / a.steps:.0f} calls per step, {1e3 * row['total'] / n:.0f} us each on the host, of "
                      f"which {1e3 * (row['total'] - named) / n:.0f} unnamed (Python, launches); named, us per call:")
                for k, ms in row["children"].most_common(a.top):
                    print(f"    {1e3 * ms / n:8.1f}  x{row['counts'][k] / n:4.1f}  {k}")
            del model, step
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  batch {batch_size}x{model_args['block_size']}")
    print(f"{'variant':<22}{'wall':>8}{'host':>8}{'busy':>8}{'idle':>8}  (ms per step)")
    for name, r in rows.items():
        print(f"{name:<22}{r['wall']:8.2f}{r['host']:8.2f}{r['busy']:8.2f}{r['idle']:8.2f}")


if __name__ == "__main__":
    main()
