"""fused_ops/classifier.py: the LM head and cross-entropy as one operator, against F.cross_entropy(x @ W.T) and a
float64 reference (the repo's rule: at most twice the same-dtype PyTorch error, plus a tiny epsilon), in float32,
under fp16 autocast and with fp16 tensors; odd vocabularies, chunks with a short last one, ignored targets, a
sequence with every target ignored; special values by the rule in the module's docstring (from the logits, and
from tiles' log-sum-exps as Hopper's logits GEMM writes them, with a stand-in for that GEMM and its fallback); the
chunks' rows; gradcheck; the GPT with
classifier="fused" (gradients, evaluation, generation, checkpoints, torch.compile with fullgraph). GPU: bf16 at
GPT-2's width and vocabulary, and the GPT in every compile mode."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fused_ops import classifier
from fused_ops.classifier import cross_entropy_rows, linear_cross_entropy
from model import GPT, GPTConfig
from tests.numerics import EPS, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["a block a row", "16-wide blocks"])
def row_passes(request, monkeypatch):
    """The row kernel with a row in one block, and in several (its online max and sum across blocks)."""
    if request.param != "a block a row":
        monkeypatch.setattr(classifier, "BLOCK_V", 16)
    return request.param


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that every test crosses chunk boundaries (and ends on a short chunk)."""
    monkeypatch.setattr(classifier, "CHUNK_LOGITS", 5 * 101)


def data(M, C, V, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g, dtype=torch.float64)
    w = torch.randn(V, C, generator=g, dtype=torch.float64) / math.sqrt(C)
    t = torch.randint(0, V, (M,), generator=g)
    t[::7] = -1  # ignored targets
    return x.to(device), w.to(device), t.to(device)


def loss_and_grads(fn, x, w, t, dtype, autocast):
    """(loss, dx, dW) of fn with x, w as dtype leaves (or fp32 leaves under autocast in dtype)."""
    x, w = ((x.float(), w.float()) if autocast else (x.to(dtype), w.to(dtype)))
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ctx = torch.autocast(x.device.type, dtype=dtype) if autocast else torch.autocast(x.device.type, enabled=False)
    with ctx:
        loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w), t, ignore_index=-1)


@pytest.mark.parametrize("V", [101, 257])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float16, True), (torch.float16, False)])
def test_matches_float64_reference(small_chunks, V, dtype, autocast, monkeypatch):
    if V == 257:  # the row in several blocks: the online max and sum across them
        monkeypatch.setattr(classifier, "BLOCK_V", 64)
    x, w, t = data(23, 16, V)
    ref = loss_and_grads(eager, x, w, t, torch.float64, False)
    ours = loss_and_grads(linear_cross_entropy, x, w, t, dtype, autocast)
    same = loss_and_grads(eager, x, w, t, dtype, autocast)
    for name, a, b, r in zip(("loss", "dx", "dW"), ours, same, ref):
        # the gradients keep the leaves' dtypes, as eager's; the loss is fp32 (tests/test_classifier_loss.py)
        assert a.dtype == (torch.float32 if name == "loss" else b.dtype), name
        bound = 2 * rel_err(b, r) + EPS[dtype]
        assert rel_err(a, r) <= bound, (name, rel_err(a, r), bound)


def test_a_sequence_with_every_target_ignored_and_a_batch_with_all_ignored(small_chunks):
    x, w, t = data(24, 8, 101)
    t = t.view(4, 6)
    t[1] = -1  # one whole sequence ignored: it adds nothing, and the mean is over the others
    ref = loss_and_grads(eager, x.view(4, 6, 8).reshape(24, 8), w, t.reshape(-1), torch.float64, False)
    ours = loss_and_grads(lambda a, b, c: linear_cross_entropy(a.view(4, 6, 8), b, c), x, w, t, torch.float64, False)
    for a, r in zip(ours, ref):
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-12)
    assert not ours[1].view(4, 6, 8)[1].any()  # the ignored positions get no gradient
    # every target ignored: the mean is 0/0 = NaN, as F.cross_entropy's, and no position gets a gradient
    loss, dx, dw = loss_and_grads(linear_cross_entropy, x, w, torch.full_like(t.reshape(-1), -1), torch.float64, False)
    assert math.isnan(loss.item()) and math.isnan(eager(x, w, torch.full_like(t.reshape(-1), -1)).item())
    assert not dx.any() and not dw.any()


def test_gradcheck_float64(small_chunks):
    x, w, t = data(9, 4, 11)
    x.requires_grad_(), w.requires_grad_()
    # (fast mode: a random projection of the Jacobian, as test_fused_ops's gradchecks)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t), (x, w), fast_mode=True)


