"""Time the MLP alone: the fused kernels against cuBLAS matmuls, eager PyTorch and torch.compile, and (on a GPU
with FP8 tensor cores) the FP8 fused MLP against the bf16 one and torchao's float8 training (where installed).

    python bench_mlp.py                      # GPT-2 small MLP (M=12288, C=768), gelu and swiglu, bf16
    python bench_mlp.py --widths 768,1024,2048,4096 --out results/mlp.json    # default: out-bench/mlp.json

Every number is a median of triton.testing.do_bench on random data, all measured in one run: of each
call as the host issues it, and of forward + backward replayed as one CUDA graph (the GPU time; the paths' graphs
timed in rounds, the order reversed every other round, median and spread). The floor
is the MLP's matmul FLOPs at the matmul peak measured in the same run (an 8192^3 bf16 product).

The fused path runs as the GPU picks its kernels (on Hopper, the Gluon ping-pong ones: fused_ops/hopper/). With
--portable=True (the default on a GPU) the same run also times the portable kernels, what every other GPU runs:
"portable" (FUSED_OPS_PINGPONG=0: the Triton kernels, their TMA main loop on Hopper) and "pointer"
(FUSED_OPS_PINGPONG=0 FUSED_OPS_TMA=0: the pointer main loop, what Ampere and Ada run).
Each fused result is first checked against a float64 reference (the 2x eager-error rule).
bench.py --mlp_widths runs the same measurement (these functions) across widths, with a table, CSV and PNG.
"""

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import triton
from triton.testing import do_bench

from helpers import errors
from helpers.variants import FAMILIES
from fused_ops import env as fused_env, fp8_supported, linear_act_dgrad, linear_act_forward
from fused_ops.numerics import EPS, rel_err
from fused_ops.tuning import TUNING_LOG
from model import MLP, GPTConfig

DTYPE = torch.bfloat16
DEFAULT_TOKENS = {768: 12288, 1024: 16384, 2048: 8192, 4096: 8192}  # M per width C (others: 8192)
DEFAULT_OUT = "out-bench/mlp.json"  # untracked (.gitignore's out*/), as bench.py's


def add_backward_thread_arg(ap):
    """--backward_thread, shared by the scripts that time training work: where backward runs meanwhile."""
    ap.add_argument("--backward_thread", choices=("caller", "engine"), default="caller",
                    help="run backward on the calling thread, as train.py does on one GPU, or on the autograd "
                         "engine's device thread (PyTorch's default)")


def backward_thread(args):
    """Autograd multithreading off for --backward_thread=caller, on for engine (also a context manager that
    restores the previous setting on exit)."""
    return torch.autograd.set_multithreading_enabled(args.backward_thread == "engine")


