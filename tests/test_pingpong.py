"""The Hopper ping-pong kernel (fused_ops/pingpong.py): it compiles for sm_90 with the installed Triton
(on any machine), and on a Hopper GPU it computes what the eager path does, no worse than it."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fused_ops import env, linear_act_dgrad, linear_act_forward
from fused_ops.fp8 import hopper as fp8_hopper
from fused_ops.hopper import pingpong
from model import GATED_ACTIVATIONS
from numerics import check_dgrad, check_linear_act, poisoned, rel_err

# On a GPU the ping-pong kernel must run where it is chosen: its silent fallback would pass every check.
pytestmark = pytest.mark.filterwarnings("error::fused_ops.hopper.pingpong.FallbackWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

COMPILE_FOR_SM90 = """
import json, sys, traceback, torch, triton, warnings
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from fused_ops.hopper import pingpong as pp
from fused_ops.fp8 import hopper as fp8_pp

def compile_for_sm90(args, consts, tiles, device):  # stands in for the launch
    signature, constexprs, args = {}, {}, list(args)
    for i, p in enumerate(pp.pingpong_kernel.params):
        arg = consts[p.name] if p.is_constexpr else args.pop(0)
        signature[p.name] = "constexpr" if p.is_constexpr else mangle_type(arg)
        if signature[p.name] == "constexpr":  # a constexpr parameter, or an argument passed as None
            constexprs[(i,)] = arg
    kernel = triton.compile(GluonASTSource(pp.pingpong_kernel, signature, constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=consts["CONSUMER_WARPS"],
                                         maxnreg=pp.registers(consts["CONSUMER_WARPS"])[0]))
    shared.append(kernel.metadata.shared)
    evens.append(consts["EVEN"])

pp._run = compile_for_sm90
warnings.simplefilter("error", pp.FallbackWarning)  # a failure must fail this test, not fall back
shared = []  # compile_for_sm90's: each kernel's shared memory (bytes)
evens = []  # and whether it was compiled for whole tiles (EVEN)


def compile_case(op, act, up_act, gated, bias, even):
    M, K, N = (1024, 200, 512) if even else (1000, 200, 520)
    t = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)
    rows = 2 * N if gated else N
    if op == "forward":
        pp.linear_act_forward(t(M, K), t(rows, K), t(rows) if bias else None, act, up_act, gated, bias, t(M, N), t(M, rows))
    elif op in ("forward_fp8", "dgrad_fp8", "forward_fp8_in", "dgrad_fp8_in"):  # (FP8 in: rows of 16 bytes)
        K, N, inv = 256, 512, (torch.ones(1), torch.ones(1))  # (M: even or not)
        e4m3 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e4m3fn)
        e5m2 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e5m2)
        rows = 2 * N if gated else N
        if op == "forward_fp8":
            fp8_pp.linear_act_forward_fp8(e4m3(M, K), e4m3(rows, K), inv, t(rows) if bias else None, act, e4m3(M, N),
                                      e4m3(N, 1008), t(M, rows), torch.ones(1), torch.ones(1), up_act, gated)
        elif op == "dgrad_fp8":
            fp8_pp.dgrad_fp8(e5m2(M, K), e4m3(N, K), inv, t(M, rows), e5m2(M, rows), e5m2(rows, 1008), bias, torch.ones(1),
                         torch.ones(1), gated)
        elif op == "forward_fp8_in":  # 16-bit outputs (the fallback when an FP8 output fails: then a cast pass)
            pp.linear_act_forward(e4m3(M, K), e4m3(rows, K), t(rows) if bias else None, act, up_act, gated, bias,
                                  t(M, N), t(M, rows), inv=inv)
        else:
            pp.dgrad(e5m2(M, K), e4m3(N, K), t(M, rows), t(M, rows), gated, bias, inv=inv)
    elif op == "lse":  # the classifier's logits GEMM, 16-bit or FP8 in (act says which)
        inv = (torch.ones(1), torch.ones(1)) if act == "fp8" else None
        a = (lambda *shape: torch.empty(*shape, dtype=torch.float8_e4m3fn)) if inv else t
        assert pp.logits_lse(a(M, 256), a(N, 256), t(M, N), inv) is not None
    else:
        pp.dgrad(t(M, K), t(K, N), t(M, rows), t(M, rows), gated, bias)


results = {}
for case in json.loads(sys.argv[1]):  # [op, act, up_act, gated, bias, even]: one process compiles them all
    shared.clear()
    evens.clear()
    pp.FAILURE = pp.LOGITS_FAILURE = fp8_pp.FP8_FAILURE = None  # (one case's failure turns the kernel off: not here)
    try:
        op, act, up_act, gated, bias, even = case
        compile_case(op, act, up_act, bool(gated), bool(bias), bool(even))
        results[" ".join(map(str, case))] = {"shared": max(shared), "even": all(evens)}
    except Exception:
        results[" ".join(map(str, case))] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(results))
