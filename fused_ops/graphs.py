"""Per-shape CUDA graphs of the fused MLP, for a model that is not compiled.

Why. Outside torch.compile every fused MLP costs the host about half a millisecond per layer and step: Python,
autograd and a dozen launches (the weights' autocast casts, the Triton kernel, cuBLAS, and the same again in
backward). At GPT-2 small's size the GPU does the MLP's work in about as long, so the step waits on the host and
the kernels' gain is lost (docs/performance.md). A CUDA graph records those launches once and replays them for a
few microseconds of host time.

How. As torch.cuda.make_graphed_callables, but per layer and per input shape, captured lazily:
- The first call with a new shape (and dtype, autocast state, grad mode) runs the plain path: it compiles and
  tunes the kernels, which may not happen inside a capture.
- The second captures. The forward goes into one graph reading a static copy of x and the parameters in place
  (the optimizer updates them in place, so a graph always reads the current weights); with autograd on, its
  backward goes into a second graph, torch.autograd.grad from a static grad_y. Both share one memory pool of
  their own (one pool for all layers would be smaller but is not safe as captured here: a layer's input gradient,
  handed on down the residual stream uncopied, could sit where an earlier-captured layer keeps its temporaries).
  Capture runs nothing, so the graphs are then replayed for the call itself.
- Every later call copies x in, replays, and hands out the outputs (forward: y; backward: the gradients).

What keeps it exact, and what it costs:
- A replay overwrites the graph's buffers, and y and the gradients are handed out as they lie there, uncopied (in
  a GPT y and x's gradient are read once, by the residual stream's sum, and dropped; a parameter's gradient is
  added into its .grad). Before a replay, the graph checks that nobody holds one from an earlier call (the count
  of tensors on their memory, as torch.compile's CUDA-graph trees check theirs); if someone does (a caller keeping
  y, torch.autograd.grad's result, a hook), this call runs the plain path instead of overwriting it. (What the
  count does not see: a storage object, y.untyped_storage(), kept without a tensor.)
- A second forward before the first one's backward (two forwards, then two backwards) runs the plain path
  instead of overwriting what the first backward will read. A backward whose forward buffers were overwritten
  anyway (a retain_graph backward after a later forward) raises instead of returning wrong gradients.
- A leaf's first gradient is cloned (autograd keeps it as the leaf's .grad without copying it, and the next
  micro-step's replay would write into it); gradients added into an existing .grad are not. A second backward
  through one forward (retain_graph) and a parameter changed in place between forward and backward raise, where
  the plain path would not or would too.
- Not captured: inference mode; torch.utils.checkpoint with graphs is not supported (its recompute would take
  the plain path and save different tensors: FUSED_OPS_GRAPHS=0).
- Memory: each captured shape holds its layer's buffers (x, y, grad_y, the saved activations, the gradients and
  the backward's temporaries) for the rest of the run, where the plain path frees them after backward: GPT-2
  small at 12x1024 tokens reserved 3 GiB more (16.9 against 13.9 GiB; 6 GiB before every capture ran on one side
  stream, capture_stream: results/fp8_one_gpu_modes_h100.txt). At most MAX_SHAPES shapes
  per layer are captured, later ones run the plain path; FUSED_OPS_GRAPHS=0 when memory is short.
- State a layer keeps besides its parameters (the FP8 MLP's scales, `keep`) is put back as it was after a capture:
  the capture's warm-up run would otherwise count as a step of its own. Its kernels update that state in place on
  the GPU, so replays carry it on; host state is not captured (the FP8 MLP calibrates before its first capture).
- A capture that fails (out of memory, say) turns the graphs off for the process with one warning; the plain path
  runs. FUSED_OPS_GRAPHS=0 turns them off (to save memory, to compare, or to debug a kernel launch by launch).
"""

import contextlib
import warnings
import weakref

import torch

from . import env

MAX_SHAPES = 4  # captured shapes per layer (training, evaluation, sampling's prompt and its one-token steps)
_failed = False  # set by a failed capture: the plain path from then on


_streams = {}  # GPU index -> the side stream captures run on


