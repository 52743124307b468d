"""How many graphs Dynamo makes for a small FP8 GPT (3 blocks, fp8_reach="blocks", classifier="fp8") under
compile_regions on a GPU: one block's graph and GPT.output's is the goal (tests/test_compile.py asks the same on the
CPU, through Triton's interpreter). aot_eager stands in for Inductor: the question is what Dynamo traces.

    PYTHONPATH=. python lab/startup/regions_graphs.py
"""

import torch
from torch._dynamo.utils import counters

from helpers import runtime
from model import GPT, GPTConfig

compile_ = torch.compile
torch.compile = lambda fn, mode=None: compile_(fn, backend="aot_eager")
cfg = dict(block_size=64, vocab_size=256, n_layer=3, n_head=2, n_embd=128, dropout=0.0, mlp="fused", fp8=True,
           fp8_reach="blocks", classifier="fp8")
torch.manual_seed(0)
idx = torch.randint(0, 256, (4, 64), device="cuda")
model = GPT(GPTConfig(**cfg)).cuda()
runtime.wrap_model(model, True, 1, "cuda", regions=True)
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(idx, idx)[1]
loss.backward()
print(torch.__version__, "regions", dict(counters["stats"]), "dynamic_sources:", torch.compiler.config.dynamic_sources,
      "loss", loss.item())
