"""Where the FP8 MLP's host time goes: GPT-2 small's MLP (M = 12288, C = 768, GELU) under bf16 autocast,
forward + backward, timed on the host without synchronizing (what the Python and the launches cost), against
the GPU time of the same calls, then cProfile's top entries for 20 calls. GPU with FP8 tensor cores.

    PYTHONPATH=. python lab/fp8/host_time.py
"""

import cProfile
import pstats
import time

import torch

from fused_ops.fp8 import FP8State
from fused_ops.fp8 import fp8_mlp
from fused_ops.mlp import fused_mlp_layers


def main():
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(768, 3072).cuda(), torch.nn.Linear(3072, 768).cuda()
    x = torch.randn(12288, 768, device="cuda", requires_grad=True)
    gy = torch.randn(12288, 768, device="cuda", dtype=torch.bfloat16) * 1e-3
    state = FP8State().cuda()
    paths = {"bf16 fused": lambda: fused_mlp_layers(x, fc, proj, "gelu"),
             "fp8": lambda: fp8_mlp(x, fc, proj, "gelu", state)}
    for name, f in paths.items():
        def call():
            with torch.autocast("cuda", torch.bfloat16):
                y = f()
            y.backward(gy)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        host = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20
        print(f"{name:12s} host {host * 1e3:7.2f} ms per fwd+bwd, wall {wall * 1e3:7.2f} ms", flush=True)
        if name == "fp8":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
