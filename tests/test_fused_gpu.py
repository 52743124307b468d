"""GPU-only checks: bf16/fp16/fp32 at training-size and odd shapes, and a whole GPT under bf16 autocast.
Skipped without CUDA (the CPU suite covers the same code through the interpreter, without bf16)."""

import math

import pytest
import torch

from fused_ops import linear_act_dgrad, linear_act_forward
from fused_ops.linear_act import ln_linear_act_forward
from fused_ops.mlp import fused_mlp
from model import GATED_ACTIVATIONS, GPT, GPTConfig
from fused_ops.activations import kernel_activations
from numerics import (assert_no_worse_than_eager, assert_within_rule, check_dgrad, check_linear_act, check_ln_mlp_16bit,
                      check_saved, eager_act, EPS, ln_mlp_16bit_outputs, poisoned, rel_err)
from special_values import assert_nonfinite_pattern, mlp_expected

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(4096, 768, 3072), (1000, 777, 1531), (3, 64, 2048), (12288, 768, 2048)]  # (M, K, N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu2", "swiglu", "geglu", "sigmoid_tanh"])
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("main_loop", ["auto", "pointer"])
def test_forward_and_dgrad_large_and_odd(dtype, act, M, K, N, main_loop, monkeypatch):
    """main_loop="auto" reads aligned operands through TMA on Hopper (K=777 rows are not 16-byte aligned,
    so that shape takes the pointer loop either way); "pointer" forces the pointer loop."""
    import fused_ops.matmul

    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "auto" if main_loop == "auto" else "0")
    gated = act in GATED_ACTIVATIONS
    rows = (2 if gated else 1) * N
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = (torch.randn(rows, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(rows, device="cuda", dtype=dtype)
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, rows), dtype, "cuda")
    linear_act_forward(x, w, b, act, out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, act)

    grad_y = torch.randn(M, K, device="cuda", dtype=dtype)
    w2 = (torch.randn(K, N, device="cuda") * N ** -0.5).to(dtype)
    grad_z = poisoned(saved.shape, dtype, "cuda")
    _, grad_b = linear_act_dgrad(grad_y, w2, saved, act, out=grad_z)
    check_dgrad(grad_z, grad_b, grad_y, w2, saved, act)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("main_loop", ["auto", "pointer"])
