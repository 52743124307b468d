"""Issue 47: at width 1536, a 2-layer GPT with classifier="fused" (or "fp8") under torch.compile's reduce-overhead
gave losses 0.25% off the uncompiled ones, varying from call to call; at 768 they agreed, and with classifier="eager"
at 1536 too. Is it the operator under compile, or its place in the model? (1) linear_cross_entropy alone, plain
against compiled (default, reduce-overhead), C = 768, 1536, with the weight also read by an embedding (as GPT-2's
tied wte) or not; (2) the GPT, plain against default compile.

    python lab/classifier/wide_compile_probe.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import model
from fused_ops.classifier import linear_cross_entropy


def alone(C, mode, tied, M=12288, V=50304):
    torch._dynamo.reset()
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(V, C, device="cuda", generator=g) * 0.02).requires_grad_()
    idx = torch.randint(0, V, (M,), device="cuda", generator=g)
    targets = idx.roll(-1)
    h = torch.randn(M, C, device="cuda", generator=g)

    def fn(h):
        x = F.layer_norm(h + (F.embedding(idx, w) if tied else 0), (C,))
        return linear_cross_entropy(x, w, targets)
    run = fn if mode is None else torch.compile(fn, mode=mode)
    out = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(h)
        loss.backward()
        out.append(round(loss.item(), 5))
        w.grad = None
    return out


def gpt(width, mode, mlp="fused"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = model.GPT(model.GPTConfig(n_layer=2, n_head=width // 128, n_embd=width, bias=False, mlp=mlp,
                                  classifier="fused")).cuda()
    run = m if mode is None else torch.compile(m, mode=mode)
    idx = torch.randint(0, 50304, (12, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, idx.roll(-1, 1))[1]
        loss.backward()
        out.append(round(loss.item(), 5))
        m.zero_grad(set_to_none=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:  # --bisect: the GPT at 1536 only, the MLP eager and fused (FUSED_OPS_PINGPONG from the env)
        for mlp in ("eager", "fused"):
            print(f"3 width=1536 mlp={mlp} pingpong={os.environ.get('FUSED_OPS_PINGPONG', '1')}: "
                  + "  ".join(f"{mode}: {gpt(1536, mode, mlp)}" for mode in (None, "default")), flush=True)
        sys.exit()
    for C in (768, 1536):
        for tied in (False, True):
            print(f"1 C={C} tied={tied}: " + "  ".join(f"{mode}: {alone(C, mode, tied)}"
                                                      for mode in (None, "default", "reduce-overhead")), flush=True)
    for width in (768, 1536):
        print(f"2 width={width}: " + "  ".join(f"{mode}: {gpt(width, mode)}" for mode in (None, "default")), flush=True)
