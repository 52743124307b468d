"""The GPT model: shapes, initial loss, parameter layout across MLP paths, KV-cache generation, config errors,
what it imports."""

import math
import os
import subprocess
import sys

import pytest
import torch

import fused_ops
from model import GPT, MLP, GPTConfig, gpu_peak_flops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU the kernels run in the interpreter
TINY = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def test_shapes_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 65, (4, 16))
    targets = torch.randint(0, 65, (4, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 16, 65)
    assert abs(loss.item() - math.log(65)) < 0.1  # small init: predictions start near uniform
    logits, loss = model(idx)
    assert logits.shape == (4, 1, 65) and loss is None


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_parameters_identical_across_mlp_paths(activation):
    shapes = {}
    for mlp in ("eager", "fused", "auto"):
        model = GPT(GPTConfig(mlp=mlp, activation=activation, **TINY))
        shapes[mlp] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["eager"] == shapes["fused"] == shapes["auto"]
    assert GPT(GPTConfig(mlp="fused", **TINY)).transformer.h[0].mlp.kind == "fused"


def test_gated_hidden_size_keeps_parameter_count_close():
    plain = GPT(GPTConfig(n_layer=1, n_head=12, n_embd=768, block_size=64, activation="gelu")).get_num_params()
    gated = GPT(GPTConfig(n_layer=1, n_head=12, n_embd=768, block_size=64, activation="swiglu")).get_num_params()
    assert GPTConfig(n_embd=768, activation="swiglu").mlp_hidden == 2048
    assert abs(gated - plain) / plain < 0.01


def test_auto_falls_back_to_eager_where_kernels_cannot_run(monkeypatch):
    monkeypatch.setattr(fused_ops.env, "INTERPRET", False)  # as on a CPU machine without the interpreter
    torch.manual_seed(0)
    eager = GPT(GPTConfig(mlp="eager", **TINY))
    auto = GPT(GPTConfig(mlp="auto", **TINY))
    auto.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 65, (2, 16))
    assert torch.equal(eager(idx, idx)[1], auto(idx, idx)[1])


@pytest.mark.parametrize("top_k", [1, 10])
def test_kv_cache_generates_the_same_tokens(top_k):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    prompt = torch.randint(0, 65, (2, 5))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(model.generate(prompt, 30, temperature=0.8, top_k=top_k, use_kv_cache=use_cache))
    assert outs[0].shape == (2, 35)  # runs past block_size (16): the cache is refilled from the cropped context
    assert torch.equal(outs[0], outs[1])


def test_kv_cache_logits_match_full_forward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    from model import KVCache

    idx = torch.randint(0, 65, (2, 12))
    caches = [KVCache(16) for _ in range(2)]
    model(idx[:, :7], kv_caches=caches)
    step, _ = model(idx[:, 7:], kv_caches=caches)  # 5 new tokens at once: offset causal mask
    full, _ = model(idx)
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value", [("mlp", "triton"), ("activation", "swish")])
def test_bad_config_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        GPTConfig(**{key: value})
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=30, n_head=4)


def test_configure_optimizers_decays_only_matrices():
    model = GPT(GPTConfig(**TINY))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == n_params


def test_gpu_peak_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("NVIDIA L4") == 121e12
    assert gpu_peak_flops("Some Future GPU") is None
    if not torch.cuda.is_available():
        assert GPT(GPTConfig(**TINY)).estimate_mfu(1, 0.1) is None


@pytest.mark.parametrize("key,value", [("n_head", 0), ("block_size", 0), ("dropout", 1.5), ("n_layer", -1)])
def test_bad_sizes_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        GPTConfig(**{key: value})


@pytest.mark.parametrize("mlp,runs_kernels", [("eager", False), ("fused", True), ("auto", True)])
def test_the_switch_picks_the_path(mlp, runs_kernels, monkeypatch):
    """model.MLP is the one switch: mlp="fused" (and "auto" where the kernels can run: here through the
    interpreter, or on CUDA) goes through the fused kernels' autograd Function, "eager" never does."""
    calls = []
    apply = fused_ops.FusedMLPFunction.apply
    monkeypatch.setattr(fused_ops.FusedMLPFunction, "apply", lambda *a: (calls.append(1), apply(*a))[1])
    model = GPT(GPTConfig(mlp=mlp, **TINY)).to(DEVICE)
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    model(idx, idx)[1].backward()
    assert len(calls) == (TINY["n_layer"] if runs_kernels else 0)


@pytest.mark.parametrize("module,never", [("fused_ops", ["model"]),
                                          ("model", ["helpers", "safetensors", "huggingface_hub", "transformers"]),
                                          ("helpers.hf_gpt2", ["model"])])
def test_dependencies_point_one_way(module, never):
    """model.py imports fused_ops, never the reverse; it loads helpers/hf_gpt2.py (and the Hugging Face libraries)
    only inside from_pretrained and save_pretrained, and hf_gpt2.py never imports model.py (it is handed the
    classes)."""
    code = f"import sys, {module}; imported = set({never!r}) & set(sys.modules); assert not imported, imported"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_one_token_of_shape_c_works_fused_as_eager(activation):
    """A 1-D input (C,) goes through the fused MLP as through nn.Linear: same output shape and values, and
    the same gradients for the input and every parameter."""
    torch.manual_seed(0)
    cfg = dict(n_embd=32, n_head=2, activation=activation, bias=True)
    eager, fused = MLP(GPTConfig(mlp="eager", **cfg)).to(DEVICE), MLP(GPTConfig(mlp="fused", **cfg)).to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(32, device=DEVICE)
    outs = []
    for m in (eager, fused):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(torch.arange(32.0, device=DEVICE) / 32)
        outs.append((y, xi.grad, *(p.grad for p in m.parameters())))
    assert outs[1][0].shape == (32,) and outs[1][1].shape == (32,)
    for e, f in zip(*outs):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-5)


def test_a_dropped_model_is_freed_at_once():
    """The MLP's path is a runner that holds no reference back to its module: no reference cycle keeps a dropped
    model's weights (on a GPU: its memory) alive until the next garbage collection."""
    import gc
    import weakref
    for mlp in ("eager", "auto", "fused"):
        gc.disable()
        try:
            gpt = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, mlp=mlp))
            weight = weakref.ref(gpt.transformer.h[0].mlp.c_fc.weight)
            del gpt
            assert weight() is None, mlp
        finally:
            gc.enable()

