"""Triton kernels for a fused MLP: linear+bias+activation forward, dgrad with the activation derivative
fused, gated (GLU) variants, their autograd Functions and fused_mlp_layers (model.MLP's fused path).

The package is in layers, each importing only those before it (tests/test_layout.py checks it); every FUSED_OPS_*
switch is in env.py (read once, a leaf), with its default and meaning. Each file explains its kernel in prose
before the code. The reading order:

The portable core (any GPU Triton runs on, or the CPU interpreter; no Hopper kernel, FP8 or speed machinery):

1. activations.py: every activation and its derivative as a Triton function chosen by a compile-time name.
2. tuning.py: block sizes (sized to each GPU's shared memory), our own tuning keyed by the weight (never the batch
   size), one program a tile or a persistent grid, and launch plans.
3. matmul.py: the matmul main loop every kernel shares (TMA on Hopper, pointers elsewhere), tile order, epilogues
   (casts.py: the FP8 tile casts the main loop and the FP8 kernels share).
4. linear_act.py: act(x @ W.T + b) with dh/dz saved for backward; gated activations from one read of x.
5. dgrad.py: (grad_y @ W2) * dh/dz and the first bias gradient, in one kernel for every activation.
6. layernorm.py: the LayerNorm folded into the first matmul (fuse_ln=True), and its one-pass backward.
7. ops.py: the kernels as torch.library operators, so torch.compile (even fullgraph=True) compiles around them.
8. mlp.py: argument checks and the MLP's autograd: the two kernels above plus cuBLAS for the rest.
9. backends.py: where a faster kernel for an op registers; linear_act.py, dgrad.py and classifier.py ask it first.
10. numerics.py: the error measure every comparison with float64 uses (rel_err) and its per-dtype epsilon (the
    tests' and benchmarks' "no worse than twice the same-dtype PyTorch error" rule).
11. classifier.py: the LM head and the cross-entropy as one operator (model.GPT's classifier="fused"): chunks of
    logits, one row kernel that writes the loss's gradient over them, cuBLAS for the GEMMs (on Hopper the logits'
    GEMM is hopper/'s, which also writes each row's log-sum-exp per tile: the row kernel then reads it once).
12. adamw.py: AdamW's step as one launch a parameter group, at the memory's rate (model.configure_optimizers').

Then, above the core:

13. hopper/: pingpong.py, the Hopper forward and dgrad, and the classifier's logits GEMM, in Gluon, warp-specialized,
    and dispatch.py, which registers them with backends.py; if the kernel fails to compile or launch on your Triton,
    the portable kernels take over after one FallbackWarning (FUSED_OPS_PINGPONG=0 turns it off).
14. fp8/: the opt-in FP8 MLP. kernels.py: delayed per-tensor scales (the recipe), the casts and the Triton
    epilogues (off Hopper) that write the FP8 copies; state.py: FP8State; hopper.py: on Hopper the ping-pong
    kernel's FP8 main loops and epilogues (FP8_IN, FP8_OUT); autograd.py runs it, outside torch.compile and inside;
    classifier.py: the classifier's FP8 form (classifier="fp8"), its logits' and dx's GEMMs in FP8; linear.py:
    a plain linear in FP8 (fp8_reach="blocks": the attention's projections); weight_copies.py: every FP8 weight
    copy of a model in three launches (model.GPT under torch.compile).
15. graphs.py: outside torch.compile, each layer's fused MLP forward and backward as CUDA graphs, one per input
    shape, so its dozen launches cost one (FUSED_OPS_GRAPHS=0 turns them off: they keep memory).
16. precompile.py: with a cold Triton cache, a child process compiles the fused kernels while the run starts up
    (FUSED_OPS_PRECOMPILE=0 turns it off).
17. layers.py: the runners model.MLP picks once (FusedMLP, FP8MLP, AutoMLP), which own the CUDA graphs.
"""

from . import env

_interpreter_problem = env.INTERPRET and env.interpreter_problem()
if _interpreter_problem:  # (before any kernel is defined: model.py's mlp="auto" then runs eager)
    raise ImportError(_interpreter_problem)

from .activations import GATED, PLAIN, kernel_activations
from .dgrad import linear_act_dgrad
from .linear_act import linear_act_forward
from .mlp import (FusedMLPFunction, LinearActFunction, check_mlp_args, fused_mlp, fused_mlp_layers, kernels_can_run,
                  layers_as_function, linear_act)
from .classifier import linear_cross_entropy
from .adamw import FusedAdamW
from . import hopper  # noqa: F401  (after the core: registers the Hopper kernels with backends)
from .fp8 import (FP8State, check_fp8_device, fp8_layers_as_function, fp8_linear, fp8_linear_qkv,
                  fp8_linear_cross_entropy, fp8_mlp, fp8_supported, fp8_weight_copies)
from .graphs import MLPGraphs, graphs_usable
from .layers import AutoMLP, FP8MLP, FusedMLP, fp8_graphs_usable

__all__ = [
    "GATED", "PLAIN", "kernel_activations", "FP8State", "check_fp8_device", "fp8_graphs_usable", "fp8_layers_as_function", "fp8_linear", "fp8_linear_qkv", "fp8_linear_cross_entropy", "fp8_mlp", "fp8_supported", "fp8_weight_copies",
    "MLPGraphs", "graphs_usable",
    "linear_act_dgrad", "linear_act_forward", "FusedMLPFunction", "LinearActFunction", "check_mlp_args", "fused_mlp", "fused_mlp_layers", "kernels_can_run",
    "linear_act", "layers_as_function", "linear_cross_entropy", "FusedAdamW", "AutoMLP", "FP8MLP", "FusedMLP",
]
