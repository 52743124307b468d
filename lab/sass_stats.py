"""What ptxas makes of the ping-pong kernels, without a GPU: compile pingpong.py's kernel (or a variant module) for
sm_90 through its own launcher at GPT-2 small's MLP size, then count ptxas's spills and the SASS instructions that
decide an epilogue's speed (barriers, shared-memory stores by width, shuffles, local-memory traffic).

Triton bundles ptxas and nvdisasm, so this runs on the CPU machine. ptxas's register allocation moves with the
Triton version: use the one the GPU image runs (3.6 in 2026-11), in a virtual environment of its own so that the
machine's Triton (the one the CPU tests run) stays as it is:

    python3 -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/python -m pip install --no-deps triton==3.6.0
    PYTHONPATH=. /tmp/t36/bin/python lab/sass_stats.py [--module fused_ops.hopper._probe_x] [--only fwd_gelu,dgrad_swiglu]

Round 22 used it to compare epilogue variants before timing them (docs/performance.md): a spill count here is what
the GPU's compile reports as well; whether a spill costs time, only the GPU says.
"""

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import warnings

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8"))
from epilogue_probe import fp8_launcher  # noqa: E402 (the FP8 launchers, launching a variant module's kernel)


COUNTED = ("BAR.SYNC", "STS.U8", "STS.U16", "STS ", "STS.64", "STS.128", "STSM", "SHFL", "STL", "LDL", "MUFU")


def compile_launch(pp):
    """Make pp._run compile (not launch) the kernel it is given; returns the list the compiled kernels go to."""
    compiled = []

    def run(args, consts, tiles, device):
        signature, constexprs, args = {}, {}, list(args)
        for i, p in enumerate(pp.pingpong_kernel.params):
            arg = consts[p.name] if p.is_constexpr else args.pop(0)
            signature[p.name] = "constexpr" if p.is_constexpr else mangle_type(arg)
            if signature[p.name] == "constexpr":  # a constexpr parameter, or an argument passed as None
                constexprs[(i,)] = arg
        compiled.append(triton.compile(GluonASTSource(pp.pingpong_kernel, signature, constexprs),
                                       target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=pp.CONSUMER_WARPS, maxnreg=pp.MAXNREG)))

    pp._run = run
    return compiled


def kernels(pp, M=12288, C=768):
    """name -> a call of pp's launcher for each FP8 kernel (and the 16-bit forwards) at GPT-2 small's MLP size."""
    bf16 = lambda *s: torch.empty(*s, dtype=torch.bfloat16)
    e4m3 = lambda *s: torch.empty(*s, dtype=torch.float8_e4m3fn)
    e5m2 = lambda *s: torch.empty(*s, dtype=torch.float8_e5m2)
    inv, one = (torch.ones(1), torch.ones(1)), torch.ones(1)
    calls = {}
    for act, gated, H in (("gelu", False, 4 * C), ("silu", True, 2048)):
        rows = 2 * H if gated else H
        tag = "swiglu" if gated else "gelu"
        calls[f"fwd_{tag}"] = lambda act=act, gated=gated, H=H, rows=rows: fp8_launcher(pp, "linear_act_forward_fp8")(
            e4m3(M, C), e4m3(rows, C), inv, None, act, e4m3(M, H), e4m3(H, M), bf16(M, rows), one, one, "identity",
            gated)
        calls[f"dgrad_{tag}"] = lambda gated=gated, H=H, rows=rows: fp8_launcher(pp, "dgrad_fp8")(
            e5m2(M, C), e4m3(H, C), inv, bf16(M, rows), e5m2(M, rows), e5m2(rows, M), False, one, one, gated)
        calls[f"fwd_{tag}_16bit"] = lambda act=act, gated=gated, H=H, rows=rows: pp.linear_act_forward(
            bf16(M, C), bf16(rows, C), None, act, "identity", gated, True, bf16(M, H), bf16(M, rows))
    V = 50304  # the classifier's logits GEMM (2458 rows: one chunk of GPT-2's head), and the plain GEMM beside it
    calls["logits_lse_16bit"] = lambda: pp.logits_lse(bf16(2458, C), bf16(V, C), bf16(2458, V))
    calls["logits_lse_fp8"] = lambda: pp.logits_lse(e4m3(2458, C), e4m3(V, C), bf16(2458, V), inv)
    calls["fwd_identity_16bit"] = lambda: pp.linear_act_forward(bf16(2458, C), bf16(V, C), None, "identity",
                                                                "identity", False, False, bf16(2458, V), None)
    return calls


def stats(kernel):
    """(ptxas's line on registers and spills, {instruction: count} in the SASS) of one compiled kernel."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        done = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    spills = " ".join(m.group(0) for m in re.finditer(r"\d+ bytes spill (stores|loads)", done.stderr))
    return spills, {name.strip(): sass.count(name) for name in COUNTED}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--module", default="fused_ops.hopper.pingpong", help="pingpong.py or a variant of it")
    p.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    a = p.parse_args()
    pp = importlib.import_module(a.module)
    compiled = compile_launch(pp)
    warnings.simplefilter("error", pp.FallbackWarning)  # a variant that does not compile must say so
    print(f"{a.module}, Triton {triton.__version__}, sm_90 (counts over both consumers' code)")
    for name, call in kernels(pp).items():
        if a.only and name not in a.only.split(","):
            continue
        call()
        spills, counts = stats(compiled.pop())
        print(f"{name:18s} {spills}\n{'':18s} " + "  ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
