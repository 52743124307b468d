"""fused_ops/fp8/graphs.py: the compiled FP8 operators replayed from CUDA graphs. On CPU through the test double
(graphs.EMULATE: a "replay" runs the body on the static inputs and writes its results where a replay would), so the
bookkeeping (static copies, inputs read in place, outputs still held, the state put back after a capture) is tested
without a GPU; on a GPU (-m gpu) the real graphs under inductor."""

import math
import warnings

import pytest
import torch

import model
from fused_ops import env
from fused_ops.fp8 import FP8State, graphs as op_graphs
from fused_ops.fp8 import state as fp8_state
from fused_ops.fp8.autograd import fp8_mlp

CUDA = torch.cuda.is_available()
needs_fp8_gpu = pytest.mark.skipif(not CUDA or not fp8_state.fp8_supported(torch.device("cuda")),
                                   reason="needs a GPU with FP8 tensor cores (sm_89+)")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(op_graphs, "EMULATE", True)
    monkeypatch.setattr(op_graphs, "_failure", None)


def _steps(state, x, w):
    """A stand-in operator body: reads its tensors and the state's buffers, moves the state on (as update_scales)."""
    state.amax.add_(1)
    return x * w + state.amax[0], x.sum(0, keepdim=True)


def _reads(y, w):
    return (y * w,)


def test_calls_are_replayed_from_the_second_on_and_follow_their_inputs(emulated):
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    for i in range(5):
        x, w = torch.randn(3, 4), torch.randn(4)  # (every tensor copied in, not only the first)
        amax = state.amax[0].item()
        y, s = graphs(_steps, state, x, w)
        torch.testing.assert_close(y, x * w + amax + 1, rtol=0, atol=1e-6)
        torch.testing.assert_close(s, x.sum(0, keepdim=True))
        assert state.amax[0].item() == amax + 1  # one step per call: the capture did not count as one
        del y, s
    (graph,) = graphs.graphs.values()
    assert graph.replays == 4  # the first call ran the body as it is; the second captured and replayed


def test_an_output_still_held_is_not_overwritten(emulated):
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    w = torch.ones(4)
    graphs(_steps, state, torch.zeros(3, 4), w)
    held, _ = graphs(_steps, state, torch.zeros(3, 4), w)  # replayed; held
    kept = held.clone()
    fresh, _ = graphs(_steps, state, torch.ones(3, 4), w)  # must not write into held
    assert torch.equal(held, kept)
    assert fresh.data_ptr() != held.data_ptr()
    (graph,) = graphs.graphs.values()
    assert graph.replays == 1
    del held
    again, _ = graphs(_steps, state, torch.ones(3, 4), w)
    assert graph.replays == 2 and torch.equal(again, torch.ones(3, 4) + state.amax[0])


def _pair(state, x):
    """A forward's stand-in with two outputs of one shape."""
    return x + 1, x + 2


def test_another_graphs_outputs_are_read_in_place_and_only_if_they_are_the_ones_given(emulated):
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    w = torch.full((4,), 2.0)
    for _ in range(3):
        y = graphs(_steps, state, torch.ones(3, 4), w)[0]  # the forward's stand-in
        (z,) = graphs(_reads, y, w)  # the backward's: reads y in place
        torch.testing.assert_close(z, 2 * y)
        del y, z
    forward, backward = graphs.graphs.values()
    assert backward.inputs[0] is forward.outputs[0]  # not a copy
    assert forward.replays == 2 and backward.replays == 2 and 0 not in backward.copied
    # a tensor of the same shape that is not the forward's output: the body runs as it is (no second graph)
    other = torch.randn(3, 4)
    (z,) = graphs(_reads, other, w)
    torch.testing.assert_close(z, other * w)
    assert backward.replays == 2 and len(graphs.graphs) == 2


def test_an_input_read_in_place_must_be_the_very_tensor(emulated):
    """Two outputs of one shape: a graph reading the first in place, given the second (an output too), runs the body."""
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    w = torch.full((4,), 3.0)
    for _ in range(3):
        first, second = graphs(_pair, state, torch.ones(3, 4))
        (z,) = graphs(_reads, first, w)
        assert torch.equal(z, torch.full((3, 4), 6.0))
        del first, second, z
    backward = graphs.graphs[(_reads, op_graphs._signature((torch.ones(3, 4), w)))]
    first, second = graphs(_pair, state, torch.ones(3, 4))
    (z,) = graphs(_reads, second, w)
    assert torch.equal(z, torch.full((3, 4), 9.0)) and backward.replays == 2


