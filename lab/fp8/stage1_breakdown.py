"""FP8 first stage (fused_ops/fp8.py) at GPT-2 small's MLP size: where its time goes, piece by piece, against the
bf16 kernels it replaces, and a check of every FP8 operand the delayed (fused) path writes against PyTorch's own
quantization with the same scales. GPU with FP8 tensor cores.

    python lab/fp8/stage1_breakdown.py [--M 12288 --C 768 --activation gelu]
"""

import argparse

import torch
from triton.testing import do_bench

from fused_ops import fp8
from fused_ops.dgrad import linear_act_dgrad
from fused_ops.fp8 import E4M3, E5M2, FP8_MAX
from fused_ops.fp8_autograd import fp8_mlp
from fused_ops.linear_act import linear_act_forward


def bench(fn):
    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def pingpong_fp8(x2, w1, activation, state):
    """(h8, h8ᵀ, dh/dz) from the ping-pong forward's FP8 epilogue (fused_ops/pingpong.py), or None where
    it does not run (not Hopper, gated)."""
    from fused_ops import pingpong
    if not pingpong.usable_fp8(x2, (w1,), (), activation == "swiglu", w1.shape[0]):
        return None
    M, N = x2.shape[0], w1.shape[0]
    h8 = torch.empty((M, N), device=x2.device, dtype=E4M3)
    h8t = torch.empty((N, fp8._padded(M)), device=x2.device, dtype=E4M3)
    saved = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    if not pingpong.linear_act_forward_fp8(x2, w1, None, activation, h8, h8t, saved, state.scale[fp8.H:],
                                           state.amax[fp8.H:]):
        return None
    return h8, h8t, saved


