"""fused_ops/graphs.py: the per-shape CUDA graphs of an uncompiled fused MLP. On CPU through MLPGraphs(emulate=True),
a test double whose every "replay" overwrites the first run's buffers in place as a CUDA graph's does, so the
bookkeeping (static buffers, leaf gradients, forwards before backwards, the shape cap) is checked in CI; on a GPU
(marked gpu) with real graphs, against the plain fused path and inside a whole GPT."""

import copy
import warnings

import pytest
import torch

import fused_ops.graphs as graphs
from fused_ops import env
from fused_ops import MLPGraphs, fused_mlp_layers, layers_as_function
from model import GPT, GPTConfig



def layer(C=16, H=32, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    c_fc, c_proj, ln = torch.nn.Linear(C, H), torch.nn.Linear(H, C), torch.nn.LayerNorm(C)
    with torch.no_grad():
        ln.weight.add_(0.1 * torch.randn(C))
    return [m.to(device, dtype) for m in (c_fc, c_proj, ln)]


def run_steps(mods, xs, graphed, accumulate=1, lr=0.1):
    """SGD steps over xs (each x: one micro-batch), zero_grad(set_to_none=True) as train.py; the outputs and the
    final parameters. graphed: an MLPGraphs, or None for the plain fused path. The loss is y's projection on a fixed
    random direction (a loss that grows with y, such as y², diverges within a few steps at a width of 768)."""
    c_fc, c_proj, ln = mods
    fn, params = layers_as_function(c_fc, c_proj, "gelu", ln)
    opt = torch.optim.SGD(params, lr=lr)
    direction = torch.randn(xs[0].shape, generator=torch.Generator().manual_seed(1)) / xs[0].numel() ** 0.5
    direction = direction.to(xs[0].device)
    outs = []
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_()
        y = fn(x, *params) if graphed is None else graphed(fn, x, params)
        ((y.float() * direction).sum() / accumulate).backward()
        outs.append((y.detach().clone(), x.grad.clone()))
        del y  # (as a training loop drops it: a y still held makes the next call run the plain path)
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return outs, [p.detach().clone() for p in params]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_steps_match_the_plain_path(accumulate):
    """Outputs, input gradients and the updated parameters after several steps: the graph reads the weights the
    optimizer updated in place, and a parameter's first gradient (kept by autograd as it is) is not overwritten
    by the next micro-step's replay."""
    xs = [torch.randn(2, 5, 16) for _ in range(6)]
    plain_outs, plain_params = run_steps(layer(), xs, None, accumulate)
    g = MLPGraphs(emulate=True)
    outs, params = run_steps(layer(), xs, g, accumulate)
    assert len(g.captured) == 1  # captured on the second call, replayed from then on
    assert next(iter(g.captured.values())).generation == len(xs) - 1
    for (y0, gx0), (y1, gx1) in zip(plain_outs, outs):
        torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for p0, p1 in zip(plain_params, params):
        torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-6)


def graphed_layer():
    mods = layer()
    fn, params = layers_as_function(mods[0], mods[1], "gelu", mods[2])
    params = list(params)
    g = MLPGraphs(emulate=True)

    def call(x):
        return g(fn, x, params)
    return g, mods, params, call


def test_two_forwards_before_their_backwards():
    """The second forward finds the graph's buffers waiting for the first backward: it runs the plain path, and
    both backwards give the plain path's gradients."""
    g, mods, params, call = graphed_layer()
    x0 = torch.randn(4, 16)
    call(x0.clone().requires_grad_()).sum().backward()  # plain (first sight), then capture + replay:
    call(x0.clone().requires_grad_()).sum().backward()
    assert len(g.captured) == 1
    xa, xb = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    ya, yb = call(xa), call(xb)
    (ya.square().sum() + 2 * yb.square().sum()).backward()
    ref = [x.detach().clone().requires_grad_() for x in (xa, xb)]
    f = [fused_mlp_layers(r, mods[0], mods[1], "gelu", mods[2]) for r in ref]
    (f[0].square().sum() + 2 * f[1].square().sum()).backward()
    torch.testing.assert_close(xa.grad, ref[0].grad)
    torch.testing.assert_close(xb.grad, ref[1].grad)