def reference_row(row, target, ignore=-1):
    """(loss, gradient of the loss) of one row by the module's rule, from float64 scalar math."""
    n = len(row)
    if target == ignore:
        return 0.0, [0.0] * n
    if not 0 <= target < n:
        return float("nan"), None  # (the loss says so; the gradient is not promised)
    if any(math.isnan(v) for v in row):
        return float("nan"), [float("nan")] * n
    if any(v == math.inf for v in row):
        return (float("nan") if row[target] == math.inf else math.inf), [float("nan")] * n
    m = max(row)
    if m == -math.inf:  # every logit -inf: log(0) - (-inf)
        return float("nan"), [float("nan")] * n
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return lse - row[target], [math.exp(v - lse) - (i == target) for i, v in enumerate(row)]


def tile_log_sum_exp(values):
    """The log-sum-exp of a tile's values by the module's rule, float64 scalar math (the Hopper GEMM's partials)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    if math.inf in values:
        return math.inf
    m = max(values)
    return m if m == -math.inf else m + math.log(sum(math.exp(v - m) for v in values))


def tile_partials(logits, tile):
    """Each row's log-sum-exp over each `tile` columns of logits (the last tile short): (M, ceil(V / tile))."""
    rows = logits.double().cpu().tolist()
    return torch.tensor([[tile_log_sum_exp(r[i:i + tile]) for i in range(0, len(r), tile)] for r in rows],
                        dtype=torch.float32 if logits.dtype != torch.float64 else torch.float64, device=logits.device)


@pytest.mark.parametrize("partials", [None, 8], ids=["from the logits", "from 8-wide tiles' log-sum-exps"])
def test_special_values_follow_the_rule(row_passes, partials):
    inf, nan = math.inf, math.nan
    V = 37
    base = [0.1 * ((7 * i) % 11) - 0.5 for i in range(V)]
    rows, targets = [], []
    for edit, target in [({}, 3), ({5: nan}, 3), ({5: nan}, -1), ({5: -inf, 9: -inf}, 3), ({5: inf}, 3),
                         ({3: inf}, 3), ({i: -inf for i in range(V) if i != 3}, 3), ({}, V + 2)]:
        row = list(base)
        for i, v in edit.items():
            row[i] = v
        rows.append(row), targets.append(target)
    rows.append([-inf] * V), targets.append(0)
    logits = torch.tensor(rows, dtype=torch.float64, device=DEVICE)
    t = torch.tensor(targets, device=DEVICE)
    count = torch.tensor(1, device=DEVICE)  # the gradient of the sum of the rows' losses
    partial = tile_partials(logits, partials) if partials else None
    losses = cross_entropy_rows(logits, t, count, -1, write_grad=True, partial=partial).cpu()
    for i, (row, target) in enumerate(zip(rows, targets)):
        loss, grad = reference_row(row, target)
        ours_loss, ours_grad = losses[i].item(), logits[i].cpu().tolist()
        assert (math.isnan(loss) and math.isnan(ours_loss)) or loss == pytest.approx(ours_loss, rel=1e-12), (i, loss,
                                                                                                           ours_loss)
        for a, b in zip(ours_grad, grad or ours_grad):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-15), (i, a, b)


