"""fused_ops/fp8/weight_copies.py: every FP8 weight copy of a model in three launches, bit for bit quantize_weight's
(the weights' current scaling), special values included; its operator under torch.compile; and model.GPT, compiled
whole, making all its layers' copies with it."""

import pytest
import torch

import model
from fused_ops.fp8 import E4M3, FP8_MAX, fp8_weight_copies
from fused_ops.fp8 import kernels as fp8_kernels
from fused_ops.fp8 import state as fp8_state
from fused_ops.fp8 import weight_copies
from test_fp8 import needs_fp8_gpu


def same_bits(a, b):
    """The same bits, where a NaN's sign bit does not count (PyTorch's CPU kernels flip it on some machines: the
    math says NaN, not which)."""
    if a.dtype != E4M3:
        return torch.equal(a, b)
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    both_nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
    return torch.equal(torch.where(both_nan, 0x7F, a), torch.where(both_nan, 0x7F, b))


def weights_with_special_values(device, scale=1.0):
    """Weights of several shapes (tiles cut at both edges: 48 x 80, 80 x 208) and contents: plain, one NaN, ±inf and
    a value past fp8's range, all zeros, subnormal fp32 among ordinary values, and one whose values all lie below
    448 / FLT_MAX (its scale would overflow to inf)."""
    g = torch.Generator(device).manual_seed(0)
    shapes = [(48, 80), (16, 16), (128, 64), (32, 16), (80, 208), (64, 48), (16, 32)]
    ws = [torch.randn(s, device=device, generator=g, dtype=torch.float32) * scale for s in shapes]
    ws[2][3, 5] = float("nan")
    ws[4][0, 0], ws[4][7, 100], ws[4][1, 1] = float("inf"), float("-inf"), -1e30
    ws[3].zero_()
    ws[5][::3] *= 1e-38  # (fp32 subnormals once scaled down this far)
    ws[6] *= 1e-36
    return ws


def check_copies(weights):
    for i, (w, made) in enumerate(zip(weights, fp8_weight_copies(weights))):
        want = fp8_state.quantize_weight(w)
        assert [tuple(t.shape) for t in made] == [tuple(t.shape) for t in want], i
        assert all(same_bits(m, e) for m, e in zip(made, want)), i
        assert made[0].is_contiguous() and made[1].is_contiguous()
        assert made[2].data_ptr() % 16 == 0  # (cuBLAS reads a scale only from a 16-byte aligned address)


def test_weight_copies_are_quantize_weight_bit_for_bit_special_values_too():
    check_copies(weights_with_special_values("cpu", 0.02))


def test_weight_copies_follow_the_math():
    """From the definition, not from quantize_weight: the largest |W| maps to 448 exactly, 1/scale = amax / 448 in
    fp32, NaN and ±inf come out NaN (scale 1, values past the range saturated), a weight of zeros keeps scale 1."""
    w = torch.tensor([[0.5, -2.0] + [0.25] * 14] * 16)
    w[3, 3], w[4, 4], w[5, 5] = float("nan"), float("inf"), float("-inf")
    w[6, 6], w[7, 7] = 1000.0, -1e30  # (at scale 1: past e4m3's range, saturated to ±448)
    finite = torch.tensor([[0.5, -2.0] + [0.25] * 14] * 16)
    (q, qt, inv), (qf, _, invf), (qz, _, invz) = fp8_weight_copies([w, finite, torch.zeros(16, 16)])
    assert inv.item() == 1.0  # (NaN or inf in W: scale 1)
    assert invf.item() == torch.tensor(1 / 224, dtype=torch.float32).item()  # scale 448 / 2 = 224
    assert qf.float()[0, 1].item() == -448.0 and qf.float()[0, 0].item() == 112.0
    assert q.float()[3, 3].isnan() and q.float()[4, 4].isnan() and qt.float()[4, 4].isnan() and q.float()[5, 5].isnan()
    assert q.float()[6, 6].item() == 448.0 and q.float()[7, 7].item() == -448.0 and qt.float()[7, 7].item() == -448.0
    assert q.float()[0, 1].item() == -2.0
    assert torch.equal(torch.nan_to_num(qt.float()), torch.nan_to_num(q.float().t()))
    assert invz.item() == 1.0 and not qz.float().any()
    tiny = torch.full((16, 16), 1e-37)  # 448 / 1e-37 overflows fp32: the largest float, and W8 · 1/scale is W again
    q, _, inv = fp8_weight_copies([tiny])[0]
    assert torch.isfinite(q.float()).all() and inv.item() > 0
    assert torch.allclose(q.float() * inv, tiny, rtol=0.07)  # (e4m3's 3 mantissa bits)


