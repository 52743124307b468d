"""The kernels as PyTorch operators (torch.ops.fused_mlp.*).

torch.compile cannot look inside a Triton launcher that tunes and caches in Python; registered as
operators with fake (shape-only) implementations, each kernel becomes one opaque node in the graph, and
the rest of the model is compiled around it without a graph break (tested with fullgraph=True). The
autograd Functions in mlp.py call these ops and differentiate them; the ops themselves have no autograd
formula (called on tensors that require grad they give no gradient, and PyTorch warns). Optional outputs
that are not computed come back as empty tensors (an operator returns a fixed number of tensors).

They are defined with torch.library.Library and one implementation for every backend, not with
torch.library.custom_op: custom_op wraps each call in a Python autograd layer and an output-aliasing
check whose host time, paid for every MLP of a step inside the compiled graph, made the fused + compile
step host-bound (lab/profile_step.py, docs/performance.md).
Outside torch.compile the launchers are called directly, skipping the dispatcher altogether.
"""

from typing import Optional

import torch
from torch import Tensor

from .activations import kernel_activations
from .dgrad import linear_act_dgrad
from .layernorm import layernorm_backward
from .linear_act import linear_act_forward, ln_linear_act_forward

_LIBRARY = torch.library.Library("fused_mlp", "DEF")


def fused_op(name):
    """Define the decorated function as the operator fused_mlp::`name` (schema from its type hints) and
    return a caller that goes through the operator only while torch.compile traces (where it must be one
    opaque node), and calls the function directly otherwise. The caller's `.op` is the operator;
    `.register_fake` registers its shape-only implementation."""
    def wrap(fn):
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
        # The kernels run on CUDA tensors, or CPU ones under the interpreter: one implementation for all.
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        op = getattr(torch.ops.fused_mlp, name).default

        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)
        call.op = op
        call.register_fake = torch.library.register_fake(f"fused_mlp::{name}")
        call.__doc__ = fn.__doc__
        return call
    return wrap


@fused_op("linear_act")
def linear_act_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                  save: bool) -> tuple[Tensor, Tensor]:
    """(act(x @ weight.T + bias), what backward needs or an empty tensor) for a 2-D x."""
    out, saved = linear_act_forward(x, weight, bias, activation, save=save)
    return out, saved if save else x.new_empty(0)


@linear_act_op.register_fake
def _linear_act_fake(x, weight, bias, activation, save):
    gated = kernel_activations(activation)[2]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty(x.shape[0], n), x.new_empty(x.shape[0], weight.shape[0]) if save else x.new_empty(0)


@fused_op("dgrad")
def dgrad_op(grad_y: Tensor, w2: Tensor, saved: Tensor, activation: str, bias_grad: bool) -> tuple[Tensor, Tensor]:
    """((grad_y @ w2) * act'(z) from the forward's saved tensor, its column sums or an empty tensor)."""
    grad_z, grad_bias = linear_act_dgrad(grad_y, w2, saved, activation, bias_grad=bias_grad)
    return grad_z, grad_bias if bias_grad else grad_y.new_empty(0)


@dgrad_op.register_fake
def _(grad_y, w2, saved, activation, bias_grad):
    sum_dtype = torch.float64 if grad_y.dtype == torch.float64 else torch.float32
    return saved.new_empty(saved.shape), saved.new_empty(saved.shape[1], dtype=sum_dtype) if bias_grad else grad_y.new_empty(0)


@fused_op("ln_linear_act")
def ln_linear_act_op(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], eps: float, weight: Tensor,
                     bias: Optional[Tensor], activation: str, save: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(act(LayerNorm(x) @ weight.T + bias), what backward needs, row stats (3, M)), the last two empty unless save."""
    out, saved, stats = ln_linear_act_forward(x, ln_weight, ln_bias, eps, weight, bias, activation, save=save)
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # as its fake says, saved or not
    return (out, saved, stats) if save else (out, x.new_empty(0), x.new_empty(0, dtype=stats_dtype))


@ln_linear_act_op.register_fake
def _(x, ln_weight, ln_bias, eps, weight, bias, activation, save):
    out, saved = _linear_act_fake(x.to(weight.dtype), weight, bias, activation, save)  # the weights' dtype (autocast)
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return out, saved, x.new_empty((3, x.shape[0]) if save else (0,), dtype=stats_dtype)


@fused_op("layernorm_backward")
def layernorm_backward_op(x: Tensor, grad_ln: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor],
                          stats: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, recomputed LayerNorm output, dγ, dβ); dγ / dβ empty when there is no γ / β."""
    dx, ln, grad_w, grad_b = layernorm_backward(x, grad_ln, ln_weight, ln_bias, stats)
    return dx, ln, x.new_empty(0) if grad_w is None else grad_w, x.new_empty(0) if grad_b is None else grad_b


@layernorm_backward_op.register_fake
def _(x, grad_ln, ln_weight, ln_bias, stats):
    return (x.new_empty(x.shape), grad_ln.new_empty(x.shape), x.new_empty(0) if ln_weight is None else ln_weight.new_empty(ln_weight.shape),
            x.new_empty(0) if ln_bias is None else ln_bias.new_empty(ln_bias.shape))