def test_direct_launch_across_specializations(act, main_loop, monkeypatch):
    """After its first launch a kernel is called directly (tuning.LaunchPlan), without Triton's JIT. Calls
    under one tuning key whose arguments Triton compiles differently (M = 1, M not a multiple of 16, a
    16-byte-misaligned x, a padded row stride, an fp32 output, bias or saved tensor) must each get a kernel
    compiled for them, never reuse one compiled under other assumptions."""
    import fused_ops.matmul
    import fused_ops.hopper.pingpong
    import fused_ops.tuning as tuning

    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "auto" if main_loop == "auto" else "0")
    monkeypatch.setattr(fused_ops.env, "PINGPONG", False)  # the Triton kernels' plans are under test
    monkeypatch.setattr(tuning, "_plans", {})
    K, N, dtype = 256, 384, torch.bfloat16
    rows = (2 if act in GATED_ACTIVATIONS else 1) * N
    w = (torch.randn(rows, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(rows, device="cuda", dtype=dtype)
    grad_w2 = (torch.randn(K, N, device="cuda") * N ** -0.5).to(dtype)
    base = torch.randn(300, K + 24, device="cuda", dtype=dtype)
    xs = [base[:64, :K].contiguous(), base[:1, :K].contiguous(), base[:37, :K].contiguous(), base[:64, :K],
          base.view(-1)[1:1 + 40 * K].view(40, K), base[:64, :K].contiguous()]
    # (x, bias, out dtype, saved dtype): each case twice, the second call through the kept kernel
    cases = [(x, b, dtype, dtype) for x in xs] + [(xs[0], b, torch.float32, dtype), (xs[0], b.float(), dtype, dtype),
                                                  (xs[0], b, dtype, torch.float32)]
    for x, bias, out_dtype, saved_dtype in cases:
        for _ in range(2):
            out, saved = poisoned((x.shape[0], N), out_dtype, "cuda"), poisoned((x.shape[0], rows), saved_dtype, "cuda")
            linear_act_forward(x, w, bias, act, out=out, saved=saved)
            check_linear_act(out, saved, x, w, b, act)  # b.float() holds the same values as b
            grad_z = poisoned(saved.shape, out_dtype, "cuda")
            _, grad_b = linear_act_dgrad(x, grad_w2, saved, act, out=grad_z)
            check_dgrad(grad_z, grad_b, x, grad_w2, saved, act)
    plans = list(tuning._plans.values())
    assert all(p.direct for p in plans)
    for name in ("linear_act_kernel", "dgrad_kernel"):  # the main key of each kernel kept several kernels
        assert max(len(p.compiled) for p in plans if p.kernel.fn.__name__ == name) >= 3, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("M,K,N", [(4096, 768, 3072), (1000, 777, 1531)])
@pytest.mark.parametrize("mean", [0.0, 50.0])
def test_layernorm_fold_forward_large_and_odd(dtype, act, M, K, N, mean):
    rows = (2 if act in GATED_ACTIVATIONS else 1) * N
    x = (torch.randn(M, K, device="cuda") + mean).to(dtype)
    w = (torch.randn(rows, K, device="cuda") * K ** -0.5).to(dtype)
    b, g, beta = (torch.randn(n, device="cuda", dtype=dtype) for n in (rows, K, K))
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, rows), dtype, "cuda")
    ln_linear_act_forward(x, g, beta, 1e-5, w, b, act, out=out, saved=saved)
    # The reference: LayerNorm in float64, then the same check as the unfolded kernel (same-dtype eager
    # error measured on the normalized input).
    z64 = torch.nn.functional.layer_norm(x.double(), (K,), g.double(), beta.double(), 1e-5)
    z_eager = torch.nn.functional.layer_norm(x, (K,), g, beta, 1e-5)
    ref = torch.addmm(b.double(), z64, w.double().t())
    eager = torch.addmm(b, z_eager, w.t())
    check_saved(saved, eager, ref, act)
    # and h itself, the output the test poisoned (NaN where the kernel wrote nothing)
    assert_no_worse_than_eager(out, eager_act(act, eager), eager_act(act, ref), "output")


def _ln_mlp_tensors(act, C, H, x, dtype=torch.float32, bias=True):
    """[x, W1, b1, W2, b2, γ, β] on the GPU for the given x, parameters in `dtype`."""
    rows = (2 if act in GATED_ACTIVATIONS else 1) * H
    r = lambda *shape, scale=1.0, mean=0.0: (torch.randn(*shape, device="cuda") * scale + mean).to(dtype)  # noqa: E731
    return [x, r(rows, C, scale=C ** -0.5), r(rows) if bias else None, r(C, H, scale=H ** -0.5), r(C) if bias else None,
            r(C, scale=0.5, mean=1.0), r(C, scale=0.5) if bias else None]


# The fuzz cases of issue 22 (rows with a large mean against their spread, read through strides), and a
# training-size one: the fold's output and all gradients within the 2x-eager rule under 16-bit autocast.
LN_CASES = {  # name: (x's leading dims, C, H, how x is laid out, bias)
    "4096x768": ((4096,), 768, 3072, "contiguous", True),
    "8x1x71 strided": ((8, 1), 71, 284, "strided", True),
    "16x1x9 strided": ((16, 1), 9, 36, "strided", True),
    "73x80 expanded": ((73,), 80, 320, "expanded", True),
    "8x1x16 sliced, no bias": ((8, 1), 16, 64, "sliced", False),
    "8x64x48, no bias": ((8, 64), 48, 192, "contiguous", False),
}


def _laid_out(shape, C, mean, layout):
    if layout == "strided":
        return (torch.randn(*shape, 2 * C, device="cuda") + mean)[..., ::2]
    if layout == "sliced":
        return (torch.randn(*shape, C + 5, device="cuda") + mean)[..., 3:3 + C]
    if layout == "expanded":
        return (torch.randn(C, device="cuda") + mean).expand(*shape, C)
    return torch.randn(*shape, C, device="cuda") + mean


