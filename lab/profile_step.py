"""Where does a training step's time go? For each variant (eager / fused, with or without torch.compile),
the same steps as bench.py: wall ms per step, host ms to enqueue a step (no synchronization inside), the
GPU's busy time per step (sum of kernel times from torch.profiler), and the kernels grouped by kind.

    python lab/profile_step.py configs/gpt2_124m.py [--activation=swiglu] [--variants=eager+compile,fused+compile]
    (a variant is eager or fused, optionally +compile or +<a torch.compile mode>, e.g. fused+reduce-overhead;
    --cpu-ops N lists the operators by host time, --cprofile N the Python functions, --gaps N the GPU's idle time
    between the profiled steps' kernels, --who REGEX the operators that launch the kernels matching REGEX)

A step whose host time exceeds its GPU time is host-bound (the GPU waits on Python); otherwise the kernel
table says which kernels the time goes to.
"""

import argparse
import collections
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import bench

# Kernel name patterns -> kind (first match wins), to compare variants whose kernels have different names.
KINDS = [
    ("fused fwd (linear_act)", r"linear_act_kernel"),
    ("fused dgrad", r"dgrad_kernel"),
    ("fused ping-pong (fwd + dgrad)", r"pingpong_kernel"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul (cuBLAS)", r"gemm|sm90_xmma|cutlass|nvjet|ampere_|sm80_"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("inductor fused", r"^triton_"),
    ("elementwise / reduce (ATen)", r"elementwise|reduce|vectorized|unrolled"),
]


def kind(name):
    return next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")


def profile_variant(model_args, state, mlp, compiled, batches, args, dtype, steps=3):
    _, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    wall, host = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(i)
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    if args.cprofile:  # where the host time goes: Python functions by own time and by cumulative time
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.steps):
            step(i)
        torch.cuda.synchronize()
        prof.disable()
        for order in ("tottime", "cumulative"):
            pstats.Stats(prof).sort_stats(order).print_stats(args.cprofile)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.cpu_ops or args.who:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    if args.cpu_ops:  # host time per operator over the profiled steps (the profiler's own overhead included)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.cpu_ops))
    if args.who:  # which operators launch the kernels matching this pattern (their chain of callers, innermost first)
        who = collections.Counter()
        for e in prof.events():
            for k in getattr(e, "kernels", []):
                if re.search(args.who, k.name):
                    chain, p = [], e
                    while p is not None and len(chain) < 5:
                        chain.append(p.name[:40])
                        p = p.cpu_parent
                    who[" < ".join(chain)] += k.duration / steps / 1e3
        for chain, ms in who.most_common(10):
            print(f"  {ms:7.3f} ms/step  {chain}")
    per_kind, per_kernel, launches, kernels = collections.Counter(), collections.Counter(), 0, []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            launches += 1
            per_kind[kind(e.name)] += e.device_time / steps / 1e3  # ms per step
            per_kernel[e.name[:70]] += e.device_time / steps / 1e3
            kernels.append((e.time_range.start, e.time_range.end, e.name))
    return {"wall_ms": statistics.median(wall) * 1e3, "host_ms": statistics.median(host) * 1e3,
            "gpu_ms": sum(per_kind.values()), "kinds": per_kind, "kernels": per_kernel, "launches": launches / steps,
            "timeline": kernels, "steps": steps}


def print_gaps(kernels, steps, top):
    """The GPU's idle time between the profiled steps' kernels (µs): in all, split into short gaps (< 10 µs: a
    launch's latency inside a graph) and long ones (the GPU waiting for the host), by the kernel that follows, and
    the longest gaps with the kernels on either side."""
    kernels.sort()
    gaps, by_next, end, prev = [], collections.Counter(), None, None
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps.append((start - end, prev, name))
            by_next[kind(name) + ": " + name[:50]] += (start - end) / steps
        end, prev = stop if end is None else max(end, stop), name
    total = sum(g for g, _, _ in gaps) / steps
    short = sum(g for g, _, _ in gaps if g < 10) / steps
    print(f"  idle between kernels: {total / 1e3:.3f} ms a step ({short / 1e3:.3f} in gaps under 10 µs, "
          f"{sum(1 for g, _, _ in gaps if g < 10) / steps:.0f} of them; the rest in "
          f"{sum(1 for g, _, _ in gaps if g >= 10) / steps:.0f} longer ones; the steps' boundaries included)")
    for name, us in by_next.most_common(top):
        print(f"    {us:8.1f} µs a step before  {name}")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"    longest: {g:8.1f} µs  {a[:40]}  ->  {b[:40]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--activation")
    ap.add_argument("--variants", default="eager,fused,eager+compile,fused+compile")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    ap.add_argument("--cprofile", type=int, default=0, help="also list this many Python functions by host time")
    ap.add_argument("--cpu-ops", type=int, default=0, help="also list this many operators by host (CPU) time")
    ap.add_argument("--gaps", type=int, default=0, help="also list the GPU's idle time between kernels (this many rows)")
    ap.add_argument("--who", help="also list the operators that launch the kernels matching this regular expression")
    a = ap.parse_args()
    args = bench.parse_args([a.config] + ([f"--activation={a.activation}"] if a.activation else []))
    args.warmup, args.steps, args.cprofile, args.cpu_ops, args.who = a.warmup, a.steps, a.cprofile, a.cpu_ops, a.who
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    results = {}
    for v in a.variants.split(","):
        mlp, compiled = bench.parse_variant(v)  # fused, fused+compile, fused+reduce-overhead (a torch.compile mode)
        results[v] = r = profile_variant(model_args, state, mlp, compiled, batches, args, dtype)
        print(f"\n== {v}: top kernels, ms per step")
        for name, ms in r["kernels"].most_common(a.top):
            print(f"  {ms:7.3f}  {name}")
        if a.gaps:
            print_gaps(r["timeline"], r["steps"], a.gaps)

    kinds = sorted({k for r in results.values() for k in r["kinds"]}, key=lambda k: -max(r["kinds"][k] for r in results.values()))
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {model_args}  batch {batch_size}")
    print(f"{'ms per step':<30}" + "".join(f"{v:>16}" for v in results))
    for label, key in (("wall", "wall_ms"), ("host (enqueue)", "host_ms"), ("GPU busy (kernels)", "gpu_ms"),
                       ("kernels (count)", "launches")):
        print(f"{label:<30}" + "".join(f"{r[key]:16.2f}" for r in results.values()))
    for k in kinds:
        print(f"  {k:<28}" + "".join(f"{r['kinds'][k]:16.2f}" for r in results.values()))


if __name__ == "__main__":
    main()
