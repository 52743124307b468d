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
