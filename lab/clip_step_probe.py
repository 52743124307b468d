"""What does the clipping's own pass over the gradients cost, against its factor riding in fused AdamW's grad_scale
(helpers/runtime.clip_and_step)?

    PYTHONPATH=. python lab/clip_step_probe.py configs/gpt2_124m.py

GPT-2 124M's parameters (the config's model) with random gradients on the GPU, fused AdamW as
model.configure_optimizers makes it; do_bench medians (GPU time; L2 flushed, which 124M fp32 parameters outgrow
anyway) of clip_grad_norm_ + step against clip_and_step, two rounds, the order reversed in the second.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from triton.testing import do_bench

import bench
from helpers import runtime
from model import GPT, GPTConfig


def main():
    args = bench.parse_args(sys.argv[1:2])
    model_args, _ = bench.load_config(args)
    model = GPT(GPTConfig(dropout=0.0, **model_args)).cuda()
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    scaler = torch.amp.GradScaler("cuda", enabled=False)

    def nanogpt():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def ours():
        runtime.clip_and_step(opt, params, 1.0, scaler)

    def norm_only():
        torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    cases = {"clip_grad_norm_ + step": nanogpt, "clip_and_step": ours, "step alone": opt.step,
             "the norm alone": norm_only}
    times = {n: [] for n in cases}
    for r in range(2):
        for name in (list(cases) if r == 0 else list(cases)[::-1]):
            times[name].append(do_bench(cases[name], warmup=20, rep=200, return_mode="median"))
    n = sum(p.numel() for p in params)
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {n / 1e6:.1f}M parameters, fused AdamW")
    for name, ms in times.items():
        print(f"{name:<26}{min(ms):8.3f} ms  rounds " + " ".join(f"{m:.3f}" for m in ms))


if __name__ == "__main__":
    main()
