"""The fused classifier's loss itself (fused_ops/classifier.py, fused_ops/fp8/classifier.py), not only its gradients:
float32 whatever the inputs' dtype (16-bit tensors, fp16 autocast, with grad or without, compiled), as eager fp32
cross-entropy's, Liger's and Cut Cross-Entropy's, never rounded to the inputs' 16 bits (bf16 tensors at GPT-2's head
gave 10.875 for a float64 10.8638: 1e-3). Its own error against a float64 reference: on the CPU with fp16 tensors
whose logits (and FP8 quantization) are exact, so that what is left is the loss's own arithmetic; on the GPU with
bf16 at GPT-2's width and vocabulary, random inputs, against the same-dtype eager fp32 loss. Out-of-range targets:
what the docstring says (a NaN loss, finite gradients)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fused_ops.classifier import linear_cross_entropy
from fused_ops.fp8 import fp8_linear_cross_entropy
from tests.numerics import EPS, rel_err
from tests.test_classifier import data
from tests.test_fp8_classifier import dequantized, recipe

OPS = {"fused": linear_cross_entropy, "fp8": fp8_linear_cross_entropy}
needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs FP8 tensor cores")


def exact_data(M, C=16, V=64, seed=0):
    """float64 x, W, targets whose products are exact in fp16 and, quantized to e4m3 with current scaling, in FP8:
    x in quarters up to 3.5 (amax 3.5: the scale is 448 / 3.5 = 128), W in eighths up to 7/8 (scale 512), so every
    logit is a multiple of 1/32 below 16 · 3.5 · 7/8 = 49 in size, which fp16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-14, 15, (M, C), generator=g).double() / 4
    w = torch.randint(-7, 8, (V, C), generator=g).double() / 8
    x[0, 0], w[0, 0] = 3.5, 7 / 8
    t = torch.randint(0, V, (M,), generator=g)
    t[::7] = -1
    return x, w, t


def run(fn, x, w, t, dtype, autocast, grad=True):
    """(loss, dx, dW, x and W as the operator got them): fp32 leaves under autocast in dtype, else dtype leaves."""
    x, w = (x.float(), w.float()) if autocast else (x.to(dtype), w.to(dtype))
    x, w = x.detach().clone().requires_grad_(grad), w.detach().clone().requires_grad_(grad)
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        loss = fn(x, w, t)
    if grad:
        loss.backward()
    return loss.detach(), x.grad, w.grad, x.detach(), w.detach()


def reference(kind, xs, ws, t, dtype):
    """(the float64 loss, the eager loss in fp32 as autocast gives it: logits in dtype, fp32 cross-entropy)
    of the values the operator computes with: as given, or for FP8 quantized (the recipe, tests/test_fp8_classifier)."""
    if kind == "fp8":
        ref = recipe(xs, ws, t)[0]
        xs, ws = (dequantized(v).to(xs.dtype) for v in (xs, ws))
    else:
        ref = F.cross_entropy(xs.double() @ ws.double().t(), t, ignore_index=-1)
    eager = F.cross_entropy(F.linear(xs.to(dtype), ws.to(dtype)).float(), t, ignore_index=-1)
    return ref, eager


def check_loss(kind, x, w, t, dtype, autocast, grad=True):
    """The loss is float32 (float64 for float64), and its error against float64 is at most twice the eager fp32
    loss's from the same 16-bit logits, plus float32's epsilon; the gradients keep the leaves' dtypes."""
    loss, dx, dw, xs, ws = run(OPS[kind], x, w, t, dtype, autocast, grad)
    assert loss.dtype == torch.float32, (kind, dtype, autocast, grad, loss.dtype)
    if grad:
        assert dx.dtype == xs.dtype and dw.dtype == ws.dtype
    ref, eager = reference(kind if grad else "fused", xs, ws, t, dtype)  # (without grad the FP8 form runs the 16-bit one)
    bound = 2 * rel_err(eager, ref) + EPS[torch.float32]
    assert rel_err(loss, ref) <= bound, (kind, dtype, autocast, grad, loss.item(), ref.item(), rel_err(loss, ref),
                                         bound)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no grad"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float16, False), (torch.float16, True), (torch.float32, False)],
                         ids=["fp16 tensors", "fp16 autocast", "fp32"])
