"""Probe (issue 47): where does the classifier's FP8 form spend its time, kernel by kernel, against the 16-bit one?
GPT-2 small's shape, bf16 inputs, forward + backward under torch.profiler, ms per call.

    PYTHONPATH=. python lab/classifier/fp8_profile.py
"""

import torch

import fused_ops
from lab.classifier.measure import kernel_table

M, C, V = 12288, 768, 50304
x = (torch.randn(M, C, device="cuda") * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, C, device="cuda") * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (M,), device="cuda")
for name, fn in (("fused", fused_ops.linear_cross_entropy), ("fp8", fused_ops.fp8_linear_cross_entropy)):
    def call():
        x.grad = w.grad = None
        fn(x, w, t).backward()
    kernel_table(call, name, top=14)
