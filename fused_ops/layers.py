"""The MLP runners model.MLP picks from, once, in its __init__ (the top layer, Liger-Kernel's "transformers/"):
each is called as runner(x, c_fc, c_proj, norm) and computes c_proj(act(c_fc(norm(x)))) its way.

- FusedMLP: the Triton kernels (mlp.fused_mlp_layers; the LayerNorm folded with fuse_ln), through per-shape CUDA
  graphs (graphs.py) where they can run: uncompiled, CUDA tensors, a plain nn.LayerNorm or none.
- FP8MLP: the FP8 MLP (fp8/), through the same graphs once its scales are calibrated.
- AutoMLP: FusedMLP where the kernels can run on x's device (CUDA, or CPU under the interpreter), else the eager
  function it is given (model.py's PyTorch).

The runners hold no parameters (the layers are passed in at each call, so checkpoints, deepcopy, .to() and
torch.compile see only the model's own modules); a runner keeps its graphs (`graphs`, None for none) and, FP8, a
reference to the MLP's FP8State, whose buffers the MLP owns.
"""

import torch

from .fp8 import fp8_layers_as_function, fp8_mlp
from .graphs import MLPGraphs, graphs_usable
from .mlp import kernels_can_run, layers_as_function


def _graphable(norm):
    """The graphs capture the LayerNorm as functional layer_norm of its parameters: a plain nn.LayerNorm or none."""
    return norm is None or type(norm) is torch.nn.LayerNorm


def fp8_graphs_usable(x, state):
    """Whether graphs.py may capture the FP8 MLP: where graphs_usable says so, once the scales are calibrated (the
    calibrating call runs other kernels). Under DDP too: each process keeps its own scales, no collective inside."""
    return graphs_usable(x) and state.calibrated


class FusedMLP:
    """The fused MLP of the Triton kernels (Hopper's where they run), through CUDA graphs where it can."""

    def __init__(self, activation, fuse_ln=False):
        self.activation, self.fuse_ln = activation, fuse_ln
        # Uncompiled, the fused MLP's launches cost the host more than its kernels take: CUDA graphs replay them
        self.graphs = MLPGraphs()

    def __call__(self, x, c_fc, c_proj, norm=None):
        fn, tensors = layers_as_function(c_fc, c_proj, self.activation, norm, self.fuse_ln)
        if self.graphs is not None and graphs_usable(x) and _graphable(norm):
            return self.graphs(fn, x, tensors)
        return fn(x, *tensors)


class FP8MLP:
    """The FP8 MLP (its GEMMs in FP8 while training; the fused bf16 path under no_grad), through CUDA graphs where it
    can. state: the MLP's FP8State (the graphs put its buffers back after a capture)."""

    def __init__(self, activation, state):
        self.activation, self.state = activation, state
        self.graphs = MLPGraphs(keep=state)

    def __call__(self, x, c_fc, c_proj, norm=None):
        if self.graphs is not None and fp8_graphs_usable(x, self.state) and _graphable(norm):
            fn, tensors = fp8_layers_as_function(c_fc, c_proj, self.activation, norm, self.state)
            return self.graphs(fn, x, tensors)
        return fp8_mlp(x if norm is None else norm(x), c_fc, c_proj, self.activation, self.state)


class AutoMLP:
    """`fused` where the kernels can run on x's device, `eager` elsewhere (both runners of the same signature)."""

    def __init__(self, fused, eager):
        self.fused, self.eager = fused, eager

    @property
    def graphs(self):
        return self.fused.graphs

    @graphs.setter
    def graphs(self, graphs):
        self.fused.graphs = graphs

    def __call__(self, x, c_fc, c_proj, norm=None):
        return (self.fused if kernels_can_run(x) else self.eager)(x, c_fc, c_proj, norm)
