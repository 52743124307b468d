"""The fused MLP inside torch.compile: the kernels are custom ops, so a whole GPT compiles as one graph."""

import pytest
import torch

from model import GPT, GPTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_loss_and_gradients(fused, loss_c, eager, idx):
    """The compiled fused model's loss (its backward done) against the eager model's, and every gradient."""
    _, loss_e = eager(idx, idx)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for (name, p_c), p_e in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fuse_ln", [False, True])
def test_fused_gpt_compiles_fullgraph_and_matches_eager(fuse_ln):
    torch.manual_seed(0)
    cfg = dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, activation="swiglu")
    eager = GPT(GPTConfig(mlp="eager", **cfg)).to(DEVICE)
    fused = GPT(GPTConfig(mlp="fused", fuse_ln=fuse_ln, **cfg)).to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 50, (2, 16), device=DEVICE)
    # fullgraph=True turns any graph break into an error; aot_eager traces forward and backward graphs
    # through the ops' fake implementations without needing a C++/Triton code generator on CPU.
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    _, loss_c = compiled(idx, idx)
    loss_c.backward()
    assert_same_loss_and_gradients(fused, loss_c, eager, idx)


def test_inductor_compiles_the_fused_mlp_and_aot_autograd_can_cache_it():
    """With Inductor (the default backend) the fused MLP is one operator with its own backward: the same loss and
    gradients as eager, and a graph AOTAutograd's on-disk cache accepts (it bypasses any graph that holds an
    autograd.Function, which made every run trace the fused model again: issue 28)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = dict(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, activation="gelu")
    eager = GPT(GPTConfig(mlp="eager", **cfg)).to(DEVICE)
    fused = GPT(GPTConfig(mlp="fused", **cfg)).to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 50, (2, 16), device=DEVICE)
    _, loss_c = torch.compile(fused)(idx, idx)
    loss_c.backward()
    assert_same_loss_and_gradients(fused, loss_c, eager, idx)
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
    assert counters["aot_autograd"]["autograd_cache_saved"] + counters["aot_autograd"]["autograd_cache_hit"] >= 1


AUTOGRAD_FUNCTION_SETTINGS = [dict(mlp="fused", classifier="fused"),
                              dict(mlp="fused", fp8=True, fp8_reach="blocks", classifier="fp8")]


@pytest.mark.parametrize("config", AUTOGRAD_FUNCTION_SETTINGS)
def test_train_py_compile_caches_graphs_with_autograd_functions(config, tmp_path, monkeypatch):
    """The fused classifier and the FP8 layers are autograd.Functions, which AOTAutograd's disk cache bypasses by
    default; compiled as train.py compiles (runtime.wrap_model) their graph is saved, and a second compile of the same
    model (a warm run) loads it: the same loss and gradients (to the CPU BLAS's rounding). (FP8: each new model
    numbers its layers anew, so only the bf16 setting's second compile can be the same graph within one process.)"""
    from torch._dynamo.utils import counters
    from helpers import runtime
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    import torch._functorch.config as functorch_config
    monkeypatch.setattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", False)
    # Inductor's C++ kernels in plain scalar code: each kernel is a g++ run, and the vectorized code's headers made
    # them about a third slower to build, cold, for every test run. What is checked here (the graph AOTAutograd
    # saves and loads, and that it computes the same) does not depend on how Inductor writes the kernels.
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", False)
    results = []
    for attempt in range(2 if "fp8" not in config else 1):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0, **config))
        idx = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = runtime.wrap_model(gpt, True, 1, "cpu")(idx, idx)[1]
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in gpt.parameters()]))
        cache = dict(counters["aot_autograd"])
        assert cache.get("autograd_cache_bypass", 0) == 0, cache
        assert cache.get("autograd_cache_saved" if attempt == 0 else "autograd_cache_hit", 0) == 1, cache
    if len(results) == 2:  # the same graph: equal up to the CPU BLAS's rounding, which varies with the buffers'
        # alignment (MKL's results are reproducible only at fixed alignment: one full-suite run of three differed)
        assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
        for a, b in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_changed_autograd_function_misses_the_cache(tmp_path, monkeypatch):
    """What makes the switch safe: an autograd.Function whose backward changed is traced into a different graph, so
    the cache misses instead of replaying the old backward."""
    from torch._dynamo.utils import counters
    import torch._functorch.config as functorch_config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", True)

    def function(k):
        class F(torch.autograd.Function):
            forward = staticmethod(lambda ctx, x: x.sin())
            backward = staticmethod(lambda ctx, g: g * k)
        return F
    seen = []
    for k in (2.0, 2.0, 3.0):
        torch._dynamo.reset()
        counters.clear()
        x = torch.ones(4, requires_grad=True)
        F = function(k)
        torch.compile(lambda x: F.apply(x).sum())(x).backward()
        seen.append((x.grad[0].item(), counters["aot_autograd"]["autograd_cache_hit"]))
    assert seen == [(2.0, 0), (2.0, 1), (3.0, 0)]


@pytest.mark.parametrize("config", [dict(), dict(mlp="fused", fp8=True, fp8_reach="blocks", classifier="fp8")])
def test_compile_regions_compiles_one_block_for_all(config, monkeypatch):
    """compile_regions (train.py's compile_regions=True): each block compiled apart, and the blocks share one
    compiled graph, so the cold start compiles one block, not n_layer. FP8: the layers' operators carry their state's
    number, an int attribute that differs between blocks; left static it would compile every block anew, and made
    dynamic only once it changed, twice (the first block's graph, then one the rest share): one graph it is. The loss
    and gradients are the whole model's compiled as one graph. (aot_eager stands in for Inductor: the question is
    what Dynamo traces.)"""
    from torch._dynamo.utils import counters
    from helpers import runtime
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: compile_(fn, backend="aot_eager"))
    import torch._dynamo.config as dynamo_config
    monkeypatch.setattr(dynamo_config, "allow_unspec_int_on_nn_module", False)  # (compile_regions sets these)
    monkeypatch.setattr(torch.compiler.config, "dynamic_sources", "")
    torch.manual_seed(0)
    # (small: the FP8 kernels run through Triton's interpreter, program by program, for each of 2 x 3 blocks)
    cfg = dict(block_size=8, vocab_size=64, n_layer=3, n_head=2, n_embd=16, dropout=0.0, **config)
    whole, regional = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg))
    regional.load_state_dict(whole.state_dict())
    idx = torch.randint(0, 64, (2, 8))
    losses = []
    for model, regions in ((whole, False), (regional, True)):
        torch._dynamo.reset()
        counters.clear()
        compiled = runtime.wrap_model(model, True, 1, "cpu", regions=regions)
        assert (compiled is model) == regions  # regions: compiled in place
        with torch.autocast("cpu", dtype=torch.float16):
            loss = compiled(idx, idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert counters["stats"]["unique_graphs"] == 1 + 1, dict(counters["stats"])  # a block's + GPT.output's
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(whole.named_parameters(), regional.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
