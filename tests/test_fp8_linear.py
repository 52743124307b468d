"""The FP8 linear (fused_ops/fp8/linear.py) and the switch that puts it in the attention (fp8_reach="blocks").

As tests/test_fp8.py, the yardstick is the recipe itself: the same per-tensor scales applied by PyTorch on the same
values, multiplied by torch._scaled_mm. Against float64, the operator's error must be no worse than twice that
reference's, plus a small epsilon. On CPU under Triton's interpreter in fp16; on a GPU (-m gpu) in bf16.
"""

import pytest
import torch
import torch.nn.functional as F

import model
from fused_ops.fp8 import E4M3, E5M2, FP8_MAX, GRAD_Y, X, FP8State, fp8_linear, fp8_linear_qkv
from fused_ops.fp8 import kernels as fp8_kernels
from fused_ops.fp8 import state as fp8_state
from helpers import config as settings
from numerics import assert_no_worse_than_eager
from test_fp8 import col_major, needs_fp8_gpu, pad_rows, quantize, rel

CUDA = torch.cuda.is_available()


def recipe_reference(x, w, b, gy, s_x, s_gy):
    """(y, dx, dW): x and grad_y quantized with the given scales, W with its own current scale, each GEMM by
    torch._scaled_mm as the recipe asks."""
    one = lambda s: torch.tensor([1.0 / s], device=x.device)
    s_w = FP8_MAX[E4M3] / w.float().abs().amax().item()
    x8, gy8, w8 = quantize(x, s_x, E4M3), quantize(gy, s_gy, E5M2), quantize(w, s_w, E4M3)
    y = torch._scaled_mm(x8, col_major(w8.t()), scale_a=one(s_x), scale_b=one(s_w), bias=b, out_dtype=x.dtype,
                         use_fast_accum=True)
    dx = torch._scaled_mm(gy8, col_major(w8), scale_a=one(s_gy), scale_b=one(s_w), out_dtype=x.dtype)
    dw = torch._scaled_mm(pad_rows(gy8.float()).to(E5M2).t().contiguous(), col_major(pad_rows(x8.float()).to(E4M3)),
                          scale_a=one(s_gy), scale_b=one(s_x), out_dtype=x.dtype)
    return y, dx, dw