"""


SM90_CASES = [
    ("forward", "gelu", "identity", 0, 1), ("forward", "relu2", "identity", 0, 0),
    ("forward", "silu", "identity", 1, 1), ("forward", "sigmoid", "tanh", 1, 0),
    ("forward_fp8", "gelu", "identity", 0, 1), ("forward_fp8", "relu2", "identity", 0, 0),
    ("dgrad_fp8", "identity", "identity", 0, 1), ("dgrad_fp8", "identity", "identity", 0, 0),
    ("forward_fp8", "silu", "identity", 1, 1), ("forward_fp8", "gelu", "identity", 1, 0),
    ("dgrad_fp8", "identity", "identity", 1, 1), ("dgrad_fp8", "identity", "identity", 1, 0),
    ("forward_fp8_in", "silu", "identity", 1, 1), ("forward_fp8_in", "gelu", "identity", 0, 0),
    ("dgrad_fp8_in", "identity", "identity", 1, 1), ("dgrad_fp8_in", "identity", "identity", 1, 0),
    ("dgrad", "identity", "identity", 0, 1), ("dgrad", "identity", "identity", 0, 0),
    ("dgrad", "identity", "identity", 1, 1), ("lse", "bf16", "identity", 0, 0), ("lse", "fp8", "identity", 0, 0)]
# The same kernels where M and N are whole tiles (EVEN: the forward's bias load and rows unmasked), as in training.
SM90_CASES = [case + (0,) for case in SM90_CASES] + [
    ("forward", "gelu", "identity", 0, 1, 1), ("forward_fp8", "gelu", "identity", 0, 1, 1),
    ("forward_fp8", "silu", "identity", 1, 1, 1)]


@pytest.mark.skipif(not pingpong.AVAILABLE and "TRITON_INTERPRET" not in os.environ,
                    reason="this Triton has no Gluon")
def test_compiles_for_hopper():
    """Every case of SM90_CASES (op, activation, up activation, gated, bias, even) compiled (not run) for sm_90 through
    the real launcher, in one process without the interpreter (one start of torch and Triton for all of them): catches a
    Triton whose Gluon API moved (TMA copy names, warp_specialize) or a variant whose shared memory outgrew an H100's
    before a Hopper user does. Triton bundles ptxas. (bias also means save; even: M and N whole tiles, which the
    launcher must see.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90, json.dumps(SM90_CASES)],
                          env=env, capture_output=True, text=True, timeout=600)
    if "No module named 'triton.experimental.gluon" in done.stderr:
        pytest.skip("this Triton has no Gluon")
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.splitlines()[-1])
    assert len(built) == len(SM90_CASES)
    failed = {case: b["error"] for case, b in built.items() if "error" in b}
    assert not failed, "\n".join(f"{case}:\n{error}" for case, error in failed.items())
    assert [b["even"] for b in built.values()] == [bool(case[5]) for case in SM90_CASES]
    too_big = {case: b["shared"] for case, b in built.items() if b["shared"] > 227 * 1024}  # an H100's per block
    assert not too_big, too_big


def test_register_plans_fit_an_sm():
    """Each consumer size's registers (registers()) fit one SM's 64K at launch and after setmaxnreg moves the loader's
    share to the two consumers, within setmaxnreg's range (24-256, multiples of 8); the plain dgrad gets one warpgroup
    a consumer, every other variant two."""
    for warps in (pingpong.CONSUMER_WARPS, pingpong.DGRAD_CONSUMER_WARPS):
        at_launch, consumer = pingpong.registers(warps)
        assert at_launch * 32 * (2 * warps + 4) <= 65536
        assert consumer * 32 * 2 * warps + pingpong.LOADER_REGS * 128 <= 65536
        assert consumer % 8 == 0 and at_launch <= consumer <= 256
    assert pingpong.registers(8) == (96, 112) and pingpong.registers(4) == (168, 240)
    warps = lambda epilogue, gated: pingpong._blocks_and_consts(True, epilogue, "identity", "identity", gated, False,
                                                                False)[2]["CONSUMER_WARPS"]
    assert (warps("mul", False), warps("mul", True), warps("act", False), warps("lse", False)) == (4, 8, 8, 8)


def test_descriptor_cache_keeps_no_tensor():
    """A descriptor is looked up by address, shape, strides, dtype and block: the same for a later tensor
    at the same address and layout, a new one when any of them differs; the cache holds no tensor (freed
    activations must not stay alive) and is emptied when full."""
    if not hasattr(pingpong, "GluonDescriptor"):
        pytest.skip("this Triton has no Gluon")
    import weakref
    pingpong._descriptors.clear()
    t = torch.empty(256, 128, dtype=torch.bfloat16)
    desc = pingpong._descriptor(t, (128, 64))
    assert desc.base.data_ptr() == t.data_ptr()
    assert (desc.shape, desc.strides, desc.block_shape) == ([256, 128], [128, 1], [128, 64])
    assert pingpong._descriptor(t.view(256, 128), (128, 64)) is desc  # another tensor, same address and layout
    assert pingpong._descriptor(t, (128, 32)) is not desc
    assert pingpong._descriptor(t[:128], (128, 64)).shape == [128, 128]
    assert pingpong._descriptor(t.view(128, 256), (128, 64)).strides == [256, 1]
    assert pingpong._descriptor(t[64:], (128, 64)).base.data_ptr() == t[64:].data_ptr()  # a view's own address
    assert pingpong._descriptor(t.view(torch.float16), (128, 64)) is not desc  # same address, another dtype
    gone = weakref.ref(t)
    del t
    assert gone() is None
    pingpong._descriptors.clear()
    rows = torch.empty(pingpong.MAX_DESCRIPTORS + 1, 8, dtype=torch.bfloat16)
    for i in range(len(rows)):  # as many different shapes
        pingpong._descriptor(rows[: i + 1], (16, 8))
    assert len(pingpong._descriptors) == 1


needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")


@pytest.fixture
def launches(monkeypatch):
    """Counts the ping-pong kernel's launches (so a test knows it ran, not the Triton fallback). These tests examine
    the ping-pong kernels, so they run them even where FUSED_OPS_PINGPONG=0 gives the rest of the suite the portable
    ones."""
    monkeypatch.setattr(env, "PINGPONG", True)
    calls = []
    real = pingpong._launch
    monkeypatch.setattr(pingpong, "_launch", lambda *a, **k: (calls.append(k["EPILOGUE"]), real(*a, **k))[1])
    return calls


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu2", "relu", "identity",
                                 "swiglu", "geglu", "geglu_tanh", "sigmoid_tanh"])
