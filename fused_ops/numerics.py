"""The yardstick the fused ops are held to: a result's relative error against a float64 reference, and the rule
that it be at most twice the same-dtype eager PyTorch error plus a tiny epsilon (EPS, by dtype). A leaf: torch only.
bench_mlp.py checks each kernel it times by it; tests/numerics.py builds the suite's checks on it."""

import torch

# The "tiny epsilon" added to the 2x rule, by dtype: a floor for cases where the eager error is ~0.
EPS = {torch.float64: 1e-13, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def rel_err(x, ref):
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere makes it inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
