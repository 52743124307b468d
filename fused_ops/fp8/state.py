"""FP8State, one layer's delayed scales and its weights' FP8 copies (an MLP's, or an FP8 linear's: linear.py), and
the device checks (kernels.py's docstring has the scaling recipe: per-tensor delayed scaling, calibrated on the first
call).

quantize_weight is the weights' current scaling in plain PyTorch (what the compiled graph runs; kernels.py's
quantize_weight_fused is the same, bit for bit, in kernels); _set_current_scale calibrates a slot.
"""

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import env
from ..graphs import capture_stream, record
from ..matmul import _capability
from .kernels import E4M3, FP8_MAX, SLOT_DTYPES, quantize_weight_fused

FP8_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores


def fp8_supported(device):
    """FP8 GEMMs need FP8 tensor cores (compute capability 8.9+), or the CPU interpreter (tests)."""
    if device.type == "cuda":
        return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= FP8_CAPABILITY
    return env.INTERPRET and device.type == "cpu"


def check_fp8_device(device, setting="fp8=True", instead="use fp8=False"):
    """One line naming the requirement, where FP8 cannot run (setting: how the caller's user asked for FP8, instead:
    what to do about it)."""
    if fp8_supported(device):
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = _capability(index)
        where = f"{torch.cuda.get_device_name(index)} is sm_{major}{minor}"
    else:
        where = f"the device is {device.type}"
    raise RuntimeError(f"{setting} needs FP8 tensor cores (an NVIDIA Ada or Hopper GPU, compute capability 8.9+); "
                       f"{where}: {instead}")


# The weights' remake (four kernels per weight, about 80 µs of host time per MLP and step) captured in one CUDA graph
# per MLP, replayed for a few µs: outside CUDA graphs (an uncompiled model), FP8's step waited on this host time
# (lab/fp8/step_gaps.py). Turned off with FUSED_OPS_GRAPHS=0, or here (the probe compares).
WEIGHT_GRAPHS = True
_weight_graph_failure = None  # what turned the weight graphs off for the process, if anything did (a line: no traceback)

_STATES = []  # weak references to every FP8State of the process, by number
_optimizer_steps = 0  # optimizer steps taken in this process (torch.optim's global post-step hook counts them)


def _count_optimizer_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class FP8State(torch.nn.Module):
    """One MLP's delayed scales (slots X, H, GRAD_Y, GRAD_Z) and its weights' FP8 copies; an FP8 linear (linear.py)
    uses slots X (its input) and GRAD_Y (its output's gradient) of a state of its own.

    Buffers, not parameters, and not saved in checkpoints (persistent=False): a resumed run calibrates
    again on its first step. They stay fp32 whatever dtype the model is cast to."""

    def __init__(self, history=16):
        super().__init__()
        if history < 1 or history & (history - 1):
            raise ValueError(f"history must be a power of two (a Triton block), got {history}")
        # inv_scale: one 16-byte row per slot, its value in column 0: cuBLAS reads a scale only from a 16-byte
        # aligned address (CUBLAS_STATUS_NOT_SUPPORTED otherwise), and the GEMMs read these.
        buffers = dict(history=torch.zeros(4, history), position=torch.zeros(4, dtype=torch.int32),
                       amax=torch.zeros(4), scale=torch.ones(4), inv_scale=torch.ones(4, 4),
                       fp8_max=torch.tensor([FP8_MAX[d] for d in SLOT_DTYPES]),
                       unit=torch.tensor([1.0, 0.0]))  # scale 1 and a scratch amax, for transpose_fp8
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)
        self.calibrated = False
        self._weights = None  # (the parameters' identity and versions, their FP8 copies)
        self._graph = None  # (the parameters' and copies' addresses, the CUDA graph that remakes the copies)
        self._views = None  # slot(i)'s views, made once
        self.op_graphs = None  # the compiled operators' CUDA graphs (graphs.py), made by autograd.py on first use
        # Its number, which the compiled graph's operators carry to find it (fp8_autograd.py): creation order,
        # so the same model gets the same numbers in every run (and compile's caches still match).
        self.number = len(_STATES)
        _STATES.append(weakref.ref(self))

    def __getstate__(self):  # (a CUDA graph is not copied: a copy captures its own)
        return {**self.__dict__, "_graph": None, "_views": None, "op_graphs": None}

    def __setstate__(self, state):  # a deep copy or an unpickled one is a state of its own, with its own number
        super().__setstate__(state)
        self.number = len(_STATES)
        _STATES.append(weakref.ref(self))

    def _apply(self, fn, recurse=True):
        for name, t in self._buffers.items():  # model.to(device, dtype) moves them, never casts them (fp32 scales)
            self._buffers[name] = t.to(fn(t).device)
        self._weights = self._graph = self._views = self.op_graphs = None
        return self

    def slot(self, i):
        """(scale[i:], amax[i:], inv_scale[i, :1]): the views of slot i's buffers that the kernels take (a slot's
        scale and amax at index 0, its 1/scale's 16-byte row), made once (again after .to(), which replaces the
        buffers): each view costs the host a few µs, and the FP8 MLP asks for about ten a layer and step."""
        if self._views is None:
            self._views = [(self.scale[j:], self.amax[j:], self.inv_scale[j, :1]) for j in range(4)]
        return self._views[i]

    def weights(self, *weights):
        """quantize_weight of each weight, in order: (W (N, K) in e4m3, Wᵀ, its 1/scale) for each (the MLP's: W1 then
        W2; an FP8 linear's: its one weight), made again only when the parameters may have changed: after any
        torch.optim optimizer's step (counted by a global hook: the fused AdamW updates parameters without moving
        their version counters), or an in-place update that moves them (load_state_dict, a foreach optimizer). So
        once per optimizer step, however many micro-steps use them; remade in place (into the same tensors), so that
        a CUDA graph reading them reads the new ones. (An update outside both, through .data, is not seen: call
        state.weights_changed().)"""
        key = (_optimizer_steps, weights[0].dtype, *((w.data_ptr(), w._version) for w in weights))
        if self._weights is None or self._weights[0] != key:
            old = None if self._weights is None else self._weights[1]
            if old is not None and [c.shape for c in old[::3]] != [w.shape for w in weights]:
                old = None  # (a model whose weights changed shape: new tensors)
            with torch.no_grad():
                copies = self._remake(weights, old)
            self._weights = (key, copies)
        return self._weights[1]

    def _remake(self, weights, old):
        """The copies of the weights, into old (three tensors per weight) if given. On a GPU, the second remake into
        the same tensors is also captured in a CUDA graph (the first compiled the kernels), which later ones replay."""
        where = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (*weights, *(old or ())))
        if self._graph is not None and self._graph[0] == where:
            self._graph[1].replay()
            return old

        def remake():
            return tuple(c for i, w in enumerate(weights)
                         for c in quantize_weight_fused(w, None if old is None else old[3 * i:3 * i + 3]))
        copies = remake()
        if (old is not None and weights[0].is_cuda and WEIGHT_GRAPHS and env.GRAPHS and _weight_graph_failure is None
                and not torch.cuda.is_current_stream_capturing()):
            self._graph = _captured(remake, where, weights[0].device)
        return copies

    def weights_changed(self):
        self._weights = self._graph = None

    def extra_repr(self):
        return f"history={self.history.shape[1]}, calibrated={self.calibrated}"