def test_at_most_max_signatures_are_captured(emulated):
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    for n in range(1, op_graphs.MAX_SIGNATURES + 3):
        for _ in range(3):
            x = torch.randn(n, 4)
            y, _ = graphs(_steps, state, x, torch.ones(4))
            torch.testing.assert_close(y, x + state.amax[0])
            del y, _
    assert len(graphs.graphs) == op_graphs.MAX_SIGNATURES
    assert all(g.replays == 2 for g in graphs.graphs.values())


def test_the_graphs_do_not_keep_their_state_alive(emulated):
    """(the state holds its graphs: no cycle back, so a model's graphs go with it without the garbage collector)"""
    import gc
    import weakref
    state = FP8State()
    state.op_graphs = op_graphs.OpGraphs()
    for _ in range(3):
        y, s = state.op_graphs(_steps, state, torch.randn(3, 4), torch.ones(4))
        del y, s
    assert state.op_graphs.graphs
    gone = weakref.ref(state)
    gc.disable()
    try:
        del state
        assert gone() is None
    finally:
        gc.enable()


def test_a_failed_capture_falls_back_with_one_warning(emulated, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("stand-in for a capture error")
    monkeypatch.setattr(op_graphs._Graph, "_capture", broken)
    state = FP8State()
    graphs = op_graphs.OpGraphs()
    w = torch.ones(4)
    graphs(_steps, state, torch.zeros(3, 4), w)
    other = op_graphs.OpGraphs()  # another layer's, captured before the failure: freed with it
    other.graphs["stand-in"] = object()
    with pytest.warns(UserWarning, match="CUDA graphs failed.*stand-in"):
        y, _ = graphs(_steps, state, torch.zeros(3, 4), w)
    assert torch.equal(y, torch.zeros(3, 4) + state.amax[0])
    assert not op_graphs.usable(torch.zeros(1))  # off for the process
    assert not other.graphs and op_graphs._failure.startswith("RuntimeError")
    state.amax.zero_()
    y, _ = graphs(_steps, state, torch.zeros(3, 4), w)  # (called directly: the body as it is, no second warning)
    assert torch.equal(y, torch.ones(3, 4))


def test_usable_only_where_asked(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setattr(op_graphs, "_failure", None)
    assert not op_graphs.usable(cpu)  # a CPU tensor without the test double
    monkeypatch.setattr(op_graphs, "EMULATE", True)
    assert op_graphs.usable(cpu)
    with torch.inference_mode():
        assert not op_graphs.usable(cpu)
    monkeypatch.setattr(env, "GRAPHS", False)
    assert not op_graphs.usable(cpu)


def compiled_fp8_gpt(emulate, bias, steps=3, micro_steps=2, monkeypatch=None):
    """A 1-layer FP8 GPT compiled (aot_eager on CPU, fp16 autocast; n_embd 16, the MLP's hidden 64: two of the
    interpreter's 32-wide tiles), `micro_steps` forward/backward pairs of 2 x 16 tokens per SGD step: (losses,
    parameters, model)."""
    import torch._dynamo
    torch._dynamo.reset()
    monkeypatch.setattr(op_graphs, "EMULATE", emulate)
    torch.manual_seed(0)
    config = model.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, mlp="fused", fp8=True,
                             dropout=0.0, bias=bias)
    gpt = model.GPT(config)
    run = torch.compile(gpt, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(gpt.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        for _ in range(micro_steps):
            idx = torch.randint(0, 64, (2, 16), generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = run(idx, idx)[1] / micro_steps
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, [p.detach().clone() for p in gpt.parameters()], gpt


@pytest.mark.parametrize("bias", [True, False])
def test_a_compiled_fp8_gpt_trains_the_same_through_the_graphs(emulated, monkeypatch, bias):
    """Gradient accumulation (two micro-steps a step): through the (emulated) graphs the losses and weights are the
    bodies' bit for bit, and from the third call on every forward and backward is a replay. (Without biases the
    backward returns no bias gradients.)"""
    plain_losses, plain_params, _ = compiled_fp8_gpt(False, bias, monkeypatch=monkeypatch)
    losses, params, gpt = compiled_fp8_gpt(True, bias, monkeypatch=monkeypatch)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    for block in gpt.transformer.h:
        replays = [g.replays for g in block.mlp.fp8.op_graphs.graphs.values()]
        # 6 forwards and backwards: the first calibrates, the second compiles its kernels, then captured: 4 replays
        assert replays == [4, 4], replays


@pytest.mark.parametrize("dtype, autocast", [(torch.float16, False), (torch.float32, True)])
def test_every_backward_replays_and_accumulated_gradients_sum(emulated, monkeypatch, dtype, autocast):
    """The weights' gradients a backward returns become the .grads at a step's first micro-step (fp16 masters without
    autocast, fp32 masters under it: either way in the masters' dtype); handed out as copies, they let every later
    backward replay, and the accumulated .grads are the sum of the micro-steps' gradients as the bodies give them (the
    same step without the graphs, bit for bit), with no warning."""
    import torch._dynamo

    def train(graphs_on):
        torch._dynamo.reset()
        monkeypatch.setattr(env, "GRAPHS", graphs_on)
        torch.manual_seed(0)
        fc, proj = torch.nn.Linear(32, 64, dtype=dtype), torch.nn.Linear(64, 32, dtype=dtype)
        state = FP8State()
        step = torch.compile(lambda x: fp8_mlp(x, fc, proj, "gelu", state), fullgraph=True, backend="aot_eager")
        gen = torch.Generator().manual_seed(0)
        grads = []
        for _ in range(3):  # steps of two micro-steps: calibration, the first calls, then captures and replays
            for _ in range(2):
                x = torch.randn(24, 32, generator=gen).to(torch.float16 if autocast else dtype)
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    loss = step(x).float().square().mean()  # (y not kept: a held output is not overwritten)
                loss.backward()
            grads.append([p.grad.clone() for p in (fc.weight, fc.bias, proj.weight, proj.bias)])
            fc.zero_grad(set_to_none=True)
            proj.zero_grad(set_to_none=True)
        return grads, state

    plain, _ = train(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed, state = train(True)
    for a, b in zip(plain, graphed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert plain[0][0].dtype == dtype
    forward, backward = state.op_graphs.graphs.values()
    # after the first step (calibration, the first calls): every forward and backward replays
    assert (forward.replays, backward.replays) == (4, 4)


def test_a_state_moved_or_copied_drops_its_graphs(emulated):
    state = FP8State()
    state.op_graphs = op_graphs.OpGraphs()
    import copy
    assert copy.deepcopy(state).op_graphs is None
    state.to("cpu")
    assert state.op_graphs is None


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape, bias", [((8, 256, 256), True), ((3, 200, 384), False)])
def test_the_graphs_train_a_compiled_gpt_as_the_bodies_do_on_the_gpu(monkeypatch, shape, bias):
    """Inductor (torch.compile's default mode, no CUDA graphs of its own) around the FP8 operators, two micro-steps per
    step, with and without biases: with the operators' graphs the losses are those without (the same kernels on the
    same data; not bit for bit: their atomic amax and bias sums, and inductor's, vary run to run), and all but the
    first two calls replay."""
    import torch._dynamo
    batch, T, width = shape
    runs = []
    for graphs_on in (False, True):
        torch._dynamo.reset()
        monkeypatch.setattr(env, "GRAPHS", graphs_on)
        torch.manual_seed(0)
        gpt = model.GPT(model.GPTConfig(block_size=T, vocab_size=512, n_layer=2, n_head=4, n_embd=width, mlp="fused",
                                        fp8=True, dropout=0.0, bias=bias)).cuda()
        step = torch.compile(gpt, fullgraph=True)
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3, fused=True)
        gen = torch.Generator("cuda").manual_seed(0)
        losses = []
        for _ in range(5):
            for _ in range(2):
                idx = torch.randint(0, 512, (batch, T), device="cuda", generator=gen)
                with torch.autocast("cuda", torch.bfloat16):
                    loss = step(idx, idx)[1] / 2
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((losses, gpt))
    (plain, _), (losses, gpt) = runs
    assert losses == pytest.approx(plain, rel=1e-3), (losses, plain)
    assert losses[-1] < losses[0] - 0.5
    for block in gpt.transformer.h:
        assert [g.replays for g in block.mlp.fp8.op_graphs.graphs.values()] == [8, 8]  # (10 calls each)


GRADIENTS = ("y", "dx", "dW1", "dW2", "db1", "db2")


def special_values_through_the_graphs(device, monkeypatch, M, C, hidden, bias):
    """NaN and ±inf in x, then in the output gradient, then a finite call, each sent through the compiled FP8 MLP as a
    replay of its operators' graphs and through the uncompiled FP8 path (FP8MLPFunction, a state of its own through
    the same calls). Returns [(case, outputs through the graphs, the uncompiled path's)], each outputs as GRADIENTS.
    On the CPU: aot_eager, fp16 and the test double; on a GPU: inductor (torch.compile's default mode), bf16."""
    import torch._dynamo
    torch._dynamo.reset()
    cuda = device == "cuda"
    monkeypatch.setattr(env, "GRAPHS", True)
    monkeypatch.setattr(op_graphs, "_failure", None)
    monkeypatch.setattr(op_graphs, "EMULATE", not cuda)
    dtype = torch.bfloat16 if cuda else torch.float16
    torch.manual_seed(0)
    fc = torch.nn.Linear(C, hidden, bias=bias, device=device)  # fp32 masters under autocast, as train.py runs
    proj = torch.nn.Linear(hidden, C, bias=bias, device=device)
    state, plain_state = FP8State().to(device), FP8State().to(device)
    compiled = torch.compile(lambda x: fp8_mlp(x, fc, proj, "gelu", state), fullgraph=True,
                             **({} if cuda else dict(backend="aot_eager")))
    runs = {"graphs": compiled, "uncompiled": lambda x: fp8_mlp(x, fc, proj, "gelu", plain_state)}

    def call(run, x, gy):
        """One forward and backward; its outputs copied out and the .grads cleared, so that nothing the next replay
        overwrites is held (else that call would run the bodies as they are, not replay)."""
        x = x.clone().requires_grad_()
        with torch.autocast(device, dtype=dtype):
            y = runs[run](x)
        y.backward(gy)
        grads = [None if p is None else p.grad for p in (fc.weight, proj.weight, fc.bias, proj.bias)]
        out = [None if t is None else t.detach().float().clone() for t in (y, x.grad, *grads)]
        for p in (*fc.parameters(), *proj.parameters()):
            p.grad = None
        return out

    gen = torch.Generator(device).manual_seed(0)

    def finite():
        return (torch.randn(M, C, device=device, generator=gen),
                torch.randn(M, C, device=device, generator=gen).to(dtype) * 1e-3)

    for _ in range(4):  # calibration, the operators' first calls, the capture (and its replay), a replay
        x, gy = finite()
        for run in runs:
            call(run, x, gy)
    graphs = list(state.op_graphs.graphs.values())
    assert [g.replays for g in graphs] == [2, 2]  # the forward's and the backward's
    x, gy = finite()
    bad_x, bad_gy = x.clone(), gy.clone()
    bad_x[3], bad_x[7, 5], bad_x[11, 2] = math.nan, math.inf, -math.inf
    bad_gy[2, 0], bad_gy[9, 4], bad_gy[13, 1] = math.nan, math.inf, -math.inf  # (db2 keeps them: unquantized)
    results = []
    for i, (case, x, gy) in enumerate([("x", bad_x, gy), ("grad_y", x, bad_gy), ("finite after", *finite())]):
        results.append((case, call("graphs", x, gy), call("uncompiled", x, gy)))
        assert [g.replays for g in graphs] == [3 + i] * 2, case  # every call a replay
    return results


def check_special_values(results):
    """NaN, +inf and -inf in the same places through the graphs as uncompiled; the finite entries close (the same
    kernels on the same values); and the specials reached the outputs (else the test would show nothing)."""
    for case, ours, plain in results:
        for name, o, p in zip(GRADIENTS, ours, plain):
            if p is None:
                assert o is None, (case, name)
                continue
            for what, where in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
                assert torch.equal(where(o), where(p)), (case, name, what, where(o).nonzero()[:8], where(p).nonzero()[:8])
            finite = p.isfinite()
            if finite.any():
                err = (o[finite] - p[finite]).norm() / p[finite].norm().clamp_min(1e-30)
                assert err < 1e-2, (case, name, err.item())
    (_, x_case, _), (_, gy_case, _), (_, after, _) = results
    assert x_case[0][[3, 7, 11]].isnan().all() and x_case[0][[0, 1, 2]].isfinite().all()  # rows with a special: NaN
    assert gy_case[1][[2, 9, 13]].isnan().all() and gy_case[0].isfinite().all()  # (±inf quantizes to NaN)
    if gy_case[5] is not None:
        assert gy_case[5][0].isnan() and gy_case[5][4] == math.inf and gy_case[5][1] == -math.inf
    assert all(t is None or t.isfinite().all() for t in after)  # nothing left behind in the graphs' buffers


@pytest.mark.parametrize("bias", [True, False])
def test_nan_and_inf_come_out_of_the_emulated_graphs_as_uncompiled(monkeypatch, bias):
    """(M = 20: rows padded to 32 in the FP8 copies)"""
    check_special_values(special_values_through_the_graphs("cpu", monkeypatch, M=20, C=32, hidden=64, bias=bias))


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_nan_and_inf_come_out_of_the_graphs_as_uncompiled_on_the_gpu(monkeypatch, bias):
    """The real graphs under inductor, M not a multiple of 16 (the FP8 copies' padding rows)."""
    check_special_values(special_values_through_the_graphs("cuda", monkeypatch, M=200, C=256, hidden=1024, bias=bias))