POOLED_SEEDS = 16  # seeds whose outputs a small case's errors are measured over, together


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "relu", "relu2", "swiglu", "geglu", "sigmoid_tanh"])
@pytest.mark.parametrize("mean", [25.0, 1000.0])
@pytest.mark.parametrize("case", list(LN_CASES))
def test_layernorm_fold_large_mean_under_autocast(half, act, mean, case):
    """The 2x rule, measured on enough numbers to mean something. A small case's gradients of γ and β are C
    numbers each (9 for "16x1x9 strided"), and the fused and eager paths round at different places (the saved
    16-bit dh/dz against eager's 16-bit grad_h): their errors are independent draws of about the same size, and
    the ratio of two 9-term norms exceeds 2 about 2.5% of the time (F(9, 9)). Issue 27 (b) was one such draw:
    seed 0 gave grad_ln_bias 2.4x eager's error, and over 40 seeds the median ratio was 1.04 with 1 seed in 40
    over 2x, with or without the fold's mean fix (results/gpu_numerics_ln_fold_h100.txt): noise, not a bias.
    So a small case is measured over POOLED_SEEDS seeds at once: ‖fused − ref‖ / ‖ref‖ over all their outputs
    stacked, against the same for eager, with the rule unchanged. A bias survives pooling; noise does not."""
    shape, C, H, layout, bias = LN_CASES[case]
    H = H * 2 // 3 if act in GATED_ACTIVATIONS else H
    seeds = 1 if math.prod(shape) * C >= 4096 else POOLED_SEEDS
    pooled = {}
    for seed in range(seeds):
        torch.manual_seed(seed)
        tensors = _ln_mlp_tensors(act, C, H, _laid_out(shape, C, mean, layout), bias=bias)
        grad_y = torch.randn(*shape, C, device="cuda")
        for name, f, e, r in ln_mlp_16bit_outputs(act, tensors, half, True, grad_y):
            pooled.setdefault(name, []).append((f.flatten(), e.flatten(), r.flatten()))
    for name, runs in pooled.items():
        f, e, r = (torch.cat(parts) for parts in zip(*runs))
        assert_within_rule(rel_err(f, r), rel_err(e, r), EPS[half], f"{act} {half} {case} mean {mean} {name} over "
                           f"{seeds} seed(s)")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("mean", [25.0, 1000.0])
def test_layernorm_fold_large_mean_16bit_modules(half, act, mean):
    torch.manual_seed(0)
    C, H = 768, 2048 if act in GATED_ACTIVATIONS else 3072
    tensors = _ln_mlp_tensors(act, C, H, (torch.randn(4096, C, device="cuda") + mean).to(half), half)
    check_ln_mlp_16bit(act, tensors, half, False, torch.randn(4096, C, device="cuda", dtype=half), f"{half} mean {mean}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["identity", "gelu", "gelu_tanh", "relu", "relu2", "swiglu", "geglu", "geglu_tanh",
                                 "sigmoid_tanh"])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_through_the_16bit_kernels(dtype, act, special, monkeypatch):
    """Non-finite values in a few rows of x: output and every gradient NaN / inf exactly where the math puts them.
    At this size (16-byte aligned rows, 16-bit) a Hopper GPU runs the forward in the ping-pong kernel, whose
    epilogues (its GELU polynomial included) are under test there: asserted by counting its launches."""
    from fused_ops import env
    from fused_ops.hopper import pingpong

    launches = []
    real = pingpong._launch
    monkeypatch.setattr(pingpong, "_launch", lambda *a, **k: (launches.append(k["EPILOGUE"]), real(*a, **k))[1])
    torch.manual_seed(0)
    gated = act in GATED_ACTIVATIONS
    M, C, H = 300, 768, 2048 if gated else 3072
    x = torch.randn(M, C, device="cuda", dtype=dtype)
    x[[7, 150, 299], [3, 400, 767]] = special
    params = [(torch.randn(*s, device="cuda") * scale).to(dtype) for s, scale in
              ((((2 if gated else 1) * H, C), C ** -0.5), (((2 if gated else 1) * H,), 1.0), ((C, H), H ** -0.5), ((C,), 1.0))]
    grad_y = torch.randn(M, C, device="cuda", dtype=dtype)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in [x] + params]
        y = fn(*leaves)
        y.backward(grad_y)
        return [y] + [t.grad for t in leaves]

    fused = run(lambda *t: fused_mlp(*t, act))
    # the expectation from the math (tests/special_values.py), not eager's: eager's GELU is NaN at -inf and
    # its derivatives NaN at ±inf, where the kernels give the limits (issue 27)
    name, up, _ = kernel_activations(act)
    expect = mlp_expected(x, *params, name, grad_y, gated_pair=(name, up) if gated else None)
    if special != special:
        assert expect[0][[7, 150, 299]].isnan().all()
    for what, f, e in zip(["y", "grad_x", "grad_w_fc", "grad_b_fc", "grad_w_proj", "grad_b_proj"], fused, expect):
        assert_nonfinite_pattern(f, e, f"{act} {dtype} {special} {what}")
    if torch.cuda.get_device_capability()[0] == 9 and pingpong.AVAILABLE and env.PINGPONG:
        assert "act" in launches


