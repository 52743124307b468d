"""Probe: where does the fused forward lose time against cuBLAS? A plain Triton matmul (the control)
and our kernel with parts of its epilogue switched off, at the GPT-2 MLP shape, CUDA-graph timed.

    python tools/matmul_probe.py          (results: notes/perf.md)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from fused_ops.linear_act import linear_act_kernel


@triton.jit
def control_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   PREC: tl.constexpr, ACC_FORM: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M); num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    gid = pid // width
    first = gid * GROUP_M
    gsz = min(num_m - first, GROUP_M)
    pid_m = first + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * sam + rk[None, :] * sak
    b_ptrs = b_ptr + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if ACC_FORM:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + cm[:, None] * scm + cn[None, :], acc.to(c_ptr.dtype.element_ty), mask=(cm < M)[:, None] & (cn < N)[None, :])


M, K, N = 12288, 768, 3072
dt = torch.bfloat16
x = torch.randn(M, K, device="cuda", dtype=dt)
w = torch.randn(N, K, device="cuda", dtype=dt)  # (N, K): B = w.T is K-major
wt = w.t().contiguous()                         # (K, N): N-major B
c = torch.empty(M, N, device="cuda", dtype=dt)
pre = torch.empty(M, N, device="cuda", dtype=dt)
b = torch.randn(N, device="cuda", dtype=dt)
rows = []
mm = do_bench_cudagraph(lambda: x @ w.t())
rows.append(("cuBLAS x @ w.T", mm))
for (bm, bn, bk, nw, ns) in [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]:
    g = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=nw, num_stages=ns)
    tag = f"{bm}x{bn}x{bk} w{nw} s{ns}"
    for prec, form in (("ieee", True), ("tf32", True), (None, False)):
        f = lambda: control_kernel[g](x, w, c, M, N, K, K, 1, 1, K, N, PREC=prec, ACC_FORM=form, **meta)
        rows.append((f"control Kmajor-B {tag} {prec} acc={form}", do_bench_cudagraph(f)))
    f = lambda: control_kernel[g](x, wt, c, M, N, K, K, 1, N, 1, N, PREC="ieee", ACC_FORM=True, **meta)
    rows.append((f"control Nmajor-B {tag}", do_bench_cudagraph(f)))
    for act, save, bias, prec in (("identity", False, False, "ieee"), ("identity", False, False, "tf32"),
                                  ("gelu", False, True, "ieee"), ("gelu", True, True, "ieee")):
        f = lambda: linear_act_kernel[g](x, w, b, c, pre, M, N, K, K, 1, K, 1, N, N, ACTIVATION=act,
                                         UP_ACTIVATION="identity", GATED=False, HAS_BIAS=bias, SAVE_PRE=save,
                                         ACC_DTYPE=tl.float32, PRECISION=prec, EVEN_K=True, INT64=False, **meta)
        rows.append((f"ours {tag} {act} save={save} {prec}", do_bench_cudagraph(f)))
    f = lambda: linear_act_kernel[g](x, wt.t(), b, c, pre, M, N, K, K, 1, 1, N, N, N, ACTIVATION="identity",
                                     UP_ACTIVATION="identity", GATED=False, HAS_BIAS=False, SAVE_PRE=False,
                                     ACC_DTYPE=tl.float32, PRECISION="ieee", EVEN_K=True, INT64=False, **meta)
    rows.append((f"ours Nmajor-B {tag} identity", do_bench_cudagraph(f)))
for name, t in rows:
    print(f"{name:<55} {t * 1e3:8.1f} us  {t / mm:5.2f}x")
