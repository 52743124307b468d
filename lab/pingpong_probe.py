"""The Gluon ping-pong kernel (fused_ops/hopper/pingpong.py) against cuBLAS and the Triton kernels, on a GPU.

CUDA-graph replay times of the forward (with the saved derivative) and the dgrad, beside cuBLAS matmuls of
the same shapes and the eager ops they replace, at GPT-2 small's MLP size unless told. (Correctness:
tests/test_pingpong.py.)

    python lab/pingpong_probe.py [--activation gelu|swiglu|...] [--M 12288 --C 768 --H 3072]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from triton.testing import do_bench_cudagraph

from fused_ops import env
from fused_ops.hopper import pingpong
from fused_ops.dgrad import linear_act_dgrad
from fused_ops.linear_act import linear_act_forward
from model import GATED_ACTIVATIONS, PLAIN_ACTIVATIONS, GPTConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--H", type=int, default=None, help="hidden size (default 4C, or 8C/3 rounded for a gated one)")
    p.add_argument("--activation", default="gelu", help="gelu or a gated one (swiglu, geglu, ...)")
    a = p.parse_args()
    act, M, C, dt = a.activation, a.M, a.C, torch.bfloat16
    gated = act in GATED_ACTIVATIONS
    H = a.H or GPTConfig(n_embd=C, n_head=1, activation=act).mlp_hidden
    rows = 2 * H if gated else H  # W1's rows: [gate; up] when gated
    x = torch.randn(M, C, device="cuda", dtype=dt)
    w = torch.randn(rows, C, device="cuda", dtype=dt) / C ** 0.5
    b = torch.randn(rows, device="cuda", dtype=dt)
    g = torch.randn(M, C, device="cuda", dtype=dt)
    w2 = torch.randn(C, H, device="cuda", dtype=dt) / H ** 0.5
    h = torch.empty(M, H, device="cuda", dtype=dt)
    z = torch.empty(M, rows, device="cuda", dtype=dt)  # x @ W.T + b alone: the main loop and one store
    dh, grad = (torch.empty(M, rows, device="cuda", dtype=dt) for _ in range(2))
    if not pingpong.usable(x, (w, h, dh, g, w2), split=H if gated else None):
        raise SystemExit("the ping-pong kernel cannot run here (needs a Hopper GPU, Gluon, FUSED_OPS_PINGPONG=1 "
                         "and 16-byte aligned rows)")
    eager_act = GATED_ACTIVATIONS[act] if gated else PLAIN_ACTIVATIONS[act]
    act_args = (lambda z: z.chunk(2, dim=-1)) if gated else (lambda z: (z, ))

    def triton_kernels(fn):  # the Triton kernels, with the ping-pong path switched off
        def run():
            env.PINGPONG = False
            try:
                return fn()
            finally:
                env.PINGPONG = True
        return run

    def eager_dgrad():  # what backward does without the fused kernel: the matmul, then dh/dz applied
        grad_h = g @ w2
        if gated:  # both halves of dh/dz times the same grad_h, broadcast (no copy of grad_h)
            return (dh.view(M, 2, H) * grad_h[:, None, :]).view(M, rows)
        return grad_h * dh

    rows_ = {
        "cuBLAS x @ W.T + b": lambda: torch.nn.functional.linear(x, w, b),
        "eager linear, activation": lambda: eager_act(*act_args(torch.nn.functional.linear(x, w, b))),
        # cuBLASLt's own fused epilogue (GELU, tanh form, nothing saved): the vendor's price of an epilogue
        **({} if gated else {"cuBLASLt linear+GELU epilogue": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)}),
        "Triton linear+act (+dh/dz)": triton_kernels(lambda: linear_act_forward(x, w, b, act, out=h, saved=dh)),
        "ping-pong linear+act (+dh/dz)": lambda: linear_act_forward(x, w, b, act, out=h, saved=dh),
        "ping-pong linear+act, no dh/dz": lambda: linear_act_forward(x, w, b, act, save=False, out=h),
        "ping-pong matmul (identity)": lambda: linear_act_forward(x, w, b, "identity", save=False, out=z),
        "cuBLAS grad_y @ W2": lambda: g @ w2,
        "eager matmul, * dh/dz": eager_dgrad,
        "Triton dgrad (+bias grad)": triton_kernels(lambda: linear_act_dgrad(g, w2, dh, act, out=grad)),
        "Triton dgrad (no bias grad)": triton_kernels(lambda: linear_act_dgrad(g, w2, dh, act, bias_grad=False,
                                                                               out=grad)),
        # the kernel itself (linear_act_dgrad sends a gated dgrad to Triton where that is faster: takes_dgrad)
        "ping-pong dgrad (+bias grad)": lambda: pingpong.dgrad(g, w2, dh, grad, gated, True),
        "ping-pong dgrad (no bias grad)": lambda: pingpong.dgrad(g, w2, dh, grad, gated, False),
    }
    times = {}
    for name, fn in rows_.items():
        fn()
        times[name] = do_bench_cudagraph(fn) * 1e3
    print(f"\n{act} M={M} C={C} H={H} bf16, {torch.cuda.get_device_name()}, CUDA-graph replay medians")
    print(f"{'kernel':32s} {'us':>8s} {'x cuBLAS':>9s}")
    for name, t in times.items():
        backward = list(times).index(name) >= list(times).index("cuBLAS grad_y @ W2")
        base = times["cuBLAS grad_y @ W2" if backward else "cuBLAS x @ W.T + b"]
        print(f"{name:32s} {t:8.1f} {t / base:9.2f}")


if __name__ == "__main__":
    main()
