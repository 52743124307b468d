"""Issue 47: at width 1536, the compiled FP8 step's losses left the uncompiled ones (fp8+cls8 with reduce-overhead:
11.11, 11.33, 12.18 against 11.14, 11.14, 11.16; with fp8_reach="blocks" NaN), where width 768 agreed. Which piece?
(A) the FP8 MLP alone, compiled (default, reduce-overhead) against uncompiled at C = 768, 1536: y's and dx's
relative difference; (B) a 2-layer GPT's loss, uncompiled against reduce-overhead, one setting at a time.

    python lab/fp8/wide_compile_probe.py      # one GPU with FP8 tensor cores
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import model
from fused_ops.fp8 import FP8State, fp8_mlp


def mlp_alone(C, mode, M=12288):
    torch._dynamo.reset()
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(C, 4 * C, bias=False).cuda(), torch.nn.Linear(4 * C, C, bias=False).cuda()
    outs = {}
    for name in ("plain", mode):
        st = FP8State().cuda()
        fn = (lambda x: fp8_mlp(x, fc, proj, "gelu", st))
        fn = torch.compile(fn, mode=None if name == "default" else name) if name != "plain" else fn
        res = []
        for i in range(4):
            x = torch.randn(M, C, device="cuda", generator=torch.Generator("cuda").manual_seed(i), requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            y.float().square().mean().backward()
            res.append((y.detach().float().clone(), x.grad.clone()))
            fc.weight.grad = proj.weight.grad = None
        outs[name] = res
    diffs = [f"{((a[0] - b[0]).norm() / b[0].norm()).item():.2e}/{((a[1] - b[1]).norm() / b[1].norm()).item():.2e}"
             for a, b in zip(outs[mode], outs["plain"])]
    print(f"A  C={C} {mode}: y/dx rel diff per call {diffs}", flush=True)


def gpt_losses(width, mode, **kw):
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = model.GPT(model.GPTConfig(n_layer=2, n_head=width // 128, n_embd=width, bias=False, **kw)).cuda()
    run = torch.compile(gpt, mode=mode) if mode else gpt
    idx = torch.randint(0, 50304, (12, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, idx.roll(-1, 1))[1]
        loss.backward()
        losses.append(round(loss.item(), 4))
        gpt.zero_grad(set_to_none=True)
    return losses


if __name__ == "__main__":
    for C in (768, 1536):
        for mode in ("default", "reduce-overhead"):
            mlp_alone(C, mode)
    settings = {"fp8 mlp": dict(mlp="fused", fp8=True), "fp8 classifier": dict(mlp="fused", classifier="fp8"),
                "fused classifier": dict(mlp="fused", classifier="fused"), "bf16 fused": dict(mlp="fused")}
    for width in (1536,):
        for name, kw in settings.items():
            print(f"B  width={width} {name}: plain {gpt_losses(width, None, **kw)} "
                  f"reduce-overhead {gpt_losses(width, 'reduce-overhead', **kw)}", flush=True)
