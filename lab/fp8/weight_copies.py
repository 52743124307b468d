"""What the FP8 MLP's weight copies cost each optimizer step: W1, W1ᵀ, W2, W2ᵀ in e4m3 (FP8State.weights), GPU time,
each way of making them captured as one CUDA graph and replayed (so launch gaps count as they do inside a step's
graph, host time does not). bench_mlp's FP8 rows leave this out (it is paid once per optimizer step, not per
micro-step); torchao casts its weights in every forward. CUDA GPU.

    PYTHONPATH=. python lab/fp8/weight_copies.py
"""

import torch
from triton.testing import do_bench

from fused_ops.fp8 import kernels as fp8, state as fp8_state


def graphed(fn):
    fn()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("GPU time of one remake of both weights' copies, us, median of 3 rounds of do_bench over a graph replay")
    for name, (rows, hidden) in {"gelu": (3072, 3072), "swiglu": (4096, 2048)}.items():
        for dtype in (torch.bfloat16, torch.float32):  # bf16 modules; fp32 master weights under autocast
            torch.manual_seed(0)
            w1 = torch.randn(rows, 768, device="cuda", dtype=dtype) / 768 ** 0.5
            w2 = torch.randn(768, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
            kept1, kept2 = fp8.quantize_weight_fused(w1), fp8.quantize_weight_fused(w2)
            # (quantize_weight, the PyTorch ops compile fuses, cannot be captured: it makes a tensor from a float)
            ways = {"quantize_weight_fused x2 (FP8State.weights)": lambda: (fp8.quantize_weight_fused(w1, kept1),
                                                                            fp8.quantize_weight_fused(w2, kept2))}
            for way, fn in ways.items():
                replay = graphed(fn)
                times = sorted(1e3 * do_bench(replay, warmup=25, rep=100, return_mode="median") for _ in range(3))
                print(f"  {name:6s} W1 {rows}x768, W2 768x{hidden}, {str(dtype)[6:]:8s} {way:44s} {times[1]:7.1f}"
                      f"  ({times[0]:.1f}-{times[2]:.1f})")


if __name__ == "__main__":
    main()
