"""The Hopper ping-pong kernel (fused_ops/pingpong.py): it compiles for sm_90 with the installed Triton
(on any machine), and on a Hopper GPU it computes what the eager path does, no worse than it."""

import os
import subprocess
import sys

import pytest
import torch

from fused_ops import linear_act_dgrad, linear_act_forward, pingpong
from numerics import check_dgrad, check_linear_act, poisoned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

COMPILE_FOR_SM90 = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from fused_ops import pingpong as pp

epilogue, activation, has_bias, save = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
M, N, K, kmajor = 1000, 520, 200, epilogue == "act"
t = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)
b = pp._descriptor(t(N, K), pp.BLOCK_N, pp.BLOCK_K) if kmajor else pp._descriptor(t(K, N), pp.BLOCK_K, pp.BLOCK_N)
args = [pp._descriptor(t(M, K), pp.BLOCK_M, pp.BLOCK_K), b, pp._descriptor(t(M, N), pp.BLOCK_M, pp.BLOCK_N // 4),
        pp._descriptor(t(M, N), pp.BLOCK_M, pp.BLOCK_N // 4), t(N), torch.empty(8, N), M, N, K]
consts = dict(B_KMAJOR=kmajor, EPILOGUE=epilogue, ACTIVATION=activation, HAS_BIAS=has_bias, SAVE=save,
              STAGES=pp.STAGES)
signature, constexprs = {}, {}
for i, p in enumerate(pp.pingpong_kernel.params):
    signature[p.name] = "constexpr" if p.is_constexpr else mangle_type(args.pop(0))
    if p.is_constexpr:
        constexprs[(i,)] = consts[p.name]
kernel = triton.compile(GluonASTSource(pp.pingpong_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=pp.CONSUMER_WARPS, maxnreg=pp.MAXNREG))
print("shared", kernel.metadata.shared)
"""


@pytest.mark.skipif(not pingpong.AVAILABLE and "TRITON_INTERPRET" not in os.environ,
                    reason="this Triton has no Gluon")
@pytest.mark.parametrize("epilogue,activation,has_bias,save", [("act", "gelu", 1, 1), ("act", "relu2", 0, 0),
                                                               ("mul", "identity", 1, 0)])
def test_compiles_for_hopper(epilogue, activation, has_bias, save):
    """Compiled (not run) for sm_90, in a process without the interpreter: catches a Triton whose Gluon
    API moved (TMA copy names, warp_specialize) before a Hopper user does. Triton bundles ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90, epilogue, activation, str(has_bias), str(save)],
                          env=env, capture_output=True, text=True, timeout=300)
    if "No module named 'triton.experimental.gluon" in done.stderr:
        pytest.skip("this Triton has no Gluon")
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) <= 227 * 1024  # an H100's shared memory per block


needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")


@pytest.fixture
def launches(monkeypatch):
    """Counts the ping-pong kernel's launches (so a test knows it ran, not the Triton fallback)."""
    calls = []
    real = pingpong._launch
    monkeypatch.setattr(pingpong, "_launch", lambda *a, **k: (calls.append(k["EPILOGUE"]), real(*a, **k))[1])
    return calls


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu2", "relu", "identity"])
@pytest.mark.parametrize("M,K,N", [(2048, 768, 3072), (1000, 200, 520), (5, 768, 3072), (129, 64, 136)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_dgrad(dtype, act, M, K, N, bias, launches):
    """Against float64, no worse than eager (numerics.py). (2048, 768, 3072): more tiles than SMs and 12
    K slices per tile, so every program runs both consumers and wraps the loader's ring many times."""
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, N), dtype, "cuda")
    linear_act_forward(x, w, b, act, out=out, saved=saved)
    check_linear_act(out, saved, x, w, b if bias else torch.zeros(N, device="cuda", dtype=dtype), act)

    grad_y = torch.randn(M, K, device="cuda", dtype=dtype)
    w2 = (torch.randn(K, N, device="cuda") * N ** -0.5).to(dtype)
    grad_z = poisoned((M, N), dtype, "cuda")
    _, grad_b = linear_act_dgrad(grad_y, w2, saved, act, out=grad_z)
    check_dgrad(grad_z, grad_b, grad_y, w2, saved, act)
    if not bias:  # the first linear has no bias: the same grad_z, no column sums
        grad_z2, none = linear_act_dgrad(grad_y, w2, saved, act, bias_grad=False, out=poisoned((M, N), dtype, "cuda"))
        assert none is None and torch.equal(grad_z2, grad_z)
    assert launches == ["act", "mul"] + ([] if bias else ["mul"])


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
    """A 16-byte-misaligned x, an fp32 output or a gated activation go to the Triton kernels, correctly."""
    M, K, N, dtype = 64, 256, 384, torch.bfloat16
    base = torch.randn(M * K + 1, device="cuda", dtype=dtype)
    w = (torch.randn(2 * N, K, device="cuda") * K ** -0.5).to(dtype)
    b = torch.randn(2 * N, device="cuda", dtype=dtype)
    x = base[1:].view(M, K)
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, N), dtype, "cuda")
    linear_act_forward(x, w[:N], b[:N], "gelu", out=out, saved=saved)
    check_linear_act(out, saved, x, w[:N], b[:N], "gelu")
    out32 = poisoned((M, N), torch.float32, "cuda")
    linear_act_forward(x.contiguous(), w[:N], b[:N], "gelu", out=out32, saved=saved)
    check_linear_act(out32, saved, x, w[:N], b[:N], "gelu")
    out, saved = poisoned((M, N), dtype, "cuda"), poisoned((M, 2 * N), dtype, "cuda")
    linear_act_forward(x.contiguous(), w, b, "swiglu", out=out, saved=saved)
    check_linear_act(out, saved, x, w, b, "swiglu")
    assert launches == []
