"""The Gluon ping-pong kernel (fused_ops/pingpong.py) against cuBLAS and the Triton kernels, on a GPU.

Correctness first (float64 reference, outputs poisoned with NaN), then CUDA-graph replay times of the
GELU forward (with the saved derivative) and the dgrad, at GPT-2 small's MLP size unless told.

    python tools/pingpong_probe.py [--M 12288 --C 768 --H 3072]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from triton.testing import do_bench_cudagraph

from fused_ops import pingpong
from fused_ops.dgrad import linear_act_dgrad
from fused_ops.linear_act import linear_act_forward


def reference_forward(x, w, b):
    z = x.double() @ w.double().T + b.double()
    phi = 0.5 * (1 + torch.erf(z / 2 ** 0.5))
    return z * phi, phi + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def check(M, C, H, dtype=torch.bfloat16):
    """Max relative errors of the ping-pong kernel and of the same-dtype PyTorch path."""
    x = torch.randn(M, C, device="cuda", dtype=dtype)
    w = torch.randn(H, C, device="cuda", dtype=dtype) / C ** 0.5
    b = torch.randn(H, device="cuda", dtype=dtype)
    g = torch.randn(M, C, device="cuda", dtype=dtype)
    w2 = torch.randn(C, H, device="cuda", dtype=dtype) / H ** 0.5
    h, dh = (torch.full((M, H), float("nan"), device="cuda", dtype=dtype) for _ in range(2))
    pingpong.linear_act_forward(x, w, b, "gelu", True, h, dh)
    ref_h, ref_dh = reference_forward(x, w, b)
    z = torch.nn.functional.linear(x, w, b).float()  # the eager path: z rounded to dtype, GELU in fp32
    eager_h = z * 0.5 * (1 + torch.erf(z / 2 ** 0.5))
    eager_dh = 0.5 * (1 + torch.erf(z / 2 ** 0.5)) + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5
    grad = torch.full((M, H), float("nan"), device="cuda", dtype=dtype)
    pingpong.dgrad(g, w2, dh, grad, False)
    ref_grad = (g.double() @ w2.double()) * dh.double()
    eager_grad = (g @ w2) * dh
    return dict(h=rel_err(h, ref_h), h_eager=rel_err(eager_h.to(dtype), ref_h),
                dh=rel_err(dh, ref_dh), dh_eager=rel_err(eager_dh.to(dtype), ref_dh),
                grad=rel_err(grad, ref_grad), grad_eager=rel_err(eager_grad, ref_grad),
                nan=bool(h.isnan().any() or dh.isnan().any() or grad.isnan().any()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--H", type=int, default=3072)
    a = p.parse_args()
    for shape in [(a.M, a.C, a.H), (1000, 200, 520), (129, 64, 136), (5, 768, 3072)]:
        print("check", shape, check(*shape), flush=True)

    M, C, H, dt = a.M, a.C, a.H, torch.bfloat16
    x = torch.randn(M, C, device="cuda", dtype=dt)
    w = torch.randn(H, C, device="cuda", dtype=dt) / C ** 0.5
    b = torch.randn(H, device="cuda", dtype=dt)
    g = torch.randn(M, C, device="cuda", dtype=dt)
    w2 = torch.randn(C, H, device="cuda", dtype=dt) / H ** 0.5
    h, dh, grad = (torch.empty(M, H, device="cuda", dtype=dt) for _ in range(3))
    def triton_kernels(fn):  # the Triton kernels, with the ping-pong path switched off
        def run():
            pingpong.ENABLED = False
            try:
                return fn()
            finally:
                pingpong.ENABLED = True
        return run

    rows = {
        "cuBLAS x @ W.T + b": lambda: torch.nn.functional.linear(x, w, b),
        "Triton linear+GELU (+dh)": triton_kernels(lambda: linear_act_forward(x, w, b, "gelu", out=h, saved=dh)),
        "ping-pong linear+GELU (+dh)": lambda: linear_act_forward(x, w, b, "gelu", out=h, saved=dh),
        "cuBLAS grad_y @ W2": lambda: g @ w2,
        "Triton dgrad (+bias grad)": triton_kernels(lambda: linear_act_dgrad(g, w2, dh, "gelu", out=grad)),
        "ping-pong dgrad (+bias grad)": lambda: linear_act_dgrad(g, w2, dh, "gelu", out=grad),
    }
    times = {}
    for name, fn in rows.items():
        fn()
        times[name] = do_bench_cudagraph(fn) * 1e3
    print(f"\nM={M} C={C} H={H} bf16, {torch.cuda.get_device_name()}, CUDA-graph replay medians")
    print(f"{'kernel':32s} {'us':>8s} {'x cuBLAS':>9s}")
    for name, t in times.items():
        base = times["cuBLAS x @ W.T + b" if "GELU" in name or "x @" in name else "cuBLAS grad_y @ W2"]
        print(f"{name:32s} {t:8.1f} {t / base:9.2f}")


if __name__ == "__main__":
    main()
