"""The classifier probes' shared parts: their shape arguments, a call's GPU time by CUDA events, and its kernels under
torch.profiler."""

import argparse
import statistics

import torch


def shape_args():
    """(M, C, V) from --M --C --V, GPT-2's classifier shape by default."""
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--V", type=int, default=50304)
    a = p.parse_args()
    return a.M, a.C, a.V


def ms(fn, n=20, sleep=False):
    """Median ms of n calls of fn (after one warm call). sleep: a ~10 ms sleep kernel first holds the GPU while the
    host enqueues the call, so the host's launch latency is not counted (GPU time alone)."""
    fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep:
            torch.cuda._sleep(20_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_table(call, title, calls=5, top=None, width=100):
    """Print fn's GPU kernels under torch.profiler: ms per call and launches per `calls` calls, largest first, and
    the GPU busy time per call."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = total.setdefault(e.name[:width], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time / 1000 / calls
    print(f"--- {title}: ms per call (launches per {calls} calls)")
    for name, (n, t) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t:7.3f}  x{n:<4} {name}")
    print(f"  {sum(v[1] for v in total.values()):7.3f}  GPU busy per call")
