"""Four questions about the GPT-2 124M step, on the GPU (GPU time, rounds alternated):
  attn    SDPA's backends at the step's shape (12 x 12 heads x 1024 x 64, causal, bf16), forward and forward + backward;
  weights the weights' FP8 copies: quantize_weight compiled (what the compiled step runs) against
          quantize_weight_fused (four kernels a weight), all of the fastest setting's weights, in CUDA-graph replay:
          the bits compared, then the time;
  sum     which node of the compiled backward calls aten::sum: a 2-layer GPT at GPT-2's width, eager MLP, compiled,
          one forward + backward under the profiler (run it with TORCH_LOGS=output_code to see the generated code);
  ln      that step's time at one split size of Inductor's mix-order reduction (SPLITS below), or with it off.
Usage: PYTHONPATH=. python lab/glue/probe_between.py attn|weights|sum|ln SPLIT"""

import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph


def spread(times):
    return f"{statistics.median(times):.4f} [{min(times):.4f}, {max(times):.4f}]"


def attn(rounds=5):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, T, D = 12, 12, 1024, 64
    C = H * D
    qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def step(backend, backward):
        def f():
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
            with sdpa_kernel([backend]):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if backward:
                torch.autograd.grad(y, qkv, dy)
        return f

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    ref = None
    for name, b in backends.items():  # correctness against each other, in float32 math
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
        with sdpa_kernel([b]):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (g,) = torch.autograd.grad(y, qkv, dy)
        if ref is None:
            ref = (y.float(), g.float())
        print(f"{name}: |y - cudnn| max {(y.float() - ref[0]).abs().max().item():.2e}, "
              f"|dqkv - cudnn| max {(g.float() - ref[1]).abs().max().item():.2e}")
    times = {(n, bw): [] for n in backends for bw in (False, True)}
    for r in range(rounds):
        order = list(backends.items()) if r % 2 == 0 else list(backends.items())[::-1]
        for name, b in order:
            for bw in (False, True):
                times[(name, bw)].append(do_bench(step(b, bw), warmup=50, rep=300))
    flops_fwd = 4 * B * H * T * T * D / 2  # causal: half the score matrix
    print("backend    pass            GPU ms (median [min, max] of rounds)   TFLOP/s")
    for (name, bw), t in times.items():
        fl = flops_fwd * (3.5 if bw else 1.0)  # backward: 2.5x the forward's matmuls
        print(f"{name:10s} {'fwd + bwd' if bw else 'fwd':15s} {spread(t):40s} {fl / statistics.median(t) / 1e9:.0f}")


def weights(rounds=5):
    from fused_ops.fp8.kernels import quantize_weight_fused
    from fused_ops.fp8.state import quantize_weight
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12 + [(50304, 768)]
    ws = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    compiled = torch.compile(lambda ws: [quantize_weight(w) for w in ws])
    for w in ws[:5] + ws[-1:]:  # bit for bit
        a, b = quantize_weight(w), quantize_weight_fused(w)
        assert all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                               y.view(torch.uint8) if y.dtype != torch.float32 else y) for x, y in zip(a, b))
    differ = 0
    for i, (a, b) in enumerate(zip(compiled(ws), [quantize_weight_fused(w) for w in ws])):
        d = [int((x.float() != y.float()).sum()) for x, y in zip(a, b)]
        if any(d) and differ < 4:
            differ += 1
            print(f"weight {i} {tuple(ws[i].shape)}: compiled against fused, elements that differ (q, qT, 1/scale) "
                  f"{d}; 1/scale {a[2].item():.9e} against {b[2].item():.9e}")
    print("compiled against fused: bit for bit on every weight" if not differ else "")
    src = torch.empty(2 ** 28, device="cuda")
    dst = torch.empty_like(src)
    variants = {"compiled quantize_weight": lambda: compiled(ws),
                "quantize_weight_fused": lambda: [quantize_weight_fused(w) for w in ws],
                "1 GiB copy": lambda: dst.copy_(src)}
    times = {n: [] for n in variants}
    for r in range(rounds):
        for n in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            times[n].append(do_bench_cudagraph(variants[n], rep=200))
    rate = 2 * src.numel() * 4 / statistics.median(times["1 GiB copy"]) / 1e6  # GB/s
    numel = sum(a * b for a, b in shapes)
    blocks = numel - 50304 * 768
    floor_two = numel * 10 / rate / 1e6  # amax read, cast read, two 1-byte copies written (ms)
    floor_one = numel * 6 / rate / 1e6  # one read, two copies written (an amax kept from elsewhere)
    print(f"{numel / 1e6:.1f}M weights ({blocks / 1e6:.1f}M in the blocks), copy rate {rate:.0f} GB/s; floors: "
          f"two passes {floor_two:.3f} ms, one pass {floor_one:.3f} ms")
    for n, t in times.items():
        print(f"{n:28s} {spread(t)} ms")


def two_layer_gpt():
    """(a 2-layer GPT at GPT-2's width, eager MLP, no bias, on the GPU; a batch of 12 x 1024 random tokens)"""
    from model import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False, dropout=0.0)
    return GPT(cfg).cuda(), torch.randint(0, 50304, (12, 1024), device="cuda")


def sum_origin():
    model, idx = two_layer_gpt()
    compiled = torch.compile(model)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, idx)[1]
        loss.backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, idx)[1]
        loss.backward()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.name == "aten::sum":
            print("aten::sum input shapes", e.input_shapes, "cuda us", e.device_time_total)


SPLITS = {"default": {}, "split32": {"triton.mix_order_reduction_split_size": 32},
          "split64": {"triton.mix_order_reduction_split_size": 64},
          "split128": {"triton.mix_order_reduction_split_size": 128},
          "off": {"triton.mix_order_reduction": False}}


def ln_split(name):
    """The 2-layer step's GPU time (forward + backward, do_bench) with Inductor's mix-order reduction (the LayerNorm
    backward's weight-gradient partials, which aten::sum adds up) at one split size, or off: one process each."""
    import torch._inductor.config as inductor_config
    model, idx = two_layer_gpt()
    with inductor_config.patch(SPLITS[name]):
        m = torch.compile(model)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(idx, idx)[1]
            loss.backward()
        for _ in range(3):
            step()
        t = [do_bench(step, warmup=20, rep=300) for _ in range(3)]
    print(f"2-layer forward + backward, mix-order {name:8s} {spread(t)} ms")


if __name__ == "__main__":
    {"attn": attn, "weights": weights, "sum": sum_origin, "ln": ln_split}[sys.argv[1]](*sys.argv[2:])
