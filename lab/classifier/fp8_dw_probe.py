"""Does the FP8 classifier gain from its dW GEMM in FP8 (fp8/classifier.py's gradient kernel writing the e5m2
gradient twice, row-major and transposed), against dW in 16 bits from the 16-bit gradient written over the logits
(the operator before, kept here as "~dw16")?

    PYTHONPATH=. python lab/classifier/fp8_dw_probe.py [--parts kernel,alone,step] [--rounds 4]

kernel: at one chunk of GPT-2's head (4096 x 50304, bf16 logits), do_bench medians of the gradient kernel for
       tiles and splits around the product's (BLOCK_R, BLOCK_V, V_SPLITS, warps), GB/s of its 4 bytes an element
       (bf16 read, two e5m2 writes), against the 16-bit row kernel's gradient pass it replaces (6 bytes an element).

alone: the classifier alone at 12288 x 768 x 50304, forward + backward, GPU time (bench_classifier.py's timing),
       rounds alternated, against torch.compile of eager; peak memory; dW against compiled eager's.
step:  bench.py's GPT-2 124M step under reduce-overhead, the fastest setting (FP8 MLP and attention, FP8 classifier)
       with and without, and the fused MLP + fused classifier in bf16, against eager + compile, rounds alternated in
       one process (wall time per step).
"""

import argparse
import itertools
import statistics

import torch
from torch import Tensor

import bench
import bench_classifier
import bench_mlp
from triton.testing import do_bench

from fused_ops import classifier as core
from fused_ops.fp8 import classifier as fp8_classifier
from fused_ops.fp8.kernels import E5M2, quantize_weight_fused
from fused_ops.ops import fused_op


