"""Does the model-wide FP8 weight-copy operator change what a compiled step computes? One process, a 2-layer
GPT-2-wide GPT (fp8 blocks, FP8 classifier) compiled whole, three optimizer steps, four times alternated: the copies
made for the whole model (fused_ops/fp8/weight_copies.py) and each layer's own. Prints each run's three losses.

    PYTHONPATH=. python lab/glue/determinism.py
"""

import torch

import model

WHOLE = model.GPT.fp8_weight_copies


def losses(whole):
    torch._dynamo.reset()
    model.GPT.fp8_weight_copies = WHOLE if whole else (lambda self: None)  # None: each layer makes its own
    torch.manual_seed(0)
    gpt = model.GPT(model.GPTConfig(block_size=1024, vocab_size=50304, n_layer=2, n_head=12, n_embd=768, mlp="fused",
                                    fp8=True, fp8_reach="blocks", classifier="fp8", dropout=0.0, bias=False)).cuda()
    opt = gpt.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    step = torch.compile(gpt)
    idx = torch.randint(0, 50304, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = []
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            loss = step(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


if __name__ == "__main__":
    for whole in (True, False, True, False):
        print("model-wide copies" if whole else "each layer's own", losses(whole), flush=True)
