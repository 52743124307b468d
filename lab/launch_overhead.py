"""Where does the CPU time of a fused call go? Host time per call (no synchronization inside the loop,
tiny shapes so the GPU never holds the CPU back) of each layer of the fused path, the fused backward's
operations one at a time beside what eager runs instead, then a cProfile of the fused MLP's forward +
backward. Last, at GPT-2 small's MLP size, do_bench's time per fwd+bwd beside the host's: where the two
agree, the path is host-bound.

    python lab/launch_overhead.py                      # the decomposition above
    python lab/launch_overhead.py --targets            # issue 20's host-time target: fused vs eager MLP
                                                       # fwd+bwd at M = 256, both backward threads, 3 rounds
    python lab/launch_overhead.py --compile_boundary   # the fused MLP's GPU time inside torch.compile vs
                                                       # outside (CUDA-graph replay), and its kernels
"""

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fused_ops import linear_act_dgrad, linear_act_forward
from fused_ops import mlp as fused_mlp_module
from fused_ops import tuning
from fused_ops.hopper import pingpong
from fused_ops.matmul import TensorDescriptor
from fused_ops.ops import dgrad_op, linear_act_op
from model import GPTConfig, MLP


@triton.jit
def noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def noop_desc_kernel(desc, BLOCK: tl.constexpr):
    desc.store([0, 0], desc.load([0, 0]))


