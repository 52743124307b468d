"""Triton kernels for a fused MLP: linear+bias+activation forward, dgrad with the activation derivative
fused, gated (GLU) variants, their autograd Functions and fused_mlp_layers (model.MLP's fused path).

The layers, each importing only those before it (tests/test_fused_ops_layout.py checks it); README.md has the
reading order file by file:
- env.py: every environment switch, read once (a leaf);
- the portable core: casts, activations -> tuning -> matmul -> linear_act / dgrad / layernorm -> ops -> mlp, with
  backends.py, where a faster kernel for an op registers (the core never imports one);
- hopper/: Hopper's Gluon ping-pong kernels, registered with backends by hopper/dispatch.py;
- fp8/: the FP8 MLP (its Triton kernels, FP8State, the ping-pong kernel's FP8 outputs, its autograd);
- graphs.py and precompile.py: the speed machinery (CUDA graphs; compiling in a child process at start-up);
- layers.py: the runners model.MLP picks from (FusedMLP, FP8MLP, AutoMLP).
"""

from .activations import GATED, PLAIN, kernel_activations
from .dgrad import linear_act_dgrad
from .linear_act import linear_act_forward
from .mlp import (FusedMLPFunction, LinearActFunction, check_mlp_args, fused_mlp, fused_mlp_layers, kernels_can_run,
                  layers_as_function, linear_act)
from . import hopper  # noqa: F401  (after the core: registers the Hopper kernels with backends)
from .fp8 import FP8State, check_fp8_device, fp8_layers_as_function, fp8_mlp, fp8_supported
from .graphs import MLPGraphs, graphs_usable
from .layers import AutoMLP, FP8MLP, FusedMLP, fp8_graphs_usable

__all__ = [
    "GATED", "PLAIN", "kernel_activations", "FP8State", "check_fp8_device", "fp8_graphs_usable", "fp8_layers_as_function", "fp8_mlp", "fp8_supported",
    "MLPGraphs", "graphs_usable",
    "linear_act_dgrad", "linear_act_forward", "FusedMLPFunction", "LinearActFunction", "check_mlp_args", "fused_mlp", "fused_mlp_layers", "kernels_can_run",
    "linear_act", "layers_as_function", "AutoMLP", "FP8MLP", "FusedMLP",
]