def test_a_backward_after_a_later_forward_raises():
    """retain_graph: a second backward after another forward replayed over its buffers is an error, never
    gradients of the wrong forward."""
    g, _, _, call = graphed_layer()
    for _ in range(2):
        call(torch.randn(4, 16, requires_grad=True)).sum().backward()
    y = call(torch.randn(4, 16, requires_grad=True))
    y.sum().backward(retain_graph=True)
    call(torch.randn(4, 16, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError, match="after a later forward"):
        y.sum().backward()


def test_a_second_backward_through_one_forward_raises():
    """retain_graph: the captured backward frees the forward's saved tensors as it goes, so it cannot run twice."""
    g, _, _, call = graphed_layer()
    for _ in range(2):
        call(torch.randn(4, 16, requires_grad=True)).sum().backward()
    y = call(torch.randn(4, 16, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        y.backward()


def test_input_gradients_are_not_overwritten_by_later_backwards():
    """torch.autograd.grad with respect to a non-leaf input: each result stays what it was."""
    g, mods, params, call = graphed_layer()
    results = []
    for _ in range(4):
        h = torch.randn(3, 16, requires_grad=True) * 1.0  # a non-leaf input
        results.append((h.detach(), torch.autograd.grad(call(h).square().sum(), h)[0]))
    assert len(g.captured) == 1
    for h, grad in results:
        h = h.clone().requires_grad_()
        ref = torch.autograd.grad(fused_mlp_layers(h, mods[0], mods[1], "gelu", mods[2]).square().sum(), h)[0]
        torch.testing.assert_close(grad, ref)


def test_a_parameter_changed_between_forward_and_backward_raises():
    g, mods, params, call = graphed_layer()
    for _ in range(2):
        call(torch.randn(4, 16, requires_grad=True)).sum().backward()
    y = call(torch.randn(4, 16, requires_grad=True)).sum()
    with torch.no_grad():
        mods[0].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.backward()


def test_inference_mode_runs_the_plain_path():
    g, *_, call = graphed_layer()
    with torch.inference_mode():
        for _ in range(3):
            call(torch.randn(2, 16))
    assert g.captured == {}
    with torch.no_grad():
        for _ in range(3):
            call(torch.randn(2, 16))
    assert len(g.captured) == 1


def test_nan_and_inf_rows_come_out_as_on_the_plain_path():
    """A replay runs the plain path's kernels: rows with NaN, +inf and -inf give the same output and gradients,
    non-finite where the plain path's are (that path is checked against the math in test_fused_ops.py)."""
    g, mods, params, call = graphed_layer()
    x = torch.randn(6, 16)
    x[1, 3], x[3, 0], x[4, 7] = float("nan"), float("inf"), float("-inf")
    runs = []
    for graphed in (False, True, True, True):  # plain, then the first sight, the capture and a replay
        h = x.clone().requires_grad_()
        y = call(h) if graphed else fused_mlp_layers(h, mods[0], mods[1], "gelu", mods[2])
        y.sum().backward()
        runs.append((y.detach(), h.grad, [p.grad.clone() for p in params]))
        for p in params:
            p.grad = None
    assert len(g.captured) == 1
    (y0, gx0, gp0), (y1, gx1, gp1) = runs[0], runs[-1]
    assert not y0.isfinite().all()
    torch.testing.assert_close(y1, y0, equal_nan=True)
    torch.testing.assert_close(gx1, gx0, equal_nan=True)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_outputs_are_not_overwritten_by_later_calls():
    """Under no_grad (evaluation, sampling) and with grad: y handed out stays what it was."""
    g, *_, call = graphed_layer()
    with torch.no_grad():
        xs = [torch.randn(3, 16) for _ in range(3)]
        ys = [call(x) for x in xs]
        keep = [y.clone() for y in ys]
        call(torch.randn(3, 16))
    assert len(g.captured) == 1
    for y, k in zip(ys, keep):
        torch.testing.assert_close(y, k, rtol=0, atol=0)
    y = call(torch.randn(3, 16, requires_grad=True))
    keep = y.detach().clone()
    y.sum().backward()
    call(torch.randn(3, 16, requires_grad=True)).sum().backward()
    torch.testing.assert_close(y.detach(), keep, rtol=0, atol=0)


def test_a_held_output_or_input_gradient_makes_the_next_call_run_the_plain_path():
    """y and a non-leaf x's gradient go out uncopied; while someone holds one, calls run the plain path (nothing
    handed out is overwritten), and once it is dropped the graph replays again."""
    g, mods, params, call = graphed_layer()
    for _ in range(2):
        call(torch.randn(4, 16, requires_grad=True) * 1.0).sum().backward()
    captured = next(iter(g.captured.values()))
    h = torch.randn(4, 16, requires_grad=True) * 1.0
    gx = torch.autograd.grad(call(h).sum(), h)[0]  # held
    keep, replays = gx.clone(), captured.generation
    call(torch.randn(4, 16, requires_grad=True) * 1.0).sum().backward()
    assert captured.generation == replays  # the plain path ran
    torch.testing.assert_close(gx, keep, rtol=0, atol=0)
    del gx
    call(torch.randn(4, 16, requires_grad=True) * 1.0).sum().backward()
    assert captured.generation == replays + 1
    with torch.no_grad():
        call(torch.randn(4, 16)), call(torch.randn(4, 16))
        evaluation = g.captured[next(k for k in g.captured if not k[3])]
        y = call(torch.randn(4, 16))
        keep = y.clone()
        call(torch.randn(4, 16))
        torch.testing.assert_close(y, keep, rtol=0, atol=0)
        assert y.data_ptr() == evaluation.y.data_ptr()  # handed out uncopied


def test_a_held_parameter_gradient_is_not_overwritten():
    """A parameter's gradient added into an existing .grad goes out uncopied; torch.autograd.grad's result for it
    (zero_grad(set_to_none=False) leaves a .grad) is held by the caller, so the next call runs the plain path."""
    g, mods, params, call = graphed_layer()
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        call(torch.randn(4, 16, requires_grad=True) * 1.0).sum().backward()
    held, keep = [], []
    for _ in range(4):  # (x without grad: a shape of its own, seen, captured, then replayed twice)
        held.append(torch.autograd.grad(call(torch.randn(4, 16) * 1.0).square().sum(), [params[0]])[0])
        keep.append(held[-1].clone())
    call(torch.randn(4, 16, requires_grad=True) * 1.0).sum().backward()
    for h, k in zip(held, keep):
        torch.testing.assert_close(h, k, rtol=0, atol=0)
    assert not torch.equal(held[0], held[1])


def test_a_failed_capture_puts_the_kept_state_back_before_the_plain_path_runs(monkeypatch):
    """keep: the capture's warm-up does not count as a step, even when the capture fails; the plain path's own
    update (the call's) does."""
    class State(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

    state = State()

    class Broken:
        def __init__(self, *args):
            state.steps += 100  # a warm-up run's update
            raise RuntimeError("no graphs here")
    monkeypatch.setattr(graphs, "_Captured", Broken)
    monkeypatch.setattr(graphs, "_failed", False)
    g = MLPGraphs(emulate=True, keep=state)

    def fn(x, w):
        state.steps += 1
        return x * w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            for _ in range(3):  # first sight, the failed capture then the plain path, the plain path
                g(fn, torch.ones(2), (torch.ones(2),))
    assert state.steps.item() == 3


def test_a_gpt_replays_every_step_with_nothing_held(monkeypatch):
    """In a whole GPT (emulated graphs on CPU), nothing keeps a layer's y or x gradient past its use, so every
    training step after the capture replays, and the losses equal the plain path's. (n_embd 16: the MLP's hidden
    64 is still two of the interpreter's 32-wide tiles.)"""
    import fused_ops
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, mlp="fused", dropout=0.0)
    monkeypatch.setattr(fused_ops.layers, "graphs_usable", lambda x: True)  # (the runners read it there)
    losses = []
    for emulated in (False, True):
        torch.manual_seed(0)
        gpt = GPT(cfg)
        for block in gpt.transformer.h:
            block.mlp.path.graphs = MLPGraphs(emulate=True) if emulated else None
        opt = torch.optim.SGD(gpt.parameters(), lr=0.1)
        run = []
        for step in range(4):  # first sight, the capture, then two replays
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            _, loss = gpt(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.item())
        losses.append(run)
    assert [next(iter(b.mlp.path.graphs.captured.values())).generation for b in gpt.transformer.h] == [3, 3]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_an_fp8_gpt_replays_and_trains_as_without_graphs(monkeypatch):
    """The FP8 MLP through the graphs (emulated on CPU, fp16 autocast), two micro-steps per optimizer step: the
    calibrating step runs plain, every later forward but the first sight replays one capture per layer; the weights'
    FP8 copies are remade once per optimizer step, in place (a real replay reads them where they lie: one capture
    serves every step), and the capture leaves the delayed scales as they were: the losses, the weights and the
    scales' history are those of the run without graphs, bit for bit. (n_embd 16: the MLP's hidden 64 is still two
    of the interpreter's 32-wide tiles.)"""
    import fused_ops
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, mlp="fused", fp8=True, dropout=0.0)
    monkeypatch.setattr(fused_ops.layers, "graphs_usable", lambda x: True)  # (fp8_graphs_usable asks it)
    cast, casts = fused_ops.fp8.state.quantize_weight_fused, []
    monkeypatch.setattr(fused_ops.fp8.state, "quantize_weight_fused", lambda w, out=None: casts.append(1) or cast(w, out))
    runs = []
    for emulated in (False, True):
        torch.manual_seed(0)
        gpt = GPT(cfg)
        for block in gpt.transformer.h:
            block.mlp.path.graphs = MLPGraphs(emulate=True, keep=block.mlp.fp8) if emulated else None
        opt = torch.optim.SGD(gpt.parameters(), lr=0.3)
        losses = []
        casts.clear()
        for step in range(3):
            for micro in range(2):
                x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2 * step + micro))
                with torch.autocast("cpu", dtype=torch.float16):
                    _, loss = gpt(x, x)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert len(casts) == 3 * 2 * cfg.n_layer  # each step's first forward: W1 and W2 of each layer
        runs.append((losses, [p.detach().clone() for p in gpt.parameters()],
                     [b.mlp.fp8.history.clone() for b in gpt.transformer.h], gpt))
    (plain, plain_params, plain_history, _), (graphed, params, history, gpt) = runs
    # 6 forwards: the calibrating one and the first sight run plain, the third captures, all 4 from it replay
    assert [len(b.mlp.path.graphs.captured) for b in gpt.transformer.h] == [1] * cfg.n_layer
    assert [next(iter(b.mlp.path.graphs.captured.values())).generation for b in gpt.transformer.h] == [4] * cfg.n_layer
    assert graphed == plain
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert all(torch.equal(a, b) for a, b in zip(history, plain_history))