def bench(fn, device="cuda", **kw):
    if device.startswith("cuda"):
        return do_bench(fn, warmup=50, rep=200, return_mode="median", **kw)
    # CPU (tests; the kernels under TRITON_INTERPRET): do_bench needs a GPU driver, and a few wall-clock
    # runs (one to warm up) exercise the same code. The numbers mean little there.
    times = []
    for _ in range(2):
        for t in kw.get("grad_to_none") or []:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def graphed(step):
    """step() captured as one CUDA graph, returned as its replay: timing the replay gives the GPU time
    of all of step's kernels with no host time between them (do_bench of step itself is host-bound for
    the fused MLP at C = 768 on the H100 machines). Warm-up (tuning, compiling) and capture run on one
    side stream. The replay keeps step (and so every tensor the graph reads) alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    torch.cuda.current_stream().wait_stream(side)

    def replay():
        graph.replay()
    replay.step = step
    return replay


def graphed_fwd_bwd(m, x, dy):
    """(replay, grads): forward + backward of m on x for the output gradient dy, captured as one CUDA graph
    (see graphed); grads holds the gradients of x and of m's parameters that each replay computes. Runs on
    copies of m (compiled again if m is compiled) and x: a leaf's gradient goes through its AccumulateGrad
    node, which joins the stream the node was made on, so leaves used before on the default stream would
    break the capture; and torch.autograd.grad, as .grad must not be accumulated into either."""
    m = torch.compile(copy.deepcopy(m._orig_mod)) if hasattr(m, "_orig_mod") else copy.deepcopy(m)
    x = x.detach().clone().requires_grad_()
    inputs = [x] + list(m.parameters())
    grads = []

    def step():
        grads[:] = torch.autograd.grad(m(x), inputs, dy)
    return graphed(step), grads


def measure_peaks(device="cuda", dtype=DTYPE):
    """Matmul TFLOP/s and copy GB/s on this device: the floor is computed against what it really reaches."""
    n, numel = (8192, 2 ** 28) if device.startswith("cuda") else (256, 2 ** 20)  # on GPU: 512 MiB, far past L2
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    tflops = 2 * n ** 3 / bench(lambda: a @ b, device) / 1e9
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * src.element_size() / bench(lambda: dst.copy_(src), device) / 1e6
    return tflops, gbps


def mlp_case(C, M, activation, compile_times, peak_tflops, device="cuda", dtype=DTYPE, compile=True, kernels=True,
             bias=True, portable=False, rounds=3):
    """One MLP shape: correctness vs float64, then fwd and fwd+bwd ms of eager, torch.compile (if compile)
    and fused, the floor at peak_tflops, and (if kernels) each kernel against the same-shape cuBLAS matmul."""
    cfg = GPTConfig(n_embd=C, n_head=1, activation=activation, bias=bias)
    H, gated = cfg.mlp_hidden, cfg.gated
    mlp = MLP(cfg).to(device, dtype)
    w1, b1, w2 = mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight
    x = torch.randn(M, C, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, C, device=device, dtype=dtype)
    fused = MLP(dataclasses.replace(cfg, mlp="fused")).to(device, dtype)
    fused.load_state_dict(mlp.state_dict())
    # A fresh compile per shape: every case shares MLP.forward, and after a few cases Dynamo would switch
    # to dynamic shapes, then past its recompile limit silently run eager.
    torch._dynamo.reset()
    compiled = torch.compile(mlp) if compile else None

    # Correctness at this shape first: forward and every gradient against float64.
    t0 = time.perf_counter()
    outs = {}
    for name, m in (("fused", fused), ("eager", mlp)):
        m.zero_grad(set_to_none=True)
        x.grad = None
        y = m(x)
        y.backward(dy)
        outs[name] = [y.detach()] + [x.grad] + [p.grad for p in m.parameters()]
    if x.is_cuda:
        torch.cuda.synchronize()
    compile_times[f"{activation} C={C} first call (autotune + compile)"] = time.perf_counter() - t0
    ref_mlp = MLP(cfg).to(device).double()
    ref_mlp.load_state_dict(mlp.state_dict())
    xr = x.detach().double().requires_grad_()
    yr = ref_mlp(xr)
    yr.backward(dy.double())
    ref = [yr] + [xr.grad] + [p.grad for p in ref_mlp.parameters()]
    errors = {"fused": [rel_err(o, r) for o, r in zip(outs["fused"], ref)],
              "eager": [rel_err(o, r) for o, r in zip(outs["eager"], ref)]}
    ok = all(f <= 2 * e + EPS[dtype] for f, e in zip(errors["fused"], errors["eager"]))

    params = list(mlp.parameters()) + list(fused.parameters()) + [x]
    n_rows = 2 * H if gated else H
    flops_fwd = 2 * M * C * n_rows + 2 * M * H * C
    row = {"C": C, "M": M, "H": H, "activation": activation, "correct": ok,
           "max_rel_err_fused": max(errors["fused"]), "max_rel_err_eager": max(errors["eager"]),
           "fwd_fused_vs_eager": rel_err(outs["fused"][0], outs["eager"][0])}
    row["floor_fwd_ms"] = flops_fwd / peak_tflops / 1e9
    row["floor_fwdbwd_ms"] = 3 * flops_fwd / peak_tflops / 1e9  # backward: two matmuls per forward one

    def fwd_bwd(m):
        def run():
            m(x).backward(dy)
        return run

    paths = {"eager": mlp, "compile": compiled, "fused": fused}
    families = {"fused": {}}
    if portable and x.is_cuda:  # the portable kernels on copies of the fused MLP (each keeps its own CUDA graphs)
        for name in ("portable", "pointer"):
            paths[name] = copy.deepcopy(fused)
            families[name] = FAMILIES[name]
    replays = {}
    for name, m in paths.items():
        if m is not None:
            with fused_env.overridden(**families.get(name, {})):
                with torch.no_grad():
                    row[f"{name}_fwd_ms"] = bench(lambda: m(x), device)
                row[f"{name}_fwdbwd_ms"] = bench(fwd_bwd(m), device, grad_to_none=params)
                if x.is_cuda:  # the same fwd + bwd captured as one CUDA graph: its replays are GPU time only
                    replays[name] = graphed_fwd_bwd(m, x, dy)[0]
    for r in range(rounds if replays else 0):
        for name in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            row.setdefault(f"{name}_graph_rounds_ms", []).append(bench(replays[name], device))
    for name in paths:
        times = row.get(f"{name}_graph_rounds_ms")
        row[f"{name}_graph_fwdbwd_ms"] = statistics.median(times) if times else None
    if x.is_cuda and fp8_supported(x.device):
        if cfg.n_embd % 16 or cfg.mlp_hidden % 16:  # (GPTConfig's rule for fp8: the FP8 GEMMs' 16-byte rows)
            print(f"  {activation} C={C}: no FP8 columns (FP8 needs n_embd and the hidden size multiples of 16)")
        else:
            row.update(fp8_case(cfg, mlp, fused, x, dy, ref, device, dtype, portable=portable))
    if not kernels:
        return row

    # The two kernels against the plain cuBLAS matmul of the same shape.
    xd = x.detach()
    saved = torch.empty(M, n_rows, device=device, dtype=dtype)
    out = torch.empty(M, H, device=device, dtype=dtype)
    row["matmul_fc_ms"] = bench(lambda: xd @ w1.t(), device)
    if activation == "gelu" and b1 is not None:  # the forward's strongest peer: cuBLASLt's bias + GELU epilogue (h only)
        row["addmm_gelu_ms"] = bench(lambda: torch._addmm_activation(b1, xd, w1.t(), use_gelu=True), device)
    row["matmul_dgrad_ms"] = bench(lambda: dy @ w2, device)
    gp = torch.empty_like(saved)
    for name, switches in families.items():
        tag = "" if name == "fused" else f"_{name}"
        with fused_env.overridden(**switches):
            row[f"kernel_fwd_save{tag}_ms"] = bench(
                lambda: linear_act_forward(xd, w1, b1, activation, out=out, saved=saved), device)
            row[f"kernel_fwd_nosave{tag}_ms"] = bench(
                lambda: linear_act_forward(xd, w1, b1, activation, save=False, out=out), device)
            row[f"kernel_dgrad{tag}_ms"] = bench(lambda: linear_act_dgrad(dy, w2, saved, activation, out=gp), device)
    return row


def torchao_float8(mlp):
    """torchao's float8 training (tensorwise scaling) on a copy of the eager MLP, compiled as torchao advises; None
    when torchao is not installed."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    return torch.compile(convert_to_float8_training(copy.deepcopy(mlp)))


