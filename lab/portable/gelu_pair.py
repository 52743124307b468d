"""The portable GELU forward (fused_ops/linear_act.py, what FUSED_OPS_PINGPONG=0 and every non-Hopper GPU run) with the
product's GELU pair or an earlier one, at GPT-2 small's MLP shape: M = 12288, C = 768, H = 3072, bf16, bias, dh/dz
saved. Prints GPU time (do_bench median), the tile config that ran and both outputs' largest error against float64.

--gelu: "product"; "x*x*k" (the product with φ's exponent rounded as (x·x)·k, the order of 3ddd621, not (x·k)·x);
"before" (rsqrt(d²) and a degree-7 polynomial, the pair before 3ddd621: lab/fp8/epilogue_steps.py holds its source).
A pair is chosen before any kernel compiles, so each process runs one; alternate the processes. FUSED_OPS_AUTOTUNE=0
runs the first tile config (what the test suite runs), =1 with FUSED_OPS_TUNING_CACHE=0 tunes in each process:

    for r in 1 2; do for g in product 'x*x*k' before; do
        FUSED_OPS_PINGPONG=0 FUSED_OPS_AUTOTUNE=0 PYTHONPATH=. python lab/portable/gelu_pair.py --gelu=$g; done; done

--ptxas (no GPU needed; Triton 3.6, the GPU image's, gives what the GPU runs): the kernel of each of the first --configs
tile configs compiled for sm_90a instead, with ptxas's registers and spills and the SASS instruction count;
--loop=pointer for the pointer main loop (FUSED_OPS_TMA=0's).
"""

import argparse
import importlib
import inspect
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fp8"))

ap = argparse.ArgumentParser()
ap.add_argument("--gelu", choices=["product", "x*x*k", "before"], default="product")
ap.add_argument("--ptxas", action="store_true")
ap.add_argument("--configs", type=int, default=3)
ap.add_argument("--loop", choices=["tma", "pointer"], default="tma")
args = ap.parse_args()

from fused_ops import activations, tuning  # noqa: E402

if args.gelu != "product":  # written out as a module: Triton reads a kernel's source from its file
    import epilogue_steps  # noqa: E402
    if args.gelu == "before":
        src = epilogue_steps.OLD_GELU
    else:
        src = inspect.getsource(activations.gelu_and_grad_16bit.fn)
        assert src.count(epilogue_steps.ORDER[0]) == 1
        src = src.replace(*epilogue_steps.ORDER)
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "gelu_variant.py"), "w") as f:
        f.write("import triton\nimport triton.language as tl\nfrom fused_ops.activations import *  # noqa\n"
                "from fused_ops.activations import _reciprocal_ftz  # noqa\n" + src)
    sys.path.insert(0, folder)
    import gelu_variant  # noqa: E402
    activations.gelu_and_grad_16bit = gelu_variant.gelu_and_grad_16bit  # (activation_and_grad's, resolved at compile)

M, C, H = 12288, 768, 3072
linear_act = importlib.import_module("fused_ops.linear_act")


def compile_only(kernel, M, N, K, call_args, consts, gated, dtype, key, descriptors=(), configs=None):
    """linear_act's launch_matmul, compiling each config for sm_90a (Triton's JIT signature: 16-byte alignment and
    integers equal to 1 specialized) and printing what ptxas and cuobjdump say (consumer_warps.sass_report)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl
    import consumer_warps  # (lab/fp8: sass_report)
    for cfg in tuning.matmul_configs(gated, dtype, all_configs=True)[:args.configs]:
        _, values = tuning._grid_and_args(cfg, M, N, call_args, descriptors)
        constexprs = tuning._constexprs(consts, cfg, K)
        signature, constants, attrs = {}, {}, {}
        for i, p in enumerate(kernel.params):
            value = constexprs[p.name] if p.is_constexpr else values.pop(0)
            if p.is_constexpr or (isinstance(value, int) and value == 1):
                signature[p.name], constants[(i,)] = "constexpr", value
                continue
            signature[p.name], spec = native_specialize_impl(BaseBackend, value, False, True, True)
            if isinstance(spec, str) and "D" in spec:
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        built = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                               options=options)
        tile = "x".join(str(cfg.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N"))
        print(f"GELU pair {args.gelu:<8} {args.loop:<7} loop, {tile} w{cfg.num_warps} P{cfg.kwargs['PERSISTENT']}: "
              f"{consumer_warps.sass_report(built.asm['ptx'])}", flush=True)


if args.ptxas:
    matmul, backends = importlib.import_module("fused_ops.matmul"), importlib.import_module("fused_ops.backends")
    matmul.tma_available = lambda device: args.loop == "tma"  # (CPU tensors stand in for the GPU's)
    backends.run = lambda *a, **k: NotImplemented  # the portable kernel, not a Hopper backend
    linear_act.launch_matmul = compile_only
    x, w, b = (torch.empty(s, dtype=torch.bfloat16) for s in ((M, C), (H, C), (H,)))
    linear_act._launch(x, w, b, "gelu", True, None, None)
    sys.exit()

from triton.testing import do_bench  # noqa: E402

g = torch.Generator("cuda").manual_seed(0)
x = torch.randn(M, C, device="cuda", generator=g).bfloat16()
w = (torch.randn(H, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
b = torch.randn(H, device="cuda", generator=g).bfloat16()
out, saved = linear_act.linear_act_forward(x, w, b, "gelu")
z = x.double() @ w.double().t() + b.double()
cdf = 0.5 * torch.special.erfc(-z / 2 ** 0.5)
err_h = (out.double() - z * cdf).abs().max().item()
err_dh = (saved.double() - (cdf + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5)).abs().max().item()
ms = do_bench(lambda: linear_act.linear_act_forward(x, w, b, "gelu", out=out, saved=saved), warmup=25, rep=300,
              return_mode="median")
cfg = next(p.cfg for k, p in tuning._plans.items() if k[0] == "linear_act")
tile = "x".join(str(cfg.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N")) + f" w{cfg.num_warps} P{cfg.kwargs['PERSISTENT']}"
print(f"{torch.cuda.get_device_name()}, GELU pair {args.gelu:<8} ({tile:<16}): {ms * 1000:7.1f} us  "
      f"(largest error against float64: h {err_h:.3g}, dh/dz {err_dh:.3g})")
