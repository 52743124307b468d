"""
The classifier alone: LM head + cross-entropy (ignore_index=-1), forward + backward, on one GPU. GPU time (CUDA events
around each call, the GPU held by a sleep kernel while the host enqueues it; a variant that waits on the GPU inside
the call pays its gaps), median of rounds x repeats, the variants' order alternated between rounds; and the peak
memory above the inputs, for eager PyTorch (the cross-entropy in fp32, as under autocast), torch.compile of it, our fused operator
(fused_ops/classifier.py) and its FP8 form on FP8 GPUs, and where installed Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy
(their defaults). The last column: each variant's x gradient against eager's (relative L2 difference).

    python bench_classifier.py [--shapes=12288x768x50304,8192x2048x128256] [--rounds=4] [--out=FILE.json]
"""

import json
import statistics

import torch
import torch.nn.functional as F

from helpers import errors

SLEEP_CYCLES = 20_000_000  # ~10 ms at the H100's or H200's clock: longer than any variant's host time per call


def variants():
    """name -> loss(x, w, targets), for every variant that can run here."""
    import fused_ops

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-1)

    out = {"eager": eager, "compile": torch.compile(eager), "fused": fused_ops.linear_cross_entropy}
    if fused_ops.fp8_supported(torch.device("cuda")):
        out["fp8"] = fused_ops.fp8_linear_cross_entropy  # (not held to eager's dx: FP8 has its own rule)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-1)
        out["liger"] = lambda x, w, t: liger(w, x, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy
        out["cce"] = lambda x, w, t: linear_cross_entropy(x, w, t, ignore_index=-1)
    except ImportError:
        pass
    return out


def inputs(M, C, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, C, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, C, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[::97] = -1
    return x, w, t


def call(fn, x, w, t):
    x.grad = w.grad = None
    fn(x, w, t).backward()


def time_ms(fn, x, w, t, repeats):
    """GPU time of one call: a sleep kernel first holds the GPU while the host enqueues the call, so that the host's
    launch latency (which differs between variants and machines) is not counted."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        call(fn, x, w, t)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_gib(fn, x, w, t):
    """Peak memory of one call above what was allocated before it (the inputs; gradients freed first)."""
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call(fn, x, w, t)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def bench_shape(M, C, V, rounds, repeats):
    x, w, t = inputs(M, C, V)
    fns = variants()
    call(fns["eager"], x, w, t)
    ref = x.grad.float().clone()
    rows = {}
    for name, fn in fns.items():  # warm-up (compiles, tunes), memory and the gradient check
        for _ in range(3):
            call(fn, x, w, t)
        diff = float((x.grad.float() - ref).norm() / ref.norm())
        rows[name] = {"variant": name, "M": M, "C": C, "V": V, "ms": [], "peak_gib": peak_gib(fn, x, w, t),
                      "dx_rel_diff": diff}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rows[name]["ms"].append(time_ms(fns[name], x, w, t, repeats))
    for row in rows.values():
        row["spread"] = [min(row["ms"]), max(row["ms"])]
        row["ms"] = statistics.median(row["ms"])
    return list(rows.values())


def main(argv=None):
    p = errors.ArgumentParser("bench_classifier.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--shapes", default="12288x768x50304,8192x2048x128256", help="MxCxV, comma-separated")
    p.add_argument("--rounds", type=int, default=4, help="rounds, the variants' order alternated")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per variant and round")
    p.add_argument("--out", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise errors.UsageError("bench_classifier.py times GPU kernels: it needs a CUDA GPU")
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 3 for s in shapes)
    except (ValueError, AssertionError):
        raise errors.UsageError(f"--shapes={args.shapes!r}: expected MxCxV[,MxCxV...], e.g. 12288x768x50304") from None
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = [row for shape in shapes for row in bench_shape(*shape, args.rounds, args.repeats)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU ms (median of {args.rounds} rounds x "
          f"{args.repeats}), [min, max] of the rounds' medians, peak GiB above the inputs, dx vs eager")
    for row in rows:
        eager = next(r["ms"] for r in rows if r["variant"] == "compile" and r["V"] == row["V"])
        print(f"{row['M']}x{row['C']}x{row['V']:<7} {row['variant']:<8} {row['ms']:8.3f} ms "
              f"[{row['spread'][0]:.3f}, {row['spread'][1]:.3f}]  {row['ms'] / eager:5.2f}x compile  "
              f"+{row['peak_gib']:.2f} GiB  dx {row['dx_rel_diff']:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    raise SystemExit(errors.run_main("bench_classifier.py", main))
