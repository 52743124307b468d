"""Probe: can the fused forward's epilogue (bias + GELU + saving the pre-activation) hide behind tensor-core
work? lab/tma_probe.py showed a TMA main loop at cuBLAS speed but ~80 us of epilogue on top, because
with TMA *stores* (a staging buffer in shared memory) only one program fits per SM. This probe keeps the
TMA loads, stores from registers (no staging buffer), so two 128x128 programs fit per SM and one's
epilogue can overlap the other's main loop; and it separates the cost of erf from the cost of the stores.

    python lab/overlap_probe.py          (results: docs/performance.md)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ops.activations import activation, activation_grad
from fused_ops.matmul import tile_ids


@triton.jit
def erf_fast(x):
    """Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, one exp and one division."""
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - p * tl.exp(-a * a)
    return tl.where(x < 0, -r, r)


@triton.jit
def probe_kernel(a_desc, b_desc, bias_ptr, pre_ptr, out_ptr, pre_desc, out_desc, M, N, K,
                 EPI: tl.constexpr, TMA_STORE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, ki * BLOCK_K])
        b = b_desc.load([ki * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = offs_m[:, None] * N + offs_n[None, :]
    if EPI == 4:  # dgrad-like: multiply by gelu' of the saved pre-activation (pre_ptr is an input here)
        z = tl.load(pre_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        out = acc * activation_grad(z, "gelu")
    elif EPI == 0:  # bare: one store, no bias
        out = acc
    else:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if TMA_STORE:
            pre_desc.store([off_m, off_n], acc.to(pre_desc.dtype))
        else:
            tl.store(pre_ptr + ptrs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
        if EPI == 1:
            out = activation(acc, "gelu")
        elif EPI == 2:
            out = 0.5 * acc * (1.0 + erf_fast(acc * 0.7071067811865476))
        else:  # identity: the two stores without erf
            out = acc
    if TMA_STORE:
        out_desc.store([off_m, off_n], out.to(out_desc.dtype))
    else:
        tl.store(out_ptr + ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_grad(z):
    return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327


def main():
    torch.manual_seed(0)
    M, C, H = 12288, 768, 3072
    dt = torch.bfloat16
    dev = "cuda"
    x = torch.randn(M, C, device=dev, dtype=dt)
    w = torch.randn(H, C, device=dev, dtype=dt) * 0.03
    wt = w.t().contiguous()  # (K, N): N-major B
    b = torch.randn(H, device=dev, dtype=dt)
    pre_ref = (x.float() @ w.float().T + b.float())
    gelu_ref = torch.nn.functional.gelu(pre_ref)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))

    rows = []
    t_mm = do_bench(lambda: x @ w.T, warmup=25, rep=300)
    rows.append(("cuBLAS x@W.T", "", t_mm, 0.0))
    rows.append(("eager addmm + gelu", "", do_bench(lambda: torch.nn.functional.gelu(torch.addmm(b, x, w.T)),
                                                    warmup=25, rep=300), 0.0))
    pre_e = torch.addmm(b, x, w.T)
    rows.append(("eager gelu alone", "", do_bench(lambda: torch.nn.functional.gelu(pre_e), warmup=25, rep=300), 0.0))

    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, maxnreg)
    configs = [(128, 256, 64, 8, 3, None), (128, 128, 64, 8, 4, None), (128, 128, 64, 4, 3, None),
               (128, 128, 64, 4, 4, None), (128, 128, 32, 4, 6, None), (128, 128, 64, 8, 3, 128),
               (128, 64, 64, 4, 4, None), (64, 256, 64, 4, 3, None), (256, 128, 64, 8, 3, None),
               (128, 256, 64, 8, 4, None)]
    pre_saved = (pre_ref.to(dt))
    dgrad_ref = (x.float() @ w.float().T) * gelu_grad(pre_saved.float())
    for epi, name in ((0, "bare"), (1, "bias+gelu+save"), (2, "bias+fast-erf gelu+save"), (3, "bias+save (no act)"),
                      (4, "dgrad: mm * gelu'(pre)")):
        for tma_store in (False, True):
            for bm, bn, bk, warps, stages, maxnreg in configs:
                label = f"{bm}x{bn}x{bk} w{warps} s{stages}" + (f" r{maxnreg}" if maxnreg else "") + \
                    (" tma-st" if tma_store else " ptr-st")
                pre = pre_saved if epi == 4 else torch.full((M, H), float("nan"), device=dev, dtype=dt)
                out = torch.full((M, H), float("nan"), device=dev, dtype=dt)
                a_d = TensorDescriptor.from_tensor(x, [bm, bk])
                b_d = TensorDescriptor.from_tensor(wt, [bk, bn])
                pre_d = TensorDescriptor.from_tensor(pre, [bm, bn])
                out_d = TensorDescriptor.from_tensor(out, [bm, bn])
                grid = (triton.cdiv(M, bm) * triton.cdiv(H, bn),)
                extra = {} if maxnreg is None else {"maxnreg": maxnreg}

                def run():
                    return probe_kernel[grid](a_d, b_d, b, pre, out, pre_d, out_d, M, H, C, EPI=epi,
                                              TMA_STORE=tma_store, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                              num_warps=warps, num_stages=stages, **extra)
                try:
                    ck = run()
                    torch.cuda.synchronize()
                    ref = {0: pre_ref - b.float(), 1: gelu_ref, 2: gelu_ref, 3: pre_ref, 4: dgrad_ref}[epi]
                    err = (out.float() - ref).abs().max().item()
                    t = do_bench(run, warmup=25, rep=300)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                info = f"regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')} " \
                       f"smem={getattr(ck.metadata, 'shared', '?')}"
                rows.append((name, label, t, err))
                print(f"{name:26s} {label:34s} {t * 1e3:7.1f} us  {t / t_mm:5.2f}x  err={err:.3g}  {info}", flush=True)

    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} M={M} K={C} N={H} bf16")
    print(f"{'variant':26s} {'best config':34s} {'us':>7s} {'x cuBLAS':>8s} {'max err':>8s}")
    best = {}
    for v, cfg, t, err in rows:
        if v not in best or t < best[v][1]:
            best[v] = (cfg, t, err)
    for v, (cfg, t, err) in best.items():
        print(f"{v:26s} {cfg:34s} {t * 1e3:7.1f} {t / t_mm:8.2f} {err:8.3g}")


if __name__ == "__main__":
    main()