def fp8_case(cfg, mlp, fused, x, dy, ref, device, dtype, rounds=3, portable=False):
    """FP8 fused against bf16 fused and torchao float8 + compile: fwd + bwd as CUDA graphs (GPU time), timed in
    `rounds` rounds, the order reversed every other round. Also each FP8 path's largest relative error against
    float64 (their yardstick is the recipe itself: tests/test_fp8.py)."""
    fp8 = MLP(dataclasses.replace(cfg, mlp="fused", fp8=True)).to(device, dtype)
    fp8.load_state_dict(mlp.state_dict())
    paths = {"fused": fused, "fp8": fp8, "torchao": torchao_float8(mlp)}
    families = {}
    if portable:  # the FP8 MLP and the bf16 one on the portable kernels (Triton epilogues, FP8 MMAs where there are)
        paths["fused_portable"], paths["fp8_portable"] = copy.deepcopy(fused), copy.deepcopy(fp8)
        families = {"fused_portable": FAMILIES["portable"], "fp8_portable": FAMILIES["portable"]}
    paths = {k: m for k, m in paths.items() if m is not None}
    row = {}
    for name in ("fp8", "torchao", "fp8_portable"):
        if name in paths:
            m = paths[name]
            with fused_env.overridden(**families.get(name, {})):
                for _ in range(2):  # the second call runs FP8's delayed (fused) path, after the calibrating one
                    xg = x.detach().clone().requires_grad_()
                    y = m(xg)
                    grads = torch.autograd.grad(y, [xg] + list(m.parameters()), dy)
            row[f"max_rel_err_{name}"] = max(rel_err(o, r) for o, r in zip([y.detach(), *grads], ref))
    replays = {}
    for name, m in paths.items():
        with fused_env.overridden(**families.get(name, {})):
            replays[name] = graphed_fwd_bwd(m, x, dy)[0]
    times = {name: [] for name in replays}
    for r in range(rounds):
        for name in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            times[name].append(bench(replays[name], device))
    for name, t in times.items():
        row[f"fp8table_{name}_rounds_ms"] = t
    return row


