"""Probe (issue 47, second round): what does the fused classifier spend beyond its three GEMMs and its row kernel?

1. The row kernel alone at full M: programs per SM (a grid-stride loop, so that few rows are in flight and the
   second read finds the row in L2), warps, block; a copy of the logits for the bandwidth. The grid-stride option
   lived in fused_ops/classifier.py at c297105 only (it gained nothing; removed after): the sweep runs where it exists.
2. The operator's forward + backward under torch.profiler: every GPU kernel with its time, GPU busy against the span.
3. GPU time two ways, fused and compiled eager: CUDA events around the call (the host's launch latency included
   where the GPU waits for it) and after a long sleep kernel (the host enqueues ahead: GPU time alone).
4. The chunk size: time and peak memory.

    PYTHONPATH=. python lab/classifier/overheads.py [--M 12288 --C 768 --V 50304]
"""

import torch
import torch.nn.functional as F

from fused_ops import classifier
from lab.classifier.measure import shape_args, kernel_table, ms


M, C, V = shape_args()
x = (torch.randn(M, C, device="cuda") * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, C, device="cuda") * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (M,), device="cuda")
t[::97] = -1
rows = []

# 1. the row kernel: programs per SM (None: one per row), warps, block
logits0 = x.detach() @ w.detach().t()
logits = logits0.clone()
count = (t != -1).sum()
bytes_ = 2 * logits.numel() * logits.element_size()
sweep = []
for per_sm in ((None, 1, 2, 4, 8) if hasattr(classifier, "PROGRAMS_PER_SM") else ()):
    for warps in (4, 8, 16):
        for block in (1024, 2048, 4096):
            classifier.PROGRAMS_PER_SM, classifier.WARPS, classifier.BLOCK_V = per_sm, warps, block
            k = ms(lambda: classifier.cross_entropy_rows(logits, t, count, -1, True))
            logits.copy_(logits0)
            loss = float(classifier.cross_entropy_rows(logits, t, count, -1, True).sum())
            logits.copy_(logits0)
            sweep.append((k, per_sm, warps, block, loss))
sweep.sort(key=lambda r: r[0])
print("--- the row kernel at full M, sorted: ms, GB/s (1 read + 1 write), programs per SM, warps, block, loss sum")
for k, per_sm, warps, block, loss in sweep:
    print(f"  {k:.3f} ms {bytes_ / k / 1e6:6.0f} GB/s  per_sm={per_sm} warps={warps} block={block}  {loss:.4f}")
if sweep:
    best = sweep[0]
    classifier.PROGRAMS_PER_SM, classifier.WARPS, classifier.BLOCK_V = best[1], best[2], best[3]
    rows.append(("row kernel, best (the rest of this run uses it)", f"{best[0]:.3f} ms per_sm={best[1]} "
                 f"warps={best[2]} block={best[3]}"))
rows.append(("row kernel as the operator runs it",
             f"{ms(lambda: classifier.cross_entropy_rows(logits, t, count, -1, True)):.3f} ms"))
logits.copy_(logits0)
copy = torch.empty_like(logits)
rows.append(("copy of the logits (1 read + 1 write), for the bandwidth", f"{ms(lambda: copy.copy_(logits)):.3f} ms"))


def fused():
    x.grad = w.grad = None
    classifier.linear_cross_entropy(x, w, t).backward()


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-1)


compiled = torch.compile(eager)


def compile_call():
    x.grad = w.grad = None
    compiled(x, w, t).backward()


# 2. the profile
for chunk in (2 ** 27,):
    classifier.CHUNK_LOGITS = chunk
    kernel_table(fused, f"profile, chunks of 2^{chunk.bit_length() - 1} logits", width=90)
classifier.CHUNK_LOGITS = 2 ** 27

# 3. timing with and without the host's latency
for name, fn in (("fused", fused), ("compile", compile_call)):
    for _ in range(3):
        fn()
    rows.append((f"{name}: events around the call", f"{ms(fn):.3f} ms"))
    rows.append((f"{name}: events after a sleep (GPU time alone)", f"{ms(fn, sleep=True):.3f} ms"))

# 4. chunk sizes
for chunk in (2 ** 25, 2 ** 26, 2 ** 27, 2 ** 28, 2 ** 30):
    classifier.CHUNK_LOGITS = chunk
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fused()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    rows.append((f"operator, chunks of 2^{chunk.bit_length() - 1} logits (GPU time alone)",
                 f"{ms(fused, sleep=True):.3f} ms  +{peak:.3f} GiB"))
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M={M} C={C} V={V}")
for name, v in rows:
    print(f"{name:<62} {v}")
