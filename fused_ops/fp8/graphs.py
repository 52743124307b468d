"""The compiled FP8 MLP's two operators replayed from CUDA graphs, where torch.compile runs without CUDA graphs of its
own (mode "default", "max-autotune-no-cudagraphs").

Why. There the operators fused_mlp::fp8_mlp_forward and fused_mlp::fp8_mlp_backward (autograd.py) run their bodies
in Python at every call: four cuBLAS _scaled_mm, five Triton and Gluon launches, a dozen allocations and views, about
1 ms of host time per layer and step (lab/fp8/step_gaps.py) for about 0.35 ms of GPU work. GPT-2 small's compiled
step then waits on the host, and FP8 lost to bf16 fused (0.81x on an H100, results/fp8_one_gpu_modes_h100.txt).
A CUDA graph records the launches once; replaying it costs the host a few µs. (With mode="reduce-overhead"
torch.compile's own CUDA graphs record the operators with the rest of the step; uncompiled, ../graphs.py records the
whole MLP.)

How. Each FP8State keeps one OpGraphs, for its layer's two operators. A call with a new signature (its tensors' shapes,
strides and dtypes, its other arguments) runs the body as it is: kernels compile and tune there, never inside a capture.
The second call captures: the body runs once on a side stream (cuBLAS makes its workspace for that stream outside the
capture), the FP8State's buffers are put back as they were (that run is not a step), and the body is recorded into a
graph that reads static copies of the tensors. That call and every later one copy their tensors into the static ones
(one _foreach_copy_), replay, and hand the graph's outputs out as they lie.
The backward reads what its forward saved: xᵀ8, hᵀ8, dh/dz and the 1/scales, ~120 MB a layer at GPT-2 small's size
with 12x1024 tokens. Where those are the forward graph's own outputs, the backward's graph reads them in place.

What keeps it exact (as ../graphs.py's):
- A replay overwrites the outputs of the graph's last replay. Before it, the graph checks that nobody holds one (the
  count of tensors on their memory): a forward whose backward has not run, a caller's copy. If someone does, the
  body runs as it is.
- The parameters' gradients (a body's `param_grads`) are handed out as copies: autograd keeps a leaf's first
  gradient as its .grad without copying it (the weights' come out in the masters' dtype, fp32 under autocast), and
  with gradient accumulation the next micro-step's replay would otherwise find it held and run the body. The copies
  move about 19 MB a layer at GPT-2 small's size (the two weights' fp32 gradients, read and written), where running
  the body costs about 1 ms of host time (above).
- A signature has one graph. Where the tensors it reads in place are not the ones given (the forward ran as it is,
  two forwards before their backwards), the body runs as it is.
- Only a calibrated state's calls are captured: the first forward and backward set the scales from the tensors' own
  amax, a host-side branch. From then on the scales live in the state's buffers, moved on by the GPU (update_scales),
  in the graph as outside it.
- Not captured: inside another capture, inference mode, FUSED_OPS_GRAPHS=0, and more than MAX_SIGNATURES signatures
  per layer. torch.compile's reduce-overhead runs each compiled function once before recording it: the operators'
  first call runs as it is there, the second is inside its capture, so they capture nothing of their own in that
  mode (tests/test_fp8.py checks). A capture that fails turns them off for the process, frees every layer's, and
  warns once; the bodies run as they are.
Memory: each captured signature keeps its buffers (static inputs, outputs, the temporaries) for the rest of the run,
where the bodies would free them after each backward: 3.9 GiB more reserved for GPT-2 small at 12x1024 tokens
(results/fp8_one_gpu_modes_h100.txt).
"""

import contextlib
import warnings
import weakref

import torch

from .. import env
from ..graphs import _holders, capture_stream, record

MAX_SIGNATURES = 4  # per layer: the forward and backward of the training shape, and of one more (the last micro-batch)
EMULATE = False  # a CPU test double for the graphs (tests): a "replay" runs the body on the static inputs
_failure = None  # what turned the graphs off for the process, if anything did (a line: no traceback keeps memory)
_every = weakref.WeakSet()  # every OpGraphs, so that a failure frees all their graphs


def usable(x):
    """Whether the operators may replay graphs here: CUDA tensors (or the test double), outside any capture and
    inference mode, graphs on and none failed."""
    if not env.GRAPHS or _failure is not None or torch.is_inference_mode_enabled():
        return False
    if x.is_cuda:
        return not torch.cuda.is_current_stream_capturing()
    return EMULATE


