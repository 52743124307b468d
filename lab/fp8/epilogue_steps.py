"""The GELU forward's epilogue, step by step: three cuts undone one at a time, from the product back to the kernel
before them, for the MLP's ping-pong forwards at GPT-2 small's size (FP8: h8, h8ᵀ, dh/dz; bf16: h, dh/dz), each
checked against the product bit for bit (or its largest difference shown) and timed in alternated rounds
(consumer_warps.py's cases and timer). The variants, cumulative:
  - "bias at the epilogue": the bias row loaded once the MMAs are done, not before them;
  - "+ masked": the bias load and the rows past M masked even where M and N are whole tiles;
  - "+ rsqrt, degree 7": GELU's Φ with t = rsqrt(d²), a degree-7 polynomial and 1/√(2π) as a multiply (the
    gelu_and_grad_16bit before the cut, its source below).
    python lab/fp8/epilogue_steps.py [--rounds=5] [--ptxas]   (--ptxas: instructions, registers, spills; no GPU)
--order instead: the product against its own GELU pair with φ's exponent rounded as (x·x)·k, 3ddd621's order, not
(x·k)·x (lab/portable/gelu_pair.py measures the same two in the portable forward).

Where the FP8 forward's warps wait (Nsight Compute's warp-state samples, by SASS instruction):
    ncu --clock-control none -k regex:pingpong --launch-skip 2 --launch-count 1 --set full --import-source yes \\
        -o fwd8 python lab/fp8/epilogue_steps.py --launch
    ncu -i fwd8.ncu-rep --page source --csv --print-source sass > fwd8.csv
    python lab/fp8/epilogue_steps.py --stalls fwd8.csv
--stalls groups the instructions by how often each warp ran them: the main loop's run once a K step, the epilogue's
once a tile (a count for each consumer: its tiles times 8 warps), the set-up's once a program.
"""

import argparse
import collections
import csv
import inspect

import consumer_warps

BIAS_LINES = """                bias = 0.0
                if HAS_BIAS and EPILOGUE == "act":  # loaded before the MMAs: at the epilogue, its latency stalled it
                    bias = _bias_row(bias_ptr, off_n, N, BN, TN, acc_layout, EVEN)
"""
WAIT = "                acc = warpgroup_mma_wait(0, deps=(acc, ))\n"
LATE_BIAS = f"{BIAS_LINES}->;;{WAIT}->{WAIT}{BIAS_LINES}"
MASKED = "even = M % BLOCK_M == 0 and N % BLOCK_N == 0->even = False"
IMPORT = "from ..activations import activation, activation_grad, gelu_and_grad_16bit, silu_and_grad"
OLD_GELU = '''
# Φ(-|x|) = exp(-x²/2) · t · S(t) with t = 1 / (1 + |x| / (2√2)) and S the degree-7 polynomial in
# gelu_and_grad_16bit, fitted to erfcx(|x|/√2) / (2t) by lab/fit_gelu_cdf.py.
GELU_CDF_T = tl.constexpr(0.3535533905932738)  # 1 / (2√2)
NEG_HALF_LOG2E = tl.constexpr(-0.7213475204444817)  # exp(-x²/2) = exp2(x² · this)


@triton.jit
def gelu_and_grad_16bit(x):
    """(GELU(x), GELU'(x)) = (x·Φ(x), Φ(x) + x·φ(x)) for 16-bit outputs: one reciprocal square root,
    one exp2 and a short polynomial an element, where libdevice's erf takes several times as many
    instructions and made the ping-pong kernel's epilogue, not its MMAs, the bottleneck (docs/performance.md).
    NaN gives (NaN, NaN), +inf (inf, 1) and -inf (-0, -0): the limits (tests/special_values.py; eager
    PyTorch gives NaN for all but gelu(+inf), and on AVX-512 CPUs for that too in fp32).
    Φ(-|x|) = φ(x)·√(2π)·t·S(t) (see GELU_CDF_T) is within ~1e-5 of Φ, relative, in both tails: far
    under the 3.9e-3 (bf16) and 4.9e-4 (fp16) of the outputs it is used for, not under fp32's."""
    # t = 1/d as rsqrt(d²): one MUFU.RSQ and a multiply, where a division (even tl.fdiv's approximate
    # one) adds range fix-ups that cost more than the polynomial's FMAs. d² overflows only past |x| ~ 5e19,
    # where exp(-x²/2), and so the tail, is 0 whatever t is (tested up to 1e30).
    d = 1.0 + GELU_CDF_T * tl.abs(x)
    t = tl.math.rsqrt(d * d)
    s = t * 0.0254627994 - 0.055224472  # S(t), Horner's rule
    s = s * t - 0.020281909
    s = s * t + 0.0624646826
    s = s * t + 0.0811223867
    s = s * t + 0.124412371
    s = s * t + 0.140997735
    s = s * t + 0.141047785
    gauss = tl.exp2(x * x * NEG_HALF_LOG2E)  # exp(-x²/2) = φ(x)·√(2π)
    tail = gauss * t * s  # Φ(-|x|)
    cdf = tl.where(x >= 0.0, 1.0 - tail, tail)
    # x clamped where it multiplies a factor that is 0 beyond ±TAIL (see TAIL): the limits at ±inf, not inf · 0
    xl = tl.where(x < -TAIL, -TAIL, x)
    xc = tl.where(xl > TAIL, TAIL, xl)
    return xl * cdf, cdf + xc * gauss * INV_SQRT_2PI
'''
RSQRT7 = (f"{IMPORT}->from ..activations import TAIL, INV_SQRT_2PI, activation, activation_grad, silu_and_grad"
          f"\nimport triton\nimport triton.language as tl\n{OLD_GELU}")