def test_same_addresses_in_another_dtype_get_a_plan_of_their_own():
    """A plan is kept by the weights' addresses and shapes and dtype: a bf16 weight where an fp32 one of the same shape
    lay (one model freed, another built) is read as bf16."""
    buffer = torch.randn(32 * 32) * 0.02
    w32, w16 = buffer.view(32, 32), buffer.view(torch.bfloat16)[:32 * 32].view(32, 32)
    assert w32.data_ptr() == w16.data_ptr()
    check_copies([w32])
    w16.copy_(torch.randn(32, 32) * 0.02)
    check_copies([w16])


def test_the_scales_are_float32_whatever_the_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        check_copies(weights_with_special_values("cpu", 0.02)[:2])
    finally:
        torch.set_default_dtype(default)


def test_one_by_one_is_the_same_bits():
    """What the operator makes for weights first seen during a CUDA graph's capture (no table can be uploaded then):
    each weight through quantize_weight_fused, into the same three tensors."""
    weights = weights_with_special_values("cpu", 0.02)
    (q, qt, inv), (q2, qt2, inv2) = weight_copies._one_by_one(weights), weight_copies.fp8_weight_copies_op(weights)
    assert same_bits(q, q2) and same_bits(qt, qt2) and torch.equal(inv[:, 0], inv2[:, 0])  # (a row's 1/scale: col 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_models_weights_are_quantize_weights_too(dtype):
    """A 16-bit model's weights (no fp32 masters): read in their dtype, quantized as quantize_weight does, in fp32.
    (Not the weight below 448 / FLT_MAX: the interpreter's bf16 conversion of subnormals is not exact, and at the
    largest scale they count.)"""
    check_copies([w.to(dtype) for w in weights_with_special_values("cpu", 0.02)[:-1]])


@pytest.mark.parametrize("bad", ["mixed", "odd", "strided", "misaligned", "int", "none"])
def test_bad_weights_are_refused_by_name(bad):
    w = torch.randn(32, 16)
    weights = {"mixed": [w, w.half()], "odd": [torch.randn(24, 16)], "strided": [torch.randn(16, 32).t()],
               "misaligned": [torch.randn(16 * 16 + 1)[1:].view(16, 16)], "int": [w.int()], "none": []}[bad]
    assert bad == "misaligned" or not weight_copies.can_run(weights)
    with pytest.raises(ValueError, match="fp8_weight_copies takes weights .N, K. with N and K multiples of 16"):
        fp8_weight_copies(weights)


def test_the_operator_compiles_fullgraph_to_the_same_bits():
    torch._dynamo.reset()
    weights = weights_with_special_values("cpu", 0.02)[1:3]
    compiled = torch.compile(fp8_weight_copies, backend="aot_eager", fullgraph=True)
    for made, want in zip(compiled(weights), fp8_weight_copies(weights)):
        assert all(same_bits(m, e) for m, e in zip(made, want))


