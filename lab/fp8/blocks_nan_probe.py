"""Issue 47: bench.py's fp8blocks+cls8 at width 1536 and 2048 gave NaN losses from the first step (reduce-overhead;
768 was finite). Where does the NaN start? (A) the FP8 linear alone at the wide shapes, uncompiled and compiled;
(B) the GPT at widths 768 and 1536, one forward, uncompiled and compiled, the first module whose output is not finite.

    python lab/fp8/blocks_nan_probe.py      # one GPU with FP8 tensor cores
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import model
from fused_ops.fp8 import FP8State, fp8_linear


def linear_alone(K, N, compiled, M=12288):
    torch.manual_seed(0)
    w = (torch.randn(N, K, device="cuda") * 0.02).requires_grad_()
    st = FP8State().cuda()
    fn = torch.compile(fp8_linear) if compiled else fp8_linear
    out = []
    for _ in range(3):
        x = torch.randn(M, K, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w, None, st)
        y.float().square().mean().backward()
        ref = x.detach() @ w.detach().t()
        out.append(f"finite y {torch.isfinite(y).all().item()} dx {torch.isfinite(x.grad).all().item()} "
                   f"dW {torch.isfinite(w.grad).all().item()} rel {((y.float() - ref).norm() / ref.norm()).item():.4f}")
        w.grad = None
    print(f"A  K={K} N={N} compiled={compiled}: " + " | ".join(out), flush=True)


def gpt_forward(width, compiled, reach):
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = model.GPTConfig(n_layer=2, n_head=width // 64, n_embd=width, bias=False, mlp="fused", fp8=True,
                             fp8_reach=reach, classifier="fused")
    gpt = model.GPT(config).cuda()
    bad = []
    for name, m in gpt.named_modules():
        if name and not compiled:
            m.register_forward_hook(lambda mod, inp, out, name=name: bad.append(name) if isinstance(out, torch.Tensor)
                                    and not torch.isfinite(out).all() else None)
    run = torch.compile(gpt, mode=compiled) if compiled else gpt
    idx = torch.randint(0, 50304, (12, 1024), device="cuda")
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, idx)[1]
        loss.backward()
        losses.append(round(loss.item(), 4))
        gpt.zero_grad(set_to_none=True)
    print(f"B  width={width} reach={reach} compiled={compiled}: losses {losses} first non-finite {bad[:3]}", flush=True)


if __name__ == "__main__":
    for K, N in ((768, 2304), (1536, 4608), (1536, 1536), (2048, 6144)):
        for compiled in (False, True):
            linear_alone(K, N, compiled)
    for width in (768, 1536):
        for reach in ("mlp", "blocks"):
            for compiled in (None, "reduce-overhead"):
                gpt_forward(width, compiled, reach)