# φ's exponent in the product's pair, and the order it had at 3ddd621
ORDER = ("phi = tl.exp2((x * NEG_HALF_LOG2E) * x + LOG2_INV_SQRT_2PI)",
         "phi = tl.exp2(x * x * NEG_HALF_LOG2E + LOG2_INV_SQRT_2PI)")


def xxk_pair():
    """The substitution that gives pingpong.py its own copy of the product's pair, in 3ddd621's order."""
    from fused_ops import activations
    src = inspect.getsource(activations.gelu_and_grad_16bit.fn)
    assert src.count(ORDER[0]) == 1 and "->" not in src and ";;" not in src
    names = "TAIL, GELU_CDF_T, NEG_HALF_LOG2E, LOG2_INV_SQRT_2PI, _reciprocal_ftz"
    return (f"{IMPORT}->from ..activations import {names}, activation, activation_grad, silu_and_grad"
            f"\nimport triton\nimport triton.language as tl\n\n\n{src.replace(*ORDER)}")


VARIANTS = {"bias at the epilogue": LATE_BIAS, "+ masked": f"{LATE_BIAS};;{MASKED}",
            "+ rsqrt, degree 7": f"{LATE_BIAS};;{MASKED};;{RSQRT7}"}


def stalls(path, groups=8):
    """The samples of ncu's source page (CSV), grouped by instructions' execution counts, with their top stalls."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Source" in r)
    col = {h: i for i, h in enumerate(rows[head])}
    reasons = [h for h in rows[head] if h.startswith("stall_") and "Not Issued" not in h]
    by_count = collections.defaultdict(lambda: [0, 0, collections.Counter(), ""])
    total = 0
    for r in rows[head + 1:]:
        g = by_count[int(r[col["Instructions Executed"]] or 0)]
        n = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        g[0] += n
        g[1] += 1
        g[3] = g[3] or r[col["Source"]].strip()
        for h in reasons:
            g[2][h[6:]] += int(r[col[h]] or 0)
        total += n
    print(f"{total} samples; groups of instructions by how often they ran (warp-level), most samples first")
    for count, (n, k, why, first) in sorted(by_count.items(), key=lambda kv: -kv[1][0])[:groups]:
        print(f"  run {count:>7} times, {k:5d} instructions, {n:6d} samples ({100 * n / total:4.1f}%): "
              + ", ".join(f"{w} {100 * v / max(n, 1):.0f}%" for w, v in why.most_common(5)) + f"   (first: {first[:40]})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ptxas", action="store_true")
    ap.add_argument("--launch", action="store_true", help="only run the product's FP8 forward 4 times (for ncu)")
    ap.add_argument("--stalls", metavar="CSV", help="summarize ncu's source page of the FP8 forward")
    ap.add_argument("--order", action="store_true", help="the product against its pair in (x·x)·k order (xxk)")
    args = ap.parse_args()
    if args.order:
        for case in ("FP8 forward", "bf16 forward"):
            consumer_warps.run({"xxk": xxk_pair()}, args.rounds, args.ptxas, only=case)
    elif args.stalls:
        stalls(args.stalls)
    elif args.launch:
        launch = next(fn for case, (fn, _, _) in consumer_warps.cases().items() if case.startswith("FP8 forward"))
        for _ in range(4):
            launch(consumer_warps.pingpong)
    else:
        for case in ("FP8 forward", "bf16 forward"):
            consumer_warps.run(VARIANTS, args.rounds, args.ptxas, only=case)