@pytest.mark.parametrize("M,K,N", [(2048, 768, 3072), (1000, 200, 520), (5, 768, 3072), (129, 64, 136)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_dgrad(dtype, act, M, K, N, bias, launches):
    """Against float64, no worse than eager (numerics.py). (2048, 768, 3072): more tiles than SMs and 12
    K slices per tile, so every program runs both consumers and wraps the loader's ring many times.
    Gated: W is [gate; up] (2N rows) and saved / grad_z [gate | up] (2N columns)."""
    rows = 2 * N if act in GATED_ACTIVATIONS else N
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = (torch.randn(rows, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(rows, device="cuda", dtype=dtype) if bias else None
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, rows), dtype, "cuda")
    linear_act_forward(x, w, b, act, out=out, saved=saved)
    check_linear_act(out, saved, x, w, b if bias else torch.zeros(rows, device="cuda", dtype=dtype), act)

    grad_y = torch.randn(M, K, device="cuda", dtype=dtype)
    w2 = (torch.randn(K, N, device="cuda") * N ** -0.5).to(dtype)
    grad_z = poisoned((M, rows), dtype, "cuda")
    _, grad_b = linear_act_dgrad(grad_y, w2, saved, act, out=grad_z)
    check_dgrad(grad_z, grad_b, grad_y, w2, saved, act)
    if not bias:  # the first linear has no bias: the same grad_z, no column sums
        grad_z2, none = linear_act_dgrad(grad_y, w2, saved, act, bias_grad=False,
                                         out=poisoned((M, rows), dtype, "cuda"))
        assert none is None and torch.equal(grad_z2, grad_z)
    gated = act in GATED_ACTIVATIONS
    assert launches == (["act"] + ["mul"] * pingpong.takes_dgrad(gated, K, True)
                        + ([] if bias else ["mul"] * pingpong.takes_dgrad(gated, K, False)))
    if gated:  # the ping-pong dgrad itself, also where the Triton one is faster and takes over
        grad_z3 = poisoned((M, rows), dtype, "cuda")
        ran, grad_b3 = pingpong.dgrad(grad_y, w2, saved, grad_z3, True, True)
        assert ran
        check_dgrad(grad_z3, grad_b3, grad_y, w2, saved, act)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("act,K,bias_grad", [("swiglu", 768, False), ("swiglu", 768, True), ("swiglu", 1024, False),
                                             ("gelu", 1024, True), ("gelu", 2048, False)])
def test_dgrad_goes_where_it_is_faster(act, K, bias_grad, launches):
    """The gated dgrad runs on the ping-pong kernel only up to K = GATED_DGRAD_MAX_K and without the bias
    gradient (pingpong.takes_dgrad; the Triton one measured faster elsewhere), the plain one always; the
    result is right either way."""
    M, N, dtype = 300, 256, torch.bfloat16
    gated = act in GATED_ACTIVATIONS
    rows = 2 * N if gated else N
    saved = torch.randn(M, rows, device="cuda", dtype=dtype)
    grad_y = torch.randn(M, K, device="cuda", dtype=dtype)
    w2 = (torch.randn(K, N, device="cuda") * N ** -0.5).to(dtype)
    grad_z = poisoned((M, rows), dtype, "cuda")
    _, grad_b = linear_act_dgrad(grad_y, w2, saved, act, bias_grad=bias_grad, out=grad_z)
    check_dgrad(grad_z, grad_b, grad_y, w2, saved, act, bias_grad)
    here = not gated or (K <= pingpong.GATED_DGRAD_MAX_K and not bias_grad)
    assert launches == (["mul"] if here else [])


@pytest.mark.gpu
@needs_hopper
def test_forward_without_saving_and_kept_kernels(launches):
    """save=False writes only the output; the second launch of a specialization uses the kept kernel."""
    M, K, N, dtype = 1000, 256, 384, torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(N, device="cuda", dtype=dtype)
    ref, ref_saved = linear_act_forward(x, w, b, "gelu")
    kept = len(pingpong._compiled)
    for _ in range(2):
        out = poisoned((M, N), dtype, "cuda")
        assert linear_act_forward(x, w, b, "gelu", save=False, out=out)[1] is None
        assert torch.equal(out, ref)
    assert len(pingpong._compiled) == kept + 1 and launches == ["act"] * 3


@pytest.mark.gpu
@needs_hopper
def test_what_tma_cannot_take_falls_back(launches):
    """A 16-byte-misaligned x, an fp32 output, or a gated activation whose up half would start off a
    16-byte boundary (N not a multiple of 8, in buffers whose rows are aligned) go to the Triton kernels."""
    M, K, N, dtype = 64, 256, 384, torch.bfloat16
    base = torch.randn(M * K + 1, device="cuda", dtype=dtype)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(N, device="cuda", dtype=dtype)
    x = base[1:].view(M, K)
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, N), dtype, "cuda")
    linear_act_forward(x, w, b, "gelu", out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, "gelu")
    out32 = poisoned((M, N), torch.float32, "cuda")
    linear_act_forward(x.contiguous(), w, b, "gelu", out=out32, saved=saved)
    check_linear_act(out32, saved, x, w, b, "gelu")
    n = N - 4
    out, saved = poisoned((M, N), dtype, "cuda")[:, :n], poisoned((M, 2 * N), dtype, "cuda")[:, :2 * n]
    w_gate_up = (torch.randn(2 * n, K, device="cuda") * K ** -0.5).to(dtype)
    b_gate_up = torch.randn(2 * n, device="cuda", dtype=dtype)
    linear_act_forward(x.contiguous(), w_gate_up, b_gate_up, "swiglu", out=out, saved=saved)
    check_linear_act(out, saved, x, w_gate_up, b_gate_up, "swiglu")
    grad_y, w2 = torch.randn(M, K, device="cuda", dtype=dtype), (torch.randn(K, n, device="cuda") * n ** -0.5).to(dtype)
    grad = poisoned((M, 2 * N), dtype, "cuda")[:, :2 * n]
    _, grad_b = linear_act_dgrad(grad_y, w2, saved, "swiglu", out=grad)
    check_dgrad(grad, grad_b, grad_y, w2, saved, "swiglu")
    assert launches == []


