"""Compiling the fused kernels in a child process while a run starts up.

With a cold Triton cache, a run compiles each kernel the first time it launches it: the fused MLP's (the forward
of evaluation, which saves nothing, the forward that saves dh/dz, its dgrad; their FP8 forms), the FP8 linears',
the classifier's, FusedAdamW's. Those launches come late, after CUDA's initialization, the model's build and
torch.compile's tracing and code generation, and each compile then sits on the critical path (docs/performance.md,
start-up).

What a kernel compiles to depends only on shapes, dtypes and flags, all known once the model is built. So start()
launches a child process that runs entry(spec, device) (model.compile_kernels: a one-block copy of the model
through an evaluation forward and two training steps, on random tokens of the run's batch shape). Triton writes what
the child compiles to its disk cache, and the parent's first launch of the same kernel (same source, argument
specialization and options, so the same cache key) loads it from there instead of compiling. The child only ever
saves time: if it is slower than the parent, fails or is killed, the parent compiles as it would have, and nothing
of the child's reaches the run but those cache files.

The child never tunes (FUSED_OPS_AUTOTUNE=0, no tuning cache): tile choices timed while the parent uses the same
GPU could be wrong, and would be kept. Where a kernel is tuned (the Triton path, not Hopper's ping-pong kernels)
the parent waits for the child before it times anything (wait(), which this module adds to tuning.BEFORE_TIMING),
then tunes as before; the child has compiled one of its candidates.

This module runs whatever entry it is given: it imports nothing of the model's (the kernels never do).
FUSED_OPS_PRECOMPILE=0 turns it off.
"""

import atexit
import importlib
import json
import os
import subprocess
import sys

import torch

from . import env, tuning

_children = []  # started and maybe still running: stopped when the parent exits


def start(entry, spec, device):
    """Launch the child running entry ("module:function", importable from the repository's root) as
    function(spec, device), spec a JSON-able dict, then waiting for the GPU; returns its Popen, or None when turned
    off."""
    if not env.PRECOMPILE:
        return None
    _children[:] = [c for c in _children if c.poll() is None]  # (finished ones reaped)
    if str(device).startswith("cuda"):  # the parent's CUDA context first: under an exclusive compute mode a
        torch.zeros(1, device=device)   # child that got there first would lock the run out of its own GPU
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child_env = {**os.environ, "FUSED_OPS_AUTOTUNE": "0", "FUSED_OPS_TUNING_CACHE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    command = "import sys, fused_ops.precompile as p; p.main(*sys.argv[1:])"
    child = subprocess.Popen([sys.executable, "-c", command, entry, json.dumps(spec), str(device)], env=child_env,
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


def main(entry, spec_json, device):
    """The child: run the entry, then wait for the GPU (an error exits non-zero; nobody reads it but a test)."""
    module, function = entry.split(":")
    if torch.device(device).index is not None:  # ("cuda" alone: the current device, as in the parent)
        torch.cuda.set_device(device)
    getattr(importlib.import_module(module), function)(json.loads(spec_json), device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