def true_or_false(text):
    """argparse type for True / False."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text.lower() == "true"


def int_list(text):
    """argparse type for "768,1024": a clear usage error for anything else."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def check_can_run(args):
    """Everything a long measurement needs, checked before it starts."""
    if not torch.cuda.is_available():
        raise errors.UsageError("this benchmark times the kernels on a CUDA GPU, and there is none here; on the CPU "
                                "the same code runs (slowly, for tests) as: TRITON_INTERPRET=1 python bench.py "
                                "--mlp_widths=32,64 --mlp_tokens=32,32 --device=cpu --compile=False")
    if args.tokens and len(args.tokens) != len(args.widths):
        raise errors.UsageError(f"--tokens gives {len(args.tokens)} values for {len(args.widths)} --widths: one per width")
    folder = os.path.dirname(args.out) or "."
    if not os.path.isdir(folder) and args.out != DEFAULT_OUT:  # (the default's folder is made)
        raise errors.UsageError(f"--out={args.out}: folder {folder} does not exist")


def main(argv=None):
    ap = errors.ArgumentParser("bench_mlp.py", description=__doc__)
    ap.add_argument("--widths", default=[768], type=int_list, help="comma-separated model widths C")
    ap.add_argument("--tokens", default=None, type=int_list,
                    help="comma-separated M per width (default 12288 for 768, else 16384/8192)")
    ap.add_argument("--activations", default="gelu,swiglu", help="comma-separated")
    ap.add_argument("--bias", default=True, type=true_or_false,
                    help="the MLP's linears with biases (True, GPT-2's) or without (False, as results/mlp_fp8_h100.txt)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the JSON file to write (results/ holds the docs' record)")
    ap.add_argument("--portable", default=True, type=true_or_false,
                    help="also time the portable kernels (FUSED_OPS_PINGPONG=0, with the TMA and the pointer main "
                         "loops) in the same run, beside the GPU's own choice")
    add_backward_thread_arg(ap)
    args = ap.parse_args(argv)
    check_can_run(args)
    backward_thread(args)
    widths = args.widths
    tokens = args.tokens or [DEFAULT_TOKENS.get(c, 8192) for c in widths]
    try:
        report(args, widths, tokens)
    except torch.OutOfMemoryError as e:
        raise errors.RunError(f"out of memory on the GPU ({str(e).splitlines()[0][:120]}): lower --tokens "
                              "or --widths") from None


