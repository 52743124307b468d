"""fused_ops/precompile.py: a child process compiles the fused MLP's kernels while a run starts up."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fused_ops
from fused_ops import precompile
from model import GPT, GPTConfig

SMALL = dict(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, dropout=0.0)
SPEC = {"C": 16, "N": 32, "H": 32, "bias": True, "activation": "gelu", "dtype": "float32", "layer_norm": True,
        "ln_bias": True, "fuse_ln": False, "tokens": 24, "autocast": None}  # a small MLP for the child


def kernels_run_here():
    return fused_ops.kernels_can_run(torch.empty(0))


@pytest.mark.parametrize("fuse_ln,activation,bias", [(False, "gelu", False), (True, "swiglu", True)])
def test_the_spec_describes_the_model_mlp(fuse_ln, activation, bias):
    model = GPT(GPTConfig(**SMALL, mlp="fused", fuse_ln=fuse_ln, activation=activation, bias=bias))
    block = model.transformer.h[0]
    spec = precompile.mlp_spec(block.mlp.c_fc, block.mlp.c_proj, activation, block.ln_2, fuse_ln, 96, torch.bfloat16)
    assert spec == {"C": 32, "N": block.mlp.c_fc.out_features, "H": block.mlp.c_proj.in_features, "bias": bias,
                    "activation": activation, "dtype": "float32", "layer_norm": True, "ln_bias": bias,
                    "fuse_ln": fuse_ln, "tokens": 96, "autocast": "bfloat16"}
    assert spec["N"] == (2 if activation == "swiglu" else 1) * spec["H"]
    json.dumps(spec)  # it travels to the child as JSON


def test_only_a_fused_mlp_on_a_gpu_starts_a_child(monkeypatch):
    started = []
    monkeypatch.setattr(precompile, "start", lambda spec, device: started.append((spec, device)) or "child")
    for mlp, device in (("eager", "cuda"), ("fused", "cpu")):
        assert GPT(GPTConfig(**SMALL, mlp=mlp)).precompile_kernels(16, torch.bfloat16, device) is None
    assert GPT(GPTConfig(**SMALL, mlp="fused")).precompile_kernels(16, None, "cuda:1") == "child"
    assert started[0][1] == "cuda:1" and started[0][0]["tokens"] == 16 and started[0][0]["autocast"] is None


@pytest.mark.parametrize("fuse_ln", [False, True])
def test_the_child_runs_the_three_kernels_paths(fuse_ln, monkeypatch):
    """In-process (the interpreter on CPU): the no_grad forward (the kernel that saves nothing), then the forward that
    saves dh/dz and its dgrad, each launched through fused_ops.tuning (the LayerNorm folded into both forwards with
    fuse_ln), in that order: the kernels the run will load, not an eager fallback. The gradient is finite."""
    if not kernels_run_here():
        pytest.skip("the kernels cannot run here")
    from fused_ops import tuning
    launched, launch = [], tuning._jit_launch

    def recording(kernel, grid, args, constexprs, cfg):
        name = kernel.fn.__name__
        launched.append((name, constexprs["SAVE"], constexprs["LN_FOLD"]) if name == "linear_act_kernel" else (name,))
        return launch(kernel, grid, args, constexprs, cfg)
    monkeypatch.setattr(tuning, "_jit_launch", recording)
    grad = precompile.compile_kernels({**SPEC, "fuse_ln": fuse_ln}, "cpu")
    assert launched == [("linear_act_kernel", False, fuse_ln), ("linear_act_kernel", True, fuse_ln), ("dgrad_kernel",)]
    assert grad.shape == (24, 16) and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_the_child_process_exits_cleanly_and_is_off_by_env(monkeypatch):
    if not kernels_run_here():
        pytest.skip("the kernels cannot run here")
    spec = {**SPEC, "N": 16, "H": 16, "bias": False, "activation": "relu", "layer_norm": False, "ln_bias": False}
    child = precompile.start(spec, "cpu")
    assert child.wait(timeout=300) == 0
    monkeypatch.setattr(fused_ops.env, "PRECOMPILE", False)
    assert precompile.start(spec, "cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_child_compiles_what_the_run_then_loads(tmp_path):
    """With a fresh Triton cache: after the child, a process running the model's fused MLP (compiled, as the configs
    run it, and uncompiled) compiles no kernel of its own: Triton's cache gains no new file."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FUSED_OPS_TUNING_CACHE": "0"}
    spec = {"C": 384, "N": 1536, "H": 1536, "bias": False, "activation": "gelu", "dtype": "float32",
            "layer_norm": True, "ln_bias": False, "fuse_ln": False, "tokens": 4096, "autocast": "bfloat16"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = "import sys, fused_ops.precompile as p; p.main(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", command, json.dumps(spec), "cuda"], env={**env, "FUSED_OPS_AUTOTUNE": "0"},
                   cwd=root, check=True)
    before = {p for p in (tmp_path / "triton").rglob("*") if p.is_file()}
    assert before
    run = ("import torch; from model import GPT, GPTConfig\n"
           "m = GPT(GPTConfig(n_layer=1, n_head=6, n_embd=384, block_size=256, vocab_size=128, dropout=0.0, "
           "bias=False, mlp='fused')).cuda()\n"
           "x = torch.randint(0, 128, (16, 256), device='cuda')\n"
           "for f in (m, torch.compile(m)):\n"
           "    with torch.autocast('cuda', torch.bfloat16):\n"
           "        with torch.no_grad(): f(x, x)\n"
           "        f(x, x)[1].backward()\n"
           "torch.cuda.synchronize()\n")
    subprocess.run([sys.executable, "-c", run], env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                                                    "FUSED_OPS_GRAPHS": "0"}, cwd=root, check=True)
    after = {p for p in (tmp_path / "triton").rglob("*") if p.is_file()}
    ours = ("linear_act_kernel", "dgrad_kernel", "pingpong_kernel", "layernorm_")  # (not Inductor's kernels)
    new = sorted(str(p.relative_to(tmp_path)) for p in after - before if p.name.startswith(ours))
    assert new == [], new


def test_wait_lets_a_child_finish_and_stops_one_past_its_time(monkeypatch):
    """tuning.py waits for the children before timing tiles; one that hangs is stopped, not waited for forever."""
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(precompile, "_children", [quick, stuck])
    precompile.wait(timeout=5)
    assert quick.returncode == 0 and stuck.returncode not in (None, 0)