@pytest.mark.parametrize("fuse_ln", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "sigmoid_tanh"])
def test_gpt_under_bf16_autocast(activation, fuse_ln):
    torch.manual_seed(0)
    cfg = dict(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=256, activation=activation)
    eager = GPT(GPTConfig(mlp="eager", **cfg)).cuda()
    fused = GPT(GPTConfig(mlp="fused", fuse_ln=fuse_ln, **cfg)).cuda()
    fused.load_state_dict(eager.state_dict())
    reference = GPT(GPTConfig(mlp="eager", **cfg)).cuda().double()
    reference.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 512, (8, 128), device="cuda")
    tgt = torch.randint(0, 512, (8, 128), device="cuda")
    results = {}
    for name, model, autocast in (("fused", fused, True), ("eager", eager, True), ("ref", reference, False)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(idx, tgt)
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert torch.isfinite(results["fused"][0])
    assert_no_worse_than_eager(results["fused"][0].float(), results["eager"][0].float(), results["ref"][0], "loss",
                               compute_dtype=torch.bfloat16)
    for n, g in results["fused"][1].items():
        assert_no_worse_than_eager(g, results["eager"][1][n], results["ref"][1][n], f"grad {n}", compute_dtype=torch.bfloat16)


def test_fused_mlp_rejects_mixed_devices():
    x = torch.randn(4, 8, device="cuda")
    w_fc, w_proj = torch.randn(32, 8, device="cuda"), torch.randn(8, 32)
    with pytest.raises(ValueError, match="w_proj is on cpu"):
        fused_mlp(x, w_fc, None, w_proj, None, "gelu")


def test_float64_on_cuda_is_rejected_clearly():
    x = torch.randn(4, 8, device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="float64 runs only under the CPU interpreter"):
        fused_mlp(x, torch.randn(32, 8, device="cuda", dtype=torch.float64), None,
                  torch.randn(8, 32, device="cuda", dtype=torch.float64), None, "gelu")


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_fused_mlp_memory_peak_not_above_eager(act):
    """Issue 4's memory target at the MLP's level: forward + backward of the fused MLP peaks at or below the
    eager MLP (bf16, GPT-2-like shapes); its backward frees h and dh/dz at their last use."""
    gated = act in GATED_ACTIVATIONS
    M, C, H = 8192, 768, 2048 if gated else 3072
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
              for s in (((2 if gated else 1) * H, C), ((2 if gated else 1) * H,), (C, H), (C,))]
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_y = torch.randn(M, C, device="cuda", dtype=torch.bfloat16, generator=gen)

    def eager(x, w_fc, b_fc, w_proj, b_proj):
        z = torch.nn.functional.linear(x, w_fc, b_fc)
        h = GATED_ACTIVATIONS[act](*z.chunk(2, dim=-1)) if gated else torch.nn.functional.gelu(z)
        return torch.nn.functional.linear(h, w_proj, b_proj)

    def peak(fn):
        leaves = [t.clone().requires_grad_() for t in [x] + params]
        fn(*leaves).backward(grad_y)  # warm-up: tuning and workspaces outside the measured pass
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*leaves).backward(grad_y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    fused, eager_peak = peak(lambda *t: fused_mlp(*t, act)), peak(eager)
    assert fused <= eager_peak, f"fused MLP peaks {(fused - eager_peak) / 2**20:.1f} MiB above eager"
