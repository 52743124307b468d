"""How large should the classifier's chunks be, and do they gain from holding whole 128-row GEMM tiles
(classifier.chunk_rows, CHUNK_LOGITS)?

    PYTHONPATH=. python lab/classifier/chunk_probe.py [--parts alone,step,small] [--rounds 4]

GPT-2's 12288 rows at about 2^27 logits a chunk: five chunks of 2458 rows, each GEMM ending on a tile one fifth full
("@2^27~2458", the rule before), or four of 2560 and one of 2048 ("@2^27"); at 2^28, three of 4096 ("@2^28"). The
classifier alone at 12288 x 768 x 50304, forward + backward, bf16 and FP8, GPU time (bench_classifier.py's timing),
rounds alternated, against torch.compile of eager, with 2^29 too (two chunks of 6144) ("alone"); and bench.py's
GPT-2 124M step under reduce-overhead at each of CHUNKS, against eager + compile, rounds alternated in one process
("step": wall time; --product: the operators' own chunk sizes, unpatched).
"""

import argparse
import math

import bench_classifier
import rounds as rounds_
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
    M, V = 12288, 50304
    base = bench_classifier.variants()
    unrounded = math.ceil(M / math.ceil(M * V / 2 ** 27))
    fns = {"compile": base["compile"]}
    for name in ("fused", "fp8"):
        fns.update({f"{name}@2^27~{unrounded}": chunked(base[name], 2 ** 27, rows=unrounded),
                    **{f"{name}@2^{e}": chunked(base[name], 2 ** e) for e in (27, 28, 29)}})
    rounds_.alone(fns, rounds, M=M, V=V)


def small_part(rounds):
    """The 16-bit operator at the chunks a quarter of compiled eager's peak memory allows (the memory target:
    the fp32 dW, 0.14 GiB, leaves about 0.15 GiB for a chunk of logits: 2^26 logits, 128 MiB, or less), against
    2^28 (the product) and compiled eager."""
    base = bench_classifier.variants()
    rounds_.alone({"compile": base["compile"], **{f"fused@2^{e}": chunked(base["fused"], 2 ** e) for e in (25, 26, 28)}},
                  rounds)


CHUNKS = (28, 29)  # the step's chunk sizes (log2 of the logits a chunk); run 2 of results/classifier_chunks: 27, 28


def step_part(rounds, product=False):
    """bench.py's step; a variant's "@2^N" runs it with CHUNK_LOGITS = 2^N."""
    def wrap(mlp):
        name, _, logits = mlp.partition("@2^")
        return name, (lambda step: chunked(step, 2 ** int(logits))) if logits else None

    ro = "reduce-overhead"
    variants = [("eager", True)] + [(f"{v}@2^{e}" if not product else v, ro) for v in ("fused+cls", "fp8blocks+cls8")
                                    for e in (CHUNKS if not product else (None,))]
    rounds_.step(variants, rounds, wrap)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--parts", default="alone,step")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--product", action="store_true", help="step: the product's own chunks (no @2^N variants)")
    args = p.parse_args()
    if "alone" in args.parts:
        alone_part(args.rounds)
    if "small" in args.parts:
        small_part(args.rounds)
    if "step" in args.parts:
        step_part(args.rounds, args.product)


if __name__ == "__main__":
    main()
