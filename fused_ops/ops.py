"""The two kernels as PyTorch custom ops.

torch.compile cannot look inside a Triton launcher that tunes and caches in Python; registered as custom
ops with fake (shape-only) implementations, each kernel becomes one opaque node in the graph, and the rest
of the model is compiled around it without a graph break (tested with fullgraph=True). The autograd
Functions in mlp.py call these ops.
"""

from typing import Optional

import torch
from torch import Tensor

from .activations import kernel_activations
from .dgrad import linear_act_dgrad
from .linear_act import linear_act_forward


@torch.library.custom_op("fused_mlp::linear_act", mutates_args=())
def linear_act_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                  save_pre: bool) -> tuple[Tensor, Tensor]:
    """(act(x @ weight.T + bias), pre-activation or an empty tensor) for a 2-D x."""
    out, pre = linear_act_forward(x, weight, bias, activation, save_pre=save_pre)
    return out, pre if save_pre else x.new_empty(0)


@linear_act_op.register_fake
def _(x, weight, bias, activation, save_pre):
    gated = kernel_activations(activation)[2]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty(x.shape[0], n), x.new_empty(x.shape[0], weight.shape[0]) if save_pre else x.new_empty(0)


@torch.library.custom_op("fused_mlp::dgrad", mutates_args=())
def dgrad_op(grad_y: Tensor, w2: Tensor, pre: Tensor, activation: str, bias_grad: bool) -> tuple[Tensor, Tensor]:
    """((grad_y @ w2) * act'(pre), its column sums or an empty tensor)."""
    grad_pre, grad_bias = linear_act_dgrad(grad_y, w2, pre, activation, bias_grad=bias_grad)
    return grad_pre, grad_bias if bias_grad else grad_y.new_empty(0)


@dgrad_op.register_fake
def _(grad_y, w2, pre, activation, bias_grad):
    sum_dtype = torch.float64 if grad_y.dtype == torch.float64 else torch.float32
    return pre.new_empty(pre.shape), pre.new_empty(pre.shape[1], dtype=sum_dtype) if bias_grad else grad_y.new_empty(0)
