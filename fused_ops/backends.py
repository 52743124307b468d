"""Where an op's faster, hardware-specific kernel plugs in: one registry, so that the portable launchers never
import a hardware backend (Liger-Kernel's layering).

The core's launchers (linear_act.py, dgrad.py, classifier.py) ask `run(op, ...)` before launching their own kernel
(the classifier's: a cuBLAS GEMM): if a backend has registered a function for that op and it takes these arguments,
it runs and its result is returned; else (nothing registered, or the function answered NotImplemented) their own
kernel runs. A registered function decides for itself whether it takes the arguments (the GPU, the dtypes, the
layouts), and answers NotImplemented where it does not, or where it failed (after warning once: an optional fast
path must never cost a run more than its speed).

Backends register at import: fused_ops/__init__.py imports hopper/ (hopper/dispatch.py) after the core.

    op            arguments                                                   result
    linear_act    x, weight, bias, act, up_act, gated, save, out, saved       anything but NotImplemented (out,
                                                                              saved written)
    dgrad         grad_y, w2, saved, out, gated, bias_grad                    the bias gradient or None (out written)
    logits_lse    x, weight, out, inv (FP8: the 1/scales, else None)          each row's log-sum-exp per tile of
                                                                              out's columns (out = x @ weight.T)
"""

_registry = {}  # op name -> the function that runs it faster where it can


class FallbackWarning(RuntimeWarning):
    """An optional fast path (a Hopper kernel, FusedAdamW's kernel) failed to compile or launch; the portable path
    (Triton's kernels, cuBLAS's, PyTorch's) runs instead for the rest of the process."""


def register(op, fn):
    """Make fn the fast path of `op` (replacing any earlier one); fn answers NotImplemented where it does not run."""
    _registry[op] = fn


def registered(op):
    """The function registered for `op`, or None."""
    return _registry.get(op)


def run(op, *args):
    """The registered fast path's result for these arguments, or NotImplemented: the caller runs its own kernel."""
    fn = _registry.get(op)
    return NotImplemented if fn is None else fn(*args)