def report(args, widths, tokens):
    """Measure every (width, activation), write args.out, print the tables."""
    torch.manual_seed(0)
    peak_tflops, bandwidth = measure_peaks()
    print(f"measured: bf16 matmul {peak_tflops:.0f} TFLOP/s, copy {bandwidth:.0f} GB/s")
    compile_times, rows = {}, []
    for C, M in zip(widths, tokens):
        for act in args.activations.split(","):
            rows.append(mlp_case(C, M, act, compile_times, peak_tflops, bias=args.bias, portable=args.portable))
            print(f"done C={C} {act}", flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "matmul_tflops": peak_tflops, "copy_gbps": bandwidth,
           "backward_thread": args.backward_thread, "bias": args.bias,
           "first_call_seconds": compile_times,
           "tuned": [[name, str(key[:3]), cfg.kwargs, cfg.num_warps, cfg.num_stages, sec] for name, key, cfg, sec in TUNING_LOG]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)

    print(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  {env['date']}")
    for k, v in compile_times.items():
        print(f"  {k}: {v:.1f} s")
    for name, key, cfg, sec in TUNING_LOG:
        print(f"  tuned {name} N={key[1]} K={key[2]}: {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages} ({sec:.1f} s)")
    spread = lambda r, k: (f"{statistics.median(r[k]):.3f} ({min(r[k]):.3f}-{max(r[k]):.3f})"  # noqa: E731
                           if r.get(k) else "-")
    families = [n for n in ("fused", "portable", "pointer") if rows and rows[0].get(f"{n}_fwdbwd_ms") is not None]
    print("fwd+bwd ms; x: speedup over the faster of eager and compile. fused: the GPU's own kernels (on Hopper the "
          "ping-pong ones); portable: FUSED_OPS_PINGPONG=0 (Triton, TMA loop); pointer: also FUSED_OPS_TMA=0")
    print("[do_bench, host time included]")
    print(f"{'case':<16}{'ok':>4}{'eager':>8}{'compile':>8}" + "".join(f"{n:>9}{'x':>6}" for n in families))
    for r in rows:
        best = min(r["eager_fwdbwd_ms"], r["compile_fwdbwd_ms"] or float("inf"))
        print(f"{r['activation'] + ' C=' + str(r['C']):<16}{'y' if r['correct'] else 'NO':>4}"
              f"{r['eager_fwdbwd_ms']:8.3f}{r['compile_fwdbwd_ms'] or float('nan'):8.3f}"
              + "".join(f"{r[n + '_fwdbwd_ms']:9.3f}{best / r[n + '_fwdbwd_ms']:6.2f}" for n in families))
    if rows and rows[0].get("eager_graph_rounds_ms"):
        print(f"[one CUDA graph: GPU time, median (min-max) of {len(rows[0]['eager_graph_rounds_ms'])} rounds "
              "alternated in order]")
        print(f"{'case':<16}{'floor':>7}{'eager':>22}{'compile':>22}" + "".join(f"{n:>22}{'x':>6}" for n in families))
        for r in rows:
            best = min(r["eager_graph_fwdbwd_ms"], r["compile_graph_fwdbwd_ms"] or float("inf"))
            print(f"{r['activation'] + ' C=' + str(r['C']):<16}{r['floor_fwdbwd_ms']:7.3f}"
                  f"{spread(r, 'eager_graph_rounds_ms'):>22}{spread(r, 'compile_graph_rounds_ms'):>22}"
                  + "".join(f"{spread(r, n + '_graph_rounds_ms'):>22}{best / r[n + '_graph_fwdbwd_ms']:6.2f}"
                            for n in families))
    print("kernels alone, do_bench ms: the forward (h and dh/dz; NS: h only) and the dgrad, per family, against the "
          "same-shape cuBLAS matmul and cuBLASLt's bias + GELU epilogue (torch._addmm_activation, h only)")
    print(f"{'case':<16}{'mm fc':>8}{'addmm+gelu':>11}" + "".join(f"{'fwd ' + n:>14}{'fwdNS ' + n:>16}" for n in families)
          + f"{'mm dgrad':>9}" + "".join(f"{'dgrad ' + n:>16}" for n in families))
    for r in rows:
        tag = lambda n: "" if n == "fused" else f"_{n}"  # noqa: E731
        print(f"{r['activation'] + ' C=' + str(r['C']):<16}{r['matmul_fc_ms']:8.3f}"
              f"{r.get('addmm_gelu_ms', float('nan')):11.3f}"
              + "".join(f"{r['kernel_fwd_save' + tag(n) + '_ms']:14.3f}{r['kernel_fwd_nosave' + tag(n) + '_ms']:16.3f}"
                        for n in families)
              + f"{r['matmul_dgrad_ms']:9.3f}" + "".join(f"{r['kernel_dgrad' + tag(n) + '_ms']:16.3f}" for n in families))
    fp8_rows = [r for r in rows if "fp8table_fp8_rounds_ms" in r]
    if fp8_rows:
        names = [n for n in ("fused", "fp8", "torchao", "fused_portable", "fp8_portable")
                 if f"fp8table_{n}_rounds_ms" in fp8_rows[0]]
        print("FP8: fwd+bwd as one CUDA graph, GPU time in ms, median (min-max) of rounds alternated in order; "
              "x: FP8 against bf16 of the same family; err: largest relative error against float64")
        print(f"{'case':<16}" + "".join(f"{n:>22}" for n in names) + f"{'x fp8':>7}{'x fp8 portable':>15}"
              f"{'err FP8':>9}{'err AO':>9}")
        for r in fp8_rows:
            med = lambda n: statistics.median(r[f"fp8table_{n}_rounds_ms"])  # noqa: E731
            xp = med("fused_portable") / med("fp8_portable") if "fp8_portable" in names else float("nan")
            print(f"{r['activation'] + ' C=' + str(r['C']):<16}"
                  + "".join(f"{spread(r, f'fp8table_{n}_rounds_ms'):>22}" for n in names)
                  + f"{med('fused') / med('fp8'):7.2f}{xp:15.2f}{r['max_rel_err_fp8']:9.2e}"
                    f"{r.get('max_rel_err_torchao', float('nan')):9.2e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(errors.run_main("bench_mlp.py", main))
