"""Probe (issue 47): where does the fused classifier's time go at GPT-2's shape, against its floor? The three GEMMs
alone (full M, bf16, cuBLAS), the row kernel alone at several tiles, and the whole operator at several chunk sizes.
GPU time, CUDA events, medians of 20.

    PYTHONPATH=. python lab/classifier/breakdown.py [--M 12288 --C 768 --V 50304]
"""

import torch

from fused_ops import classifier
from lab.classifier.measure import shape_args, ms


M, C, V = shape_args()
x = torch.randn(M, C, device="cuda").bfloat16().requires_grad_()
w = (torch.randn(V, C, device="cuda") * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (M,), device="cuda")
logits = x.detach() @ w.detach().t()
dw32 = torch.zeros(V, C, device="cuda")
rows = []
rows.append(("GEMM logits = x @ W.T", ms(lambda: torch.mm(x.detach(), w.detach().t(), out=logits))))
rows.append(("GEMM dx = dlogits @ W", ms(lambda: torch.mm(logits, w.detach()))))
rows.append(("GEMM dW = dlogits.T @ x (bf16 out)", ms(lambda: torch.mm(logits.t(), x.detach()))))
rows.append(("GEMM dW, fp32 out", ms(lambda: torch.mm(logits.t(), x.detach(), out_dtype=torch.float32, out=dw32))))
rows.append(("GEMM dW, fp32 accumulate (beta=1)",
             ms(lambda: torch.addmm(dw32, logits.t(), x.detach(), out_dtype=torch.float32, out=dw32))))
count = (t != -1).sum()
bytes_ = 2 * logits.numel() * logits.element_size()
for block in (1024, 2048, 4096, 8192):
    classifier.BLOCK_V = block
    k = ms(lambda: classifier.cross_entropy_rows(logits, t, count, -1, True))
    rows.append((f"row kernel, BLOCK {block} (1 read + 1 write: {bytes_ / 1e9:.2f} GB)", k))
    rows.append((f"  its bandwidth, GB/s", bytes_ / k / 1e6))
classifier.BLOCK_V = 2048
for chunk in (2 ** 25, 2 ** 26, 2 ** 27, 2 ** 28, 2 ** 30):
    classifier.CHUNK_LOGITS = chunk

    def op():
        x.grad = w.grad = None
        classifier.linear_cross_entropy(x, w, t).backward()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rows.append((f"whole operator, chunks of 2^{chunk.bit_length() - 1} logits", ms(op)))
    rows.append((f"  its peak GiB above the inputs", (torch.cuda.max_memory_allocated() - base) / 2 ** 30))
print(f"{torch.cuda.get_device_name()}, M={M} C={C} V={V}")
for name, v in rows:
    print(f"{name:<60} {v:10.3f}")
