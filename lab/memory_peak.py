"""What is alive at a training step's memory peak? For each variant (eager / fused, with or without
torch.compile), one step of bench.py's after warm-up under the CUDA allocator's history recorder: the
step's peak allocated memory above what was allocated before it (the parameters and optimizer state), and
the tensors alive at that moment, grouped by what allocated them (an autograd node such as GeluBackward0,
a line of the project's code, or a kernel of torch.compile's generated code).

    python lab/memory_peak.py configs/shakespeare_char.py [--variants=eager,fused,eager+compile,fused+compile]

The last table puts the variants side by side, one row per origin, so a difference between eager and
fused shows as the rows that differ.
"""

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import bench
import bench_mlp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20


def origin(frames):
    """A short name for what made an allocation, from its stack (innermost frame first)."""
    for f in frames:  # an autograd node's C++ apply: eager backward's own allocations
        m = re.search(r"(\w+Backward\w*)::apply", f.get("name", ""))
        if m:
            return m.group(1)
    compiled = any("torchinductor_" in f.get("filename", "") for f in frames)  # torch.compile's generated code
    for f in frames:  # (whose allocations carry the model's source line they were compiled from)
        name = f.get("filename", "")
        if name.startswith(REPO) and "/lab/" not in name and not name.endswith("bench.py"):
            return ("compiled " if compiled else "") + f"{os.path.relpath(name, REPO)}:{f['line']} {f['name']}"
    return "compiled" if compiled else "other"


def live_at_peak(trace):
    """(peak bytes above the start, {address: (bytes, origin)} of the blocks alive then) from the allocator's
    event trace: an alloc adds its size, a completed free removes it."""
    live, now, peak, at_peak, last = {}, 0, 0, {}, None
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e["frames"])
            now += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
        else:
            continue
        if now > peak:
            peak, at_peak, last = now, dict(live), e["addr"]
    return peak, {a: (size, label(size, frames)) for a, (size, frames) in at_peak.items()}, at_peak[last][1] if last else []


def label(size, frames):
    """origin(frames), with the tensors' size for torch.compile's allocations (a source line there may
    stand for several buffers of the compiled graph)."""
    where = origin(frames)
    return f"{where}, {size / MIB:.2f} MiB each" if where.startswith("compiled") else where


def measure(model_args, state, variant, batches, args, dtype):
    mlp, compiled = bench.parse_variant(variant)
    _, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all")
    step(args.warmup)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, live, peak_frames = live_at_peak(trace)
    by_origin = collections.Counter()
    for size, where in live.values():
        by_origin[where] += size
    return peak, by_origin, peak_frames


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--activation")
    ap.add_argument("--variants", default="eager,fused,eager+compile,fused+compile")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="origins shown in the table")
    bench_mlp.add_backward_thread_arg(ap)
    args = ap.parse_args(argv)
    bench_mlp.backward_thread(args)
    args.device, args.dtype, args.batch_size, args.block_size, args.vocab_size, args.grad_accum = \
        "cuda", None, None, None, None, 1
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    variants = args.variants.split(",")
    results = {v: measure(model_args, state, v, batches, args, dtype) for v in variants}

    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {dtype}  {args.config}  "
          f"batch {batch_size}x{model_args.get('block_size', 1024)}  backward on the {args.backward_thread} thread")
    print("step peak above the step's start (MiB): "
          + ", ".join(f"{v} {results[v][0] / MIB:.1f}" for v in variants))
    for v in variants:  # the allocation that set the peak: where in the step it is
        frames = [f for f in results[v][2] if f.get("filename", "").endswith(".py") or "Backward" in f.get("name", "")]
        print(f"{v}: peak reached at " + " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
                                                      if f.get("filename", "").endswith(".py") else f["name"][:60]
                                                      for f in frames[:4]))
    rows = collections.Counter()
    for _, by_origin, _ in results.values():
        rows.update(by_origin)
    print(f"\nalive at the peak, MiB{'':<37}" + "".join(f"{v:>15}" for v in variants))
    for where, _ in rows.most_common(args.top):
        print(f"{where[-60:]:<60}" + "".join(f"{results[v][1].get(where, 0) / MIB:15.1f}" for v in variants))


if __name__ == "__main__":
    main()
