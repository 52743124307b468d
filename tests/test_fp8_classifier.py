"""fused_ops/fp8/classifier.py: the classifier's FP8 form, against its recipe computed in float64 (x and W quantized to
e4m3 with current scaling, softmax - one_hot to e5m2 at the fixed scale 2^15, everything else exact): its error
against the unquantized float64 classifier at most twice the recipe's plus the 16-bit classifier's, plus a small
epsilon (tests/test_fp8.py's rule for the FP8 MLP, with the 16-bit tensors' own rounding). Float32 and fp16 autocast, chunks with a short last one, ignored targets and all ignored, the 16-bit
operator without grad, the argument checks, a GPT with classifier="fp8" (trains; checkpoints load as "eager"),
torch.compile with fullgraph. GPU: bf16 at GPT-2's width and vocabulary; the GPT in every compile mode."""

import math

import pytest
import torch
import torch.nn.functional as F

from fused_ops import classifier
from fused_ops.classifier import linear_cross_entropy
from fused_ops.fp8 import E4M3, E5M2, FP8_MAX, fp8_linear_cross_entropy
from model import GPTConfig
from tests.numerics import EPS, rel_err
from tests import test_classifier
from tests.test_classifier import data  # (float64 x, W, targets with every 7th ignored)

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs FP8 tensor cores")


@pytest.fixture
def small_chunks(monkeypatch):
    from fused_ops.fp8 import classifier as fp8_classifier
    monkeypatch.setattr(fp8_classifier, "CHUNK_LOGITS", 5 * 64)


def dequantized(v):
    """v through e4m3 with current scaling, as state.quantize_current (scale in fp32), back in float64."""
    v32 = v.float()
    scale = torch.tensor(FP8_MAX[E4M3], dtype=torch.float32, device=v.device) / v32.abs().amax()
    return (v32 * scale).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3).double() / scale.double()


def recipe(x, w, t):
    """(loss, dx, dW) of the FP8 recipe in float64, from the values the operator is given (x, w as its dtype)."""
    xq, wq = dequantized(x), dequantized(w)
    logits = xq @ wq.t()
    kept = t != -1
    n = kept.sum()
    p = torch.softmax(logits, -1) - F.one_hot(t.clamp(min=0), w.shape[0]).double()
    p[~kept] = 0
    loss = (torch.logsumexp(logits, -1) - logits.gather(1, t.clamp(min=0)[:, None])[:, 0])[kept].sum() / n
    g = (p * classifier.GRAD8_SCALE).to(E5M2).double() / classifier.GRAD8_SCALE
    return loss, g @ wq / n, (p / n).t() @ x.double()


def exact(x, w, t):
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(x @ w.t(), t, ignore_index=-1)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def ours(x, w, t, dtype, autocast, fn=fp8_linear_cross_entropy):
    """(loss, dx, dW, the x and W the operator saw): fp32 leaves under autocast in dtype, else dtype leaves."""
    x, w = ((x.float(), w.float()) if autocast else (x.to(dtype), w.to(dtype)))
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad, w.grad, x.detach(), w.detach()


def check_against_recipe(M, C, V, dtype, autocast, device, eps):
    """The rule: the FP8 classifier's error against float64 at most twice the recipe's (FP8's own) plus the
    16-bit classifier's in the same dtype (the logits and dlogits are 16-bit tensors here too), plus eps."""
    x, w, t = data(M, C, V, device=device)
    *got, xs, ws = ours(x, w, t, dtype, autocast)
    same = ours(x, w, t, dtype, autocast, lambda a, b, c: F.cross_entropy(F.linear(a, b), c, ignore_index=-1))
    want = exact(x, w, t)
    ref = recipe(xs, ws, t)
    for name, o, r, s, e in zip(("loss", "dx", "dW"), got, ref, same, want):
        assert o.dtype == (torch.float32 if name == "loss" else xs.dtype), name  # (the loss: fp32 always)
        assert torch.isfinite(o).all(), name
        err, ref_err = rel_err(o, e), rel_err(r, e) + rel_err(s, e)
        assert err <= 2 * ref_err + eps, f"{name}: FP8 classifier {err:.4g} against recipe + 16-bit {ref_err:.4g}"
    return got


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float16, True)])
def test_matches_the_recipe_on_cpu(small_chunks, dtype, autocast):
    check_against_recipe(23, 32, 64, dtype, autocast, "cpu", EPS[torch.float16])


def test_a_wrong_gradient_scale_is_caught(small_chunks, monkeypatch):
    """The rule above sees a gradient off by a power of two (the kernel's scale and the GEMM's disagreeing)."""
    rows = classifier.cross_entropy_rows
    monkeypatch.setattr(classifier, "cross_entropy_rows",  # the kernel quantizes at 2^14, the GEMM undoes 2^15
                        lambda *a, grad8_scale, **k: rows(*a, grad8_scale=grad8_scale / 2, **k))
    with pytest.raises(AssertionError, match="dx"):
        check_against_recipe(23, 32, 64, torch.float32, False, "cpu", EPS[torch.float16])


