"""Triton kernels for a fused MLP: linear+bias+activation forward, dgrad with the activation derivative
fused, gated (GLU) variants, their autograd Functions and fused_mlp_layers (model.MLP's fused path)."""

from .activations import GATED, PLAIN, kernel_activations
from .dgrad import linear_act_dgrad
from .graphs import MLPGraphs, graphs_usable
from .fp8 import FP8State, check_fp8_device, fp8_supported
from .fp8_autograd import fp8_graphs_usable, fp8_layers_as_function, fp8_mlp
from .linear_act import linear_act_forward
from .mlp import (FusedMLPFunction, LinearActFunction, check_mlp_args, fused_mlp, fused_mlp_layers, kernels_can_run,
                  layers_as_function, linear_act)

__all__ = [
    "GATED", "PLAIN", "kernel_activations", "FP8State", "check_fp8_device", "fp8_graphs_usable", "fp8_layers_as_function", "fp8_mlp", "fp8_supported",
    "MLPGraphs", "graphs_usable",
    "linear_act_dgrad", "linear_act_forward", "FusedMLPFunction", "LinearActFunction", "check_mlp_args", "fused_mlp", "fused_mlp_layers", "kernels_can_run", "linear_act",
    "layers_as_function",
]