def pingpong_fp8_dgrad(gy, w2, saved, state):
    """(gz8, gz8ᵀ) from the ping-pong dgrad's FP8 epilogue, or None where it does not run."""
    from fused_ops import pingpong
    M, width = gy.shape[0], saved.shape[1]
    if not pingpong.usable_fp8(gy, (w2, saved), (), False, width):
        return None
    gz8 = torch.empty((M, width), device=gy.device, dtype=E5M2)
    gz8t = torch.empty((width, fp8._padded(M)), device=gy.device, dtype=E5M2)
    ok, _ = pingpong.dgrad_fp8(gy, w2, saved, gz8, gz8t, False, state.scale[fp8.GRAD_Z:], state.amax[fp8.GRAD_Z:])
    return (gz8, gz8t) if ok else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--gy_scale", type=float, default=1e-3)
    a = p.parse_args()
    torch.manual_seed(0)
    gated = a.activation == "swiglu"
    H = 2048 if gated else 4 * a.C
    dev, dt = "cuda", torch.bfloat16
    fc = torch.nn.Linear(a.C, 2 * H if gated else H, bias=False, device=dev, dtype=dt)
    proj = torch.nn.Linear(H, a.C, bias=False, device=dev, dtype=dt)
    state = fp8.FP8State().to(dev)
    x = torch.randn(a.M, a.C, device=dev, dtype=dt, requires_grad=True)
    gy = torch.randn(a.M, a.C, device=dev, dtype=dt) * a.gy_scale
    for call in range(3):  # calibrate, then the delayed path
        fp8_mlp(x, fc, proj, a.activation, state).backward(gy)
    # every operand of the delayed path, against torch's quantization with the scales it used
    x2, w1, w2 = x.detach(), fc.weight.detach(), proj.weight.detach()
    scale = state.scale.clone()
    h8, ht8, saved = fp8.fp8_linear_act(x2, w1, None, a.activation, state)
    _, xt8 = fp8.cast_transpose(x2, state, fp8.X)
    _, gyt8 = fp8.cast_transpose(gy, state, fp8.GRAD_Y)
    gz8, gzt8, _ = fp8.fp8_dgrad(gy, w2, saved, a.activation, state, False)
    h_bf16, saved_bf16 = linear_act_forward(x2, w1, None, a.activation)
    gz_bf16, _ = linear_act_dgrad(gy, w2, saved_bf16, a.activation, bias_grad=False)
    q = lambda t, s, d: (t.float() * s).clamp(-FP8_MAX[d], FP8_MAX[d]).to(d).float()
    state.amax.zero_()
    pp_fp8 = pingpong_fp8(x2, w1, a.activation, state)  # (h8 quantized from fp32 in the ping-pong epilogue)
    amax_before = state.amax[fp8.H].item()
    checks = {"h8": (h8.float(), q(h_bf16, scale[1], E4M3)), "h8T": (ht8[:, :a.M].t().float(), q(h_bf16, scale[1], E4M3)),
              "x8T": (xt8[:, :a.M].t().float(), q(x2, scale[0], E4M3)), "gy8T": (gyt8[:, :a.M].t().float(), q(gy, scale[2], E5M2)),
              "gz8": (gz8.float(), q(gz_bf16, scale[3], E5M2)), "gz8T": (gzt8[:, :a.M].t().float(), q(gz_bf16, scale[3], E5M2))}
    pp_dgrad = pingpong_fp8_dgrad(gy, w2, saved_bf16, state)
    if pp_dgrad is not None:
        checks["gz8 pp"] = (pp_dgrad[0].float(), q(gz_bf16, scale[3], E5M2))
        checks["gz8T pp"] = (pp_dgrad[1][:, :a.M].t().float(), q(gz_bf16, scale[3], E5M2))
    if pp_fp8 is not None:
        checks["h8 pp"] = (pp_fp8[0].float(), q(h_bf16, scale[1], E4M3))
        checks["h8T pp"] = (pp_fp8[1][:, :a.M].t().float(), q(h_bf16, scale[1], E4M3))
        print(f"ping-pong FP8 epilogue: amax {amax_before:.6g}, max |h| of the bf16 kernel {h_bf16.float().abs().max().item():.6g}")
    print("scales", [f"{s:.4g}" for s in scale.tolist()])
    for name, (ours, ref) in checks.items():
        bad = ~torch.isfinite(ours)
        differ = (ours != ref) & torch.isfinite(ref)
        print(f"{name:5s} non-finite {int(bad.sum())} (ref {int((~torch.isfinite(ref)).sum())}), differ from torch's "
              f"quantization: {int(differ.sum())} of {ours.numel()}, largest |diff| {float((ours - ref)[differ].abs().max()) if differ.any() else 0:.3g}")
    # time: each piece of the FP8 path, and the bf16 kernels / GEMMs it replaces
    w28, w2inv, w1t8, w1inv = state.weights(fc.weight, proj.weight)
    one = state.inv_scale[1, :1]
    rows = {
        "bf16 fwd kernel (ping-pong, saves dh/dz)": lambda: linear_act_forward(x2, w1, None, a.activation),
        "FP8 fwd kernel (bf16 loop, h8 + h8T + dh/dz)": lambda: fp8.fp8_linear_act(x2, w1, None, a.activation, state),
        "bf16 fwd (ping-pong) then cast+T h (h8 + h8T)": lambda: fp8.cast_transpose(
            linear_act_forward(x2, w1, None, a.activation)[0], state, fp8.H, row_major=True),
        "FP8 fwd kernel (ping-pong: h8 + h8T + dh/dz)": lambda: pingpong_fp8(x2, w1, a.activation, state),
        "transpose_fp8 h8 (the pass it replaces)": lambda: fp8.transpose_fp8(h8, fp8._padded(a.M), state),
        "FP8 dgrad kernel (ping-pong: gz8 + gz8T)": lambda: pingpong_fp8_dgrad(gy, w2, saved_bf16, state),
        "bf16 dgrad kernel (ping-pong)": lambda: linear_act_dgrad(gy, w2, saved_bf16, a.activation, bias_grad=False),
        "FP8 dgrad kernel (bf16 loop, gz8 + gz8T)": lambda: fp8.fp8_dgrad(gy, w2, saved, a.activation, state, False),
        "bf16 dgrad (ping-pong) then cast+T gz": lambda: fp8.cast_transpose(
            linear_act_dgrad(gy, w2, saved_bf16, a.activation, bias_grad=False)[0], state, fp8.GRAD_Z, row_major=True),
        "cast+T x (e4m3)": lambda: fp8.cast_transpose(x2, state, fp8.X),
        "cast+T gy (e5m2)": lambda: fp8.cast_transpose(gy, state, fp8.GRAD_Y),
        "bf16 y = h @ W2T": lambda: h_bf16 @ w2.t(),
        "FP8 y = h8 @ W2T": lambda: torch._scaled_mm(h8, w28.t(), scale_a=one, scale_b=w2inv, out_dtype=dt, use_fast_accum=True),
        "bf16 dW2 = gyT @ h": lambda: gy.t() @ h_bf16,
        "FP8 dW2": lambda: torch._scaled_mm(gyt8, ht8.t(), scale_a=one, scale_b=one, out_dtype=dt),
        "bf16 dx = gz @ W1": lambda: gz_bf16 @ w1,
        "FP8 dx": lambda: torch._scaled_mm(gz8, w1t8.t(), scale_a=one, scale_b=w1inv, out_dtype=dt),
        "bf16 dW1 = gzT @ x": lambda: gz_bf16.t() @ x2,
        "FP8 dW1": lambda: torch._scaled_mm(gzt8, xt8.t(), scale_a=one, scale_b=one, out_dtype=dt),
        "update_scales": lambda: fp8.update_scales(state),
    }
    print(f"\nM={a.M} C={a.C} H={H} {a.activation}: GPU time per piece, do_bench median, us")
    for name, fn in rows.items():
        print(f"{name:48s} {bench(fn):8.1f}")
    # the whole MLP, forward + backward as one CUDA graph (bench_mlp's), bf16 fused against FP8, rounds alternated
    import dataclasses
    import bench_mlp
    from model import MLP, GPTConfig
    from fused_ops import fp8_autograd
    cfg = GPTConfig(n_embd=a.C, n_head=1, activation=a.activation, bias=False, mlp="fused")
    # FP8 with h / gz from the Triton kernels' FP8 stores, or from the bf16 ping-pong kernels + one cast pass
    # (fp8_autograd.SEPARATE_CAST: forward, dgrad): the choice is made when the graph is captured
    # (and the cast pass's tile: fp8.CAST_TILE, also read when the graph is captured)
    # (and whether the ping-pong forward writes h8 itself: fp8_autograd.PINGPONG_FP8)
    tiles = dict(fp8.CAST_TILE)
    variants = {"bf16 fused": None, "FP8 separate fwd+dgrad": (True, True, tiles, (False, False)),
                "FP8 ping-pong h8 + h8T, separate dgrad": (True, True, tiles, (True, False)),
                "FP8 ping-pong fwd + dgrad (FP8 epilogues)": (True, True, tiles, (True, True))}
    base = MLP(cfg)
    replays = {}
    for k, separate in variants.items():
        m = base if separate is None else MLP(dataclasses.replace(cfg, fp8=True))
        m.load_state_dict(base.state_dict(), strict=False)
        if separate is not None:
            fp8_autograd.SEPARATE_CAST.update(forward=separate[0], dgrad=separate[1])
            fp8.CAST_TILE = separate[2]
            fp8_autograd.PINGPONG_FP8.update(forward=separate[3][0], dgrad=separate[3][1])
        replays[k] = bench_mlp.graphed_fwd_bwd(m.to(dev, dt), x2, gy)[0]
    fp8.CAST_TILE = tiles
    times = {k: [] for k in replays}
    for r in range(4):
        for k in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            times[k].append(bench(replays[k]))
    print("MLP fwd+bwd as one CUDA graph, us per round: " + "; ".join(f"{k} {[round(t, 1) for t in v]}" for k, v in times.items()))


if __name__ == "__main__":
    main()
