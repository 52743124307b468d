"""How large should the classifier's chunks be, and do they gain from holding whole 128-row GEMM tiles
(classifier.chunk_rows, CHUNK_LOGITS)?

    PYTHONPATH=. python lab/classifier/chunk_probe.py [--parts alone,step] [--rounds 4]

GPT-2's 12288 rows at about 2^27 logits a chunk: five chunks of 2458 rows, each GEMM ending on a tile one fifth full
("@2^27~2458", the rule before), or four of 2560 and one of 2048 ("@2^27"); at 2^28, three of 4096 ("@2^28"). The
classifier alone at 12288 x 768 x 50304, forward + backward, bf16 and FP8, GPU time (bench_classifier.py's timing),
rounds alternated, against torch.compile of eager, with 2^29 too (two chunks of 6144) ("alone"); and bench.py's
GPT-2 124M step under reduce-overhead at each of CHUNKS, against eager + compile, rounds alternated in one process
("step": wall time; --product: the operators' own chunk sizes, unpatched).
"""

import argparse
import math
import statistics

import torch

import bench
import bench_classifier
import bench_mlp
from fused_ops import classifier


def chunked(fn, logits, rows=None):
    """fn run with CHUNK_LOGITS = logits (and chunk_rows giving `rows`, if given)."""
    def run(*args):
        saved = classifier.chunk_rows, classifier.CHUNK_LOGITS
        classifier.CHUNK_LOGITS = logits
        if rows:
            classifier.chunk_rows = lambda M, V: rows
        try:
            return fn(*args)
        finally:
            classifier.chunk_rows, classifier.CHUNK_LOGITS = saved
    return run


def alone_part(rounds):
    M, C, V = 12288, 768, 50304
    x, w, t = bench_classifier.inputs(M, C, V)
    base = bench_classifier.variants()
    unrounded = math.ceil(M / math.ceil(M * V / 2 ** 27))
    fns = {"compile": base["compile"]}
    for name in ("fused", "fp8"):
        fns.update({f"{name}@2^27~{unrounded}": chunked(base[name], 2 ** 27, rows=unrounded),
                    **{f"{name}@2^{e}": chunked(base[name], 2 ** e) for e in (27, 28, 29)}})
    peak, times = {}, {n: [] for n in fns}
    for name, fn in fns.items():
        for _ in range(3):
            bench_classifier.call(fn, x, w, t)
        peak[name] = bench_classifier.peak_gib(fn, x, w, t)
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(bench_classifier.time_ms(fns[name], x, w, t, 10))
    ref = statistics.median(times["compile"])
    print(f"\nthe classifier alone, {M} x {C} x {V}, fwd + bwd, GPU time, {rounds} rounds alternated")
    print(f"{'variant':<18}{'ms':>8}{'vs compile':>12}{'peak GiB':>10}  rounds")
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:<18}{ms:8.3f}{ms / ref:11.3f}x{peak[name]:10.2f}  " + " ".join(f"{m:.3f}" for m in times[name]))


CHUNKS = (28, 29)  # the step's chunk sizes (log2 of the logits a chunk); run 2 of results/classifier_chunks: 27, 28


def step_part(rounds, product=False):
    """bench.py's step; a variant's "@2^27" or "@2^28" runs it with that CHUNK_LOGITS."""
    real = bench.make_step

    def make_step(model_args, state, mlp, compiled, batches, args, dtype):
        name, _, logits = mlp.partition("@2^")
        model, step = real(model_args, state, name, compiled, batches, args, dtype)
        return model, (chunked(step, 2 ** int(logits)) if logits else step)

    bench.make_step = make_step
    args = bench.parse_args(["configs/gpt2_124m.py", f"--rounds={rounds}", "--steps=20", "--warmup=8"])
    model_args, batch_size, dtype, batches, state = bench.setup(args)
    ro = "reduce-overhead"
    variants = [("eager", True)] + [(f"{v}@2^{e}" if not product else v, ro) for v in ("fused+cls", "fp8blocks+cls8")
                                    for e in (CHUNKS if not product else (None,))]
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
    p.add_argument("--parts", default="alone,step")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--product", action="store_true", help="step: the product's own chunks (no @2^N variants)")
    args = p.parse_args()
    if "alone" in args.parts:
        alone_part(args.rounds)
    if "step" in args.parts:
        step_part(args.rounds, args.product)


if __name__ == "__main__":
    main()