def exact_linear(x, w, b, gy):
    """The float64 linear: (y, dx, dW, db)."""
    x, w = (t.detach().double().requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(x, w, b)
    y.backward(gy.double())
    return y, x.grad, w.grad, None if b is None else b.grad


def check_against_recipe(M, K, N, dtype, device, bias=True, calls=3, eps=1e-3):
    """Several calls (the first calibrates, the rest use the delayed scales), each against recipe_reference."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, N, bias=bias, device=device, dtype=dtype)
    state = FP8State().to(device)
    for call in range(calls):
        x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
        gy = torch.randn(M, N, device=device, dtype=dtype) * 1e-3
        before = state.scale.tolist()
        y = fp8_linear(x, layer.weight, layer.bias, state)
        y.backward(gy)
        if call == 0:  # calibration: x's and gy's own amax (read back from the history)
            s_x, s_gy = (FP8_MAX[d] / state.history[i, 0].item() for i, d in ((X, E4M3), (GRAD_Y, E5M2)))
        else:
            s_x, s_gy = before[X], before[GRAD_Y]
        exact = exact_linear(x, layer.weight, layer.bias, gy)
        ref = recipe_reference(x.detach(), layer.weight.detach(), None if layer.bias is None else layer.bias.detach(),
                               gy, s_x, s_gy)
        for name, o, r, e in zip(("y", "dx", "dW"), (y, x.grad, layer.weight.grad), ref, exact):
            assert torch.isfinite(o).all(), (call, name)
            err, ref_err = rel(o, e), rel(r, e)
            assert err <= 2 * ref_err + eps, f"call {call} {name}: FP8 linear {err:.4g} against the recipe's {ref_err:.4g}"
        if bias:  # db = grad_y.sum(0), unquantized: the 16-bit rule
            assert_no_worse_than_eager(layer.bias.grad, gy.sum(0), gy.double().sum(0), f"call {call} db")
        layer.zero_grad(set_to_none=True)
    assert state.calibrated
    assert state.history[X].count_nonzero() == calls and state.history[GRAD_Y].count_nonzero() == calls


# ---------------------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("M", [64, 45])  # 45: rows padded to 48 in the transposed copies
def test_fp8_linear_matches_the_recipe_on_cpu(M, bias):
    check_against_recipe(M, 32, 96, torch.float16, "cpu", bias)


def check_under_autocast(device, dtype, M=40, K=32, N=48):
    """Training runs under autocast: fp32 masters; the weight's FP8 copies come from them, dW comes out fp32."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, N, device=device)
    state = FP8State().to(device)
    for _ in range(2):
        x = torch.randn(M, K, device=device, requires_grad=True)
        with torch.autocast(device, dtype=dtype):
            y = fp8_linear(x, layer.weight, layer.bias, state)
        assert y.dtype == dtype
        y.float().square().mean().backward()
        for p in (layer.weight, layer.bias, x):
            assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        copies = state.weights(layer.weight)
        assert torch.equal(copies[0].float(), fp8_state.quantize_weight(layer.weight)[0].float())
        assert rel(y, F.linear(x.double(), layer.weight.double(), layer.bias.double())) < 0.06  # (x and W: ~3% each)
        layer.zero_grad()


def test_fp8_linear_under_autocast_on_cpu():
    check_under_autocast("cpu", torch.float16)


def test_nan_stays_nan_and_inf_becomes_nan_in_its_row():
    """kernels.py's rule: NaN in, NaN out; ±inf becomes NaN when quantized (e4m3 has no inf). Only the row that
    holds it is touched in y; the delayed scales skip the non-finite amax."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48, device="cpu", dtype=torch.float16)
    state = FP8State()
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(20, 32, dtype=torch.float16)
        x[3, 5] = bad
        y = fp8_linear(x.requires_grad_(), layer.weight, layer.bias, state)
        assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(20) != 3]).all(), bad
        y.backward(torch.ones_like(y) * 1e-3)  # dW = gyᵀ x: x's column 5 only, as the math says
        dw = layer.weight.grad
        assert torch.isnan(dw[:, 5]).all() and torch.isfinite(dw[:, torch.arange(32) != 5]).all(), bad
        assert torch.isfinite(state.scale).all()
        layer.zero_grad(set_to_none=True)


def test_no_grad_is_the_16_bit_linear():
    layer = torch.nn.Linear(32, 48, dtype=torch.float16)
    state = FP8State()
    x = torch.randn(8, 32, dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(fp8_linear(x, layer.weight, layer.bias, state), F.linear(x, layer.weight, layer.bias))
    assert not state.calibrated


def test_bad_inputs_are_named():
    state = FP8State()
    with pytest.raises(TypeError, match="16-bit activations"):
        fp8_linear(torch.randn(4, 32, requires_grad=True), torch.randn(48, 32), None, state)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(4, 24, dtype=torch.float16, requires_grad=True),
                   torch.randn(48, 24, dtype=torch.float16), None, state)


def test_the_switch_is_checked_and_keeps_checkpoints_loadable():
    assert model.GPTConfig().fp8_reach == "mlp"
    for bad in (dict(fp8_reach="blocks"), dict(fp8_reach="all", fp8=True, mlp="fused")):
        with pytest.raises(ValueError, match="'fp8_reach'"):
            model.GPTConfig(**bad)
    import train
    with pytest.raises(settings.ConfigError, match="fp8_reach"):
        settings.check({**train.DEFAULTS, "fp8_reach": "blocks"})
    args = dict(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32, mlp="fused")
    blocks = model.GPT(model.GPTConfig(**args, fp8=True, fp8_reach="blocks"))
    assert blocks.transformer.h[0].attn.fp8 is not None
    keys = set(model.GPT(model.GPTConfig(**args)).state_dict())
    assert set(blocks.state_dict()) == keys  # the scales are not saved: a checkpoint loads across every setting
    model.GPT(model.GPTConfig(**{**args, "mlp": "eager"})).load_state_dict(blocks.state_dict())


def check_qkv_against_chunked(M, K, n, dtype, device, calls=3, exact=True):
    """fp8_linear_qkv against fp8_linear(...).chunk(3) on a copy of the layer with its own state, call by call (the
    first calibrates): q, k, v, dx, dW, db and the scales. The gradients come as views with a row stride wider than
    n (as attention's backward may leave them), the last row count not a multiple of 16. exact: bit for bit (CPU);
    else within 2 FP8 steps of the chunked linear's error against float64 (on the GPU cuBLAS may pick other kernels
    for the thirds)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(K, 3 * n, device=device, dtype=dtype) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    states = [FP8State().to(device), FP8State().to(device)]
    for call in range(calls):
        x = torch.randn(M, K, device=device, dtype=dtype)
        grads = torch.randn(M, 3 * n + 16, device=device, dtype=dtype)[:, :3 * n] * 1e-3  # (row stride 3n + 16)
        outs, dxs = [], []
        for layer, state, fn in zip(layers, states, ("chunked", "qkv")):
            xi = x.clone().requires_grad_()
            parts = (fp8_linear(xi, layer.weight, layer.bias, state).chunk(3, dim=-1) if fn == "chunked"
                     else fp8_linear_qkv(xi, layer.weight, layer.bias, state))
            torch.autograd.backward(parts, [grads[:, i * n:(i + 1) * n] for i in range(3)])
            outs.append((*parts, xi.grad, layer.weight.grad, layer.bias.grad))
        exact64 = exact_linear(x, layers[0].weight, layers[0].bias, grads)
        wanted = (*exact64[0].chunk(3, dim=-1), *exact64[1:])
        for name, a, b, e in zip(("q", "k", "v", "dx", "dW", "db"), *outs, wanted):
            if exact:
                assert torch.equal(a, b), (call, name)
            else:
                assert rel(b, e) <= 2 * rel(a, e) + 1e-3, (call, name, rel(b, e), rel(a, e))
        assert torch.equal(states[0].scale, states[1].scale) and torch.equal(states[0].history, states[1].history)
        for layer in layers:
            layer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("M", [64, 45])
def test_fp8_linear_qkv_is_fp8_linear_chunked_on_cpu(M):
    check_qkv_against_chunked(M, 32, 48, torch.float16, "cpu")


def test_cast_transpose_parts_is_the_cast_of_the_concatenation():
    """Each part cast straight into its columns of q and rows of qᵀ: bit for bit the cast of the parts side by side,
    the transposed copy's padding columns zero, the amax over all parts."""
    torch.manual_seed(0)
    parts = [torch.randn(45, 64 + 16, dtype=torch.float16)[:, :64] * s for s in (1.0, 3.0, 0.5)]
    states = [FP8State(), FP8State()]
    for st in states:
        st.scale[GRAD_Y] = 100.0
    q, qt = fp8_kernels.cast_transpose_parts(parts, states[0], GRAD_Y)
    q_ref, qt_ref = fp8_kernels.cast_transpose(torch.cat(parts, dim=1), states[1], GRAD_Y, row_major=True)
    assert q.shape == (45, 192) and qt.shape == (192, 48)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), qt_ref.view(torch.uint8)) and not qt[:, 45:].float().any()
    assert torch.equal(states[0].amax, states[1].amax) and states[0].amax[GRAD_Y] == max(p.abs().max() for p in parts)


