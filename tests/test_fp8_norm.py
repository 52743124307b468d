"""fused_ops/fp8/norm.py: the residual add, the LayerNorm and the FP8 casts of its output in one pass, its backward
in PyTorch ops, and the FP8 MLP operator that runs them in a GPT compiled whole (model.Block's ln_2)."""

import functools

import pytest
import torch
import torch.nn.functional as F

import model
from fused_ops import env
from fused_ops.fp8 import E4M3, FP8State, X
from fused_ops.fp8 import kernels as fp8_kernels
from fused_ops.fp8.norm import add_layer_norm_fp8, layer_norm_grads
from numerics import assert_no_worse_than_eager, rel_err
from test_fp8 import needs_fp8_gpu


def inputs(M, C, device, x_dtype=torch.float32, d_dtype=torch.float16, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(M, C, device=device, generator=g).to(x_dtype) * 2 + 0.5  # (a mean away from 0)
    d = torch.randn(M, C, device=device, generator=g).to(d_dtype)
    w = torch.randn(C, device=device, generator=g) * 0.5 + 1
    b = torch.randn(C, device=device, generator=g) * 0.1
    return x, d, w, b


def calibrated(device, scale):
    state = FP8State().to(device)
    state.scale[X] = scale
    state.calibrated = True
    return state


def unfused(x, d, w, b, dtype, scale, state):
    """The path the fused pass replaces: PyTorch's add and LayerNorm, the output in dtype, then cast_transpose."""
    s = (x + d).to(x.dtype)
    y = F.layer_norm(s, (x.shape[1],), w, b, 1e-5).to(dtype)
    q, qt = fp8_kernels.cast_transpose(y, state, X, row_major=True)
    return s, q, qt


@pytest.mark.parametrize("M, C, dtype", [(37, 48, torch.float16), (64, 96, torch.float16), (16, 200, torch.float16)])
def test_the_pass_is_no_worse_than_pytorch_then_the_cast(M, C, dtype):
    """Against float64: s exact (an fp32 add), y8 dequantized no worse than PyTorch's LayerNorm in dtype cast by the
    separate pass (the 2x rule), the transposed copy the row-major one with zero padding, mean and rstd to fp32's
    rounding, y's amax folded into the slot. Odd rows, a width that is not a power of two, one of no 16."""
    x, d, w, b = inputs(M, C, "cpu")
    scale = 448.0 / 8.0
    state, other = calibrated("cpu", scale), calibrated("cpu", scale)
    s, q, qt, mean, rstd = add_layer_norm_fp8(x, d, w, b, 1e-5, state, dtype)
    s64 = x.double() + d.double()
    y64 = F.layer_norm(s64, (C,), w.double(), b.double(), 1e-5)
    assert torch.equal(s, (x + d.float()))
    _, q_ref, _ = unfused(x, d, w, b, dtype, scale, other)
    assert_no_worse_than_eager(q.double() / scale, q_ref.double() / scale, y64, "y8")
    Mp = qt.shape[1]
    assert qt.shape == (C, -(-M // 16) * 16) and q.dtype == qt.dtype == E4M3
    assert torch.equal(qt[:, :M].view(torch.uint8), q.t().view(torch.uint8))
    assert not qt[:, M:Mp].view(torch.uint8).any()
    assert torch.allclose(mean.squeeze(1).double(), s64.mean(1), rtol=0, atol=1e-5)
    assert torch.allclose(rstd.squeeze(1).double(), (s64.var(1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-5)
    y = (((s64 - s64.mean(1, keepdim=True)) * rstd.double()) * w.double() + b.double()).to(dtype)
    assert state.amax[X].item() == pytest.approx(y.abs().max().item(), rel=2e-3)


def test_without_delta_or_affine_parameters():
    """No delta (s is x: none returned), no weight nor bias (LayerNorm(elementwise_affine=False))."""
    x, _, _, _ = inputs(20, 32, "cpu")
    state = calibrated("cpu", 448.0 / 4)
    s, q, _, _, _ = add_layer_norm_fp8(x, None, None, None, 1e-5, state, torch.float16)
    y64 = F.layer_norm(x.double(), (32,))
    assert s is None
    y_ref = F.layer_norm(x, (32,)).half()
    assert_no_worse_than_eager(q.double() / (448.0 / 4), fp8_kernels.cast_transpose(
        y_ref, calibrated("cpu", 448.0 / 4), X, row_major=True)[0].double() / (448.0 / 4), y64, "y8")


def test_the_calibrating_call_sets_the_scale_from_y():
    """An uncalibrated state: the kernel runs once to measure y's amax, which sets X's scale (448 / amax), then
    quantizes with it: y8's largest magnitude is 448."""
    x, d, w, b = inputs(24, 32, "cpu")
    state = FP8State()
    _, q, _, _, _ = add_layer_norm_fp8(x, d, w, b, 1e-5, state, torch.float16)
    assert q.float().abs().max().item() == 448.0
    assert state.inv_scale[X, 0].item() == pytest.approx(1 / state.scale[X].item())


def test_special_values_make_their_row_nan():
    """NaN or inf in a row (of x or delta) makes that row's mean or variance NaN, so its y8 is NaN; the other rows are
    finite; a NaN amax is left out of the slot's (atomic max of NaN: the slot stays finite)."""
    x, d, w, b = inputs(16, 32, "cpu")
    x[3, 5], x[7, 0], d[11, 31] = float("nan"), float("inf"), float("-inf")
    state = calibrated("cpu", 10.0)
    s, q, qt, _, _ = add_layer_norm_fp8(x, d, w, b, 1e-5, state, torch.float16)
    bad = torch.zeros(16, dtype=torch.bool)
    bad[[3, 7, 11]] = True
    assert q.float()[bad].isnan().all() and q.float()[~bad].isfinite().all()
    assert torch.equal(qt[:, :16].view(torch.uint8), q.t().view(torch.uint8))
    assert s[3, 5].isnan() and s[7, 0] == float("inf") and s[11, 31] == float("-inf")


def test_the_backward_is_layer_norms():
    """layer_norm_grads (fp32 math) against autograd through F.layer_norm in float64, with s's own gradient added."""
    torch.manual_seed(0)
    x, _, w, b = inputs(12, 40, "cpu")
    s = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    grad_y, grad_s = torch.randn(12, 40, dtype=torch.float64), torch.randn(12, 40, dtype=torch.float64)
    F.layer_norm(s, (40,), w64, b64, 1e-5).backward(grad_y)
    mean = s.detach().mean(1, keepdim=True)
    rstd = (s.detach().var(1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    gx, gw, gb = layer_norm_grads(grad_y, s.detach(), mean, rstd, w64, b64, grad_s)
    close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-5)
    assert close(gx, s.grad + grad_s) and close(gw, w64.grad) and close(gb, b64.grad)
    assert layer_norm_grads(grad_y, s.detach(), mean, rstd, w64, None, needs=(False, True))[1:] == (None, None)


def gpt_grads(compiled, mode, bias, n_layer=2):
    """A 2-layer FP8 GPT (blocks' reach), one step on a batch: its loss and gradients, compiled whole
    (aot_eager, fullgraph) or not; mode "autocast" (fp16 autocast, fp32 weights) or "fp16" (a 16-bit model); and the
    operators the compiled forward ran."""
    torch.manual_seed(0)
    config = model.GPTConfig(block_size=16, vocab_size=64, n_layer=n_layer, n_head=2, n_embd=32, mlp="fused",
                             fp8=True, fp8_reach="blocks", dropout=0.0, bias=bias)
    gpt = model.GPT(config)
    if mode == "fp16":
        gpt.half()
    seen = []

    def backend(gm, example):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(gm, example)
    torch._dynamo.reset()
    run = torch.compile(gpt, backend=backend, fullgraph=True) if compiled else gpt
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16, enabled=mode == "autocast"):
        loss = run(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in gpt.named_parameters()}, seen


def reference_grads(bias):
    """The same GPT's loss and gradients in float64, eager MLP and attention."""
    torch.manual_seed(0)
    config = model.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, mlp="fused", fp8=True,
                             fp8_reach="blocks", dropout=0.0, bias=bias)
    state = model.GPT(config).state_dict()
    ref = model.GPT(model.GPTConfig(**{**config.__dict__, "mlp": "eager", "fp8": False, "fp8_reach": "mlp"}))
    ref.load_state_dict(state)
    ref.double()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = ref(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("mode, bias", [("autocast", False), ("fp16", True)])
def test_a_gpt_compiled_whole_runs_ln_2_in_the_mlps_pass_and_learns_as_uncompiled(mode, bias):
    """Compiled whole, each block's ln_2 runs inside the FP8 MLP's operator (no separate LayerNorm for it: one a block
    is left, ln_1, and ln_f's), and the loss and every gradient are within the 2x rule of the uncompiled model's
    errors against float64 (what the uncompiled FP8 GPT computes is the same-dtype path here)."""
    loss, grads, seen = gpt_grads(True, mode, bias)
    plain_loss, plain_grads, _ = gpt_grads(False, mode, bias)
    ref_loss, ref_grads = reference_grads(bias)
    assert seen.count("fused_mlp.fp8_norm_mlp_forward.default") == 2
    assert sum("layer_norm" in op for op in seen) == 3
    assert_no_worse_than_eager(loss.double(), plain_loss.double(), ref_loss, "loss", torch.float16)
    for name, ref in ref_grads.items():
        if name.endswith("wpe.weight") or ref.abs().max() == 0:
            continue
        e, e_plain = rel_err(grads[name], ref), rel_err(plain_grads[name], ref)
        assert e <= 2 * e_plain + 1e-3, f"{name}: {e:.3e} against uncompiled {e_plain:.3e}"


def test_the_switch_leaves_ln_2_apart(monkeypatch):
    """FUSED_OPS_NORM_CAST=0: ln_2 is a LayerNorm of its own again, the MLP the plain operator."""
    monkeypatch.setattr(env, "NORM_CAST", False)
    _, _, seen = gpt_grads(True, "autocast", False)
    assert "fused_mlp.fp8_norm_mlp_forward.default" not in seen
    assert seen.count("fused_mlp.fp8_mlp_forward.default") == 2


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("M, C", [(12288, 768), (1000, 1536)])
def test_the_pass_on_the_gpu(M, C):
    """GPT-2 small's rows (fp32 residual, bf16 delta, bf16 y) and an odd 1000 x 1536: y8 no worse than PyTorch then
    the separate cast (the 2x rule against float64), the transposed copy exactly the row-major one (transposed
    copies stored from fp32 tiles came out wrong on Hopper with Triton 3.6), s exact."""
    x, d, w, b = inputs(M, C, "cuda", d_dtype=torch.bfloat16)
    scale = 448.0 / 8.0
    state, other = calibrated("cuda", scale), calibrated("cuda", scale)
    s, q, qt, _, _ = add_layer_norm_fp8(x, d, w, b, 1e-5, state, torch.bfloat16)
    _, q_ref, _ = unfused(x, d, w, b, torch.bfloat16, scale, other)
    y64 = F.layer_norm(x.double() + d.double(), (C,), w.double(), b.double(), 1e-5)
    assert torch.equal(s, x + d.float())
    assert_no_worse_than_eager(q.double() / scale, q_ref.double() / scale, y64, "y8")
    assert torch.equal(qt[:, :M].view(torch.uint8), q.t().view(torch.uint8))
    assert not qt[:, M:].view(torch.uint8).any()