def test_a_backend_gemm_with_log_sum_exps_gives_the_same_loss(small_chunks, monkeypatch):
    """With a stand-in for Hopper's FP8 logits GEMM that also writes each row's log-sum-exps per tile (given the
    1/scales), the same loss and gradients as with torch._scaled_mm and the row kernel's two reads."""
    from fused_ops import backends
    x, w, t = data(23, 32, 64)
    plain = ours(x, w, t, torch.float32, False)
    calls = []
    monkeypatch.setitem(backends._registry, "logits_lse", test_classifier.standin_logits_lse(calls))
    got = ours(x, w, t, torch.float32, False)
    assert calls == [True] * 5  # every chunk, FP8 in
    for name, a, b in zip(("loss", "dx", "dW"), got, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (name, rel_err(a, b))
    # the loss's log-sum-exps are the partials' (offset by log 2: every loss grows by log 2)
    monkeypatch.setitem(backends._registry, "logits_lse", test_classifier.standin_logits_lse(calls, offset=math.log(2)))
    assert ours(x, w, t, torch.float32, False)[0].item() == pytest.approx(plain[0].item() + math.log(2), rel=1e-5)


def test_ignored_targets_and_no_grad(small_chunks):
    """Every target ignored: NaN loss (0/0, as F.cross_entropy) and no gradient; without grad the 16-bit operator
    runs (the same loss as the fused classifier's, bit for bit)."""
    x, w, t = data(23, 32, 64)
    loss, dx, dw, *_ = ours(x, w, torch.full_like(t, -1), torch.float32, False)
    assert math.isnan(loss.item()) and not dx.any() and not dw.any()
    with torch.no_grad():
        assert torch.equal(fp8_linear_cross_entropy(x.float(), w.float(), t), linear_cross_entropy(x.float(), w.float(), t))


def test_special_values(small_chunks):
    """NaN in x, or +inf (NaN once quantized: the module's rule), makes the mean loss NaN and the gradients NaN
    where they meet it; finite inputs give finite ones."""
    x, w, t = data(23, 32, 64)
    for bad in (math.nan, math.inf):
        x_bad = x.float().clone()
        x_bad[3, 5] = bad
        loss, dx, dw, *_ = ours(x_bad, w, t, torch.float32, False)
        assert math.isnan(loss.item()), bad
        assert dx.isnan().any() and dw.isnan().any(), bad
    loss, dx, dw, *_ = ours(x, w, t, torch.float32, False)
    assert math.isfinite(loss.item()) and dx.isfinite().all() and dw.isfinite().all()


def test_errors_name_the_argument():
    x, w, t = data(4, 32, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear_cross_entropy(x.float(), w[:50].float(), t.clamp(max=49))
    with pytest.raises(ValueError, match="targets must be integers"):
        fp8_linear_cross_entropy(x.float(), w.float(), t.float())
    with pytest.raises(ValueError, match="'classifier'='fp8' needs n_embd .* and vocab_size \\(67\\)"):
        GPTConfig(vocab_size=67, n_embd=32, n_head=2, classifier="fp8")
    with pytest.raises(ValueError, match="classifier"):
        GPTConfig(classifier="fp16")


def gpt(classifier_kind, **kw):
    return test_classifier.gpt(classifier_kind, vocab_size=64, **kw)  # (FP8 GEMMs: V a multiple of 16)


def train(model, idx, steps, device_type, dtype, compiled=None, mode=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device_type, dtype=dtype):
            loss = (model if compiled is None else compiled)(idx, idx.roll(-1, 1))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_the_gpt_trains_with_the_fp8_classifier(small_chunks, tmp_path):
    """A small GPT with classifier="fp8" under fp16 autocast: it learns as the eager one does (losses within a few
    percent), evaluates and generates, and its checkpoint loads into classifier="eager". (Five steps on 3 x 8
    tokens: 24 rows, in chunks of 5 with a short last one.)"""
    idx = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    losses = {kind: train(gpt(kind), idx, 5, "cpu", torch.float16) for kind in ("eager", "fp8")}
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.5, losses
    assert losses["fp8"] == pytest.approx(losses["eager"], rel=5e-2), losses
    model = gpt("fp8")
    with torch.no_grad():
        assert model(idx, idx)[0] is None and model(idx)[0].shape == (3, 1, 64)
    assert model.generate(idx[:1, :4], 3).shape == (1, 7)
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    gpt("eager").load_state_dict(torch.load(tmp_path / "ckpt.pt"))


def test_compiles_with_fullgraph(small_chunks):
    x, w, t = data(12, 32, 64)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_linear_cross_entropy, backend="aot_eager", fullgraph=True)
    results = [ours(x, w, t, torch.float32, False, fn)[:3] for fn in (fp8_linear_cross_entropy, compiled)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("autocast", [True, False])
def test_bf16_matches_the_recipe_on_the_gpu(autocast):
    check_against_recipe(1024, 768, 50304, torch.bfloat16, autocast, "cuda", EPS[torch.bfloat16])


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("mode", [False, True, "reduce-overhead"])
def test_the_gpt_in_every_compile_mode_on_the_gpu(mode):
    """Eight optimizer steps of a small GPT, classifier="fp8" against "eager", bf16 autocast: the same losses
    within a few percent, compiled as uncompiled."""
    idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1)).cuda()
    losses = {}
    for kind in ("eager", "fp8"):
        torch._dynamo.reset()
        model = gpt(kind, bias=False).cuda()
        compiled = torch.compile(model, mode=None if mode is True else mode) if mode else None
        losses[kind] = train(model, idx, 8, "cuda", torch.bfloat16, compiled, mode)
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.5, losses
    assert losses["fp8"] == pytest.approx(losses["eager"], rel=5e-2), losses


def test_bench_names_the_fp8_classifier_variants():
    """bench.py's and the lab probes' variant names: +cls8 picks the FP8 form, +cls the 16-bit one."""
    import bench
    assert bench.parse_variant("fp8+cls8+reduce-overhead") == ("fp8+cls8", "reduce-overhead")
    assert bench.parse_variant("fused+cls+compile") == ("fused+cls", True)
    assert bench.parse_variant("eager") == ("eager", False)
