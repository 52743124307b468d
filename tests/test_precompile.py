"""fused_ops/precompile.py: a child process compiles the fused kernels while a run starts up (model.compile_kernels,
the child's work: a one-block copy of the model through an evaluation and two training steps)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fused_ops
import model
from fused_ops import precompile
from model import GPT, GPTConfig

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=8, vocab_size=64, dropout=0.0)


def kernels_run_here():
    return fused_ops.kernels_can_run(torch.empty(0))


def spec_of(monkeypatch, config, device="cuda:1", batch_size=3, autocast=torch.bfloat16, grad_clip=1.0):
    """The spec GPT.precompile_kernels hands precompile.start (None where it starts no child)."""
    started = []
    monkeypatch.setattr(precompile, "start", lambda entry, spec, device: started.append((entry, spec, device)) or "child")
    child = GPT(GPTConfig(**config)).precompile_kernels(batch_size, autocast, device, grad_clip)
    assert (child is None) == (not started)
    if started:
        entry, spec, started_on = started[0]
        assert entry == "model:compile_kernels" and started_on == device
        json.dumps(spec)  # it travels to the child as JSON
        return spec


def test_the_spec_is_the_model_with_one_block(monkeypatch):
    config = {**SMALL, "mlp": "fused", "activation": "swiglu", "fuse_ln": True, "classifier": "fused"}
    spec = spec_of(monkeypatch, config)
    assert spec == {"config": {**vars(GPTConfig(**config)), "n_layer": 1}, "batch_size": 3, "autocast": "bfloat16",
                    "grad_clip": True}
    assert spec_of(monkeypatch, {**SMALL, "mlp": "fused"}, autocast=None, grad_clip=0.0)["autocast"] is None


def test_only_fused_work_on_a_gpu_starts_a_child(monkeypatch):
    assert spec_of(monkeypatch, {**SMALL, "mlp": "eager"}) is None  # nothing of ours to compile
    assert spec_of(monkeypatch, {**SMALL, "mlp": "fused"}, device="cpu") is None  # (the interpreter compiles nothing)
    assert spec_of(monkeypatch, {**SMALL, "mlp": "eager", "classifier": "fused"}) is not None
    assert spec_of(monkeypatch, {**SMALL, "mlp": "auto"}) is not None


def recorded_launches(monkeypatch):
    """The names of the Triton kernels launched from now on, through tuning's plans or directly (with
    linear_act_kernel's SAVE): Triton's launch itself is recorded (the interpreter's, on CPU)."""
    from fused_ops import classifier
    kind = type(classifier._cross_entropy_kernel)  # (JITFunction, or the interpreter's InterpretedFunction)
    launched, run = [], kind.run

    def recording(self, *args, **kwargs):
        name = self.fn.__name__
        launched.append(f"{name}(SAVE={kwargs['SAVE']})" if name == "linear_act_kernel" else name)
        return run(self, *args, **kwargs)
    monkeypatch.setattr(kind, "run", recording)
    return launched


@pytest.mark.parametrize("config,wanted", [
    (dict(mlp="fused", classifier="fused"),  # the evaluation's forward saves nothing; training's saves dh/dz
     ["linear_act_kernel(SAVE=False)", "linear_act_kernel(SAVE=True)", "dgrad_kernel", "_cross_entropy_kernel"]),
    (dict(mlp="fused", fuse_ln=True), ["linear_act_kernel(SAVE=False)", "linear_act_kernel(SAVE=True)",
                                       "dgrad_kernel", "layernorm_stats_kernel", "layernorm_backward_kernel"]),
    (dict(mlp="fused", fp8=True, fp8_reach="blocks", classifier="fp8"),
     ["cast_transpose_kernel", "fp8_linear_act_kernel", "fp8_dgrad_kernel", "update_scales_kernel",
      "_cross_entropy_kernel",  # and the copies a run compiled whole makes of every FP8 weight at once
      "weight_amax_kernel", "weight_cast_kernel", "weight_transpose_kernel"]),
])
def test_the_child_runs_the_kernels_the_run_will(config, wanted, monkeypatch):
    """In-process (the interpreter on CPU, fp16 autocast): every kernel family the model's run launches, launched
    through fused_ops.tuning (the kernels the run will load, not an eager fallback), and a training step that moved
    the weights."""
    if not kernels_run_here():
        pytest.skip("the kernels cannot run here")
    launched = recorded_launches(monkeypatch)
    spec = {"config": {**SMALL, "n_layer": 1, "n_embd": 16, **config}, "batch_size": 2, "autocast": "float16",
            "grad_clip": False}
    before = GPT(GPTConfig(**spec["config"]))
    gpt = model.compile_kernels(spec, "cpu")
    assert set(wanted) <= set(launched), sorted(set(launched))
    moved = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(), gpt.state_dict().values())
             if a.is_floating_point()]
    assert any(moved) and all(torch.isfinite(p).all() for p in gpt.parameters())


