"""The fused kernels against float64 references and the same-dtype eager PyTorch path.

Runs on CUDA when there is a GPU, else on CPU through Triton's interpreter (small shapes; no bf16 there,
since bf16 tl.dot is wrong in the interpreter: bf16 is covered by test_fused_gpu.py).
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ops
from fused_ops import linear_act_dgrad, linear_act_forward
from fused_ops.mlp import FusedMLPFunction, LinearActFunction, fused_mlp, linear_act
from model import GATED_ACTIVATIONS
from fused_ops.activations import kernel_activations
from numerics import assert_no_worse_than_eager, check_dgrad, check_linear_act, eager_act, poisoned, rel_err
from special_values import assert_nonfinite_pattern, mlp_expected

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
ALL_ACTS = ["identity", "gelu", "gelu_tanh", "relu", "relu2"] + list(GATED_ACTIVATIONS)
SHAPES = [(1, 16, 16), (37, 45, 70), (64, 32, 32), (70, 96, 33)]  # (M, K, N); most are not block multiples


def make(shape, dtype, scale=1.0, gen=None):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("act", ALL_ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_linear_act_forward(act, dtype, M, K, N):
    gated = act in GATED_ACTIVATIONS
    x, w, b = make((M, K), dtype), make(((2 if gated else 1) * N, K), dtype, K ** -0.5), make(((2 if gated else 1) * N,), dtype)
    out, saved = poisoned((M, N), dtype, DEVICE), poisoned((M, w.shape[0]), dtype, DEVICE)
    linear_act_forward(x, w, b, act, out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, act)


@pytest.mark.parametrize("act", ALL_ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_dgrad(act, dtype, M, K, N):
    """grad_z = (grad_y @ W2) * dh/dz and its column sums (the first linear's bias gradient), from the saved
    dh/dz (any values will do: dgrad only multiplies by them)."""
    gated = act in GATED_ACTIVATIONS
    grad_y, w2 = make((M, K), dtype), make((K, N), dtype, K ** -0.5)
    saved = make((M, (2 if gated else 1) * N), dtype)
    out = poisoned(saved.shape, dtype, DEVICE)
    grad_z, grad_bias = linear_act_dgrad(grad_y, w2, saved, act, out=out)
    assert grad_z is out
    check_dgrad(grad_z, grad_bias, grad_y, w2, saved, act)


@pytest.mark.parametrize("act", ["gelu", "relu2", "swiglu", "sigmoid_tanh"])
@pytest.mark.parametrize("M,K,N", [(37, 45, 70), (64, 32, 32)])
def test_whole_tile_epilogue(act, M, K, N, monkeypatch):
    """Configs may run the epilogue on the whole tile instead of half its columns at a time (SPLIT_EPILOGUE
    off): that path computes the same outputs."""
    import fused_ops.tuning as tuning

    whole = tuning._config(32, 32, 32, 4, 1, group_m=2, split=False)
    monkeypatch.setattr(tuning, "matmul_configs", lambda gated=False, dtype=None: [whole])
    monkeypatch.setattr(tuning, "_plans", {})
    test_linear_act_forward(act, torch.float32, M, K, N)
    test_dgrad(act, torch.float32, M, K, N)
    assert all(not cfg.kwargs["SPLIT_EPILOGUE"] for _, _, cfg, _ in tuning.TUNING_LOG[-2:])


TMA_SHAPES = [(1, 16, 16), (37, 48, 72), (70, 96, 40)]  # 16-byte aligned rows (TMA's rule), sizes not block multiples


@pytest.mark.parametrize("act", ALL_ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", TMA_SHAPES)
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_tma_main_loop(act, dtype, M, K, N, layout, monkeypatch):
    """Forward and dgrad with the operands read through TMA descriptors: out-of-bounds rows and the K
    tail come back as zeros from the copy engine, not from masks. A column-major weight is the other
    orientation of B (N-major in the forward, K-major in dgrad), and for gated activations moves the
    up half along columns instead of rows."""
    import fused_ops.matmul

    if fused_ops.matmul.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs a Hopper GPU")
    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "1")
    gated = act in GATED_ACTIVATIONS
    arrange = (lambda t: t.t().contiguous().t()) if layout == "column-major" else (lambda t: t)
    x, w, b = make((M, K), dtype), arrange(make(((2 if gated else 1) * N, K), dtype, K ** -0.5)), make(((2 if gated else 1) * N,), dtype)
    assert fused_ops.matmul.tma_operands(x, w.t())[0], "this case must take the TMA path"
    out, saved = poisoned((M, N), dtype, DEVICE), poisoned((M, w.shape[0]), dtype, DEVICE)
    linear_act_forward(x, w, b, act, out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, act)

    grad_y, w2 = make((M, K), dtype), arrange(make((K, N), dtype, K ** -0.5))
    assert fused_ops.matmul.tma_operands(grad_y, w2)[0], "this case must take the TMA path"
    grad_z = poisoned(saved.shape, dtype, DEVICE)
    _, grad_bias = linear_act_dgrad(grad_y, w2, saved, act, out=grad_z)
    check_dgrad(grad_z, grad_bias, grad_y, w2, saved, act)


@pytest.mark.parametrize("act", list(GATED_ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,halves", [(37, 48, 4), (70, 96, 2), (37, 48, 1.5)])
def test_gated_forward_pairs_the_gate_and_up_rows(act, dtype, M, K, halves, monkeypatch):
    """Through TMA, the gated forward reads the gate and up rows of a tile as one B tile (matmul_loop's B_PAIRS):
    the accumulator's left half is the gate, its right half the up projection. N = halves x the tile's half width;
    where that half does not divide N (halves 1.5), and with FUSED_OPS_GATE_PAIRS=0, two accumulators as before.
    (On a GPU the Hopper kernels are switched off: they would take the launch first.)"""
    import fused_ops.matmul
    import fused_ops.tuning

    if fused_ops.matmul.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs a Hopper GPU")
    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "1")
    monkeypatch.setattr(fused_ops.env, "PINGPONG", False)
    N = int(halves * fused_ops.tuning.matmul_configs(False, dtype)[0].kwargs["BLOCK_N"] // 2)
    paired = _paired_launches(monkeypatch)
    x, w, b = make((M, K), dtype), make((2 * N, K), dtype, K ** -0.5), make((2 * N,), dtype)
    for pairs in (True, False):
        monkeypatch.setattr(fused_ops.env, "GATE_PAIRS", pairs)
        out, saved = poisoned((M, N), dtype, DEVICE), poisoned((M, 2 * N), dtype, DEVICE)
        linear_act_forward(x, w, b, act, out=out, saved=saved)
        check_linear_act(out, saved, x, w, b, act)
    assert paired == [halves == int(halves), False]
    # NaN and ±inf in x: the paired kernel gives the pattern of the two-accumulator one (tested against the math in
    # test_nan_and_inf_reach_output_and_gradients), element for element
    x[3, 5], x[5, 7], x[6, 1] = float("nan"), float("inf"), -float("inf")
    runs = []
    for pairs in (True, False):
        monkeypatch.setattr(fused_ops.env, "GATE_PAIRS", pairs)
        runs.append(linear_act_forward(x, w, b, act))
    for a, e in zip(*runs):
        assert torch.equal(torch.isnan(a), torch.isnan(e)) and torch.equal(torch.isinf(a), torch.isinf(e))
        assert torch.equal(a[torch.isinf(a)], e[torch.isinf(e)])
        torch.testing.assert_close(a[torch.isfinite(a)], e[torch.isfinite(e)], rtol=1e-2, atol=1e-3)


def _paired_launches(monkeypatch):
    """[whether the gated forward paired its rows] for each forward launch from here on."""
    import importlib

    module = importlib.import_module("fused_ops.linear_act")
    paired = []

    def spy(kernel, *args, _real=module.launch_matmul, **kwargs):
        paired.append(args[4]["PAIRED"])
        return _real(kernel, *args, **kwargs)

    monkeypatch.setattr(module, "launch_matmul", spy)
    return paired


def test_tma_falls_back_to_pointers_for_unaligned_rows(monkeypatch):
    """Rows whose stride is not a multiple of 16 bytes cannot be described to TMA: the pointer loop runs."""
    import fused_ops.matmul

    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "1")
    x, w, b = make((37, 45), torch.float32), make((70, 45), torch.float32, 0.15), make((70,), torch.float32)
    assert fused_ops.matmul.tma_operands(x, w.t())[0] == []
    out, saved = poisoned((37, 70), torch.float32, DEVICE), poisoned((37, 70), torch.float32, DEVICE)
    linear_act_forward(x, w, b, "gelu", out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, "gelu")


def _mlp_tensors(dtype, act, M=33, C=40, H=72, bias=True, shape=None):
    gated = act in GATED_ACTIVATIONS
    x = make(shape or (M, C), dtype)
    w_fc, w_proj = make(((2 if gated else 1) * H, C), dtype, C ** -0.5), make((C, H), dtype, H ** -0.5)
    b_fc = make((w_fc.shape[0],), dtype) if bias else None
    b_proj = make((C,), dtype) if bias else None
    return x, w_fc, b_fc, w_proj, b_proj


def _eager_mlp(x, w_fc, b_fc, w_proj, b_proj, act):
    h = eager_act(act, torch.nn.functional.linear(x, w_fc, b_fc))
    return torch.nn.functional.linear(h, w_proj, b_proj)


def _run_with_grads(fn, tensors, grad_y):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    y.backward(grad_y)
    return [y] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu2", "swiglu", "sigmoid_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_mlp_output_and_all_gradients(act, dtype, bias):
    tensors = _mlp_tensors(dtype, act, bias=bias, shape=(3, 11, 40))  # 3-D input, M = 33
    grad_y = make((3, 11, 40), dtype)
    fused = _run_with_grads(lambda *t: fused_mlp(*t, act), tensors, grad_y)
    eager = _run_with_grads(lambda *t: _eager_mlp(*t, act), tensors, grad_y)
    ref = _run_with_grads(lambda *t: _eager_mlp(*t, act), [t.double() if t is not None else None for t in tensors],
                          grad_y.double())
    names = ["y", "grad_x", "grad_w_fc"] + (["grad_b_fc"] if bias else []) + ["grad_w_proj"] + (["grad_b_proj"] if bias else [])
    for name, f, e, r in zip(names, fused, eager, ref):
        assert f.shape == r.shape and f.dtype == e.dtype, name
        assert_no_worse_than_eager(f, e, r, f"{act} {dtype} {name}")


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_fused_mlp_with_paired_gate_rows_under_autocast(act, monkeypatch):
    """The gated forward with its rows paired (TMA, test_gated_forward_pairs_the_gate_and_up_rows) as training runs it:
    fp32 masters under fp16 autocast, the output and every gradient within the rule of eager under the same autocast."""
    import fused_ops.matmul

    if fused_ops.matmul.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs a Hopper GPU")
    monkeypatch.setattr(fused_ops.env, "TMA_MODE", "1")
    monkeypatch.setattr(fused_ops.env, "PINGPONG", False)  # (on a GPU the Hopper kernels would take it first)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    tensors = _mlp_tensors(torch.float32, act, C=48, H=64, shape=(3, 11, 48))
    grad_y = make((3, 11, 48), torch.float32)

    def under_autocast(fn):
        def run(*t):
            with torch.autocast(device_type, dtype=torch.float16):
                return fn(*t).float()
        return run

    paired = _paired_launches(monkeypatch)
    fused = _run_with_grads(under_autocast(lambda *t: fused_mlp(*t, act)), tensors, grad_y)
    eager = _run_with_grads(under_autocast(lambda *t: _eager_mlp(*t, act)), tensors, grad_y)
    ref = _run_with_grads(lambda *t: _eager_mlp(*t, act), [t.double() for t in tensors], grad_y.double())
    for name, f, e, r in zip(["y", "grad_x", "grad_w_fc", "grad_b_fc", "grad_w_proj", "grad_b_proj"], fused, eager, ref):
        assert_no_worse_than_eager(f, e, r, f"{act} autocast {name}", compute_dtype=torch.float16)
    assert paired == [True]


def test_non_contiguous_inputs():
    act = "gelu"
    _, w_fc, b_fc, w_proj, b_proj = _mlp_tensors(torch.float32, act)
    base = make((40, 66), torch.float32)
    x = base.t()[:, :40][:, ::1]  # (66, 40) view with strides (1, 66): column-major
    assert not x.is_contiguous()
    y = fused_mlp(x, w_fc, b_fc, w_proj.t().contiguous().t(), b_proj, act)  # w_proj column-major too
    ref = _eager_mlp(x.double(), w_fc.double(), b_fc.double(), w_proj.double(), b_proj.double(), act)
    assert rel_err(y, ref) < 1e-5
    wide = make((2, 9, 80), torch.float32)[..., ::2]  # every other feature: a strided last dim
    y = fused_mlp(wide, w_fc, b_fc, w_proj, b_proj, act)
    ref = _eager_mlp(wide.double(), w_fc.double(), b_fc.double(), w_proj.double(), b_proj.double(), act)
    assert y.shape == (2, 9, 40) and rel_err(y, ref) < 1e-5


def kernel_pair(act):
    """mlp_expected's (gated_pair, act) for a model-level activation name."""
    name, up, gated = kernel_activations(act)
    return ((name, up) if gated else None), name


# 16-bit runs on the GPU only: there C = 64 and H = 64 make the rows 16-byte aligned, so on a Hopper GPU the
# ping-pong kernel's epilogues (its GELU polynomial included) run; fp32 covers the Triton kernels everywhere.
@pytest.mark.parametrize("act", ALL_ACTS)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_reach_output_and_gradients(act, dtype, special):
    """One non-finite input in one row: the output and every gradient are NaN / ±inf exactly where the math
    puts them (a NaN must reach the loss, or train.py's NaN stop never fires). The expectation is derived,
    not eager's (tests/special_values.py; eager's GELU at ±inf depends on the CPU, issue 27): x[2, 5] = NaN
    makes row 2 of z, h and y NaN, every entry of dW2 (each sums over row 2 of h) and column 5 of dW1; and
    where act'(NaN) is NaN (all but identity and relu) row 2 of grad_z, so db1, all of dW1 and row 2 of dx.
    ±inf makes z[2, j] = ±inf by the sign of W1[j, 5]; the activation's limits there, and the IEEE sums of
    the matmuls after them (+inf and -inf together: NaN), say the rest."""
    tensors = _mlp_tensors(dtype, act, M=6, C=64, H=64)
    tensors[0][2, 5] = special
    grad_y = make((6, 64), dtype)
    fused = _run_with_grads(lambda *t: fused_mlp(*t, act), tensors, grad_y)
    gated_pair, name = kernel_pair(act)
    expect = mlp_expected(*tensors, name, grad_y, gated_pair=gated_pair)
    # the case is live: a NaN input makes the whole output row NaN, and inf makes something non-finite
    # (sigmoid_tanh's output stays finite for inf; its weight gradient does not)
    assert expect[0][2].isnan().all() if special != special else not all(torch.isfinite(e).all() for e in expect)
    if special != special:  # the derivation above, spelled out
        assert expect[4].isnan().all() and expect[2][:, 5].isnan().all() and not expect[5].isnan().any()
    for what, f, e in zip(["y", "grad_x", "grad_w_fc", "grad_b_fc", "grad_w_proj", "grad_b_proj"], fused, expect):
        assert_nonfinite_pattern(f, e, f"{act} {dtype} {special} {what}")


@pytest.mark.skipif(DEVICE == "cuda", reason="float64 kernels run only under the CPU interpreter (CI runs this)")
@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu", "sigmoid_tanh"])
def test_gradcheck_float64(act):
    """gradcheck's fast mode: it checks a random projection of the Jacobian (a wrong entry changes it all the same)
    for a fraction of the interpreter's time that every entry takes."""
    tensors = [t.requires_grad_() for t in _mlp_tensors(torch.float64, act, M=5, C=6, H=7)]
    assert torch.autograd.gradcheck(lambda *t: FusedMLPFunction.apply(*t, act), tensors, eps=1e-6, atol=1e-7,
                                    fast_mode=True)
    x, w, b = tensors[:3]
    assert torch.autograd.gradcheck(lambda *t: LinearActFunction.apply(*t, act), (x, w, b), eps=1e-6, atol=1e-7,
                                    fast_mode=True)


@pytest.mark.parametrize("retain", [False, True])
def test_backward_lets_h_and_dh_dz_go_at_their_last_use(retain):
    """The fused MLP's backward frees h once dW2 is made and dh/dz once grad_z is, before the first linear's
    matmuls (so its memory peak is not above eager's); under retain_graph it keeps them, and a second
    backward gives the same gradients."""
    x, w_fc, b_fc, w_proj, b_proj = [t.requires_grad_() for t in _mlp_tensors(torch.float32, "gelu")]
    hidden = []  # weak references to the saved (M, H) tensors: h and dh/dz

    def pack(t):
        if t.shape == (x.shape[0], w_proj.shape[1]):
            hidden.append(weakref.ref(t))
        return t

    alive = []  # how many of them are alive at each matmul of backward

    class CountAtMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                alive.append(sum(r() is not None for r in hidden))
            return func(*args, **(kwargs or {}))

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_mlp(x, w_fc, b_fc, w_proj, b_proj, "gelu")
    assert len(hidden) == 2
    grad_y = make(y.shape, torch.float32)
    with CountAtMatmuls():
        y.backward(grad_y, retain_graph=retain)
    # dW2 = grad_y.T @ h, then (after the dgrad kernel) grad_x = grad_z @ W1 and dW1 = grad_z.T @ x
    assert alive == ([2, 2, 2] if retain else [2, 0, 0])
    if retain:
        first = [t.grad.clone() for t in (x, w_fc, b_fc, w_proj, b_proj)]
        for t in (x, w_fc, b_fc, w_proj, b_proj):
            t.grad = None
        y.backward(grad_y)
        for a, b in zip(first, (x.grad, w_fc.grad, b_fc.grad, w_proj.grad, b_proj.grad)):
            assert torch.equal(a, b)


def test_linear_act_layer_matches_eager():
    x, w, b = make((2, 7, 24), torch.float32), make((40, 24), torch.float32, 0.2), make((40,), torch.float32)
    y = linear_act(x, w, b, "geglu")
    ref = eager_act("geglu", torch.nn.functional.linear(x.double(), w.double(), b.double()))
    assert y.shape == (2, 7, 20) and rel_err(y, ref) < 1e-5


def test_zero_size_batch():
    tensors = _mlp_tensors(torch.float32, "gelu", shape=(0, 40))
    x, w_fc, b_fc, w_proj, b_proj = [t.requires_grad_() for t in tensors]
    y = fused_mlp(x, w_fc, b_fc, w_proj, b_proj, "gelu")
    assert y.shape == (0, 40)
    y.sum().backward()
    assert x.grad.shape == (0, 40)
    for p in (w_fc, b_fc, w_proj, b_proj):
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0


def test_bad_inputs_name_the_argument():
    x, w_fc, b_fc, w_proj, b_proj = _mlp_tensors(torch.float32, "gelu")
    with pytest.raises(ValueError, match="activation"):
        fused_mlp(x, w_fc, b_fc, w_proj, b_proj, "swish")
    with pytest.raises(TypeError, match="w_fc"):
        fused_mlp(x, w_fc.half(), b_fc, w_proj, b_proj, "gelu")
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        fused_mlp(x.long(), w_fc, b_fc, w_proj, b_proj, "gelu")
    with pytest.raises(ValueError, match="last dim"):
        fused_mlp(x[:, :-1], w_fc, b_fc, w_proj, b_proj, "gelu")
    with pytest.raises(ValueError, match="w_fc must have 2\\*H"):
        fused_mlp(x, w_fc, b_fc, w_proj, b_proj, "swiglu")  # gated needs [gate; up] rows
    with pytest.raises(ValueError, match="b_proj must have shape"):
        fused_mlp(x, w_fc, b_fc, w_proj, b_fc, "gelu")
    with pytest.raises(ValueError, match="at least 1 dim"):
        fused_mlp(x[0, 0], w_fc, b_fc, w_proj, b_proj, "gelu")


def test_cpu_tensors_without_interpreter_are_rejected(monkeypatch):
    monkeypatch.setattr(fused_ops.env, "INTERPRET", False)
    x, w_fc, b_fc, w_proj, b_proj = (t.cpu() for t in _mlp_tensors(torch.float32, "gelu"))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fused_mlp(x, w_fc, b_fc, w_proj, b_proj, "gelu")


def test_strided_bias_and_buffers_are_rejected_not_misread():
    x, w_fc, b_fc, w_proj, b_proj = _mlp_tensors(torch.float32, "gelu")
    strided_bias = torch.repeat_interleave(b_fc, 2)[::2]
    assert torch.equal(strided_bias, b_fc) and strided_bias.stride(0) == 2
    with pytest.raises(ValueError, match="b_fc must be contiguous"):
        fused_mlp(x, w_fc, strided_bias, w_proj, b_proj, "gelu")
    M, N = x.shape[0], w_fc.shape[0]
    wide = torch.empty(M, 2 * N, device=DEVICE)
    with pytest.raises(ValueError, match="out must have unit column stride"):
        linear_act_forward(x, w_fc, b_fc, "gelu", out=wide[:, ::2])
    with pytest.raises(ValueError, match="saved must have shape"):
        linear_act_forward(x, w_fc, b_fc, "gelu", saved=torch.empty(M, N + 1, device=DEVICE))
    saved = make((M, N), torch.float32)
    with pytest.raises(ValueError, match="saved must have unit column stride"):
        linear_act_dgrad(make((M, 40), torch.float32), w_proj, torch.repeat_interleave(saved, 2, dim=1)[:, ::2], "gelu")


def test_interpreter_problem_names_the_versions_and_the_remedy(monkeypatch):
    """env.interpreter_problem (fused_ops refuses to import under TRITON_INTERPRET=1 when it answers): None for the
    Triton and NumPy this suite runs on; for Triton 3.6's interpreter, which reads a scalar with int(array), beside a
    NumPy that refuses that (2.4), one line naming both versions and what to install."""
    import numpy
    import triton
    from triton.runtime import interpreter
    from fused_ops import env
    assert env.interpreter_problem() is None

    def _patch_lang_tensor(tensor, scope):  # (the line of Triton 3.6's)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    class Refused:  # (NumPy 2.4's 1-element array: no int() of it)
        def __int__(self):
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _patch_lang_tensor)
    monkeypatch.setattr(numpy, "zeros", lambda *shape, **kw: Refused())
    problem = env.interpreter_problem()
    assert problem.startswith(f"TRITON_INTERPRET=1: the CPU interpreter of Triton {triton.__version__} cannot run with "
                              f"NumPy {numpy.__version__} ")
    assert problem.endswith("install a later Triton (3.9 is tested) or numpy<2.4")