def _captured(remake, where, device):
    """(where, a CUDA graph of remake()), or None after one warning if the capture fails (the eager remake goes on)."""
    global _weight_graph_failure
    try:
        with torch.cuda.device(device):  # (the streams are the weights' GPU's, whichever is current)
            return where, record(remake, capture_stream(device), error_mode="thread_local")[1]
    except Exception as e:  # an optional fast path: fall back, once, with one warning
        _weight_graph_failure = f"{type(e).__name__}: {e}"
        warnings.warn(f"capturing the FP8 weights' remake in a CUDA graph failed ({_weight_graph_failure}); it runs "
                      "eagerly from now on", stacklevel=4)
        return None


def quantize_weight(w):
    """(fp8(W · scale) in e4m3, the same transposed and contiguous, 1/scale), current scaling: both copies, since
    each GEMM takes its operands K-major (the forward W, the input gradient's Wᵀ)."""
    w = w.detach().float()
    amax = w.abs().amax()
    # The two divisions in float64, rounded once to fp32: the correctly rounded fp32 quotients (53 bits hold the
    # double rounding harmlessly), as weight_scale_kernel's div_rn, also inside torch.compile, whose Triton kernels
    # divide fp32 approximately (an ulp off: results/glue/README.md). The compiled and uncompiled paths must agree
    # bit for bit. (A tensor over a tensor: a float over a tensor is computed as float · (1/tensor).)
    a64 = amax.double()
    # (an amax below 448 / FLT_MAX would make the scale inf: these copies ±448 with a 1/scale of 0, the kernels' NaN;
    # the largest float instead, whose copies dequantize to W, in all three)
    scale = torch.where((amax > 0) & amax.isfinite(),
                        (a64.new_tensor(FP8_MAX[E4M3]) / a64).float().clamp(max=torch.finfo(torch.float32).max),
                        torch.ones_like(amax))
    q = (w * scale).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3])
    q = torch.where(w.isinf(), float("nan"), q).to(E4M3)  # ±inf: NaN, as in the kernels
    s64 = scale.double()
    return q, q.t().contiguous(), (torch.ones_like(s64) / s64).float().reshape(1)


def _set_current_scale(state, slot, t=None):
    """Calibration: the slot's scale from t's own amax, or (t None) from the amax a kernel just folded into the slot,
    which is then reset (where it is finite and nonzero; else the scale stays)."""
    if t is None:
        amax = state.amax[slot].clone()
        state.amax[slot] = 0.0
    else:
        amax = t.detach().abs().amax().float()
    usable = (amax > 0) & amax.isfinite()
    scale = torch.where(usable, state.fp8_max[slot] / torch.where(usable, amax, 1.0), state.scale[slot])
    state.scale[slot] = scale
    state.inv_scale[slot, 0] = scale.reciprocal()
