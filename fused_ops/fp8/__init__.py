"""The FP8 MLP (opt-in, model.py's fp8=True): all six of the MLP's GEMMs in FP8, built on the core and on hopper/;
the FP8 linear (linear.py, model.py's fp8_reach="blocks": the attention's projections); and the classifier's FP8 form
(classifier.py, model.py's classifier="fp8").

Reading order: kernels.py (the recipe in its docstring, then the Triton kernels and their launchers), state.py
(FP8State: the delayed scales and the weights' FP8 copies; the device checks), hopper.py (the ping-pong kernel's FP8
outputs on Hopper), autograd.py (the autograd.Function and the torch.compile operators; fp8_mlp), graphs.py (the
operators' own CUDA graphs, under torch.compile without its own), linear.py (the same recipe for a plain linear),
weight_copies.py (every weight's FP8 copies of a model in three launches: model.GPT under torch.compile).
The arrows point one way: fp8/ imports the core and hopper/, neither of them imports fp8/.
"""

from .autograd import fp8_layers_as_function, fp8_mlp
from .classifier import fp8_linear_cross_entropy
from .linear import fp8_linear, fp8_linear_qkv
from .kernels import E4M3, E5M2, FP8_MAX, GRAD_Y, GRAD_Z, H, SLOT_DTYPES, X
from .state import FP8State, check_fp8_device, fp8_supported
from .weight_copies import fp8_weight_copies

__all__ = ["E4M3", "E5M2", "FP8_MAX", "GRAD_Y", "GRAD_Z", "H", "SLOT_DTYPES", "X", "FP8State", "check_fp8_device",
           "fp8_layers_as_function", "fp8_linear", "fp8_linear_qkv", "fp8_linear_cross_entropy", "fp8_mlp",
           "fp8_supported", "fp8_weight_copies"]
