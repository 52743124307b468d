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
  count of tensors on their memory): a forward whose backward has not run, a gradient kept as a .grad. If someone
  does, the body runs as it is.
- An input the graph reads in place (a forward's output) must be the one given; if not, the body runs as it is.
- Only a calibrated state's calls are captured: the first forward and backward set the scales from the tensors' own
  amax, a host-side branch. From then on the scales live in the state's buffers, moved on by the GPU (update_scales),
  in the graph as outside it.
- Not captured: inside another capture (reduce-overhead's, which records the bodies itself), inference mode,
  FUSED_OPS_GRAPHS=0, and more than MAX_SIGNATURES signatures per layer. A capture that fails turns them off for the
  process with one warning; the bodies run as they are.
Memory: each captured signature keeps its buffers (static inputs, outputs, the temporaries) for the rest of the run,
where the bodies would free them after each backward.
"""

import warnings
import weakref

import torch

from .. import env
from ..graphs import _holders, capture_stream

MAX_SIGNATURES = 4  # per layer: the forward and backward of the training shape, and of one more (the last micro-batch)
EMULATE = False  # a CPU test double for the graphs (tests): a "replay" runs the body on the static inputs
_failure = None  # the exception that turned the graphs off for the process, if one did


def usable(x):
    """Whether the operators may replay graphs here: CUDA tensors (or the test double), outside any capture and
    inference mode, graphs on and none failed."""
    if not env.GRAPHS or _failure is not None or torch.is_inference_mode_enabled():
        return False
    if x.is_cuda:
        return not torch.cuda.is_current_stream_capturing()
    return EMULATE


def _signature(args):
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


def _where(t):
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Graph:
    """One signature's graph: its static inputs (copies, or another graph's outputs read in place), its outputs, and
    the count of tensors on each output's memory while nobody else holds one."""

    def __init__(self, body, args, shared, state):
        self.inputs = tuple(s if s is not None else a.clone() if isinstance(a, torch.Tensor) else a
                            for a, s in zip(args, shared))
        self.copied = [i for i, (a, s) in enumerate(zip(args, shared)) if isinstance(a, torch.Tensor) and s is None]
        cuda = [a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        self.outputs, self._graph = self._capture(body, state, cuda[0] if cuda else None)
        self.handed = tuple((t, _holders(t)) for t in self.outputs if t is not None and t.numel())
        self.replays = 0

    def _capture(self, body, state, device):
        """(outputs, graph): the body recorded on the static inputs (device None, the test double: run on them, graph
        None); the state's buffers put back as they were after it (the call itself is the replay that follows)."""
        kept = [b.clone() for b in state.buffers()]
        try:
            if device is None:
                return body(*self.inputs), None
            graph, stream = torch.cuda.CUDAGraph(), capture_stream(device)
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(stream):
                    body(*self.inputs)  # (lazy initializations, cuBLAS's workspace for the stream: not in a capture)
                    graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
                    try:
                        outputs = body(*self.inputs)
                    finally:
                        graph.capture_end()
            finally:
                torch.cuda.current_stream().wait_stream(stream)
            return outputs, graph
        finally:
            for b, old in zip(state.buffers(), kept):
                b.copy_(old)

    def run(self, body, args):
        """The body's outputs for args through a replay, or None where a replay would overwrite what someone holds."""
        if any(_holders(t) > alone for t, alone in self.handed):
            return None
        if any(a is not None and isinstance(s, torch.Tensor) and i not in self.copied and _where(a) != _where(s)
               for i, (a, s) in enumerate(zip(args, self.inputs))):
            return None
        if self.copied:
            torch._foreach_copy_([self.inputs[i] for i in self.copied], [args[i] for i in self.copied])
        if self._graph is None:  # the test double: the body's results written where a replay would write them
            torch._foreach_copy_(*zip(*((o, n) for o, n in zip(self.outputs, body(*self.inputs))
                                        if o is not None and o.numel())))
        else:
            self._graph.replay()
        self.replays += 1
        return tuple(None if t is None else t.detach() for t in self.outputs)  # (uncopied: see handed)


class OpGraphs:
    """One layer's captured signatures; __call__(body, *args) returns body(*args), through a graph where it can.

    body: a function of its arguments and the FP8State's buffers only, launching the same work every call with the
    same signature, and returning a tuple of tensors (or None); state: the layer's FP8State (kept by a weak
    reference)."""

    def __init__(self, state):
        self.state = weakref.ref(state)
        self.graphs, self.seen, self.calls = {}, set(), 0
        self.outputs = {}  # _where(t) -> t for every graph's outputs: the inputs another graph may read in place

    def __call__(self, body, *args):
        global _failure
        self.calls += 1
        if _failure is not None:
            return body(*args)
        shared = tuple(self.outputs.get(_where(a)) if isinstance(a, torch.Tensor) and a.numel() else None
                       for a in args)
        signature = (body, _signature(args))
        key = (*signature, tuple(s is not None for s in shared))  # (where the inputs read in place differ: another)
        graph = self.graphs.get(key)
        if graph is None:
            if signature not in self.seen or len(self.graphs) >= MAX_SIGNATURES:
                if len(self.seen) < 64:
                    self.seen.add(signature)
                return body(*args)  # the first call: kernels compile and tune here, never inside a capture
            try:
                graph = self.graphs[key] = _Graph(body, args, shared, self.state())
            except Exception as e:  # an optional fast path: fall back, once, with one warning
                _failure = e
                warnings.warn(f"capturing the compiled FP8 MLP's operators in CUDA graphs failed ({type(e).__name__}: "
                              f"{e}); they run as they are from now on", stacklevel=3)
                return body(*args)
            self.outputs.update((_where(t), t) for t in graph.outputs if t is not None and t.numel())
        out = graph.run(body, args)
        return body(*args) if out is None else out
