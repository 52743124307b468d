"""The one place the core's launchers reach the Hopper kernels: each core op that has a ping-pong version is
registered here with fused_ops.backends, as a function that says whether the kernel takes the arguments
(pingpong.usable, pingpong.takes_dgrad) and runs it, or answers NotImplemented so that the core's own kernel runs
(Triton's; for the classifier's logits, cuBLAS's GEMM).

A ping-pong kernel that fails to compile or launch answers NotImplemented too, after its one FallbackWarning
(pingpong._fails; the logits GEMM's own: pingpong.logits_lse): the core's kernels then write every output, for the
rest of the process.
The functions look pingpong's names up at each call (module attributes), so a test can replace them.
"""

from .. import backends
from . import pingpong


def linear_act(x, weight, bias, act, up_act, gated, save, out, saved):
    """linear_act_forward without the LayerNorm fold (the fold normalizes x's tiles as it loads them: Triton only)."""
    if not (pingpong.usable(x, (weight, out, saved if save else None), (bias,), out.shape[1] if gated else None)
            and pingpong.linear_act_forward(x, weight, bias, act, up_act, gated, save, out, saved)):
        return NotImplemented
    return True


def dgrad(grad_y, w2, saved, out, gated, bias_grad):
    """linear_act_dgrad: the bias gradient (or None), or NotImplemented where the Triton dgrad should run (see
    pingpong.takes_dgrad: the gated dgrad is faster in Triton at larger widths or with a bias gradient)."""
    N = w2.shape[1]
    if not (pingpong.takes_dgrad(gated, grad_y.shape[1], bias_grad)
            and pingpong.usable(grad_y, (w2, saved, out), split=N if gated else None)):
        return NotImplemented
    ran, grad_bias = pingpong.dgrad(grad_y, w2, saved, out, gated, bias_grad)
    return grad_bias if ran else NotImplemented


def logits_lse(x, weight, out, inv):
    """The classifier's logits GEMM with each row's log-sum-exp per tile beside it (pingpong.logits_lse), or
    NotImplemented where the kernel does not take these operands or failed: the classifier then runs cuBLAS."""
    if not pingpong.usable(x, (weight, out)):
        return NotImplemented
    partial = pingpong.logits_lse(x, weight, out, inv)
    return NotImplemented if partial is None else partial


backends.register("linear_act", linear_act)
backends.register("dgrad", dgrad)
backends.register("logits_lse", logits_lse)
