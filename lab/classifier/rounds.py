"""What the classifier probes share: the classifier alone and bench.py's GPT-2 step, variants timed in rounds whose
order alternates, each printed as one table (lse_gemm_probe.py, chunk_probe.py)."""

import statistics

import torch

import bench
import bench_classifier
import bench_mlp


def alone(fns, rounds, M=12288, C=768, V=50304):
    """fns: name -> loss(x, w, t), "compile" (torch.compile of eager) among them. Forward + backward at M x C x V, GPU
    time (bench_classifier.py's timing), peak memory, dx against compiled eager's."""
    x, w, t = bench_classifier.inputs(M, C, V)
    bench_classifier.call(fns["compile"], x, w, t)
    ref = x.grad.float().clone()
    peak, diff, times = {}, {}, {n: [] for n in fns}
    for name, fn in fns.items():
        for _ in range(3):
            bench_classifier.call(fn, x, w, t)
        diff[name] = float((x.grad.float() - ref).norm() / ref.norm())
        peak[name] = bench_classifier.peak_gib(fn, x, w, t)
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(bench_classifier.time_ms(fns[name], x, w, t, 10))
    base = statistics.median(times["compile"])
    print(f"\nthe classifier alone, {M} x {C} x {V}, fwd + bwd, GPU time, {rounds} rounds alternated")
    print(f"{'variant':<18}{'ms':>8}{'vs compile':>12}{'peak GiB':>10}{'dx vs compile':>15}  rounds")
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:<18}{ms:8.3f}{ms / base:11.3f}x{peak[name]:10.2f}{diff[name]:15.2e}  "
              + " ".join(f"{m:.3f}" for m in times[name]))


def patch_make_step(wrap):
    """bench.make_step, each variant's name through wrap(name) -> (bench.py's name, a function of its step or None)."""
    real = bench.make_step

    def make_step(model_args, state, mlp, compiled, batches, args, dtype):
        name, around = wrap(mlp)
        model, step = real(model_args, state, name, compiled, batches, args, dtype)
        return model, (around(step) if around else step)

    bench.make_step = make_step


def step(variants, rounds, wrap):
    """bench.py's GPT-2 124M step (configs/gpt2_124m.py, train.py's step, wall time), variants [(name, compile)], the
    first the reference; wrap as patch_make_step's."""
    patch_make_step(wrap)
    args = bench.parse_args(["configs/gpt2_124m.py", f"--rounds={rounds}", "--steps=20", "--warmup=8"])
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    with bench_mlp.backward_thread(args):  # (as bench.main)
        rows = bench.run_interleaved(model_args, state, variants, batches, args, dtype)
    base = rows[0]["ms_per_step"]
    print(f"\nGPT-2 124M step, 12 x 1024 tokens, {torch.cuda.get_device_name()}, {rounds} rounds alternated")
    print(f"{'variant':<40}{'ms/step':>9}{'vs eager+compile':>18}  first losses  rounds")
    for r in rows:
        print(f"{bench.label(r):<40}{r['ms_per_step']:9.2f}{base / r['ms_per_step']:17.3f}x  "
              + " ".join(f"{v:.4f}" for v in r["first_losses"][:3]) + "  "
              + " ".join(f"{m:.2f}" for m in r["round_ms"]))