def test_new_parameters_and_shapes_get_their_own_graphs(monkeypatch):
    """A parameter replaced (a new storage) is never read through an old graph, whose capture is dropped; past
    MAX_SHAPES the plain path runs."""
    monkeypatch.setattr(graphs, "MAX_SHAPES", 2)
    g, mods, params, call = graphed_layer()
    x = torch.randn(2, 16)
    with torch.no_grad():
        call(x), call(x)
        mods[0].weight.data = mods[0].weight.data * 2  # a new tensor: the captured key no longer matches
        params[0] = mods[0].weight
        y = call(x)
        ref = fused_mlp_layers(x, mods[0], mods[1], "gelu", mods[2])
        torch.testing.assert_close(y, ref)
        call(x)
        assert len(g.captured) == 1  # the old parameters' graphs are freed with them
        for rows in (3, 3, 5, 5):
            call(torch.randn(rows, 16))
        assert len(g.captured) == 2


def test_a_failed_capture_falls_back_with_one_warning(monkeypatch):
    class Broken:
        def __init__(self, *args):
            raise RuntimeError("no graphs here")
    monkeypatch.setattr(graphs, "_Captured", Broken)
    monkeypatch.setattr(graphs, "_failed", False)
    _, mods, _, call = graphed_layer()
    x = torch.randn(2, 16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ys = [call(x) for _ in range(3)]
    assert len([w for w in caught if "CUDA graph" in str(w.message)]) == 1
    assert graphs._failed
    torch.testing.assert_close(ys[-1], fused_mlp_layers(x, mods[0], mods[1], "gelu", mods[2]))


def test_a_deep_copy_of_the_model_recaptures():
    """A copy of a layer that has captured a graph starts with none (a graph cannot be copied: its buffers and
    memory pool are the original's), and captures its own on its second call."""
    g, mods, params, call = graphed_layer()
    x = torch.randn(4, 16)
    for _ in range(2):  # first sight, then the capture
        call(x.clone().requires_grad_()).sum().backward()
    assert len(g.captured) == 1 and g.seen
    copied = copy.deepcopy(g)
    assert copied.seen == set() and copied.captured == {}
    assert len(g.captured) == 1  # the original keeps its own
    fn, _ = layers_as_function(mods[0], mods[1], "gelu", mods[2])
    for _ in range(2):
        y = copied(fn, x.clone().requires_grad_(), params)
        y.sum().backward()
    (theirs,), (ours,) = copied.captured.values(), g.captured.values()
    assert theirs is not ours and theirs.x.data_ptr() != ours.x.data_ptr()
    torch.testing.assert_close(y, fused_mlp_layers(x, mods[0], mods[1], "gelu", mods[2]))


# --- on the GPU, real CUDA graphs ---

def fused_ops_fp8_supported():
    from fused_ops import fp8_supported
    return fp8_supported(torch.device("cuda"))

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphed_steps_equal_the_plain_path_on_the_gpu(dtype, autocast, accumulate):
    """The same kernels replayed: outputs, gradients and updated parameters equal the plain fused path's (to the
    dtype's rounding: a stale weight or an overwritten buffer would be far off)."""
    xs = [torch.randn(8, 128, 768, device="cuda") for _ in range(6)]
    results = []
    for graphed in (None, MLPGraphs()):
        mods = layer(768, 3072, "cuda", dtype)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            results.append(run_steps(mods, [x.to(dtype) for x in xs], graphed, accumulate, lr=1e-3))
    (plain_outs, plain_params), (outs, params) = results
    for (y0, gx0), (y1, gx1) in zip(plain_outs, outs):  # (cuBLAS may pick another algorithm inside a capture)
        assert y0.isfinite().all() and gx0.isfinite().all()
        torch.testing.assert_close(y1, y0)
        torch.testing.assert_close(gx1, gx0)
    for p0, p1 in zip(plain_params, params):
        torch.testing.assert_close(p1, p0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_whole_gpt_with_graphs_equals_without(monkeypatch, fp8):
    """A GPT trained three steps under bf16 autocast (dropout on: its random numbers stay outside the graphs), then
    evaluated: the same losses with the graphs as without (FUSED_OPS_GRAPHS=0), to bf16's rounding. FP8 too (its
    first step calibrates ungraphed, so its training shape is captured one step later)."""
    if fp8 and not fused_ops_fp8_supported():
        pytest.skip("needs FP8 tensor cores")
    cfg = GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_embd=256, mlp="fused", dropout=0.1,
                    fp8=fp8)
    losses = []
    for enabled in (False, True):
        monkeypatch.setattr(env, "GRAPHS", enabled)
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        run = []
        for step in range(4):
            torch.manual_seed(step)
            x = torch.randint(0, 512, (4, 256), device="cuda")
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.item())
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            run += [model(x, x)[1].item() for _ in range(3)]
        losses.append(run)
        captured = sum(len(b.mlp.path.graphs.captured) for b in model.transformer.h)
        assert captured == (2 * cfg.n_layer if enabled else 0)  # training and evaluation shapes, per layer
        if enabled:  # every training step after the first sight (and, FP8, the calibrating step) replayed
            train = [c for b in model.transformer.h for k, c in b.mlp.path.graphs.captured.items() if k[3]]
            assert [c.generation for c in train] == [3 - fp8] * cfg.n_layer
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