def host_us(fn, n=50, repeats=9):
    """Median over `repeats` rounds of the host time per call of n calls (synchronized between rounds, so the
    GPU queue never fills and blocks the host): this machine's host timings are noisy round to round."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


class PythonIdentity(torch.autograd.Function):
    """The fixed cost of an autograd Function written in Python (the fused MLP's is one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def on_calling_thread(step):
    """step with backward run on the calling thread (autograd multithreading off), as train.py does on one GPU."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


def time_inside_backward(step):
    """Host time per call spent inside FusedMLPFunction.backward's own body, while `step` runs."""
    backward, spent = fused_mlp_module.FusedMLPFunction.backward, []

    def timed(ctx, grad):
        t0 = time.perf_counter()
        out = backward(ctx, grad)
        spent.append(time.perf_counter() - t0)
        return out
    fused_mlp_module.FusedMLPFunction.backward = staticmethod(timed)
    try:
        host_us(step)
    finally:
        fused_mlp_module.FusedMLPFunction.backward = staticmethod(backward)
    return statistics.median(spent) * 1e6


def autocast_step(mlp, x, dy):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mlp(x)
    y.backward(dy)


def main():
    dt = torch.bfloat16
    cfg = GPTConfig(n_embd=768, n_head=12, activation="gelu")
    M, C = 256, cfg.n_embd
    x = torch.randn(M, C, device="cuda", dtype=dt)
    fused = MLP(dataclasses.replace(cfg, mlp="fused")).cuda().to(dt)
    eager = MLP(cfg).cuda().to(dt)
    fused32, eager32 = MLP(dataclasses.replace(cfg, mlp="fused")).cuda(), MLP(cfg).cuda()
    w, b = fused.c_fc.weight.detach(), fused.c_fc.bias.detach()
    buf = torch.randn(1024, device="cuda")
    t2 = torch.randn(64, 64, device="cuda", dtype=dt)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, C, device="cuda", dtype=dt)
    w2 = fused.c_proj.weight.detach()
    saved = linear_act_forward(x, w, b, "gelu")[1]
    h = torch.randn(M, w.shape[0], device="cuda", dtype=dt)  # an (M, H) stand-in for h and grad_z
    w_gate_up = torch.randn(2 * w.shape[0], C, device="cuda", dtype=dt) * C ** -0.5
    saved_gate_up = linear_act_forward(x, w_gate_up, None, "swiglu")[1]
    rows = [
        ("torch.empty", lambda: torch.empty(M, C, device="cuda", dtype=dt)),
        ("triton launch, pointer args", lambda: noop_kernel[(1,)](buf, 1024, BLOCK=1024)),
        ("TensorDescriptor.from_tensor", lambda: TensorDescriptor.from_tensor(t2, [64, 64])),
        ("triton launch, descriptor arg", lambda: noop_desc_kernel[(1,)](TensorDescriptor.from_tensor(t2, [64, 64]),
                                                                        BLOCK=64)),
        ("linear_act_forward", lambda: linear_act_forward(x, w, b, "gelu")),
        ("linear_act_dgrad", lambda: linear_act_dgrad(dy, w2, saved, "gelu")),
        ("linear_act through the custom op", lambda: linear_act_op.op(x, w, b, "gelu", True)),
        ("dgrad through the custom op", lambda: dgrad_op.op(dy, w2, saved, "gelu", True)),
        ("swiglu linear_act through the custom op", lambda: linear_act_op.op(x, w_gate_up, None, "swiglu", True)),
        ("swiglu dgrad through the custom op", lambda: dgrad_op.op(dy, w2, saved_gate_up, "swiglu", False)),
        ("fused MLP fwd (no grad)", lambda: fused(x)),
        ("fused MLP fwd (grad on)", lambda: fused(xg)),
        ("eager MLP fwd (grad on)", lambda: eager(xg)),
        ("fused MLP fwd+bwd", lambda: fused(xg).backward(dy)),
        ("eager MLP fwd+bwd", lambda: eager(xg).backward(dy)),
        ("fused MLP fwd+bwd, backward on the calling thread", on_calling_thread(lambda: fused(xg).backward(dy))),
        ("eager MLP fwd+bwd, backward on the calling thread", on_calling_thread(lambda: eager(xg).backward(dy))),
        ("Python autograd.Function (identity) fwd+bwd", lambda: PythonIdentity.apply(xg).backward(dy)),
        ("aten view fwd+bwd", lambda: xg.view_as(xg).backward(dy)),
        # what FusedMLPFunction runs, one operation at a time (eager's backward runs its own in C++)
        ("  fwd: addmm (second linear)", lambda: torch.addmm(fused.c_proj.bias.detach(), h, w2.t())),
        ("  bwd: mm grad_y.T @ h (dW2)", lambda: dy.t() @ h),
        ("  bwd: sum grad_y (db2)", lambda: dy.sum(0)),
        ("  bwd: dgrad op with bias gradient", lambda: dgrad_op(dy, w2, saved, "gelu", True)),
        ("  bwd: mm grad_z @ W1 (dx)", lambda: h @ w),
        ("  bwd: mm grad_z.T @ x (dW1)", lambda: h.t() @ x),
        ("  eager's fwd: F.gelu", lambda: torch.nn.functional.gelu(h)),
        # as in training: fp32 weights under bf16 autocast (each call casts them)
        ("fused MLP fwd+bwd, fp32 weights, autocast", lambda: autocast_step(fused32, xg, dy)),
        ("eager MLP fwd+bwd, fp32 weights, autocast", lambda: autocast_step(eager32, xg, dy)),
    ]
    # the ping-pong forward launch in its layers: usable() + linear_act_forward = our Python around the
    # launch, _launch = descriptors looked up + _run, _run = the key lookup + Triton's launcher (which
    # encodes each TMA descriptor it is passed)
    out_pp, saved_pp = torch.empty(M, w.shape[0], device="cuda", dtype=dt), torch.empty_like(saved)
    pp_consts = dict(EPILOGUE="act", ACTIVATION="gelu", UP_ACTIVATION="identity", GATED=False, HAS_BIAS=True, SAVE=True)
    blocks, _, consts_pp = pingpong._blocks_and_consts(True, **pp_consts)
    descs = [None if t is None else pingpong._descriptor(t, blk)
             for t, blk in zip((x, w, None, out_pp, None, saved_pp, None), blocks)]
    run_args = (*descs, b, None, M, w.shape[0], C)
    tiles = tuning.cdiv(M, pingpong.BLOCK_M) * tuning.cdiv(w.shape[0], pingpong.BLOCK_N)
    rows += [
        ("  ping-pong fwd: pingpong.usable", lambda: pingpong.usable(x, (w, out_pp, saved_pp), (b,))),
        ("  ping-pong fwd: pingpong.linear_act_forward", lambda: pingpong.linear_act_forward(
            x, w, b, "gelu", "identity", False, True, out_pp, saved_pp)),
        ("  ping-pong fwd: pingpong._launch", lambda: pingpong._launch(x, w, out_pp, saved_pp, b, None, True, **pp_consts)),
        ("  ping-pong fwd: pingpong._run", lambda: pingpong._run(run_args, consts_pp, tiles, x.device)),
    ]
    results = [(name, host_us(fn)) for name, fn in rows]
    results.append(("fused MLP fwd+bwd: inside FusedMLPFunction.backward", time_inside_backward(lambda: fused(xg).backward(dy))))
    # What of the fused MLP's host time is the ping-pong launches (Triton's launcher, descriptors included):
    # the same fwd+bwd with them replaced by a no-op (outputs left unwritten).
    run = pingpong._run
    pingpong._run = lambda *args: None
    try:
        results.append(("fused MLP fwd+bwd, ping-pong launches skipped", host_us(lambda: fused(xg).backward(dy))))
    finally:
        pingpong._run = run
    # The same calls with every kernel launched through Triton's JIT instead of the kept compiled kernel.
    for plan in tuning._plans.values():
        plan.direct = False
    results += [(name + " (JIT launch)", host_us(fn)) for name, fn in rows if "linear_act" in name or "Fused" in name]
    for plan in tuning._plans.values():
        plan.direct = plan.const_values is not None

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fused(xg).backward(dy)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(40)

    # GPT-2 small's MLP (M = 12288): do_bench's median per fwd+bwd against the host's time per call
    big = []
    xb = torch.randn(12288, C, device="cuda", dtype=dt, requires_grad=True)
    dyb = torch.randn(12288, C, device="cuda", dtype=dt)
    for name, mlp in (("eager", eager), ("fused", fused)):
        step = lambda: mlp(xb).backward(dyb)  # noqa: E731
        for where, fn in (("", step), (", backward on the calling thread", on_calling_thread(step))):
            big.append((name + where, 1000 * do_bench(fn, return_mode="median"), host_us(fn, n=5)))

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"{'host time per call, M = 256':52s} {'us':>8s}")
    for name, us in results:
        print(f"{name:52s} {us:8.1f}")
    print(f"{'MLP fwd+bwd at M = 12288, C = 768':52s} {'do_bench us':>12s} {'host us':>9s}")
    for name, bench_us, host in big:
        print(f"{name:52s} {bench_us:12.1f} {host:9.1f}")