@fused_op("probe_fp8_linear_cross_entropy_dw16")
def dw16_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
            grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 classifier as it was (tree 0df8b30): the row kernel writes the 16-bit gradient over the logits and
    g8 beside it; dW += dlogitsᵀ @ x in 16 bits."""
    M, V = x.shape[0], weight.shape[0]
    x8, _, inv_x = quantize_weight_fused(x, transposed=False)
    w8, w8t, inv_w = quantize_weight_fused(weight)
    xc = x.to(dtype)
    count = (targets != ignore_index).sum()
    inv_g = (count.clamp(min=1).float() * core.GRAD8_SCALE).reciprocal().reshape(1)
    losses = []
    dx = torch.empty((M, x.shape[1]), device=x.device, dtype=dtype)
    dw = torch.empty(weight.shape, device=weight.device, dtype=torch.float32)
    rows = core.chunk_rows(M, V)
    buffer = torch.empty((min(rows, M), V), device=x.device, dtype=dtype)
    grad8 = torch.empty((min(rows, M), V), device=x.device, dtype=E5M2)
    for start in range(0, M, rows):
        n = min(rows, M - start)
        logits = buffer[:n]
        partial = core.logits_and_partials(x8[start:start + n], w8, logits, inv=(inv_x, inv_w))
        losses.append(core.cross_entropy_rows(logits, targets[start:start + n], count, ignore_index, True,
                                              grad8=grad8[:n], grad8_scale=core.GRAD8_SCALE, partial=partial))
        torch._scaled_mm(grad8[:n], w8t.t(), scale_a=inv_g, scale_b=inv_w, out_dtype=dtype, out=dx[start:start + n])
        core._accumulate(dw, logits.t(), xc[start:start + n], first=start == 0)
    del buffer, logits, grad8
    loss = torch.cat(losses).sum() / count
    return loss, dx.to(x.dtype), dw.to(weight.dtype)


@dw16_op.register_fake
def _(x, weight, targets, ignore_index, dtype, grad):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape)


DW16 = core.loss_function(dw16_op)


def dw16(x, w, t):
    return core.run_classifier(DW16, x, w, t, -1)


def kernel_part():
    n, V = 4096, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, V, device="cuda", generator=g) * 3).bfloat16()
    t = torch.randint(0, V, (n,), device="cuda", generator=g)
    count = (t != -1).sum()
    lse = torch.logsumexp(logits.float(), -1)
    g8, g8t = torch.empty(n, V, device="cuda", dtype=E5M2), torch.empty(V, n, device="cuda", dtype=E5M2)
    saved = fp8_classifier.BLOCK_R, fp8_classifier.BLOCK_V, fp8_classifier.V_SPLITS
    rows = []
    for r, v, s, w in itertools.product((32, 64), (128, 256), (2, 4), (4, 8)):
        fp8_classifier.BLOCK_R, fp8_classifier.BLOCK_V, fp8_classifier.V_SPLITS = r, v, s
        real = fp8_classifier._gradient_kernel.run

        def run(*a, **k):  # (the warps: launched by gradients8 as num_warps=4)
            return real(*a, **{**k, "num_warps": w})
        fp8_classifier._gradient_kernel.run = run
        try:
            ms = do_bench(lambda: fp8_classifier.gradients8(logits, lse, t, -1, g8, g8t), warmup=20, rep=100)
        finally:
            fp8_classifier._gradient_kernel.run = real
        rows.append((ms, (r, v, s, w)))
    fp8_classifier.BLOCK_R, fp8_classifier.BLOCK_V, fp8_classifier.V_SPLITS = saved
    scratch = logits.clone()
    row_ms = do_bench(lambda: core.cross_entropy_rows(scratch.copy_(logits), t, count, -1, True,
                                                      grad8=g8, partial=None), warmup=20, rep=100)
    copy_ms = do_bench(lambda: scratch.copy_(logits), warmup=20, rep=100)
    print(f"\nthe gradient kernel at one chunk, {n} x {V} (do_bench, µs; GB/s of 4 bytes an element)")
    for ms, cfg in sorted(rows)[:8] + [row for row in rows if row[1] == (32, 256, 4, 4)]:
        print(f"  BLOCK_R, BLOCK_V, V_SPLITS, warps = {cfg}: {ms * 1e3:7.1f} µs  {4 * n * V / ms / 1e6:6.0f} GB/s")
    print(f"  the 16-bit row kernel, two reads, gradient in place and g8 (less a copy of the logits): "
          f"{(row_ms - copy_ms) * 1e3:7.1f} µs; the copy {copy_ms * 1e3:.1f} µs")


def alone_part(rounds):
    M, C, V = 12288, 768, 50304
    x, w, t = bench_classifier.inputs(M, C, V)
    base = bench_classifier.variants()
    fns = {"compile": base["compile"], "fp8": base["fp8"], "fp8~dw16": dw16, "fused": base["fused"]}
    bench_classifier.call(fns["compile"], x, w, t)
    ref = w.grad.float().clone()
    peak, diff, times = {}, {}, {n: [] for n in fns}
    for name, fn in fns.items():
        for _ in range(3):
            bench_classifier.call(fn, x, w, t)
        diff[name] = float((w.grad.float() - ref).norm() / ref.norm())
        peak[name] = bench_classifier.peak_gib(fn, x, w, t)
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(bench_classifier.time_ms(fns[name], x, w, t, 10))
    base_ms = statistics.median(times["compile"])
    print(f"\nthe classifier alone, {M} x {C} x {V}, fwd + bwd, GPU time, {rounds} rounds alternated")
    print(f"{'variant':<12}{'ms':>8}{'vs compile':>12}{'peak GiB':>10}{'dW vs compile':>15}  rounds")
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:<12}{ms:8.3f}{ms / base_ms:11.3f}x{peak[name]:10.2f}{diff[name]:15.2e}  "
              + " ".join(f"{m:.3f}" for m in times[name]))


def step_part(rounds):
    real = bench.make_step

    def make_step(model_args, state, mlp, compiled, batches, args, dtype):
        model, step = real(model_args, state, mlp.replace("~dw16", ""), compiled, batches, args, dtype)
        if "~dw16" in mlp:  # (torch.compile traces on the first step: the attribute is read then)
            model.fused_classifier = dw16
        return model, step

    bench.make_step = make_step
    args = bench.parse_args(["configs/gpt2_124m.py", f"--rounds={rounds}", "--steps=20", "--warmup=8"])
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    ro = "reduce-overhead"
    variants = [("eager", True), ("fused+cls", ro), ("fp8blocks+cls8", ro), ("fp8blocks+cls8~dw16", ro)]
    with bench_mlp.backward_thread(args):  # (as bench.main)
        rows = bench.run_interleaved(model_args, state, variants, batches, args, dtype)
    base = rows[0]["ms_per_step"]
    print(f"\nGPT-2 124M step, 12 x 1024 tokens, {torch.cuda.get_device_name()}, {rounds} rounds alternated")
    print(f"{'variant':<40}{'ms/step':>9}{'vs eager+compile':>18}  first losses  rounds")
    for r in rows:
        print(f"{bench.label(r):<40}{r['ms_per_step']:9.2f}{base / r['ms_per_step']:17.3f}x  "
              + " ".join(f"{v:.4f}" for v in r["first_losses"][:3]) + "  " + " ".join(f"{m:.2f}" for m in r["round_ms"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--parts", default="kernel,alone,step")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if "kernel" in args.parts:
        kernel_part()
    if "alone" in args.parts:
        alone_part(args.rounds)
    if "step" in args.parts:
        step_part(args.rounds)


if __name__ == "__main__":
    main()
