"""Which of a training step's cuBLAS GEMMs run below the GPU's matmul peak, and by how much?

    PYTHONPATH=. python lab/gemm_census.py configs/gpt2_124m.py [--variants=fused+cls,fp8blocks+cls8] [--steps=3]

One uncompiled step per variant under torch.profiler, shapes recorded: every GEMM operator (aten::mm, addmm, bmm,
_scaled_mm) with the kernels it launched, grouped by operator, shapes and kernel, with its ms per step (GPU time)
and TFLOP/s. Uncompiled so that each kernel has its operator; compiled steps call the same GEMMs at the same shapes
(Inductor hands them to cuBLAS as extern kernels). Our own kernels (the ping-pong MLP, the classifier's logits GEMM)
are not operators here and are not listed. The last table: the GEMMs' total against the same FLOPs at --peak.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import bench

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::baddbmm")


def flops(name, shapes):
    """2 M N K of the operator's (M, K) @ (K, N) (bmm: times the batch)."""
    if name in ("aten::addmm", "aten::baddbmm"):
        shapes = shapes[1:]
    a, b = shapes[0], shapes[1]
    if len(a) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[0] * a[1] * b[1]


def census(step, steps):
    step(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    rows = collections.defaultdict(lambda: [0, 0.0, 0.0])  # (op, shapes, kernel) -> [calls, µs, flop]
    for e in prof.events():
        if e.name not in GEMM_OPS or not e.kernels:
            continue
        shapes = tuple(tuple(s) for s in e.input_shapes if s)
        kernel = max(e.kernels, key=lambda k: k.duration).name
        r = rows[(e.name.removeprefix("aten::"), shapes[:2] if e.name != "aten::addmm" else shapes[:3], kernel[:60])]
        r[0] += 1
        r[1] += sum(k.duration for k in e.kernels)
        r[2] += flops(e.name, shapes)
    return {k: (c / steps, us / steps / 1e3, f / steps) for k, (c, us, f) in rows.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--variants", default="fused+cls,fp8blocks+cls8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak", type=float, default=750.0, help="bf16 TFLOP/s taken as the floor (FP8: twice)")
    a = ap.parse_args()
    args = bench.parse_args([a.config])
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    summary = []
    for v in a.variants.split(","):
        mlp, compiled = bench.parse_variant(v)
        _, step = bench.make_step(model_args, state, mlp, compiled, batches, args, dtype)
        rows = census(step, a.steps)
        print(f"\n== {v}: GEMM operators, per step (GPU time), slowest total first")
        print(f"{'calls':>6}{'ms':>8}{'TFLOP/s':>9}  op, shapes, kernel")
        total_ms = floor_ms = 0.0
        for (op, shapes, kernel), (calls, ms, f) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            peak = a.peak * (2 if op == "_scaled_mm" else 1)
            total_ms += ms
            floor_ms += f / peak / 1e9
            print(f"{calls:6.0f}{ms:8.3f}{f / ms / 1e9:9.0f}  {op} {shapes} {kernel}")
        summary.append((v, total_ms, floor_ms))
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  batch {batch_size}  {model_args}")
    print(f"{'variant':<24}{'GEMM ms':>9}{'at peak':>9}{'lost':>8}   (peak {a.peak:.0f} TFLOP/s bf16, x2 FP8)")
    for v, ms, floor in summary:
        print(f"{v:<24}{ms:9.2f}{floor:9.2f}{ms - floor:8.2f}")


if __name__ == "__main__":
    main()