def versions():
    import subprocess
    commit = os.environ.get("COMMIT") or subprocess.run(  # COMMIT: for a copy of the tree without its .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {os.cpu_count()} CPUs")


def spread(values):
    return f"{statistics.median(values):8.1f} [{min(values):7.1f}-{max(values):7.1f}]"


def targets(rounds):
    """Issue 20: host time of one MLP fwd+bwd at M = 256 (GPT-2 small's width), fused vs eager, backward on the
    calling thread and on autograd's engine thread, with and without biases; the variants alternate order
    each round."""
    dt, M = torch.bfloat16, 256
    rows = {}
    for bias in (False, True):
        cfg = GPTConfig(n_embd=768, n_head=12, activation="gelu", bias=bias)
        mlps = {"eager": MLP(cfg).cuda().to(dt), "fused": MLP(dataclasses.replace(cfg, mlp="fused")).cuda().to(dt)}
        x = torch.randn(M, 768, device="cuda", dtype=dt, requires_grad=True)
        dy = torch.randn(M, 768, device="cuda", dtype=dt)
        for r in range(rounds):
            for name in (("eager", "fused") if r % 2 == 0 else ("fused", "eager")):
                step = lambda m=mlps[name]: m(x).backward(dy)  # noqa: E731
                for thread, fn in (("calling thread", on_calling_thread(step)), ("engine thread", step)):
                    rows.setdefault((bias, thread, name), []).append(host_us(fn, n=100, repeats=11))
    print(versions())
    print(f"host us per MLP fwd+bwd, M = 256, C = 768, GELU, bf16: median of {rounds} rounds [min-max]; each round "
          "a median of 11 x 100 calls")
    for bias in (False, True):
        for thread in ("calling thread", "engine thread"):
            e, f = rows[bias, thread, "eager"], rows[bias, thread, "fused"]
            print(f"bias={bias!s:5} {thread:15s} eager {spread(e)}  fused {spread(f)}  fused/eager "
                  f"{statistics.median(f) / statistics.median(e):5.2f}  rounds: eager {[round(v) for v in e]} "
                  f"fused {[round(v) for v in f]}")


def compile_boundary(rounds):
    """Issue 20: GPU time of the fused MLP's fwd+bwd (GPT-2 small, M = 12288, no bias, bf16) replayed as one CUDA
    graph, uncompiled vs inside torch.compile, alternated; then the kernels of one replay of each (profiler),
    so that what the compiled graph adds shows by name. Run with TORCH_LOGS=output_code to see its code."""
    from bench_mlp import graphed_fwd_bwd

    from fused_ops.hopper import pingpong
    dt, M, C = torch.bfloat16, 12288, 768
    print(versions())
    for act in ("gelu", "swiglu"):
        cfg = GPTConfig(n_embd=C, n_head=12, activation=act, bias=False, mlp="fused")
        mlp = MLP(cfg).cuda().to(dt)
        x = torch.randn(M, C, device="cuda", dtype=dt)
        dy = torch.randn(M, C, device="cuda", dtype=dt)
        replays, first, launched = {}, {}, {}
        real_launch = pingpong._launch
        for name, m in (("fused", mlp), ("fused in torch.compile", torch.compile(mlp))):
            calls = []
            pingpong._launch = lambda *a, **k: (calls.append(k["EPILOGUE"]), real_launch(*a, **k))[1]
            t0 = time.perf_counter()
            replays[name] = graphed_fwd_bwd(m, x, dy)[0]  # compiles, warms up, captures
            torch.cuda.synchronize()
            first[name], launched[name] = time.perf_counter() - t0, sorted(set(calls))
            pingpong._launch = real_launch
        times = {name: [] for name in replays}
        for r in range(rounds):
            for name in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
                times[name].append(1000 * do_bench(replays[name], warmup=50, rep=300, return_mode="median"))
        # the same, one replay of each in turn (the order alternating), each timed by its own CUDA events:
        # drifts of the GPU's clock over the run then hit both alike
        events = {name: [] for name in replays}
        for i in range(400):
            for name in (list(replays) if i % 2 == 0 else list(replays)[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replays[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
        paired = {name: sorted(1000 * s.elapsed_time(e) for s, e in pairs[20:]) for name, pairs in events.items()}
        print(f"\n{act}: GPU us per fwd+bwd (CUDA-graph replay), median [min-max] of {rounds} alternated do_bench rounds; "
              "then 380 replays of each in turn, median [25th-75th percentile]")
        for name, t in times.items():
            q = paired[name]
            print(f"  {name:24s} {spread(t)}  rounds {[round(v, 1) for v in t]}  interleaved {q[len(q) // 2]:7.1f} "
                  f"[{q[len(q) // 4]:.1f}-{q[3 * len(q) // 4]:.1f}]  first call {first[name]:.1f} s  "
                  f"ping-pong epilogues launched {launched[name]}")
        base, comp = (paired[n][len(paired[n]) // 2] for n in replays)
        print(f"  compiled / uncompiled: {statistics.median(times['fused in torch.compile']) / statistics.median(times['fused']):.3f} "
              f"(do_bench rounds), {comp / base:.3f} (interleaved)")
        for name, replay in replays.items():  # the step the graph holds, run as is (same kernels)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    replay.step()
                torch.cuda.synchronize()
            print(f"  kernels of 5 {name} fwd+bwd:")
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", action="store_true")
    ap.add_argument("--compile_boundary", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.targets:
        targets(args.rounds)
    elif args.compile_boundary:
        compile_boundary(args.rounds)
    else:
        main()