def test_fp8_linear_qkv_with_an_output_unused():
    """An output nobody reads gets a zero gradient (autograd materializes it): its weight rows and bias get none."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 144, dtype=torch.float16)
    x = torch.randn(20, 32, dtype=torch.float16, requires_grad=True)
    state = FP8State()
    for _ in range(2):  # calibrating, then on delayed scales
        q, k, v = fp8_linear_qkv(x, layer.weight, layer.bias, state)
        (q.float().sum() + k.float().sum()).backward()
        assert torch.isfinite(layer.weight.grad).all() and not layer.weight.grad[96:].any()
        assert not layer.bias.grad[96:].any() and layer.bias.grad[:96].all()
        layer.zero_grad(set_to_none=True)


def test_fp8_linear_qkv_checks_its_thirds():
    with pytest.raises(ValueError, match="N/3 and K multiples of 16"):  # (72 = 3 x 24)
        fp8_linear_qkv(torch.randn(4, 32, dtype=torch.float16, requires_grad=True),
                       torch.randn(72, 32, dtype=torch.float16), None, FP8State())
    with torch.no_grad():  # (evaluation: the 16-bit linear, in thirds)
        layer = torch.nn.Linear(32, 96, dtype=torch.float16)
        x = torch.randn(4, 32, dtype=torch.float16)
        assert all(torch.equal(a, b) for a, b in zip(fp8_linear_qkv(x, layer.weight, layer.bias, FP8State()),
                                                     F.linear(x, layer.weight, layer.bias).chunk(3, -1)))


# A GPT with fp8_reach="blocks" compiled with fullgraph, bit for bit the uncompiled one: tests/test_fp8.py's
# test_fp8_gpt_compiles_fullgraph_and_trains_as_uncompiled (one compile for the MLP's and the linears' operators).


# ---------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("M,K,N", [(12288, 768, 2304), (12288, 768, 768), (1000 + 7, 256, 512)])
def test_fp8_linear_matches_the_recipe_on_the_gpu(M, K, N):
    check_against_recipe(M, K, N, torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("M", [12288, 1000 + 7])
def test_fp8_linear_qkv_against_fp8_linear_chunked_on_the_gpu(M):
    check_qkv_against_chunked(M, 768, 768, torch.bfloat16, "cuda", exact=False)


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_linear_under_autocast_on_the_gpu():
    check_under_autocast("cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("mode", [False, True, "reduce-overhead"])
def test_a_gpt_with_fp8_blocks_trains_in_every_compile_mode(mode):
    """GPT-2-small-shaped layers (2 of them), bf16 autocast, AdamW, 6 steps: each compile mode's losses within 2% of
    the uncompiled run's (the compiled graph fuses the weights' casts and the operators run the same kernels, but
    inductor's other kernels round differently), and falling."""
    import torch._dynamo

    def run(compile):
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = model.GPTConfig(block_size=1024, vocab_size=50304, n_layer=2, mlp="fused", fp8=True,
                                 fp8_reach="blocks", classifier="fp8")
        gpt = model.GPT(config).cuda()
        step = gpt if not compile else torch.compile(gpt, mode=None if compile is True else compile)
        opt = gpt.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
        idx = torch.randint(0, 50304, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        losses = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step(idx, idx)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses
    plain, losses = run(False), run(mode)
    assert losses[-1] < losses[0] - 1.0
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, plain)), (losses, plain)
