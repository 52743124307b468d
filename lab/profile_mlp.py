"""Diagnostics for the fused MLP on a GPU: every tile config of each kernel timed on its own, launch
overhead (do_bench vs CUDA-graph replay), and a torch.profiler breakdown of one fused fwd+bwd.

    python lab/profile_mlp.py [--C 768 --M 12288]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from fused_ops import FusedMLP, linear_act_forward
from fused_ops.activations import kernel_activations
from fused_ops.dgrad import dgrad_kernel
from fused_ops.linear_act import linear_act_kernel
from fused_ops.matmul import tma_operands
from fused_ops.tuning import TUNING_LOG, _config, matmul_configs, run_config
from model import MLP, GPTConfig


# Tiles outside the tuning list, for --probe: 4-warp tiles small enough in shared memory for two
# programs per SM (one's epilogue could then run beside the other's MMAs).
PROBE_CONFIGS = [_config(128, 128, 64, 4, 2), _config(128, 128, 32, 4, 4), _config(128, 128, 32, 4, 3),
                 _config(128, 256, 32, 8, 4), _config(128, 128, 64, 4, 2, maxnreg=168)]


def time_config(kernel, M, N, K, args, consts, cfg, descriptors=()):
    """Graph-replay time of one config and what decides its occupancy (registers, spills, shared memory)."""
    run = lambda: run_config(kernel, M, N, K, args, consts, cfg, descriptors)
    time_config.occupancy = ""
    try:
        compiled = run()
        t = do_bench_cudagraph(run)
    except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
        return f"error {type(e).__name__}: {str(e)[:80]}"
    time_config.occupancy = (f"[{compiled.n_regs} regs, {compiled.n_spills} spills, "
                             f"{compiled.metadata.shared // 1024} KB smem]")
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--C", type=int, default=768)
    ap.add_argument("--M", type=int, default=12288)
    ap.add_argument("--loops", default="pointer,tma",
                    help="main loops to time per config: pointer (reads an N-major copy of W, as the launcher "
                         "does), tma (W as it is, K-major, as the launcher does), tma-nmajor (the copy, with TMA)")
    ap.add_argument("--probe", action="store_true", help="also time PROBE_CONFIGS, tiles not in the tuning list")
    a = ap.parse_args()
    dt = torch.bfloat16
    for act in ("gelu", "swiglu"):
        cfg = GPTConfig(n_embd=a.C, n_head=1, activation=act)
        H, gated = cfg.mlp_hidden, cfg.gated
        rows = 2 * H if gated else H
        M, C = a.M, a.C
        x = torch.randn(M, C, device="cuda", dtype=dt)
        w1 = torch.randn(rows, C, device="cuda", dtype=dt) * C ** -0.5
        b1 = torch.randn(rows, device="cuda", dtype=dt)
        w2 = torch.randn(C, H, device="cuda", dtype=dt) * H ** -0.5
        dy = torch.randn(M, C, device="cuda", dtype=dt)
        out, pre, gp = (torch.empty(M, H, device="cuda", dtype=dt), torch.empty(M, rows, device="cuda", dtype=dt),
                        torch.empty(M, rows, device="cuda", dtype=dt))
        k_act, k_up, _ = kernel_activations(act)
        mm_fc = do_bench_cudagraph(lambda: x @ w1.t())
        mm_dg = do_bench_cudagraph(lambda: dy @ w2)
        print(f"\n== {act} M={M} C={C} H={H}: cuBLAS fc {mm_fc * 1e3:.1f} us, dgrad-shaped {mm_dg * 1e3:.1f} us (graph replay)")
        common = dict(ACTIVATION=k_act, UP_ACTIVATION=k_up, GATED=gated, ACC_DTYPE=triton.language.float32,
                      PRECISION="ieee", INT64=False)
        fmt = lambda t, ref: f"{t * 1e3:7.1f} us ({t / ref:4.2f}x cuBLAS)" if isinstance(t, float) else t
        w1_n = w1.t().contiguous().t()  # the N-major copy the forward reads at this M
        dg_args = (dy, w2, pre, gp, None, M, H, C, C, 1, H, 1, rows, rows, rows)
        for loop in a.loops.split(","):
            w_fwd = w1 if loop == "tma" else w1_n
            fwd_args = (x, w_fwd, b1, out, pre, w1, out, 0.0, M, H, C, C, 1, *w_fwd.stride(), H, rows)
            fwd_desc, fwd_kmajor = tma_operands(x, w_fwd.t()) if loop.startswith("tma") else ([], False)
            dg_desc, dg_kmajor = tma_operands(dy, w2) if loop.startswith("tma") else ([], False)
            if loop.startswith("tma") and not (fwd_desc and dg_desc):
                print("  (no TMA on this GPU / Triton)")
                continue
            fwd_c = dict(common, LN_FOLD=False, TMA=bool(fwd_desc), B_KMAJOR=fwd_kmajor)
            for c in matmul_configs(gated, dt) + (PROBE_CONFIGS if a.probe else []):
                f = time_config(linear_act_kernel, M, H, C, fwd_args, dict(fwd_c, HAS_BIAS=True, SAVE=True), c,
                                fwd_desc)
                occupancy = time_config.occupancy
                bare = time_config(linear_act_kernel, M, H, C, fwd_args,
                                   dict(fwd_c, HAS_BIAS=False, SAVE=False, ACTIVATION="identity"), c, fwd_desc)
                print(f"  fwd   {loop:10s} {c.kwargs} w{c.num_warps} s{c.num_stages} r{getattr(c, 'maxnreg', None)}: "
                      f"{fmt(f, mm_fc)} {occupancy}  bare matmul {fmt(bare, mm_fc)}")
            for c in (matmul_configs(False, dt) + (PROBE_CONFIGS if a.probe else []) if loop != "tma-nmajor" else []):
                partial = torch.empty(triton.cdiv(M, c.kwargs["BLOCK_M"]), rows, device="cuda")
                args = dg_args[:4] + (partial,) + dg_args[5:]
                d = time_config(dgrad_kernel, M, H, C, args, dict(GATED=gated, BIAS_GRAD=True, ACC_DTYPE=common["ACC_DTYPE"],
                                                                  PRECISION="ieee", INT64=False, TMA=bool(dg_desc),
                                                                  B_KMAJOR=dg_kmajor), c, dg_desc)
                print(f"  dgrad {loop:10s} {c.kwargs} w{c.num_warps} s{c.num_stages} r{getattr(c, 'maxnreg', None)}: "
                      f"{fmt(d, mm_dg)} {time_config.occupancy}")

        # Launch overhead of the autotuned launcher (tuned on the first call).
        linear_act_forward(x, w1, b1, act, out=out, saved=pre)
        t_bench = do_bench(lambda: linear_act_forward(x, w1, b1, act, out=out, saved=pre), return_mode="median")
        t_graph = do_bench_cudagraph(lambda: linear_act_forward(x, w1, b1, act, out=out, saved=pre))
        xs = x[:64]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            linear_act_forward(xs, w1, b1, act)
        cpu_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"  launcher fwd: do_bench {t_bench * 1e3:.1f} us, graph {t_graph * 1e3:.1f} us; CPU per call {cpu_us:.1f} us")

        # The whole fused MLP fwd+bwd under the profiler.
        mlp = FusedMLP(cfg).cuda().to(dt)
        xg = x.clone().requires_grad_()
        for _ in range(3):
            mlp(xg).backward(dy)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                mlp(xg).backward(dy)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        eager = MLP(cfg).cuda().to(dt)
        fb = lambda m: (lambda: m(xg).backward(dy))
        print(f"  fwd+bwd: fused do_bench {do_bench(fb(mlp), return_mode='median'):.3f} ms, graph "
              f"{do_bench_cudagraph(fb(mlp)):.3f} ms; eager do_bench {do_bench(fb(eager), return_mode='median'):.3f} ms, "
              f"graph {do_bench_cudagraph(fb(eager)):.3f} ms")

    for name, key, cfg, seconds in TUNING_LOG:
        print(f"tuned {name} {key[:3]}: {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages} in {seconds:.1f} s")
    try:
        x64 = torch.randn(5, 6, device="cuda", dtype=torch.float64)
        linear_act_forward(x64, torch.randn(7, 6, device="cuda", dtype=torch.float64), None, "gelu")
        print("float64 on GPU: ok")
    except Exception as e:
        import traceback; print("float64 on GPU fails:", "".join(traceback.format_exception(e))[-3000:])


if __name__ == "__main__":
    main()
