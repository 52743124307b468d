"""The LayerNorm fold's error on rows whose mean dwarfs their spread, on a GPU: the "16x1x9 strided", mean 1000,
gelu, fp16-autocast case over many seeds, with the statistics' mean residual (the fix) and without it (zeroed: the
statistics as they were), to tell noise from bias. Run as `python lab/ln_fold_seed_sweep.py [seeds]`; results/gpu_numerics_ln_fold_h100.txt holds a run."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the tests' numerics helpers and fixtures

import fused_ops.linear_act  # noqa: E402,F401
from numerics import EPS, ln_mlp_16bit_errors  # noqa: E402
from test_fused_gpu import _laid_out, _ln_mlp_tensors  # noqa: E402

linear_act_module = sys.modules["fused_ops.linear_act"]
with_residual = linear_act_module.layernorm_stats


def without_residual(x, eps):
    stats = with_residual(x, eps)
    stats[2] = 0
    return stats


def main(seeds):
    for label, stats_fn in (("without residual (as before)", without_residual), ("with residual (fixed)", with_residual)):
        linear_act_module.layernorm_stats = stats_fn
        ratios, allowance = {}, {}
        for seed in range(seeds):
            torch.manual_seed(seed)
            tensors = _ln_mlp_tensors("gelu", 9, 36, _laid_out((16, 1), 9, 1000.0, "strided"))
            grad_y = torch.randn(16, 1, 9, device="cuda")
            for name, e_fused, e_eager in ln_mlp_16bit_errors("gelu", tensors, torch.float16, True, grad_y):
                ratios.setdefault(name, []).append(e_fused / e_eager)
                allowance.setdefault(name, []).append(e_fused / (2 * e_eager + EPS[torch.float16]))
        print(f"== {label}: {seeds} seeds")
        print("grad_ln_bias fused/eager per seed: " + " ".join(f"{r:.2f}" for r in ratios["grad_ln_bias"]))
        for name, r in ratios.items():
            s = sorted(r)
            print(f"{name:14s} fused/eager median {s[len(s) // 2]:.2f}  mean {sum(s) / len(s):.2f}  max {s[-1]:.2f}  "
                  f"seeds over the 2x rule: {sum(a > 1 for a in allowance[name])} (worst {max(allowance[name]):.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