def standin_logits_lse(calls, tile=16, offset=0.0):
    """The Hopper GEMM's contract (hopper/pingpong.logits_lse) computed by PyTorch: out = x @ weight.T, and each
    row's log-sum-exps over `tile` columns of out as stored (plus offset: a test's way to see the row kernel take
    them). FP8 (inv given): x and weight dequantized in fp32."""
    def logits_lse(x, weight, out, inv):
        calls.append(inv is not None)
        if inv is None:
            torch.mm(x, weight.t(), out=out)
        else:
            out.copy_((x.float() * inv[0]) @ (weight.float() * inv[1]).t())
        return tile_partials(out, tile) + offset
    return logits_lse


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float16, True)])
def test_a_backend_gemm_with_log_sum_exps_gives_the_same_loss(small_chunks, dtype, autocast, monkeypatch):
    """Where a backend's logits GEMM also writes each row's log-sum-exps per tile (Hopper's), the row kernel reads
    those instead of the logits a first time: the same loss and gradients, with and without grad."""
    from fused_ops import backends
    x, w, t = data(23, 16, 101)
    plain = loss_and_grads(linear_cross_entropy, x, w, t, dtype, autocast)
    calls = []
    monkeypatch.setitem(backends._registry, "logits_lse", standin_logits_lse(calls))
    ours = loss_and_grads(linear_cross_entropy, x, w, t, dtype, autocast)
    assert len(calls) == 5 and not any(calls)  # every chunk (23 rows of 5), 16-bit
    for name, a, b in zip(("loss", "dx", "dW"), ours, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (name, rel_err(a, b))
    with torch.no_grad():
        assert linear_cross_entropy(x.float(), w.float(), t).item() == pytest.approx(plain[0].item(), rel=1e-5)
    # the loss's log-sum-exps are the partials' (each tile's sum of exponentials doubled: every loss grows by log 2)
    monkeypatch.setitem(backends._registry, "logits_lse", standin_logits_lse(calls, offset=math.log(2)))
    shifted = loss_and_grads(linear_cross_entropy, x, w, t, dtype, autocast)[0]
    assert shifted.item() == pytest.approx(plain[0].item() + math.log(2), rel=1e-5)


def test_a_failing_hopper_gemm_falls_back_to_cublas_once(small_chunks, monkeypatch):
    """If the Hopper logits GEMM fails to compile or launch: one FallbackWarning, then cuBLAS's GEMM and the row
    kernel's two reads, with the same loss; the variant is not tried again, and the other ping-pong kernels stay on."""
    from fused_ops.hopper import dispatch, pingpong
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(kwargs["EPILOGUE"])
        raise RuntimeError("no sm_90 here")
    x, w, t = data(23, 16, 101)
    plain = linear_cross_entropy(x.float(), w.float(), t)
    monkeypatch.setattr(pingpong, "FAILURE", None)
    monkeypatch.setattr(pingpong, "LOGITS_FAILURE", None)
    monkeypatch.setattr(pingpong, "usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(pingpong, "_launch", broken)
    with warnings.catch_warnings(record=True) as caught:  # (pytest.warns would re-emit the interpreter's own)
        warnings.simplefilter("always", pingpong.FallbackWarning)
        loss = linear_cross_entropy(x.float(), w.float(), t)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, pingpong.FallbackWarning)]
    assert len(fallbacks) == 1 and "logits GEMM failed" in fallbacks[0], fallbacks
    # only this variant is off: the MLP's ping-pong kernels keep running
    assert attempts == ["lse"] and isinstance(pingpong.LOGITS_FAILURE, RuntimeError) and pingpong.FAILURE is None
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    assert dispatch.logits_lse(x.float(), w.float(), torch.empty(23, 101), None) is NotImplemented


@pytest.mark.parametrize("M, V", [(12288, 50304), (12289, 50304), (8 * 1024, 128256), (300, 50304), (100, 50304),
                                  (1, 7), (4096, 50304)])
def test_chunks_hold_whole_row_tiles_and_about_chunk_logits(M, V):
    rows = classifier.chunk_rows(M, V)
    chunks = math.ceil(M / rows)
    unrounded = math.ceil(M / math.ceil(M * V / classifier.CHUNK_LOGITS))
    assert rows >= unrounded and chunks <= math.ceil(M * V / classifier.CHUNK_LOGITS)  # no more chunks than before
    assert rows % classifier.TILE_ROWS == 0 or rows == unrounded <= classifier.TILE_ROWS
    assert rows - unrounded < classifier.TILE_ROWS  # the memory: at most a tile of rows more
    if (M, V) == (12288, 50304) and classifier.CHUNK_LOGITS == 2 ** 27:  # (2458 rows before the rounding)
        assert rows == 2560 and M - (chunks - 1) * rows == 2048


def test_gpt2s_head_in_chunks_of_whole_tiles(monkeypatch):
    assert classifier.chunk_rows(12288, 50304) == 4096  # 2^28 logits a chunk: three chunks
    monkeypatch.setattr(classifier, "CHUNK_LOGITS", 2 ** 27)
    test_chunks_hold_whole_row_tiles_and_about_chunk_logits(12288, 50304)


def test_errors_name_the_argument():
    x, w, t = data(4, 8, 11)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(x, w[:, :4], t)
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(x, w, t.float())
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(x, w, t[:3])
    with pytest.raises(ValueError, match="config key 'classifier'"):
        GPTConfig(classifier="fast")


