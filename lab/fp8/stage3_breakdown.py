"""FP8 MLP, third stage (FP8 main loops in the ping-pong kernels) at GPT-2 small's MLP size: where its time goes,
piece by piece, against the bf16 kernels it replaces, and the whole MLP (forward + backward as one CUDA graph)
against bf16 fused, rounds alternated. Hopper GPU. (stage1_breakdown.py measured stages 1 to 2; it is in the
history at commit 0e7c2aa.)

    PYTHONPATH=. python lab/fp8/stage3_breakdown.py [--M 12288 --C 768 --activations gelu,swiglu]
"""

import argparse
import dataclasses

import torch
from triton.testing import do_bench

import bench_mlp
from fused_ops.fp8 import hopper as fp8_hopper, kernels as fp8, state as fp8_state
from fused_ops.hopper import pingpong
from fused_ops.dgrad import linear_act_dgrad
from fused_ops.fp8.autograd import _first_linear, _second_dgrad
from fused_ops.linear_act import linear_act_forward
from lab.fp8.epilogue_probe import setup
from model import MLP, GPTConfig


def bench(fn):
    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def pieces(M, C, activation, dev="cuda", dt=torch.bfloat16):
    gated = activation == "swiglu"
    H = 2048 if gated else 4 * C
    d = setup(M, C, gated, dev, dt)  # (H's and grad_z's scales are set below, from the bf16 kernels' outputs)
    x, gy, w1, w2, state, x8, xt8, gy8, gyt8, w18, w1t8, w28, w2t8 = (
        d[k] for k in ("x", "gy", "w1", "w2", "state", "x8", "xt8", "gy8", "gyt8", "w18", "w1t8", "w28", "w2t8"))
    (inv_x, w1inv), (inv_gy, w2inv) = d["inv1"], d["inv2"]
    h, saved = linear_act_forward(x, w1, None, activation)
    fp8_state._set_current_scale(state, fp8.H, h)
    h8, ht8, saved8 = _first_linear(x8, w18, (inv_x, w1inv), None, activation, state, dt)
    gz, _ = linear_act_dgrad(gy, w2, saved, activation, bias_grad=False)
    fp8_state._set_current_scale(state, fp8.GRAD_Z, gz)
    gz8, gzt8, _ = _second_dgrad(gy8, w2t8, (inv_gy, w2inv), saved8, activation, state, False)
    one = state.inv_scale[1, :1]
    rows = {
        "cast x: x8 + x8T (e4m3)": lambda: fp8.cast_transpose(x, state, fp8.X, row_major=True),
        "cast gy: gy8 + gy8T (e5m2)": lambda: fp8.cast_transpose(gy, state, fp8.GRAD_Y, row_major=True),
        "bf16 fwd kernel (ping-pong, h + dh/dz)": lambda: linear_act_forward(x, w1, None, activation),
        "FP8 fwd (FP8 loop; h8 + h8T + dh/dz)": lambda: _first_linear(x8, w18, (inv_x, w1inv), None, activation,
                                                                      state, dt),
        "bf16 dgrad kernel (ping-pong)": lambda: linear_act_dgrad(gy, w2, saved, activation, bias_grad=False),
        "FP8 dgrad (FP8 loop; gz8 + gz8T)": lambda: _second_dgrad(gy8, w2t8, (inv_gy, w2inv), saved8, activation,
                                                                 state, False),
        "bf16 y = h @ W2T": lambda: h @ w2.t(),
        "FP8 y": lambda: torch._scaled_mm(h8, w28.t(), scale_a=one, scale_b=w2inv, out_dtype=dt, use_fast_accum=True),
        "bf16 dW2 = gyT @ h": lambda: gy.t() @ h,
        "FP8 dW2": lambda: torch._scaled_mm(gyt8, ht8.t(), scale_a=one, scale_b=one, out_dtype=dt),
        "bf16 dx = gz @ W1": lambda: gz @ w1,
        "FP8 dx": lambda: torch._scaled_mm(gz8, w1t8.t(), scale_a=one, scale_b=w1inv, out_dtype=dt),
        "bf16 dW1 = gzT @ x": lambda: gz.t() @ x,
        "FP8 dW1": lambda: torch._scaled_mm(gzt8, xt8.t(), scale_a=one, scale_b=one, out_dtype=dt),
        "update_scales": lambda: fp8.update_scales(state),
        "weight copies (W1, W1T, W2, W2T)": lambda: state.weights_changed() or state.weights(w1, w2),
    }
    print(f"\nM={M} C={C} H={H} {activation}: GPU time per piece, do_bench median, us "
          f"(ping-pong FP8 failure: {fp8_hopper.FP8_FAILURE!r}, 16-bit: {pingpong.FAILURE!r})")
    for name, fn in rows.items():
        print(f"{name:44s} {bench(fn):8.1f}")


def whole_mlp(M, C, activations, rounds=4, dev="cuda", dt=torch.bfloat16):
    """bf16 fused against FP8, forward + backward as one CUDA graph (bench_mlp's), bias-free 16-bit modules."""
    replays = {}
    for activation in activations:
        cfg = GPTConfig(n_embd=C, n_head=1, activation=activation, bias=False, mlp="fused")
        x = torch.randn(M, C, device=dev, dtype=dt)
        gy = torch.randn(M, C, device=dev, dtype=dt) * 1e-3
        base = MLP(cfg).to(dev, dt)
        replays[f"{activation} bf16 fused"] = bench_mlp.graphed_fwd_bwd(base, x, gy)[0]
        m = MLP(dataclasses.replace(cfg, fp8=True))
        m.load_state_dict(base.state_dict(), strict=False)
        replays[f"{activation} FP8 fused"] = bench_mlp.graphed_fwd_bwd(m.to(dev, dt), x, gy)[0]
    times = {k: [] for k in replays}
    for r in range(rounds):
        for k in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            times[k].append(bench(replays[k]))
    print("\nMLP fwd+bwd as one CUDA graph, GPU time, us per round (alternated):")
    for k, v in times.items():
        print(f"{k:24s} " + " ".join(f"{t:7.1f}" for t in v) + f"   median {sorted(v)[len(v) // 2]:.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--activations", default="gelu,swiglu")
    a = p.parse_args()
    activations = a.activations.split(",")
    for activation in activations:
        pieces(a.M, a.C, activation)
    whole_mlp(a.M, a.C, activations)


if __name__ == "__main__":
    main()
