"""The portable GELU forward (fused_ops/linear_act.py, what FUSED_OPS_PINGPONG=0 and every non-Hopper GPU run) with the
product's GELU pair or the one before it (lab/fp8/epilogue_steps.py holds its source), at GPT-2 small's MLP shape:
M = 12288, C = 768, H = 3072, bf16, bias, dh/dz saved; the default tile (FUSED_OPS_AUTOTUNE=0), so that both pairs run
the same config. Prints GPU time (do_bench median) and both outputs' largest error against float64. The pair is
chosen before any kernel compiles, so each process runs one; alternate the processes:

    for r in 1 2 3; do for g in product before; do
        FUSED_OPS_PINGPONG=0 FUSED_OPS_AUTOTUNE=0 PYTHONPATH=. python lab/portable/gelu_pair.py --gelu=$g; done; done
"""

import argparse
import os
import sys
import tempfile

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fp8"))

ap = argparse.ArgumentParser()
ap.add_argument("--gelu", choices=["product", "before"], default="product")
args = ap.parse_args()

from fused_ops import activations  # noqa: E402
from fused_ops.linear_act import linear_act_forward  # noqa: E402

if args.gelu == "before":  # written out as a module: Triton reads a kernel's source from its file
    import epilogue_steps  # noqa: E402
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "gelu_before.py"), "w") as f:
        f.write("import triton\nimport triton.language as tl\nfrom fused_ops.activations import TAIL, INV_SQRT_2PI\n"
                + epilogue_steps.OLD_GELU)
    sys.path.insert(0, folder)
    import gelu_before  # noqa: E402
    activations.gelu_and_grad_16bit = gelu_before.gelu_and_grad_16bit  # (activation_and_grad's, resolved at compile)

M, C, H = 12288, 768, 3072
g = torch.Generator("cuda").manual_seed(0)
x = torch.randn(M, C, device="cuda", generator=g).bfloat16()
w = (torch.randn(H, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
b = torch.randn(H, device="cuda", generator=g).bfloat16()
out, saved = linear_act_forward(x, w, b, "gelu")
z = x.double() @ w.double().t() + b.double()
cdf = 0.5 * torch.special.erfc(-z / 2 ** 0.5)
err_h = (out.double() - z * cdf).abs().max().item()
err_dh = (saved.double() - (cdf + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5)).abs().max().item()
ms = do_bench(lambda: linear_act_forward(x, w, b, "gelu", out=out, saved=saved), warmup=25, rep=300,
              return_mode="median")
print(f"{torch.cuda.get_device_name()}, GELU pair {args.gelu:<8}: {ms * 1000:7.1f} us  "
      f"(largest error against float64: h {err_h:.3g}, dh/dz {err_dh:.3g})")
