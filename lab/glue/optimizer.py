"""The optimizer step of GPT-2 124M alone, against its floor: PyTorch's fused AdamW and fused_ops.FusedAdamW (at a
few block sizes), each with the clipping's grad_scale, and the global gradient norm the clipping needs. The floor:
28 bytes a parameter (p, grad, exp_avg, exp_avg_sq read; p and the moments written) at the copy rate measured in the
same run (a 1 GiB device-to-device copy). Two figures a step: the GPU's kernel time (torch.profiler, 10 steps) and
the wall time per step (do_bench medians over rounds alternated: host time included where the step is host-bound).

    python lab/glue/optimizer.py [--rounds=3]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from triton.testing import do_bench

from fused_ops import adamw
from model import GPT, GPTConfig


def gpu_ms(fn, steps=10):
    """Kernel time per call, from torch.profiler: GPU time only."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0) / steps / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    groups = lambda: [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},  # noqa: E731
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    scale = torch.tensor(1.5, device="cuda")

    def stepper(make):
        opt = make()
        opt.grad_scale = scale
        opt.step()  # (state allocated, kernel compiled)
        return opt.step

    def ours(block, warps):
        def make():
            adamw.BLOCK, adamw.NUM_WARPS = block, warps
            return adamw.FusedAdamW(groups(), lr=6e-4, betas=(0.9, 0.95))
        return make

    src = torch.empty(2 ** 28, device="cuda")
    dst = torch.empty_like(src)
    variants = {
        "copy 1 GiB (the rate)": lambda: dst.copy_(src),
        "torch fused AdamW": stepper(lambda: torch.optim.AdamW(groups(), lr=6e-4, betas=(0.9, 0.95), fused=True)),
        "grad norm (foreach)": lambda: torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True),
    }
    for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]:
        variants[f"FusedAdamW BLOCK={block} warps={warps}"] = stepper(ours(block, warps))
    times = {k: [] for k in variants}
    for r in range(a.rounds):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            times[k].append(do_bench(variants[k], warmup=10, rep=100))
    rate = 2 * src.numel() * 4 / (statistics.median(times["copy 1 GiB (the rate)"]) * 1e-3)
    floor = 28 * n / rate * 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {n / 1e6:.1f}M parameters; copy rate "
          f"{rate / 1e9:.0f} GB/s; AdamW floor (28 B a parameter) {floor:.3f} ms; norm floor {4 * n / rate * 1e3:.3f} ms")
    print(f"| step | GPU ms | x the AdamW floor | wall ms, median (min-max) over {a.rounds} rounds |\n|---|---|---|---|")
    for k, ts in times.items():
        g = gpu_ms(variants[k])
        print(f"| {k} | {g:.3f} | {g / floor:.2f} | {statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f}) |")


if __name__ == "__main__":
    main()