def graph_ops(gpt, idx):
    """The operators of the forward graph that torch.compile traces of gpt (aot_eager), by name."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.float16):
        torch.compile(gpt, backend=backend, fullgraph=True)(idx, idx)[1].backward()
    return seen


@pytest.mark.parametrize("reach", ["mlp", "blocks"])
def test_a_gpt_compiled_whole_makes_every_copy_in_one_operator(reach):
    """Two layers, compiled whole: one fp8_weight_copies node for all their FP8 weights (2 a layer with the MLP's
    reach, 4 with the blocks'), and no weight copy made by a layer (quantize_weight's amax is an abs)."""
    torch.manual_seed(0)
    gpt = model.GPT(model.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, mlp="fused",
                                    fp8=True, fp8_reach=reach, dropout=0.0))
    ops = graph_ops(gpt, torch.randint(0, 64, (2, 16)))
    assert ops.count("fused_mlp.fp8_weight_copies.default") == 1
    assert not any("abs" in op for op in ops)
    assert len(gpt.transformer.h[0].fp8_weights()[0]) == (2 if reach == "blocks" else 0)


def test_a_16_bit_gpt_compiled_whole_makes_its_copies_in_one_operator():
    """A model cast to fp16 (no autocast): its weights go into the operator in fp16, and the step is the uncompiled
    one's, bit for bit. (tests/test_fp8.py's fullgraph test does the same under autocast, fp32 weights.)"""
    torch.manual_seed(0)
    config = model.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, mlp="fused", fp8=True,
                             fp8_reach="blocks", dropout=0.0)
    idx = torch.randint(0, 64, (2, 16))
    plain = model.GPT(config).half()
    compiled = model.GPT(config).half()
    compiled.load_state_dict(plain.state_dict())
    assert weight_copies.can_run([w for b in compiled.transformer.h for part in b.fp8_weights() for w in part])
    torch._dynamo.reset()
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)
    losses = [gpt(idx, idx)[1] for gpt in (plain, torch.compile(compiled, backend=backend, fullgraph=True))]
    assert seen.count("fused_mlp.fp8_weight_copies.default") == 1
    assert losses[0].item() == losses[1].item()
    for gpt, loss in zip((plain, compiled), losses):
        loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), compiled.parameters()))


def test_weights_the_operator_cannot_take_are_copied_by_each_layer():
    """One block's weights in fp16, the others' in fp32 (under autocast both work): no model-wide operator, each
    layer's own copies (quantize_weight, an abs for its amax)."""
    torch.manual_seed(0)
    gpt = model.GPT(model.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, mlp="fused",
                                    fp8=True, dropout=0.0))
    gpt.transformer.h[1].mlp.half()
    ops = graph_ops(gpt, torch.randint(0, 64, (2, 16)))
    assert "fused_mlp.fp8_weight_copies.default" not in ops and ops.count("abs") == 4


@needs_fp8_gpu
@pytest.mark.gpu
def test_weight_copies_are_quantize_weight_bit_for_bit_on_the_gpu():
    """GPT-2 small's 48 FP8 weights (12 blocks' c_attn, c_proj, c_fc, c_proj) in one call, against
    quantize_weight_fused (the uncompiled path's) and quantize_weight compiled (a layer's under torch.compile);
    then the special values' weights."""
    torch._dynamo.reset()
    compiled = torch.compile(fp8_state.quantize_weight, dynamic=False)
    g = torch.Generator("cuda").manual_seed(0)
    weights = [torch.randn(s, device="cuda", generator=g) * 0.02
               for s in [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12]
    for i, (w, made) in enumerate(zip(weights, fp8_weight_copies(weights))):
        for want in (fp8_kernels.quantize_weight_fused(w), compiled(w)):
            assert all(same_bits(m, e) for m, e in zip(made, want)), i
    check_copies(weights_with_special_values("cuda", 0.02))
    assert FP8_MAX[E4M3] == 448.0


@needs_fp8_gpu
@pytest.mark.gpu
def test_weight_copies_replay_in_a_cuda_graph_on_the_gpu():
    """Captured in a CUDA graph (as torch.compile's reduce-overhead records a step), a replay makes the copies of the
    weights as they are then: the weights changed in place between replays, the copies follow."""
    weights = [torch.randn(s, device="cuda") for s in [(768, 768), (3072, 768)]]
    fp8_weight_copies(weights)  # (the plan and the kernels, before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        made = fp8_weight_copies(weights)
    for step in range(3):
        for w in weights:
            w.mul_(1.5).add_(0.01)
        graph.replay()
        for w, copies in zip(weights, made):
            assert all(same_bits(m, e) for m, e in zip(copies, fp8_state.quantize_weight(w))), step


@needs_fp8_gpu
@pytest.mark.gpu
def test_weights_first_seen_in_a_capture_are_copied_one_by_one_on_the_gpu():
    """A graph re-recorded for moved parameters captures the operator on weights it has no plan for: it makes the copies
    one by one (no table upload inside a capture), and the replays follow the weights."""
    weights = [torch.randn(s, device="cuda") for s in [(768, 768), (3072, 768)]]
    fp8_kernels.quantize_weight_fused(weights[0])  # (its kernels compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        made = fp8_weight_copies(weights)
    for w in weights:
        w.mul_(0.5)
    graph.replay()
    for w, copies in zip(weights, made):
        assert all(same_bits(m, e) for m, e in zip(copies, fp8_state.quantize_weight(w)))
