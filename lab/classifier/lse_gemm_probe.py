"""Does the classifier gain from its own logits GEMM (hopper/pingpong.py's "lse" epilogue: each row's log-sum-exp
per 128 columns written beside the logits, so the row kernel reads the logits once instead of twice)?

    PYTHONPATH=. python lab/classifier/lse_gemm_probe.py [--parts gemm,alone,step] [--rounds 4]
    (--parts variants, order, knobs: gemm with lse_lean_variant.py's epilogues and tile orders beside the product's; they
    write fused_ops/hopper/_probe_*.py, to delete after)

gemm:  at one chunk of GPT-2's head (2458 x 768 x 50304, classifier.chunk_rows), do_bench medians: cuBLAS's GEMM
       (torch.mm; FP8: torch._scaled_mm) against ours with the partials, and the row kernel with two reads of the
       logits against one read plus the partials. GPU time.
alone: the classifier alone at 12288 x 768 x 50304, forward + backward (bench_classifier.py's timing: GPU time),
       with our GEMM and with cuBLAS's ("~cublas"), bf16 and FP8, against torch.compile of eager; rounds alternated.
profile: lab/profile_step.py's kernel table, with and without our GEMM (reduce-overhead).
step:  bench.py's GPT-2 124M step (configs/gpt2_124m.py, 12 x 1024 tokens), the same variants with and without our
       GEMM, against eager + compile, rounds alternated in one process (wall time per step).
"""

import argparse
import statistics

import torch
from triton.testing import do_bench

import bench_classifier
import rounds as rounds_
from fused_ops import backends
from fused_ops.classifier import cross_entropy_rows
from fused_ops.hopper import pingpong


def without_our_gemm(fn):
    """fn run with the classifier's Hopper GEMM unregistered: cuBLAS's GEMM and the row kernel's two reads."""
    def run(*args):
        saved = backends._registry.pop("logits_lse")
        try:
            return fn(*args)
        finally:
            backends._registry["logits_lse"] = saved
    return run