def gpt(classifier, vocab_size=67, **kw):
    """A 2-layer GPT, seed 0 (an odd vocabulary by default; the FP8 form's tests pass a multiple of 16)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, mlp="eager",
                         dropout=0.0, classifier=classifier, **kw))


def test_the_gpt_with_the_fused_classifier(small_chunks, tmp_path):
    """Same loss and gradients as the eager classifier (float64), under fp16 autocast within the rule, the same
    evaluation loss without grad, the same generation, and checkpoints that load across the settings."""
    idx = torch.randint(0, 67, (3, 16), generator=torch.Generator().manual_seed(1))
    tgt = idx.roll(-1, 1)
    tgt[:, -1] = -1
    models = {c: gpt(c) for c in ("eager", "fused")}
    grads = {}
    for name, m in models.items():
        m.double()
        logits, loss = m(idx, tgt)
        assert (logits is None) == (name == "fused")
        loss.backward()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    assert torch.allclose(grads["fused"], grads["eager"], rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        assert models["fused"](idx, tgt)[1].item() == pytest.approx(models["eager"](idx, tgt)[1].item(), rel=1e-12)
        last = [m(idx)[0] for m in models.values()]  # generation's logits: the last position, through lm_head
        assert torch.equal(last[0], last[1])
    out = [m.generate(idx[:1, :4], 5, top_k=1) for m in models.values()]
    assert torch.equal(out[0], out[1])
    # under fp16 autocast: the rule against the float64 gradient
    errors = {}
    for name in ("eager", "fused"):
        m = gpt(name)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(idx, tgt)[1]
        loss.backward()
        errors[name] = rel_err(torch.cat([p.grad.reshape(-1) for p in m.parameters()]), grads["eager"])
    assert errors["fused"] <= 2 * errors["eager"] + EPS[torch.float16], errors
    # checkpoints: the same parameters whatever the classifier
    torch.save(models["fused"].state_dict(), tmp_path / "ckpt.pt")
    eager_model = gpt("eager").double()
    eager_model.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert torch.equal(eager_model.lm_head.weight, models["fused"].lm_head.weight)


def test_compiles_with_fullgraph(small_chunks):
    """The operator is one node torch.compile compiles around (aot_eager on the CPU), with the same loss and
    gradients as the uncompiled call."""
    x, w, t = data(12, 8, 101)
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)
    results = [loss_and_grads(fn, x, w, t, torch.float32, False) for fn in (linear_cross_entropy, compiled)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bench_classifier_says_what_it_needs(capsys):
    """bench_classifier.py: one line naming --shapes when it cannot parse them, and one line without a GPU."""
    import bench_classifier
    from helpers import errors
    assert errors.run_main("bench_classifier.py", bench_classifier.main, ["--shapes=12288x768"]) == 2 or \
        not torch.cuda.is_available()
    err = capsys.readouterr().err
    if torch.cuda.is_available():
        assert "--shapes='12288x768'" in err
    else:
        assert errors.run_main("bench_classifier.py", bench_classifier.main, []) == 2
        assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit):
        bench_classifier.main(["--shape=1x2x3"])  # no prefix matching of option names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,C,V", [(1024, 768, 50304), (333, 64, 1001)])
def test_bf16_on_the_gpu(M, C, V):
    x, w, t = data(M, C, V, device="cuda")
    ref = loss_and_grads(eager, x, w, t, torch.float64, False)
    for autocast in (True, False):
        ours = loss_and_grads(linear_cross_entropy, x, w, t, torch.bfloat16, autocast)
        same = loss_and_grads(eager, x, w, t, torch.bfloat16, autocast)
        for name, a, b, r in zip(("loss", "dx", "dW"), ours, same, ref):
            bound = 2 * rel_err(b, r) + EPS[torch.bfloat16]
            assert rel_err(a, r) <= bound, (autocast, name, rel_err(a, r), bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [False, True, "reduce-overhead"])
def test_the_gpt_in_every_compile_mode_on_the_gpu(mode):
    """Three optimizer steps of a small GPT, fused classifier against eager, bf16 autocast: the same losses within
    bf16's noise, and the fused one's gradients within the rule of the float64 eager model's."""
    idx = torch.randint(0, 67, (8, 16), generator=torch.Generator().manual_seed(1)).cuda()
    losses = {}
    for name in ("eager", "fused"):
        torch._dynamo.reset()
        raw = gpt(name, bias=False).cuda()
        model = torch.compile(raw, mode=None if mode is True else mode) if mode else raw
        opt = torch.optim.AdamW(raw.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(3):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(idx, idx.roll(-1, 1))[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["fused"] == pytest.approx(losses["eager"], rel=2e-2), losses


def test_bench_variants_with_the_fused_classifier(tmp_path):
    """bench.py's +cls variants: the same first losses as without the fused classifier (same weights and batches)."""
    import bench
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\n"
                   "dataset = 'shakespeare_char'\n")
    rows = bench.main([str(cfg), f"--device={DEVICE}", "--dtype=float32", "--compile=False", "--warmup=1", "--steps=2",
                       "--mlps=eager,eager+cls", f"--out={tmp_path / 'b'}"])
    assert [r["mlp"] for r in rows] == ["eager", "eager+cls"]
    assert rows[1]["first_losses"] == pytest.approx(rows[0]["first_losses"], rel=1e-5)
