"""Probe: where does DDP's gradient all-reduce run against the backward, and what does the bucket size change?

One GPT-2 124M training step per GPU under torchrun (bench.py's step: DDP inside torch.compile, as train.py runs
it), traced with torch.profiler on rank 0. From the trace: the step's span on the GPU, the NCCL kernels' total
time, and how much of it is exposed (no compute kernel running beside it). Plain torch.compile, so that every
kernel shows in the trace (under CUDA graphs the kernels hide inside graph launches); the communication pattern
is the same. Also the median step time for each --buckets value, rounds alternated.

    torchrun --standalone --nproc_per_node=2 lab/ddp_overlap.py configs/gpt2_124m.py --mlps=fused --buckets=25,100
"""

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import bench


def intervals(trace_events, nccl):
    """Merged [start, end) GPU-kernel intervals (µs) of NCCL kernels (nccl=True) or of all the others."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events
                   if e.get("cat") == "kernel" and e["name"].startswith("nccl") == nccl)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def exposed(comm, compute):
    """Time in comm's intervals with no compute interval beside it."""
    total = 0.0
    for a, b in comm:
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute)
        total += (b - a) - covered
    return total


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--buckets")]
    buckets = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--buckets=")), "25")
    args = bench.parse_args(argv)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    args.device = f"cuda:{os.environ['LOCAL_RANK']}"
    torch.cuda.set_device(args.device)
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    mlp, compiled = args.mlps.split(",")[0], bench.compile_setting(args.compile.split(",")[0])
    steps = {}
    for mb in buckets.split(","):
        args.bucket_mb = float(mb)
        model, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
        for i in range(args.warmup):
            step(i)
        steps[float(mb)] = (model, step, [])
    for r in range(4):
        for mb in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            _, step, times = steps[mb]
            for i in range(args.steps):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(i)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
    rows = []
    for mb, (_, step, times) in steps.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(0)
            torch.cuda.synchronize()
        if rank == 0:
            path = f"/tmp/ddp_overlap_{mb}.json"
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            comm, compute = intervals(events, True), intervals(events, False)
            span = max(b for _, b in comm + compute) - min(a for a, _ in comm + compute)
            rows.append((mb, statistics.median(times), min(times), max(times), span / 1e3,
                         sum(b - a for a, b in comm) / 1e3, exposed(comm, compute) / 1e3, len(comm)))
    if rank == 0:
        print(f"\n{torch.cuda.get_device_name()}, {dist.get_world_size()} GPUs, {mlp} compile={compiled}, "
              f"{args.grad_accum} micro-step(s) of {batch_size}x{model_args.get('block_size')} per GPU")
        print(f"{'bucket MB':>9}{'step ms':>9}{'min-max':>14}{'traced ms':>10}{'NCCL ms':>9}{'exposed ms':>11}{'NCCL runs':>10}")
        for mb, med, lo, hi, span, comm, exp, n in rows:
            print(f"{mb:9.0f}{med:9.2f}{lo:7.2f}-{hi:<6.2f}{span:10.2f}{comm:9.2f}{exp:11.2f}{n:10d}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