def test_the_child_process_exits_cleanly_and_is_off_by_env(monkeypatch):
    if not kernels_run_here():
        pytest.skip("the kernels cannot run here")
    spec = {"config": {**SMALL, "n_layer": 1, "n_embd": 16, "mlp": "fused", "activation": "relu"},
            "batch_size": 2, "autocast": None, "grad_clip": True}
    child = precompile.start("model:compile_kernels", spec, "cpu")
    bad = precompile.start("model:no_such_function", spec, "cpu")  # (a child that fails only exits non-zero)
    # (the two run side by side: each child's interpreter imports torch, seconds of a 2-core machine's time)
    assert child.wait(timeout=300) == 0
    assert bad.wait(timeout=300) != 0
    monkeypatch.setattr(fused_ops.env, "PRECOMPILE", False)
    assert precompile.start("model:compile_kernels", spec, "cpu") is None


# The Triton cache's files of our kernels: not Inductor's (named triton_*), nor the small C launchers Triton builds
# per argument signature (__triton_launcher*, Inductor's among them, by name indistinguishable).
OURS_ONLY = ("import os, sys, pathlib\n"
             "print(sorted(str(p) for p in pathlib.Path(sys.argv[1]).rglob('*') if p.is_file()\n"
             "      and not p.name.removeprefix('__grp__').startswith(('triton_', '__triton_launcher'))))\n")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config,compile", [
    (dict(mlp="fused", classifier="fused"), "default"),
    (dict(mlp="fused", fp8=True, fp8_reach="blocks", classifier="fp8"), "reduce-overhead"),
])
def test_the_child_compiles_what_the_run_then_loads(config, compile, tmp_path):
    """With a fresh Triton cache: after the child, a process training the model (four blocks, compiled as the configs
    run it, then uncompiled) with FusedAdamW compiles no kernel of ours: Triton's cache gains no file that is not
    Inductor's."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FUSED_OPS_TUNING_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # 4 blocks: the FP8 config's model-wide weight copies then take 16 weights, a count Triton would specialize
    # on, where the child's one block has 4
    full = dict(n_layer=4, n_head=6, n_embd=384, block_size=256, vocab_size=1024, dropout=0.0, bias=False, **config)
    spec = {"config": {**full, "n_layer": 1}, "batch_size": 16, "autocast": "bfloat16", "grad_clip": True}
    command = "import sys, fused_ops.precompile as p; p.main(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", command, "model:compile_kernels", json.dumps(spec), "cuda"],
                   env={**env, "FUSED_OPS_AUTOTUNE": "0"}, cwd=root, check=True)
    before = subprocess.run([sys.executable, "-c", OURS_ONLY, str(tmp_path / "triton")], capture_output=True,
                            text=True, check=True).stdout
    assert "kernel" in before
    run = ("import torch; from model import GPT, GPTConfig; from helpers import runtime\n"
           f"m = GPT(GPTConfig(**{full!r})).cuda()\n"
           "opt = m.configure_optimizers(0.1, 1e-4, (0.9, 0.95), 'cuda')\n"
           "x = torch.randint(0, 1024, (16, 256), device='cuda')\n"
           f"for f in (torch.compile(m, mode={compile!r}), m):\n"
           "    for _ in range(3):\n"
           "        torch.compiler.cudagraph_mark_step_begin()\n"
           "        with torch.autocast('cuda', torch.bfloat16):\n"
           "            with torch.no_grad(): m.eval(); f(x, x); m.train()\n"
           "            loss = f(x, x)[1]\n"
           "        loss.backward()\n"
           "        runtime.clip_and_step(opt, m.parameters(), 1.0, torch.amp.GradScaler('cuda', enabled=False))\n"
           "        opt.zero_grad(set_to_none=True)\n"
           "torch.cuda.synchronize()\n")
    subprocess.run([sys.executable, "-c", run], env=env, cwd=root, check=True)
    after = subprocess.run([sys.executable, "-c", OURS_ONLY, str(tmp_path / "triton")], capture_output=True,
                           text=True, check=True).stdout
    new = sorted(set(eval(after)) - set(eval(before)))
    assert new == [], new


def test_wait_lets_a_child_finish_and_stops_one_past_its_time(monkeypatch):
    """tuning.py waits for the children before timing tiles; one that hangs is stopped, not waited for forever."""
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(precompile, "_children", [quick, stuck])
    precompile.wait(timeout=5)
    assert quick.returncode == 0 and stuck.returncode not in (None, 0)