def fused_mlp_fwd_bwd(act, device, dtype):
    """(y, grad_x and every weight's gradient) of one fused MLP on fixed random data."""
    from fused_ops import fused_mlp
    gen = torch.Generator().manual_seed(0)
    M, C, H = 70, 64, 96
    rows = 2 * H if act in GATED_ACTIVATIONS else H
    tensors = [(torch.randn(shape, generator=gen) * scale).to(device, dtype).requires_grad_()
               for shape, scale in (((M, C), 1.0), ((rows, C), C ** -0.5), ((rows,), 1.0), ((C, H), H ** -0.5),
                                    ((C,), 1.0))]
    y = fused_mlp(*tensors, act)
    y.backward(torch.randn(y.shape, generator=gen).to(device, dtype))
    return [y.detach()] + [t.grad for t in tensors]


def force_hopper_path(monkeypatch):
    """Select the ping-pong kernel for every launch (as on an H100 with 16-bit tensors), and make it fail as a
    Triton whose Gluon moved would. Returns the list of attempted launches."""
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(kwargs["EPILOGUE"])
        raise RuntimeError("stand-in for a Gluon compile error")
    monkeypatch.setattr(pingpong, "FAILURE", None)
    monkeypatch.setattr(pingpong, "usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(pingpong, "_launch", broken)
    return attempts


@pytest.mark.filterwarnings("default::fused_ops.hopper.pingpong.FallbackWarning")
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_failed_pingpong_falls_back_with_one_warning(act, monkeypatch):
    """If the ping-pong kernel fails to compile or launch, the fused MLP's forward and backward run the Triton
    kernels instead and give exactly their result; one warning says so, once per process; the kernel is not
    tried again. (On CPU through the interpreter, with the Hopper path forced; on a GPU for real tensors.)"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    monkeypatch.setattr(env, "PINGPONG", False)
    expected = fused_mlp_fwd_bwd(act, device, dtype)  # the Triton kernels alone
    monkeypatch.setattr(env, "PINGPONG", True)
    attempts = force_hopper_path(monkeypatch)
    with pytest.warns(pingpong.FallbackWarning, match="stand-in for a Gluon compile error") as caught:
        got = fused_mlp_fwd_bwd(act, device, dtype)
        again = fused_mlp_fwd_bwd(act, device, dtype)
    assert len([w for w in caught if issubclass(w.category, pingpong.FallbackWarning)]) == 1
    assert attempts == ["act"] and isinstance(pingpong.FAILURE, RuntimeError)
    for e, g, a in zip(expected, got, again):
        assert torch.equal(g, e) and torch.equal(a, e)


@pytest.mark.filterwarnings("default::fused_ops.hopper.pingpong.FallbackWarning")
def test_failed_pingpong_dgrad_falls_back(monkeypatch):
    """The same when the forward ran elsewhere and the first failure is the dgrad's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    monkeypatch.setattr(env, "PINGPONG", False)
    expected = fused_mlp_fwd_bwd("gelu", device, dtype)
    monkeypatch.setattr(env, "PINGPONG", True)
    attempts = force_hopper_path(monkeypatch)
    monkeypatch.setattr(pingpong, "linear_act_forward", lambda *args: False)  # the forward: Triton's, no warning
    with pytest.warns(pingpong.FallbackWarning) as caught:
        got = fused_mlp_fwd_bwd("gelu", device, dtype)
    assert len(caught) == 1 and attempts == ["mul"]
    for e, g in zip(expected, got):
        assert torch.equal(g, e)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.filterwarnings("default::fused_ops.hopper.pingpong.FallbackWarning")
def test_failed_pingpong_compile_falls_back_on_gpu(monkeypatch):
    """On a Hopper GPU, a real failure of the kernel's compilation (a ring of 12 slots: more shared memory than
    an H100 block has, as a Triton that lays out memory differently could ask) falls back the same way."""
    monkeypatch.setattr(env, "PINGPONG", False)
    expected = fused_mlp_fwd_bwd("gelu", "cuda", torch.bfloat16)
    monkeypatch.setattr(env, "PINGPONG", True)
    monkeypatch.setattr(pingpong, "FAILURE", None)
    monkeypatch.setattr(pingpong, "_compiled", {})
    real = pingpong._blocks_and_consts

    def too_many_slots(*args, **kwargs):
        blocks, tn, consts = real(*args, **kwargs)
        return blocks, tn, {**consts, "STAGES": 12}
    monkeypatch.setattr(pingpong, "_blocks_and_consts", too_many_slots)
    with pytest.warns(pingpong.FallbackWarning) as caught:
        got = fused_mlp_fwd_bwd("gelu", "cuda", torch.bfloat16)
    assert len(caught) == 1 and pingpong.FAILURE is not None
    for e, g in zip(expected, got):
        assert torch.equal(g, e)


def fp8_operands(a, b_kmajor, a_dtype, g):
    """(a8, b8, (1/scale of a, 1/scale of b)) per-tensor quantized as the FP8 MLP does, b K-major (N, K)."""
    E4M3 = torch.float8_e4m3fn
    s_a = {E4M3: 448.0, torch.float8_e5m2: 57344.0}[a_dtype] / a.float().nan_to_num().abs().max().item()
    s_b = 448.0 / b_kmajor.float().abs().max().item()
    a8, b8 = (a.float() * s_a).to(a_dtype), (b_kmajor.float() * s_b).to(E4M3).contiguous()
    return a8, b8, (torch.tensor([1 / s_a], device="cuda"), torch.tensor([1 / s_b], device="cuda"))


def dequantized(q, inv):
    return q.double() * inv.double()


def assert_near(ours, want, bound=1e-2):
    """Relative (Frobenius) error: FP8 MMAs accumulate with fast (fewer-bit) accumulation, ~1e-3 of the sums'
    magnitude, which elementwise tolerances would charge to the smallest values."""
    ours = ours.double()
    err = ((ours - want).norm() / want.norm()).item()
    assert err < bound, err


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("M", [1000, 1024])
def test_forward_fp8_output(act, programs, saturate, M, monkeypatch):
    """The FP8 MLP's forward GEMM, FP8 in (x8, W8 in e4m3, an FP8 main loop) and out (h8 and h8ᵀ): fp8(h · scale) of
    the fp32 h, within one FP8 step of torch's quantization of the h the 16-bit-output variant writes from the same
    accumulator (and equal almost everywhere; that h near the float64 one on the same FP8 operands), NaN in NaN's
    rows, the transposed copy bit for bit the same with zero columns from M to its padded width; dh/dz as the
    16-bit-output variant writes it; the amax over the real rows only. Here the rows past M = 1000 (zeros in, act(bias) out) would give act(bias) (3 for GELU, 18 for relu²)
    where the real rows' amax is several times smaller. programs=2: 32 tiles on two persistent programs, so that
    both consumers run and reuse their buffers across tiles (with one program per SM, each program here gets one
    tile). K = 384: three K slices of 128. saturate: a scale 50x larger, so that many values pass e4m3's range and
    must come out ±448 (the conversion saturates them: fp8_quantize.quantize). M = 1024: whole tiles, the epilogue's
    unmasked form (EVEN)."""
    if programs:
        monkeypatch.setattr(pingpong, "_num_sms", lambda device: programs)
    E4M3 = torch.float8_e4m3fn
    K, N = 384, 512
    Mp = -(-M // 16) * 16
    g = torch.Generator("cuda").manual_seed(0)
    x = (torch.rand(M, K, device="cuda", generator=g) + 0.5).bfloat16()  # positive, so that x @ W.T < -3
    w = (-(torch.rand(N, K, device="cuda", generator=g) + 0.5) * (4 / K)).bfloat16()
    b = torch.full((N,), 3.0 if act == "gelu" else 4.25, device="cuda", dtype=torch.bfloat16)
    x[5, 3] = float("nan")
    x8, w8, inv = fp8_operands(x, w, E4M3, g)
    # (saturate: relu²'s h is ~0.06 here, GELU's up to ~1)
    scale = torch.tensor([(100.0 * (50 if saturate else 1)) if act == "gelu" else (20.0 * (2000 if saturate else 1))],
                         device="cuda")
    amax = torch.zeros(1, device="cuda")
    h8 = torch.empty(M, N, device="cuda", dtype=E4M3)
    h8t = torch.full((N, Mp), 1.0, device="cuda").to(E4M3)  # (Mp: M padded to 16, as fp8.py pads)
    saved = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    assert fp8_hopper.linear_act_forward_fp8(x8, w8, inv, b, act, h8, h8t, saved, scale, amax)
    assert torch.equal(h8t[:, :M].t().view(torch.uint8), h8.view(torch.uint8))  # bit for bit, NaNs too
    assert (h8t[:, M:].float() == 0).all()
    z = dequantized(x8, inv[0]) @ dequantized(w8, inv[1]).t() + b.double()
    f = {"gelu": torch.nn.functional.gelu, "relu2": lambda v: torch.relu(v) ** 2}[act]
    h = f(z)
    h16, saved16 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16), torch.empty_like(saved)
    assert pingpong.linear_act_forward(x8, w8, b, act, "identity", False, True, h16, saved16, inv=inv)
    ref = (h16.double() * scale.item()).clamp(-448, 448).to(E4M3).double()
    ours = h8.double()
    assert ours[5].isnan().all() and not ours[torch.arange(M) != 5].isnan().any()
    rows = torch.arange(M, device="cuda") != 5
    diff = (ours - ref)[rows].abs()
    assert (diff <= ref[rows].abs() / 8 + 2 ** -9).all()  # one step: e4m3 has 3 mantissa bits (2^-9: subnormals)
    assert (diff == 0).float().mean() > 0.95
    assert (ours[rows].abs() == 448).any() == saturate
    want = h16[rows].float().abs().max().item()  # (the kernel's own h: its amax is of the fp32 h)
    assert 0 < want < f(b[0].double()).item() / 3 and amax.item() == pytest.approx(want, rel=1e-2)
    assert torch.equal(saved[rows], saved16[rows])
    # (relu²'s data: z = 4.25 - 4 ± a little, so the FP8 MMA's fast accumulation error on the sum of 4 is ~16x in
    # z relative, 7% in h: 0.8% for GELU's)
    assert_near(h16[rows], h[rows], 0.1 if act == "relu2" else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("act", ["gelu", "relu2"])
def test_forward_fp8_output_without_bias(act):
    """Without a bias the FP8 forward has no row mask (rows past M give act(0) = 0 by themselves): at odd M, hᵀ's
    columns from M to its padded width are zeros, hᵀ is h transposed bit for bit, the amax is the real rows', and h8
    is within one FP8 step of torch's quantization of the 16-bit-output variant's h."""
    E4M3 = torch.float8_e4m3fn
    M, K, N, Mp = 1000 + 3, 384, 512, 1008
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    x8, w8, inv = fp8_operands(x, w, E4M3, g)
    scale, amax = torch.tensor([16.0], device="cuda"), torch.zeros(1, device="cuda")
    h8, h8t = torch.empty(M, N, device="cuda", dtype=E4M3), torch.full((N, Mp), 1.0, device="cuda").to(E4M3)
    saved = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    assert fp8_hopper.linear_act_forward_fp8(x8, w8, inv, None, act, h8, h8t, saved, scale, amax)
    h16, saved16 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16), torch.empty_like(saved)
    assert pingpong.linear_act_forward(x8, w8, None, act, "identity", False, True, h16, saved16, inv=inv)
    assert torch.equal(h8t[:, :M].t().view(torch.uint8), h8.view(torch.uint8))
    assert (h8t[:, M:].view(torch.uint8) == 0).all()
    assert torch.equal(saved, saved16)
    ref = (h16.double() * scale.item()).clamp(-448, 448).to(E4M3).double()
    diff = (h8.double() - ref).abs()
    assert (diff <= ref.abs() / 8 + 2 ** -9).all() and (diff == 0).float().mean() > 0.95
    assert amax.item() == pytest.approx(h16.double().abs().max().item(), rel=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("saturate", [False, True])
def test_dgrad_fp8_output(bias_grad, programs, saturate, monkeypatch):
    """The FP8 MLP's dgrad, FP8 in (gy8 in e5m2, W2ᵀ in e4m3: mixed FP8 MMAs) and out (gz8 and gz8ᵀ, e5m2): within
    one FP8 step of torch's quantization of what the 16-bit-output variant writes from the same accumulator (itself
    near (gy8 @ W2) * saved in float64), equal almost everywhere, NaN in NaN's row; the transposed copy bit for bit, zero past M; the amax; the bias gradient's column sums those of
    the 16-bit-output variant, bit for bit. programs, saturate: as in test_forward_fp8_output (±57344 here)."""
    if programs:
        monkeypatch.setattr(pingpong, "_num_sms", lambda device: programs)
    E5M2 = torch.float8_e5m2
    M, K, N = 1000, 384, 512
    g = torch.Generator("cuda").manual_seed(0)
    gy = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w2 = (torch.randn(K, N, device="cuda", generator=g) / K ** 0.5).bfloat16()
    saved = torch.rand(M, N, device="cuda", generator=g).bfloat16()
    nan_row = None if bias_grad else 9  # (a NaN row would make every column sum NaN)
    if nan_row is not None:
        gy[nan_row, 2] = float("nan")
    gy8, w2t8, inv = fp8_operands(gy, w2.t(), E5M2, g)
    scale, amax = torch.tensor([1e5 if saturate else 1000.0], device="cuda"), torch.zeros(1, device="cuda")
    gz8 = torch.empty(M, N, device="cuda", dtype=E5M2)
    gz8t = torch.full((N, 1008), 1.0, device="cuda").to(E5M2)
    ok, db = fp8_hopper.dgrad_fp8(gy8, w2t8, inv, saved, gz8, gz8t, bias_grad, scale, amax)
    assert ok
    assert torch.equal(gz8t[:, :M].t().view(torch.uint8), gz8.view(torch.uint8))
    assert (gz8t[:, M:].float() == 0).all()
    gz = (dequantized(gy8, inv[0]) @ dequantized(w2t8, inv[1]).t()) * saved.double()
    gz16 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ok16, db16 = pingpong.dgrad(gy8, w2t8, saved, gz16, False, bias_grad, inv=inv)
    assert ok16
    ref = (gz16.double() * scale.item()).clamp(-57344, 57344).to(E5M2).double()
    ours = gz8.double()
    rows = torch.arange(M, device="cuda") != (-1 if nan_row is None else nan_row)
    if nan_row is not None:
        assert ours[nan_row].isnan().all()
    assert not ours[rows].isnan().any()
    diff = (ours - ref)[rows].abs()
    assert (diff <= ref[rows].abs() / 4 + 2 ** -16).all()  # one step: e5m2 has 2 mantissa bits
    assert (diff == 0).float().mean() > 0.9
    assert (ours[rows].abs() == 57344).any() == saturate
    assert amax.item() == pytest.approx(gz[rows].abs().max().item(), rel=2e-2)
    assert_near(gz16[rows], gz[rows])
    if bias_grad:
        torch.testing.assert_close(db, db16, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("op", ["forward", "dgrad"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_fp8_inputs(op, bias):
    """The gated variants on FP8 operands with 16-bit outputs (the FP8 MLP's SwiGLU path, a cast pass after them):
    against float64 on the same FP8 operands, at odd M, the output's 16-bit rounding and fast accumulation apart."""
    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    M, K, N = 1000 + 7, 768, 512
    g = torch.Generator("cuda").manual_seed(1)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    if op == "forward":
        w = (torch.randn(2 * N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        b = torch.randn(2 * N, device="cuda", generator=g).bfloat16() if bias else None
        a8, w8, inv = fp8_operands(a, w, E4M3, g)
        h, saved = (torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in (N, 2 * N))
        assert pingpong.linear_act_forward(a8, w8, b, "silu", "identity", True, True, h, saved, inv=inv)
        z = dequantized(a8, inv[0]) @ dequantized(w8, inv[1]).t() + (0 if b is None else b.double())
        gate, up = z[:, :N], z[:, N:]
        silu = torch.nn.functional.silu
        sig = torch.sigmoid(gate)
        assert_near(h, silu(gate) * up)
        assert_near(saved[:, :N], up * sig * (1 + gate * (1 - sig)))  # dh/dgate = up · silu'(gate)
        assert_near(saved[:, N:], silu(gate))  # dh/dup = silu(gate)
    else:
        w2 = (torch.randn(K, N, device="cuda", generator=g) / K ** 0.5).bfloat16()
        saved = torch.rand(M, 2 * N, device="cuda", generator=g).bfloat16()
        a8, w2t8, inv = fp8_operands(a, w2.t(), E5M2, g)
        out = torch.empty_like(saved)
        ok, db = pingpong.dgrad(a8, w2t8, saved, out, True, bias, inv=inv)
        assert ok
        grad_h = dequantized(a8, inv[0]) @ dequantized(w2t8, inv[1]).t()
        want = torch.cat([grad_h, grad_h], 1) * saved.double()
        assert_near(out, want)
        if bias:
            assert_near(db, want.sum(0))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("op", ["forward", "dgrad"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("M", [1007, 1024])
def test_gated_fp8_output(op, bias, programs, M, monkeypatch):
    """The gated variants with FP8 outputs (the FP8 MLP's SwiGLU path): h8 (forward, e4m3) or gz8 over both halves
    (dgrad, e5m2, stored from the spent saved tiles) within one FP8 step of torch's quantization of what the
    16-bit-output variant writes from the same accumulator (itself near the float64 result on the same FP8 operands)
    and equal almost everywhere; the transposed copy bit for bit, zero past M; the amax; what both variants write
    (dh/dgate and dh/dup, the bias sums) bit for bit; at odd M, and at whole tiles (M = 1024: the forward's unmasked
    form, EVEN). Without bias, a NaN in one row of the input: NaN in
    that row of both halves (and of dh/dgate, dh/dup), nowhere else, and kept out of the amax."""
    if programs:
        monkeypatch.setattr(pingpong, "_num_sms", lambda device: programs)
    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    K, N, Mp = 768, 512, -(-M // 16) * 16
    g = torch.Generator("cuda").manual_seed(2)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    nan_row = None if bias else 5  # (a NaN row would make every bias-gradient column sum NaN)
    if nan_row is not None:
        a[nan_row, 3] = float("nan")
    rows = torch.arange(M, device="cuda") != (-1 if nan_row is None else nan_row)
    scale, amax = torch.tensor([64.0 if op == "forward" else 4096.0], device="cuda"), torch.zeros(1, device="cuda")
    if op == "forward":
        w = (torch.randn(2 * N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        b = torch.randn(2 * N, device="cuda", generator=g).bfloat16() if bias else None
        a8, w8, inv = fp8_operands(a, w, E4M3, g)
        q, qt = torch.empty(M, N, device="cuda", dtype=E4M3), torch.full((N, Mp), 1.0, device="cuda").to(E4M3)
        saved = torch.empty(M, 2 * N, device="cuda", dtype=torch.bfloat16)
        assert fp8_hopper.linear_act_forward_fp8(a8, w8, inv, b, "silu", q, qt, saved, scale, amax, "identity", True)
        z = dequantized(a8, inv[0]) @ dequantized(w8, inv[1]).t() + (0 if b is None else b.double())
        want = torch.nn.functional.silu(z[:, :N]) * z[:, N:]
        h16, saved16 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16), torch.empty_like(saved)
        assert pingpong.linear_act_forward(a8, w8, b, "silu", "identity", True, True, h16, saved16, inv=inv)
        assert torch.equal(saved.view(torch.int16), saved16.view(torch.int16))  # (bit for bit, NaNs too)
        if nan_row is not None:
            assert saved[nan_row].isnan().all() and not saved[rows].isnan().any()
        out16, fp8_max, step, subnormal = h16, 448.0, 8, 2 ** -9
    else:
        w2 = (torch.randn(K, N, device="cuda", generator=g) / K ** 0.5).bfloat16()
        saved = torch.rand(M, 2 * N, device="cuda", generator=g).bfloat16()
        a8, w2t8, inv = fp8_operands(a, w2.t(), E5M2, g)
        q, qt = torch.empty(M, 2 * N, device="cuda", dtype=E5M2), torch.full((2 * N, Mp), 1.0, device="cuda").to(E5M2)
        ok, db = fp8_hopper.dgrad_fp8(a8, w2t8, inv, saved, q, qt, bias, scale, amax, True)
        assert ok
        grad_h = dequantized(a8, inv[0]) @ dequantized(w2t8, inv[1]).t()
        want = torch.cat([grad_h, grad_h], 1) * saved.double()
        out16 = torch.empty_like(saved)
        ok16, db16 = pingpong.dgrad(a8, w2t8, saved, out16, True, bias, inv=inv)
        assert ok16
        if bias:
            torch.testing.assert_close(db, db16, rtol=0, atol=0)
        fp8_max, step, subnormal = 57344.0, 4, 2 ** -16
    assert torch.equal(qt[:, :M].t().view(torch.uint8), q.view(torch.uint8))  # (bit for bit, NaNs too)
    assert (qt[:, M:].float() == 0).all()
    if nan_row is not None:
        assert q[nan_row].float().isnan().all()
    assert not q.float()[rows].isnan().any()
    out16, want, q = out16[rows], want[rows], q.view(torch.uint8)[rows].view(q.dtype)
    assert_near(out16, want)
    ref = (out16.double() * scale.item()).clamp(-fp8_max, fp8_max).to(q.dtype).double()
    diff = (q.double() - ref).abs()
    assert (diff <= ref.abs() / step + subnormal).all() and (diff == 0).float().mean() > 0.9  # one step
    assert amax.item() == pytest.approx(out16.double().abs().max().item(), rel=1e-2)


def reference_partials(out, tile=pingpong.BLOCK_N):
    """Each row's log-sum-exp over each `tile` columns of out as stored, in float64: torch for rows of finite values,
    the module's rule in scalar math (tests/test_classifier.tile_log_sum_exp) for the others."""
    from tests.test_classifier import tile_partials
    M, V = out.shape
    T = -(-V // tile)
    padded = torch.full((M, T * tile), float("-inf"), dtype=torch.float64, device=out.device)
    padded[:, :V] = out.double()
    ref = torch.logsumexp(padded.view(M, T, tile), -1)
    special = (~torch.isfinite(out)).any(1).nonzero()[:, 0]
    if len(special):
        ref[special] = tile_partials(out[special], tile).double().to(out.device)
    return ref


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("M,K,V", [(2048, 768, 50304), (333, 64, 1000)])
def test_logits_gemm_writes_each_tiles_log_sum_exp(dtype, M, K, V, launches):
    """pingpong.logits_lse: the logits (as cuBLAS's GEMM, within 16-bit rounding) and each row's log-sum-exp over
    each 128 of their columns as stored (float64 reference; the last tile short when V is not a multiple of 128).
    Special values (16-bit: x with NaN, +inf, and +inf against a tile of negative weights: NaN, ±inf and a tile of
    only -inf logits) follow the classifier's rule."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(V, K, generator=gen) * K ** -0.5
    fp8 = dtype == torch.float8_e4m3fn
    inv = None
    if fp8:  # as fp8/classifier.py: current scaling
        sx, sw = 448 / x.abs().max(), 448 / w.abs().max()
        x, w = (x * sx).to(dtype), (w * sw).to(dtype)
        inv = (sx.reciprocal().reshape(1).cuda(), sw.reciprocal().reshape(1).cuda())
        x[3, 5] = float("nan")
    else:
        x, w = x.to(dtype), w.to(dtype)
        w[:128, 0] = -w[:128, 0].abs()  # the first tile of columns: negative weights on feature 0
        x[3, 5], x[5, 1], x[9, 0] = float("nan"), float("inf"), float("inf")
        if dtype == torch.bfloat16:  # finite logits above 2.4e38 (fp32's max / log2 e) in the first tile of row 11
            x[11], w[:128, 2] = 0.0, 1.0
            x[11, 2] = 3e38
    x, w = x.cuda(), w.cuda()
    out_dtype = torch.bfloat16 if fp8 else dtype
    out = poisoned((M, V), out_dtype, "cuda")
    partial = pingpong.logits_lse(x, w, out, inv)
    assert launches == ["lse"]
    want = x.float() @ w.float().t()
    if fp8:
        want = want * inv[0] * inv[1]
    finite = torch.isfinite(want).all(1)
    assert torch.allclose(out[finite].float(), want[finite], rtol=1e-2, atol=1e-2)
    assert torch.equal(out[~finite].isnan(), want[~finite].isnan()) and torch.equal(out[~finite].isinf(), want[~finite].isinf())
    ref = reference_partials(out)
    assert partial.shape == ref.shape and partial.dtype == torch.float32
    assert torch.equal(partial.isnan(), ref.isnan()) and torch.equal(partial.isinf(), ref.isinf())
    assert torch.equal(partial[partial.isinf()], ref[ref.isinf()].float())
    ok = torch.isfinite(ref)
    assert torch.allclose(partial[ok].double(), ref[ok], rtol=1e-5, atol=1e-5)
    if not fp8:
        assert ref[9, 0] == float("-inf") and ref[9, 1:].eq(float("inf")).any() and ref[3].isnan().all()
    if dtype == torch.bfloat16:
        assert ref[11, 0] > 2.4e38 and torch.isfinite(partial[11]).all()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("V", [50304, 1000])
def test_the_classifier_takes_its_log_sum_exps_from_the_hopper_gemm(V, launches, monkeypatch):
    """The fused classifier runs the logits GEMM above (one launch a chunk), takes each row's log-sum-exp from its
    partials (offset by log 2, every loss grows by log 2), and gives the loss and gradients it gives with cuBLAS's
    GEMM and the row kernel's two reads, within bf16's noise."""
    from fused_ops import backends, linear_cross_entropy
    from tests.test_classifier import data, loss_and_grads
    x, w, t = data(2048, 768, V, device="cuda")
    ours = loss_and_grads(linear_cross_entropy, x, w, t, torch.bfloat16, True)
    assert launches and set(launches) == {"lse"}
    real = backends._registry["logits_lse"]
    monkeypatch.setitem(backends._registry, "logits_lse", lambda *args: real(*args) + math.log(2))
    shifted = loss_and_grads(linear_cross_entropy, x, w, t, torch.bfloat16, True)[0]
    monkeypatch.setitem(backends._registry, "logits_lse", lambda *args: NotImplemented)
    plain = loss_and_grads(linear_cross_entropy, x, w, t, torch.bfloat16, True)
    assert ours[0].item() == pytest.approx(plain[0].item(), rel=1e-5)
    assert shifted.item() == pytest.approx(ours[0].item() + math.log(2), rel=1e-5)
    for a, b in zip(ours[1:], plain[1:]):
        assert rel_err(a, b) < 1e-2
