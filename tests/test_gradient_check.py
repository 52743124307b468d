"""The check this project is known for: the same tiny GPT and batch through mlp="eager" and mlp="fused"
give the same loss and the same gradient for every parameter, for every activation.

On CPU the fused kernels run through Triton's interpreter in fp32. Each comparison uses a float64 copy
of the eager model as the reference: the fused error must be at most ~2x the fp32 eager error.
"""

import copy

import pytest
import torch

from model import GATED_ACTIVATIONS, GPT, GPTConfig, PLAIN_ACTIVATIONS
from numerics import assert_no_worse_than_eager, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loss_and_grads(model, idx, targets, autocast_dtype=None):
    """The loss and every parameter's gradient; with autocast_dtype the forward runs under autocast, the
    backward outside it, as train.py does."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def tiny_models(activation, fuse_ln):
    """(eager GPT, fused GPT with the same weights, a float64 copy of the eager one, a batch, its targets)."""
    torch.manual_seed(0)
    cfg = dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True,
               activation=activation)
    eager = GPT(GPTConfig(mlp="eager", **cfg)).to(DEVICE)
    fused = GPT(GPTConfig(mlp="fused", fuse_ln=fuse_ln, **cfg)).to(DEVICE)
    fused.load_state_dict(eager.state_dict())  # same names and shapes: a checkpoint moves across
    reference = copy.deepcopy(eager).double()
    idx = torch.randint(0, 50, (3, 16), device=DEVICE)
    targets = torch.randint(0, 50, (3, 16), device=DEVICE)
    return eager, fused, reference, idx, targets


@pytest.mark.parametrize("fuse_ln", [False, True], ids=["mlp", "ln+mlp"])
@pytest.mark.parametrize("activation", list(PLAIN_ACTIVATIONS) + list(GATED_ACTIVATIONS))
def test_fused_model_matches_eager(activation, fuse_ln):
    """fuse_ln=True also folds each block's second LayerNorm into the fused MLP."""
    check_fused_model_matches_eager(activation, fuse_ln)


@pytest.mark.parametrize("activation", ["gelu", "relu2", "swiglu", "sigmoid_tanh"])
def test_fused_model_matches_eager_tma_main_loop(activation, monkeypatch):
    """The same check with the kernels reading their operands through TMA descriptors (the H100 path)."""
    import fused_ops.matmul

    if fused_ops.matmul.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs a Hopper GPU")
    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "1")
    assert fused_ops.matmul.tma_available(torch.device(DEVICE))
    check_fused_model_matches_eager(activation, fuse_ln=False)


def check_fused_model_matches_eager(activation, fuse_ln):
    eager, fused, reference, idx, targets = tiny_models(activation, fuse_ln)
    loss_f, grads_f = loss_and_grads(fused, idx, targets)
    loss_e, grads_e = loss_and_grads(eager, idx, targets)
    loss_r, grads_r = loss_and_grads(reference, idx, targets)

    assert torch.isfinite(loss_f)
    assert abs(loss_f.item() - loss_e.item()) < 1e-5
    assert_no_worse_than_eager(loss_f, loss_e, loss_r, "loss")
    assert grads_f.keys() == grads_e.keys()
    for name in grads_e:
        assert_no_worse_than_eager(grads_f[name], grads_e[name], grads_r[name], f"{activation} grad {name}")
        assert rel_err(grads_f[name], grads_e[name]) < 1e-4, name


@pytest.mark.parametrize("fuse_ln", [False, True], ids=["mlp", "ln+mlp"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_model_matches_eager_under_fp16_autocast(activation, fuse_ln):
    """fp32 weights under fp16 autocast, as in mixed-precision training: the fused MLP casts what it is given
    as nn.Linear would, and the folded LayerNorm keeps its parameters and its W β in fp32.
    (bf16 autocast is tested on the GPU: bf16 dot is wrong in the interpreter.)"""
    eager, fused, reference, idx, targets = tiny_models(activation, fuse_ln)
    loss_f, grads_f = loss_and_grads(fused, idx, targets, torch.float16)
    loss_e, grads_e = loss_and_grads(eager, idx, targets, torch.float16)
    loss_r, grads_r = loss_and_grads(reference, idx, targets)
    assert torch.isfinite(loss_f) and loss_f.dtype == loss_e.dtype
    assert_no_worse_than_eager(loss_f, loss_e, loss_r, "loss", compute_dtype=torch.float16)
    for name in grads_e:
        assert grads_f[name].dtype == grads_e[name].dtype == torch.float32, name
        assert_no_worse_than_eager(grads_f[name], grads_e[name], grads_r[name], f"{activation} grad {name}",
                                   compute_dtype=torch.float16)