def _signature(args):
    """What a graph is captured for: the tensors' shapes, strides, dtypes and devices, the other arguments' values
    (the layer's FP8State by its type only: an OpGraphs serves one state, and a key must not keep it alive)."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else type(a) if isinstance(a, torch.nn.Module) else a for a in args)


def _where(t):
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Graph:
    """One signature's graph: its static tensors (copies, or another graph's outputs read in place; the other
    arguments are not kept: every call with the signature brings the same), its outputs, and the count of tensors on
    each output's memory while nobody else holds one."""

    def __init__(self, body, args, shared):
        self.inputs = tuple(s if s is not None else a.clone() if isinstance(a, torch.Tensor) else None
                            for a, s in zip(args, shared))
        self.copied = [i for i, (a, s) in enumerate(zip(args, shared)) if isinstance(a, torch.Tensor) and s is None]
        self.shared = tuple(s is not None for s in shared)
        devices = [a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        self.outputs, self._graph = self._capture(body, args, devices[0] if devices else None)
        self.cloned = frozenset(getattr(body, "param_grads", ()))  # handed out as copies (see the top of this file)
        self.handed = tuple((i, t, _holders(t)) for i, t in enumerate(self.outputs)
                            if t is not None and t.numel() and i not in self.cloned)
        self.replays = 0

    def _arguments(self, args):
        return tuple(s if isinstance(s, torch.Tensor) else a for s, a in zip(self.inputs, args))

    def _capture(self, body, args, device):
        """(outputs, graph): the body recorded on the static tensors (device None, the test double: run on them, graph
        None); the state's buffers put back as they were after it (the call itself is the replay that follows)."""
        state = next((a for a in args if isinstance(a, torch.nn.Module)), torch.nn.Module())
        inputs = self._arguments(args)
        kept = [b.clone() for b in state.buffers()]
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():  # (the layer's streams)
            try:
                if device is None:
                    return body(*inputs), None
                stream = capture_stream(device)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    body(*inputs)  # (lazy initializations, cuBLAS's workspace for the stream: not in a capture)
                return record(lambda: body(*inputs), stream, torch.cuda.graph_pool_handle(), "thread_local")
            finally:
                for b, old in zip(state.buffers(), kept):
                    b.copy_(old)

    def held(self):
        """The indices of the outputs someone still holds (a replay would overwrite them)."""
        return [i for i, t, alone in self.handed if _holders(t) > alone]

    def run(self, body, args, shared):
        """The body's outputs for args through a replay, or None where it cannot: a replay would overwrite what
        someone holds, or an input read in place is not the one given."""
        if shared != self.shared or self.held():
            return None
        if any(s and _where(a) != _where(t) for s, a, t in zip(shared, args, self.inputs)):
            return None
        if self.copied:
            torch._foreach_copy_([self.inputs[i] for i in self.copied], [args[i] for i in self.copied])
        if self._graph is None:  # the test double: the body's results written where a replay would write them
            for o, n in zip(self.outputs, body(*self._arguments(args))):
                if o is not None:
                    o.copy_(n)
        else:
            self._graph.replay()
        self.replays += 1
        return tuple(None if t is None else t.clone() if i in self.cloned else t.detach()  # (the rest uncopied:
                     for i, t in enumerate(self.outputs))                                  # see handed)


class OpGraphs:
    """One layer's captured signatures; __call__(body, *args) returns body(*args), through a graph where it can.

    body: a function of its arguments and the FP8State's buffers only (the state among its arguments), launching the
    same work every call with the same signature, and returning a tuple of tensors (or None)."""

    def __init__(self):
        self.graphs, self.seen, self.calls = {}, set(), 0
        self.outputs = {}  # _where(t) -> t for every graph's outputs: the inputs another graph may read in place
        _every.add(self)

    def __call__(self, body, *args):
        self.calls += 1
        if _failure is not None:
            return body(*args)
        signature = (body, _signature(args))
        shared = tuple(isinstance(a, torch.Tensor) and a.numel() > 0 and _where(a) in self.outputs for a in args)
        graph = self.graphs.get(signature)
        if graph is None:
            if signature not in self.seen or len(self.graphs) >= MAX_SIGNATURES:
                if len(self.seen) < 64:  # (signatures that never come back are not all remembered)
                    self.seen.add(signature)
                return body(*args)  # the first call: kernels compile and tune here, never inside a capture
            try:
                graph = _Graph(body, args, [self.outputs[_where(a)] if s else None for s, a in zip(shared, args)])
            except Exception as e:  # an optional fast path: fall back, once, with one warning
                _fail(e)
                return body(*args)
            self.graphs[signature] = graph
            self.outputs.update((_where(t), t) for t in graph.outputs if t is not None and t.numel())
        out = graph.run(body, args, shared)
        return body(*args) if out is None else out


def _fail(e):
    """Turn the graphs off for the process, with one warning, and free every layer's."""
    global _failure
    _failure = f"{type(e).__name__}: {e}"
    for graphs in list(_every):
        graphs.graphs.clear()
        graphs.outputs.clear()
    warnings.warn(f"capturing the compiled FP8 MLP's operators in CUDA graphs failed ({_failure}); they run as they "
                  "are from now on", stacklevel=4)
