"""Compiling the fused MLP's kernels in a child process while a run starts up.

With a cold Triton cache, a run compiles each kernel the first time it launches it: for each MLP shape, the
forward of evaluation (no_grad, saves nothing), the forward that saves dh/dz and its dgrad. Those launches come
late, after CUDA's initialization, the model's build and torch.compile's tracing, and each compile then sits on
the critical path: on one H100 host they added ~7.6 s to a cold start, ~3 s on another
(results/wallclock_shakespeare_char_5000_h100_2026-11-26.txt).

What a kernel compiles to depends only on shapes, dtypes and flags, all known once the model is built. So start()
launches a child process that runs, on the same GPU and random data, one forward under no_grad and one forward +
backward of an MLP of the same shape. Triton writes what the child compiles to its disk cache, and the parent's
first launch of the same kernel (same source, argument specialization and options, so the same cache key) loads
it from there instead of compiling. The child only ever saves time: if it is slower than the parent, fails or is
killed, the parent compiles as it would have, and nothing of the child's reaches the run but those cache files.

The child never tunes (FUSED_OPS_AUTOTUNE=0, no tuning cache): tile choices timed while the parent uses the same
GPU could be wrong, and would be kept. Where a kernel is tuned (the Triton path, not Hopper's ping-pong kernels)
the parent waits for the child before it times anything (wait(), which this module adds to tuning.BEFORE_TIMING), then tunes as before; the
child has compiled one of its candidates.

FUSED_OPS_PRECOMPILE=0 turns it off.
"""

import atexit
import json
import os
import subprocess
import sys

import torch

from . import env, tuning
from .mlp import fused_mlp_layers

_children = []  # started and maybe still running: stopped when the parent exits


def mlp_spec(c_fc, c_proj, activation, norm, fuse_ln, tokens, autocast_dtype):
    """What the child needs to compile an MLP's kernels: the layers' shapes and dtypes, the activation, the
    LayerNorm (folded or not), the rows of a batch (tokens) and the autocast dtype (None without autocast)."""
    layer_norm = isinstance(norm, torch.nn.LayerNorm)
    return {"C": c_fc.in_features, "N": c_fc.out_features, "H": c_proj.in_features, "bias": c_fc.bias is not None,
            "activation": activation, "dtype": str(c_fc.weight.dtype).removeprefix("torch."),
            "layer_norm": layer_norm, "ln_bias": layer_norm and norm.bias is not None,
            "fuse_ln": bool(fuse_ln and layer_norm), "tokens": int(tokens),
            "autocast": None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch.")}


def start(spec, device):
    """Launch the child compiling spec's kernels on `device`; returns its Popen, or None when turned off."""
    if not env.PRECOMPILE:
        return None
    _children[:] = [c for c in _children if c.poll() is None]  # (finished ones reaped)
    if str(device).startswith("cuda"):  # the parent's CUDA context first: under an exclusive compute mode a
        torch.zeros(1, device=device)   # child that got there first would lock the run out of its own GPU
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child_env = {**os.environ, "FUSED_OPS_AUTOTUNE": "0", "FUSED_OPS_TUNING_CACHE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    command = "import sys, fused_ops.precompile as p; p.main(*sys.argv[1:])"
    child = subprocess.Popen([sys.executable, "-c", command, json.dumps(spec), str(device)], env=child_env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _children.append(child)
    return child


def wait(timeout=120.0):
    """Wait for the running children (tuning.py, before it times tile configs: a child's kernels on the same GPU
    would skew the timings it keeps). A child past the timeout is stopped."""
    for child in _children:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _before_timing():  # (wait looked up when called: a test replaces it)
    wait()


tuning.BEFORE_TIMING.append(_before_timing)


@atexit.register
def _stop_children():
    for child in _children:
        if child.poll() is None:
            child.kill()
            child.wait()


def compile_kernels(spec, device):
    """Run the MLP of `spec` once under no_grad and once forward + backward (the child's work; callable in-process)."""
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    fc = torch.nn.Linear(spec["C"], spec["N"], bias=spec["bias"], device=device, dtype=dtype)
    proj = torch.nn.Linear(spec["H"], spec["C"], bias=spec["bias"], device=device, dtype=dtype)
    norm = torch.nn.LayerNorm(spec["C"], bias=spec["ln_bias"], device=device, dtype=dtype) if spec["layer_norm"] else None
    x = torch.randn(spec["tokens"], spec["C"], device=device, dtype=dtype)
    autocast = torch.autocast(torch.device(device).type, dtype=getattr(torch, spec["autocast"] or "float32"),
                              enabled=spec["autocast"] is not None)
    with autocast:
        with torch.no_grad():
            fused_mlp_layers(x, fc, proj, spec["activation"], norm, spec["fuse_ln"])
        y = fused_mlp_layers(x.requires_grad_(), fc, proj, spec["activation"], norm, spec["fuse_ln"])
    y.backward(torch.randn_like(y))
    return x.grad


def main(spec_json, device):
    """The child: compile, then wait for the GPU (an error exits non-zero; nobody reads it but a test)."""
    spec = json.loads(spec_json)
    if torch.device(device).index is not None:  # ("cuda" alone: the current device, as in the parent)
        torch.cuda.set_device(device)
    compile_kernels(spec, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
