"""Where does the CPU time of a fused call go? Host time per call (no synchronization inside the loop,
tiny shapes so the GPU never holds the CPU back) of each layer of the fused path, the fused backward's
operations one at a time beside what eager runs instead, then a cProfile of the fused MLP's forward +
backward. Last, at GPT-2 small's MLP size, do_bench's time per fwd+bwd beside the host's: where the two
agree, the path is host-bound.

    python lab/launch_overhead.py
"""

import cProfile
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

from fused_ops import FusedMLP, linear_act_dgrad, linear_act_forward
from fused_ops import mlp as fused_mlp_module
from fused_ops import pingpong, tuning
from fused_ops.matmul import TensorDescriptor
from fused_ops.ops import dgrad_op, linear_act_op
from model import MLP, GPTConfig


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
    fused = FusedMLP(cfg).cuda().to(dt)
    eager = MLP(cfg).cuda().to(dt)
    fused32, eager32 = FusedMLP(cfg).cuda(), MLP(cfg).cuda()
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
        ("FusedMLP fwd (no grad)", lambda: fused(x)),
        ("FusedMLP fwd (grad on)", lambda: fused(xg)),
        ("eager MLP fwd (grad on)", lambda: eager(xg)),
        ("FusedMLP fwd+bwd", lambda: fused(xg).backward(dy)),
        ("eager MLP fwd+bwd", lambda: eager(xg).backward(dy)),
        ("FusedMLP fwd+bwd, backward on the calling thread", on_calling_thread(lambda: fused(xg).backward(dy))),
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
        ("FusedMLP fwd+bwd, fp32 weights, autocast", lambda: autocast_step(fused32, xg, dy)),
        ("eager MLP fwd+bwd, fp32 weights, autocast", lambda: autocast_step(eager32, xg, dy)),
    ]
    results = [(name, host_us(fn)) for name, fn in rows]
    results.append(("FusedMLP fwd+bwd: inside FusedMLPFunction.backward", time_inside_backward(lambda: fused(xg).backward(dy))))
    # What of the fused MLP's host time is the ping-pong launches (Triton's launcher, descriptors included):
    # the same fwd+bwd with them replaced by a no-op (outputs left unwritten).
    run = pingpong._run
    pingpong._run = lambda *args: None
    try:
        results.append(("FusedMLP fwd+bwd, ping-pong launches skipped", host_us(lambda: fused(xg).backward(dy))))
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


if __name__ == "__main__":
    main()
