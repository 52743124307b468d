"""Probe: does a TMA (tensor-descriptor) main loop, optionally persistent, close the gap to cuBLAS for
the fused forward (bias + GELU + save pre) and dgrad (x GELU'(pre)) at the GPT-2 MLP shape? Sweeps tile
configs, persistence, epilogue subtiling, warp specialization and two programs per SM (maxnreg).

    python lab/tma_probe.py          (results: docs/performance.md)
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
def epi(acc, off_m, off_n, b_ptr, pre_desc, out_desc, N, EPI: tl.constexpr, BN: tl.constexpr):
    if EPI == 0:
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))
    elif EPI == 1:
        offs_n = off_n + tl.arange(0, BN)
        z = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        pre_desc.store([off_m, off_n], z.to(pre_desc.dtype))
        out_desc.store([off_m, off_n], activation(z, "gelu").to(out_desc.dtype))
    else:
        z = pre_desc.load([off_m, off_n]).to(tl.float32)
        out_desc.store([off_m, off_n], (acc * activation_grad(z, "gelu")).to(out_desc.dtype))


@triton.jit
def probe_kernel(a_desc, b_desc, b_ptr, pre_desc, out_desc, M, N, K,
                 EPI: tl.constexpr, B_KMAJOR: tl.constexpr, PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr,
                 SUBTILE: tl.constexpr, WS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        start, step = tl.program_id(0), NUM_PROGS
    else:
        start, step = tl.program_id(0), num_tiles
    for tile in tl.range(start, num_tiles, step, flatten=PERSISTENT, warp_specialize=WS):
        pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            if B_KMAJOR:
                b = b_desc.load([off_n, ki * BLOCK_K]).T
            else:
                b = b_desc.load([ki * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        if SUBTILE:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            epi(acc0, off_m, off_n, b_ptr, pre_desc, out_desc, N, EPI, BLOCK_N // 2)
            epi(acc1, off_m, off_n + BLOCK_N // 2, b_ptr, pre_desc, out_desc, N, EPI, BLOCK_N // 2)
        else:
            epi(acc, off_m, off_n, b_ptr, pre_desc, out_desc, N, EPI, BLOCK_N)


def main():
    torch.manual_seed(0)
    M, C, H = 12288, 768, 3072
    dt = torch.bfloat16
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(M, C, device=dev, dtype=dt)
    w = torch.randn(H, C, device=dev, dtype=dt) * 0.03   # W1 (H, C): K-major B
    w2 = torch.randn(C, H, device=dev, dtype=dt) * 0.03  # W2 (C, H): dgrad B = W2 is N-major
    b = torch.randn(H, device=dev, dtype=dt)
    gy = torch.randn(M, C, device=dev, dtype=dt)
    pre_ref = x @ w.T + b
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))

    rows = []
    t_cublas = do_bench(lambda: x @ w.T, warmup=25, rep=200)
    rows.append(("cuBLAS x@W1.T", "", t_cublas, True))
    t_cublas_d = do_bench(lambda: gy @ w2, warmup=25, rep=200)
    rows.append(("cuBLAS gy@W2", "", t_cublas_d, True))

    from fused_ops.linear_act import linear_act_forward
    from fused_ops.dgrad import linear_act_dgrad
    os.environ["FUSED_OPS_AUTOTUNE"] = "1"
    t = do_bench(lambda: linear_act_forward(x, w, b, "gelu"), warmup=25, rep=200)
    rows.append(("current fwd gelu+save", "tuned", t, True))
    pre_cur = linear_act_forward(x, w, b, "gelu")[1]
    t = do_bench(lambda: linear_act_dgrad(gy, w2, pre_cur, "gelu", bias_grad=False), warmup=25, rep=200)
    rows.append(("current dgrad gelu", "tuned", t, True))

    ref_out = {1: torch.nn.functional.gelu(pre_ref.float()), 2: (gy.float() @ w2.float())}
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, maxnreg, programs per SM when persistent)
    configs = [(128, 256, 64, 8, 3, None, 1), (128, 128, 64, 8, 4, None, 1),
               (128, 128, 64, 4, 3, None, 2), (128, 128, 64, 4, 2, None, 2),
               (128, 128, 64, 8, 3, 128, 2), (128, 128, 64, 8, 2, 128, 2),
               (64, 256, 64, 4, 3, None, 2), (128, 64, 64, 4, 4, None, 2)]
    for epi_mode, name in ((0, "bare"), (1, "fwd gelu+save"), (2, "dgrad gelu")):
        for persistent in (False, True):
            for bm, bn, bk, warps, stages, maxnreg, per_sm in configs:
                for subtile, ws in ((False, False), (True, False)) + (((False, True), (True, True)) if persistent else ()):
                    label = f"{bm}x{bn}x{bk} w{warps} s{stages} r{maxnreg}" + (f" P{per_sm}" if persistent else "") + \
                        (" sub" if subtile else "") + (" WS" if ws else "")
                    if epi_mode == 2:
                        a_d = TensorDescriptor.from_tensor(gy, [bm, bk])
                        b_d = TensorDescriptor.from_tensor(w2, [bk, bn])
                        kmajor, pre = False, pre_ref
                    else:
                        a_d = TensorDescriptor.from_tensor(x, [bm, bk])
                        b_d = TensorDescriptor.from_tensor(w, [bn, bk])
                        kmajor, pre = True, torch.empty(M, H, device=dev, dtype=dt)
                    out = torch.full((M, H), float("nan"), device=dev, dtype=dt)
                    ebn = bn // 2 if subtile else bn  # the epilogue's store block
                    pre_d = TensorDescriptor.from_tensor(pre, [bm, ebn])
                    out_d = TensorDescriptor.from_tensor(out, [bm, ebn])
                    tiles = triton.cdiv(M, bm) * triton.cdiv(H, bn)
                    progs = min(per_sm * sms, tiles)
                    grid = (progs,) if persistent else (tiles,)
                    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

                    def run():
                        return probe_kernel[grid](a_d, b_d, b, pre_d, out_d, M, H, C, EPI=epi_mode, B_KMAJOR=kmajor,
                                           PERSISTENT=persistent, NUM_PROGS=progs, SUBTILE=subtile, WS=ws,
                                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                           num_warps=warps, num_stages=stages, **extra)
                    try:
                        ck = run()
                        torch.cuda.synchronize()
                        info = f"regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')} smem={getattr(ck.metadata, 'shared', '?')}"
                        ok = True
                        if epi_mode == 1:
                            ok = torch.allclose(out.float(), ref_out[1], atol=0.05, rtol=0.02)
                        elif epi_mode == 2:
                            g = ref_out[2] * (0.5 * (1 + torch.erf(pre_ref.float() / 2 ** 0.5)) +
                                              pre_ref.float() * torch.exp(-0.5 * pre_ref.float() ** 2) / (2 * torch.pi) ** 0.5)
                            ok = torch.allclose(out.float(), g, atol=0.1, rtol=0.05)
                        t = do_bench(run, warmup=25, rep=200)
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    rows.append((f"TMA {name}", label, t, ok))
                    print(f"{name:14s} {label:36s} {t * 1e3:7.1f} us ok={ok} {info}", flush=True)

    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"{'variant':24s} {'config':32s} {'us':>7s} {'x cuBLAS':>9s} ok")
    best = {}
    for v, cfg, t, ok in rows:
        if v.startswith("TMA"):
            if ok and (v not in best or t < best[v][1]):
                best[v] = (cfg, t)
        else:
            ref = t_cublas_d if "dgrad" in v or "gy@" in v else t_cublas
            print(f"{v:24s} {cfg:32s} {t * 1e3:7.1f} {t / ref:9.2f} {ok}")
    for v, (cfg, t) in best.items():
        ref = t_cublas_d if "dgrad" in v else t_cublas
        print(f"{v:24s} {cfg:32s} {t * 1e3:7.1f} {t / ref:9.2f} best")


if __name__ == "__main__":
    main()