def test_the_loss_is_float32_within_float32s_error(kind, grad, dtype, autocast):
    x, w, t = exact_data(45)
    if kind == "fp8":  # the premise: FP8 quantization keeps these values (so the logits are exact in fp16 too)
        assert torch.equal(dequantized(x.to(dtype)), x) and torch.equal(dequantized(w.to(dtype)), w)
    check_loss(kind, x, w, t, dtype, autocast, grad)


def test_float64_stays_float64():
    x, w, t = exact_data(9)
    loss = run(linear_cross_entropy, x, w, t, torch.float64, False)[0]
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(F.cross_entropy(x @ w.t(), t, ignore_index=-1).item(), rel=1e-13)


@pytest.mark.parametrize("kind", OPS)
def test_compiled_the_loss_is_float32_too(kind):
    """torch.compile (aot_eager, fullgraph) traces the operator's fake, whose loss is float32: the same loss, bit for
    bit, as the uncompiled call with fp16 tensors."""
    x, w, t = exact_data(12)
    torch._dynamo.reset()
    compiled = torch.compile(OPS[kind], backend="aot_eager", fullgraph=True)
    plain, ours = (run(fn, x, w, t, torch.float16, False)[0] for fn in (OPS[kind], compiled))
    assert ours.dtype == plain.dtype == torch.float32 and torch.equal(ours, plain)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("bad", [64, 1000, -2, -100])
def test_an_out_of_range_target_gives_a_nan_loss_and_finite_gradients(kind, bad):
    """As the operators' docstring says: a target outside [0, V) that is not ignore_index raises nothing (F.cross_
    entropy raises) and makes the mean loss NaN, with grad or without; the gradients stay finite (the row's is its
    softmax / n, with no one-hot term)."""
    x, w, t = exact_data(12)
    t[3] = bad
    loss, dx, dw, *_ = run(OPS[kind], x, w, t, torch.float32, False)
    assert math.isnan(loss.item()) and dx.isfinite().all() and dw.isfinite().all()
    with torch.no_grad():
        assert math.isnan(OPS[kind](x.float(), w.float(), t).item())
    with pytest.raises(IndexError):
        F.cross_entropy(x @ w.t(), t, ignore_index=-1)
    # the row's gradient: softmax / n, n counting it (every target that is not ignore_index)
    x32, w32 = x.float(), w.float()
    n = (t != -1).sum()
    want = torch.softmax(x32[3:4] @ w32.t(), -1) @ w32 / n
    if kind == "fused":
        assert torch.allclose(dx[3:4], want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fused", pytest.param("fp8", marks=needs_fp8_gpu)])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 tensors", "bf16 autocast"])
def test_bf16_loss_at_gpt2s_head_on_the_gpu(kind, autocast):
    """GPT-2's width and vocabulary, random inputs (the report's case: 10.875 for a float64 10.8638)."""
    x, w, t = data(1024, 768, 50304, device="cuda")
    check_loss(kind, x, w, t, torch.bfloat16, autocast)


@pytest.mark.parametrize("kind", OPS)
def test_the_gpt_and_its_loss_scaling_with_an_fp32_loss(kind):
    """model.GPT with the fused classifier: under fp16 autocast (train.py's way) the loss is fp32, GradScaler scales
    it and steps; with fp16 weights and no autocast it is fp32 too, and the weights' gradients are fp16."""
    from tests.test_fp8_classifier import gpt
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model = gpt(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(idx, idx.roll(-1, 1))[1]
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    model = gpt(kind).half()
    loss = model(idx, idx.roll(-1, 1))[1]
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float16
