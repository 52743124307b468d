"""Probe (issue 47): where does the classifier's FP8 form spend its time, kernel by kernel, against the 16-bit one?
GPT-2 small's shape, bf16 inputs, forward + backward under torch.profiler, ms per call.

    PYTHONPATH=. python lab/classifier/fp8_profile.py
"""

import torch

import fused_ops

M, C, V = 12288, 768, 50304
x = (torch.randn(M, C, device="cuda") * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, C, device="cuda") * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (M,), device="cuda")
for name, fn in (("fused", fused_ops.linear_cross_entropy), ("fp8", fused_ops.fp8_linear_cross_entropy)):
    def call():
        x.grad = w.grad = None
        fn(x, w, t).backward()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    total = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = total.setdefault(e.name[:100], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time / 1000 / 5
    print(f"--- {name}: ms per call (launches per 5 calls)")
    for k, (n, ms) in sorted(total.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {ms:7.3f}  x{n:<4} {k}")
    print(f"  {sum(v[1] for v in total.values()):7.3f}  GPU busy per call")