def gemm_part(variants=None, M=2458):
    C, V = 768, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, C, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, C, device="cuda", generator=g) * 0.02).bfloat16()
    out = torch.empty(M, V, device="cuda", dtype=torch.bfloat16)
    one = torch.ones(1, device="cuda")
    x8, w8 = x.to(torch.float8_e4m3fn), (w * 32).to(torch.float8_e4m3fn)
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    count = (t != -1).sum()
    flops = 2 * M * C * V
    rows = []

    def bench_ms(fn):
        return do_bench(fn, warmup=50, rep=300, return_mode="median")

    for r in range(2):  # two rounds, the order reversed in the second
        cases = [("bf16 GEMM: cuBLAS", lambda: torch.mm(x, w.t(), out=out), flops),
                 ("bf16 GEMM: ours, no partials", lambda: pingpong.linear_act_forward(
                     x, w, None, "identity", "identity", False, False, out, None), flops),
                 ("bf16 GEMM: ours + partials", lambda: pingpong.logits_lse(x, w, out), flops),
                 *[(f"bf16 GEMM: ours + partials, {n}", lambda v=v: v.logits_lse(x, w, out), flops)
                   for n, v in (variants or {}).items() if not n.startswith("plain")],
                 *[(f"bf16 GEMM: ours, no partials, {n}", lambda v=v: v.linear_act_forward(
                     x, w, None, "identity", "identity", False, False, out, None), flops)
                   for n, v in (variants or {}).items() if n.startswith("plain")],
                 ("fp8 GEMM: _scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16, out=out), flops),
                 ("fp8 GEMM: ours, no partials", lambda: pingpong.linear_act_forward(
                     x8, w8, None, "identity", "identity", False, False, out, None, inv=(one, one)), flops),
                 ("fp8 GEMM: ours + partials", lambda: pingpong.logits_lse(x8, w8, out, (one, one)), flops),
                 *[(f"fp8 GEMM: ours + partials, {n}", lambda v=v: v.logits_lse(x8, w8, out, (one, one)), flops)
                   for n, v in (variants or {}).items() if not n.startswith("plain")],
                 *[(f"fp8 GEMM: ours, no partials, {n}", lambda v=v: v.linear_act_forward(
                     x8, w8, None, "identity", "identity", False, False, out, None, inv=(one, one)), flops)
                   for n, v in (variants or {}).items() if n.startswith("plain")]]
        partial = pingpong.logits_lse(x, w, out)
        grad8 = torch.empty(M, V, device="cuda", dtype=torch.float8_e5m2)
        cases += [("row kernel: two reads", lambda: cross_entropy_rows(out, t, count, -1, True), None),
                  ("row kernel: partials + one read", lambda: cross_entropy_rows(out, t, count, -1, True,
                                                                                 partial=partial), None),
                  ("fp8 row kernel: two reads", lambda: cross_entropy_rows(out, t, count, -1, True, grad8=grad8),
                   None),
                  ("fp8 row kernel: partials + one read",
                   lambda: cross_entropy_rows(out, t, count, -1, True, grad8=grad8, partial=partial), None)]
        for name, fn, f in (cases if r == 0 else cases[::-1]):
            rows.append((r, name, bench_ms(fn), f))
    for n, v in (variants or {}).items():  # each variant's partials against the product's, on the same logits
        if n.startswith("plain"):
            continue
        a, b = pingpong.logits_lse(x, w, out), v.logits_lse(x, w, out)
        print(f"{n} partials vs the product's: max abs difference {float((a - b).abs().max()):.2e}")
    print(f"\none chunk {M} x {C} x {V}, do_bench medians (GPU time), two rounds")
    for name in dict.fromkeys(n for _, n, _, _ in rows):
        ms = [m for _, n, m, _ in rows if n == name]
        f = next(f for _, n, _, f in rows if n == name)
        print(f"{name:<50}{statistics.mean(ms) * 1e3:9.1f} us  ({ms[0] * 1e3:.1f}, {ms[1] * 1e3:.1f})"
              + (f"  {f / statistics.mean(ms) / 1e9:6.0f} TFLOP/s" if f else ""))


def alone_part(rounds):
    fns = bench_classifier.variants()
    rounds_.alone({"compile": fns["compile"], "fused": fns["fused"], "fused~cublas": without_our_gemm(fns["fused"]),
                   "fp8": fns["fp8"], "fp8~cublas": without_our_gemm(fns["fp8"])}, rounds)


def cublas(name):
    """A variant's "~cublas": its steps run without our GEMM (rounds.patch_make_step's wrap)."""
    return name.replace("~cublas", ""), (without_our_gemm if "~cublas" in name else None)


def profile_part():
    """lab/profile_step.py's kernel table for the variants with and without our GEMM."""
    import os
    import sys
    rounds_.patch_make_step(cublas)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import profile_step
    sys.argv = ["profile_step.py", "configs/gpt2_124m.py", "--top=8", "--variants=" + ",".join(
        f"{v}+reduce-overhead" for v in ("fp8blocks+cls8", "fp8blocks+cls8~cublas", "fused+cls", "fused+cls~cublas"))]
    profile_step.main()


def step_part(rounds):
    ro = "reduce-overhead"
    rounds_.step([("eager", True), ("fused+cls", ro), ("fused+cls~cublas", ro), ("fp8blocks+cls8", ro),
                  ("fp8blocks+cls8~cublas", ro)], rounds, cublas)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--parts", default="gemm,alone,step")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    parts = args.parts.split(",")
    if "gemm" in parts:
        gemm_part()
    if "variants" in parts:  # with the epilogue variants of lse_lean_variant.py beside the product's
        import os
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lse_lean_variant import variant_module
        gemm_part({n: variant_module(n) for n in ("first", "lean", "two_pass", "two_pass_fp32")})
    if "order" in parts:  # the log-sum-exp after the stores are issued, and the tile order, with the variants
        import os
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lse_lean_variant import variant_module
        gemm_part({f"{n}{'_after' if a else ''}{'_g64' if g else ''}": variant_module(n, a, g)
                   for n, a, g in (("plain", False, 64), ("two_pass", True, None), ("two_pass", True, 64),
                                   ("two_pass_fp32", True, None), ("two_pass_fp32", True, 64),
                                   ("two_pass", False, 64))})
    if "knobs" in parts:  # the product's GEMM with other ring depths and tile orders, at the product's chunk (4096)
        import os
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lse_lean_variant import knob_module
        gemm_part({f"s{s}_g{g}": knob_module(s, g) for s, g in ((4, 64), (5, 64), (5, 32), (4, 8), (5, 8))}, M=4096)
    if "alone" in parts:
        alone_part(args.rounds)
    if "step" in parts:
        step_part(args.rounds)
    if "profile" in parts:
        profile_part()


if __name__ == "__main__":
    main()