def capture_stream(device):
    """The side stream every capture of fused_ops runs on, one per GPU: what a capture's warm-up frees stays cached
    for the next capture, where a new stream per capture would strand it (the caching allocator gives a freed block
    only to the stream that freed it; GPT-2 small's FP8 operators held 8 GiB more that way)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(index)
    return _streams[index]


def record(fn, stream, pool=None, error_mode="global"):
    """(fn()'s outputs, a CUDA graph of its launches), recorded on stream (capture_stream's) into pool (None: a pool
    of its own); the stream waits for the current one first, and the current one for it after. capture_begin rather
    than torch.cuda.graph(): that one empties the allocator's cache on every capture, a cost every layer and shape
    would pay again. error_mode: capture_begin's capture_error_mode."""
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=error_mode)
            try:
                out = fn()
            finally:
                graph.capture_end()
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    return out, graph


def _holders(t):
    """How many tensors share t's memory (references to its storage)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def graphs_usable(x):
    """Whether the graphs may run here: CUDA tensors, outside torch.compile, inference mode (its tensors cannot be
    copied into later) and someone else's capture."""
    return (env.GRAPHS and not _failed and x.is_cuda and not torch.compiler.is_compiling()
            and not torch.is_inference_mode_enabled() and not torch.cuda.is_current_stream_capturing())


class _Captured:
    """One shape's graphs: the static input, outputs and gradients, and the replay functions."""

    def __init__(self, fn, x, params, train, emulate):
        self.params = params
        self.generation = 0  # forwards replayed so far: a backward checks that its forward's buffers are intact
        self.backward_of = 0  # the generation whose backward last ran
        self.pending = None  # weakref to the autograd node of a forward whose backward has not run
        # Fresh leaves: x's static copy, and stand-ins sharing the parameters' memory (a replay reads the current
        # weights). The parameters' own gradient accumulators may belong to another stream (the default one, from
        # an earlier step whose graph is still alive), and a capture may not touch the default stream.
        self.x = x.detach().clone().requires_grad_(x.requires_grad)
        stand_ins = tuple(None if p is None else p.detach().requires_grad_(p.requires_grad) for p in params)
        surface = (self.x, *stand_ins)
        self.inputs = tuple(t for t in surface if t is not None and t.requires_grad) if train else ()
        holder = {}

        def forward():
            with torch.enable_grad() if train else torch.no_grad():
                holder["y"] = fn(self.x, *stand_ins)
            return holder["y"]

        def backward():
            return torch.autograd.grad(holder["y"], self.inputs, self.grad_y, allow_unused=True)

        pool, stream = (None, None) if emulate else (torch.cuda.graph_pool_handle(), capture_stream(x.device))
        if not emulate:  # lazy initializations (cuBLAS workspaces, the backward's kernels) outside the capture
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y = forward()
                if train:
                    torch.autograd.grad(y, self.inputs, torch.ones_like(y), allow_unused=True)
            del y
        self.y, self.replay_forward = self._record(forward, pool, stream)
        if train:
            self.grad_y = torch.empty_like(self.y)
            grads, self.replay_backward = self._record(backward, pool, stream)
            slots = iter(grads)  # one gradient per input surface entry (None where it needs none)
            self.grads = tuple(next(slots) if t is not None and t.requires_grad else None for t in surface)
        # What a replay overwrites and hands out uncopied (y, and the gradients not copied out in backward), with
        # the count of tensors on their memory while nobody else holds one: more later means a caller still holds
        # one (see handed_out_alive).
        handed = (self.y, *(g for g in self.grads if g is not None)) if train else (self.y,)
        self.handed = tuple((t, _holders(t)) for t in handed)

    @staticmethod
    def _record(fn, pool, stream):
        """Run fn once into buffers that every replay overwrites in place: (its outputs, replay). Forward and
        backward are captured on one stream (the backward's nodes run on their forward's stream)."""
        if stream is None:  # emulated (CPU test double): rerun fn, copy into the first run's buffers as a replay would
            out = fn()

            def replay():
                new = fn()
                for o, n in zip(out if isinstance(out, tuple) else (out,), new if isinstance(new, tuple) else (new,)):
                    if o is not None:
                        o.detach().copy_(n)
            return out, replay
        out, graph = record(fn, stream, pool)
        return out, graph.replay

    def handed_out_alive(self):
        """Something an earlier replay handed out (y, a gradient) is still held: a replay would overwrite it."""
        return any(_holders(t) > alone for t, alone in self.handed)

    def busy(self):
        """A forward's buffers are still waiting for its backward (its autograd node is alive)."""
        return self.pending is not None and self.pending() is not None


class _Replay(torch.autograd.Function):
    """The autograd node of a replayed forward: its backward replays the captured backward."""

    @staticmethod
    def forward(ctx, captured, x, *params):
        captured.x.detach().copy_(x)
        captured.replay_forward()
        captured.generation += 1
        ctx.captured, ctx.generation = captured, captured.generation
        # leaves whose first gradient becomes their .grad (see backward)
        ctx.leaves = tuple(t if t is not None and t.is_leaf else None for t in (x, *params))
        ctx.versions = tuple(None if p is None else p._version for p in params)
        captured.pending = weakref.ref(ctx)
        return captured.y.detach()  # (uncopied: the next replay waits until nobody holds it, see handed_out_alive)

    @staticmethod
    def backward(ctx, grad_y):
        captured = ctx.captured
        if ctx.generation != captured.generation or captured.backward_of == ctx.generation:
            # (the backward's capture frees what forward saved as it goes, so a replay needs a fresh forward)
            raise RuntimeError("the fused MLP's CUDA graph cannot run a backward twice through one forward, or after "
                               "a later forward (retain_graph?): set FUSED_OPS_GRAPHS=0 for such a run")
        if any(p is not None and p._version != v for p, v in zip(captured.params, ctx.versions)):
            raise RuntimeError("a parameter of the fused MLP was modified in place between its forward and its "
                               "backward (the gradient would mix old activations with new weights)")
        captured.grad_y.detach().copy_(grad_y)
        captured.replay_backward()
        captured.pending, captured.backward_of = None, ctx.generation
        out = []
        for t, g in zip(ctx.leaves, captured.grads):
            # The next replay writes into g. A leaf's first gradient becomes its .grad as it is, and the next
            # micro-step's backward replays before anyone could see it is held: copy it. The others go out
            # uncopied (x's gradient when x is not a leaf, one added into an existing .grad): the next forward
            # checks that nobody holds them.
            if g is not None and t is not None and t.grad is None:
                g = g.clone()
            out.append(None if g is None else g.detach())
        return (None, *out)


class MLPGraphs:
    """A layer's captured shapes. __call__(fn, x, params) returns fn(x, *params), through a graph where it can.

    fn must compute from its arguments only (params: the layer's parameters, None for a missing bias) and the
    buffers of `keep` (a module, restored after each capture), and launch the same work every call for the same
    input shape. emulate: a CPU test double for CUDA graphs (buffers
    overwritten in place at every "replay"), so that the bookkeeping above can be tested without a GPU."""

    def __init__(self, emulate=False, keep=None):
        self.emulate, self.keep, self.captured, self.seen = emulate, keep, {}, set()

    def __call__(self, fn, x, params):
        global _failed
        if _failed or torch.is_inference_mode_enabled():
            return fn(x, *params)
        train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))
        autocast = torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type)
        key = (tuple(x.shape), x.dtype, x.requires_grad, train, autocast,
               tuple(None if p is None else (p.data_ptr(), p.dtype, p.requires_grad) for p in params))
        captured = self.captured.get(key)
        if captured is None:
            if key not in self.seen or len(self.captured) >= MAX_SHAPES:
                if len(self.seen) < 64:  # (shapes that never come back: sampling without a KV cache)
                    self.seen.add(key)
                return fn(x, *params)  # the first call: kernels compile and tune here, never inside a capture
            for old in [k for k in self.captured if k[-1] != key[-1]]:  # parameters replaced: free their graphs
                del self.captured[old]
            kept = None if self.keep is None else [b.clone() for b in self.keep.buffers()]
            try:
                with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (streams, pool: x's GPU)
                    captured = self.captured[key] = _Captured(fn, x, params, train, self.emulate)
            except Exception as e:  # an optional fast path: fall back, once, with one warning
                _failed = True
                warnings.warn(f"capturing the fused MLP in a CUDA graph failed ({type(e).__name__}: {e}); the "
                              "plain fused path runs from now on", stacklevel=2)
            finally:  # (the capture's warm-up run, even a failed one, is not a step: put the kept state back)
                for b, old in zip(() if kept is None else self.keep.buffers(), kept or ()):
                    b.copy_(old)
            if captured is None:
                return fn(x, *params)
        if captured.handed_out_alive():  # something an earlier call handed out is still held: do not overwrite it
            return fn(x, *params)
        if not train:
            captured.x.copy_(x)
            captured.replay_forward()
            return captured.y.detach()
        if captured.busy():  # two forwards before one backward: the first one's buffers are still needed
            return fn(x, *params)
        return _Replay.apply(captured, x, *params)

    def __getstate__(self):  # (copy.deepcopy / pickling of a model: the graphs are not copied, they are recaptured)
        return {"emulate": self.emulate, "keep": self.keep, "captured": {}, "seen": set()}
