"""The ping-pong kernel's consumers as one warpgroup each (4 warps, up to 240 registers a thread after setmaxnreg)
against two (8 warps, 112; the product: two, and one in the plain dgrad), and tiles of 64 output columns: the MLP's four ping-pong GEMMs at GPT-2 small's size (M = 12288, C = 768,
H = 3072, GELU, bias): the FP8 forward (h8, h8ᵀ, dh/dz) and dgrad (gz8, gz8ᵀ, the bias gradient's partials), the
bf16 forward and dgrad; cuBLAS's GEMM of the same shape for scale. Each variant's outputs are checked bit for bit
against the product's, then timed (GPU time, do_bench medians), rounds alternated.

A variant is pingpong.py's source with a substitution, written as fused_ops/hopper/_probe_<name>.py (deleted after).
--ptxas (no GPU needed): each kernel compiled for sm_90a instead, and what ptxas says of its registers and spills.
    python lab/fp8/consumer_warps.py [--rounds=5] [--ptxas] [name='old->new;;old2->new2' ...]
"""

import argparse
import importlib
import inspect
import os
import statistics
import subprocess
import tempfile

import torch
from triton.testing import do_bench

from fused_ops.hopper import pingpong

M, C, H = 12288, 768, 3072
W4 = "CONSUMER_WARPS = 8->CONSUMER_WARPS = 4"  # every consumer one warpgroup
W8 = "DGRAD_CONSUMER_WARPS = 4->DGRAD_CONSUMER_WARPS = 8"  # every consumer two (the product before the dgrad's four)
N64 = "BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64->BLOCK_M, BLOCK_N, BLOCK_K = 128, 64, 64;;PART = 32  #->PART = 16  #"
VARIANTS = {"w8": W8, "w4": W4, "n64": N64}  # (n64: tiles of 64 output columns, stored 16 at a time)


def variant(name, subs):
    src = inspect.getsource(pingpong)
    for pair in subs.split(";;"):
        old, new = pair.split("->")
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    path = os.path.join(os.path.dirname(pingpong.__file__), f"_probe_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    return importlib.import_module(f"fused_ops.hopper._probe_{name}"), path


def cases(dev="cuda"):
    """name -> (launch(pp), the outputs it writes, cuBLAS's GEMM of the same shape)."""
    g = torch.Generator(dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g)
    one = lambda v: torch.full((1,), v, device=dev)
    x8, w8 = (rnd(M, C) * 8).to(torch.float8_e4m3fn), (rnd(H, C) * 8).to(torch.float8_e4m3fn)
    gy8, w2t8 = (rnd(M, C) * 8).to(torch.float8_e5m2), (rnd(H, C) * 8).to(torch.float8_e4m3fn)
    inv = (one(1 / 8), one(1 / 8 / C ** 0.5))
    bias = rnd(H).bfloat16()
    saved = rnd(M, H).bfloat16()
    out = {k: torch.empty(M, H, device=dev, dtype=torch.bfloat16) for k in ("h", "dh", "gz")}
    h8, gz8 = (torch.empty(M, H, device=dev, dtype=d) for d in (torch.float8_e4m3fn, torch.float8_e5m2))
    h8t, gz8t = (torch.empty(H, M, device=dev, dtype=d) for d in (torch.float8_e4m3fn, torch.float8_e5m2))
    amax = torch.zeros(2, device=dev)
    partial = torch.empty(M // 128, H, device=dev)
    x, w, gy, w2 = rnd(M, C).bfloat16(), rnd(H, C).bfloat16() / C ** 0.5, rnd(M, C).bfloat16(), rnd(C, H).bfloat16() / C ** 0.5
    gelu = dict(ACTIVATION="gelu", UP_ACTIVATION="identity", GATED=False)
    mul = dict(ACTIVATION="identity", UP_ACTIVATION="identity", GATED=False)

    def fwd8(pp):
        amax.zero_()
        pp._launch(x8, w8, h8, out["dh"], bias, None, True, out2=h8t, scale=one(4.0), amax=amax[:1], inv=inv,
                   EPILOGUE="act", HAS_BIAS=True, SAVE=True, FP8_OUT=True, **gelu)

    def dgrad8(pp):
        amax.zero_()
        pp._launch(gy8, w2t8, gz8, saved, None, partial, True, out2=gz8t, scale=one(4.0), amax=amax[1:], inv=inv, n=H,
                   EPILOGUE="mul", HAS_BIAS=True, SAVE=False, FP8_OUT=True, **mul)

    def fwd16(pp):
        pp._launch(x, w, out["h"], out["dh"], bias, None, True, EPILOGUE="act", HAS_BIAS=True, SAVE=True, **gelu)

    def dgrad16(pp):
        pp._launch(gy, w2, out["gz"], saved, None, partial, False, EPILOGUE="mul", HAS_BIAS=True, SAVE=False, **mul)

    s = one(1.0)
    return {"FP8 forward (h8, h8T, dh/dz)": (fwd8, [h8, h8t, out["dh"], amax], lambda: torch._scaled_mm(
                x8, w8.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16)),
            "FP8 dgrad (gz8, gz8T, bias partials)": (dgrad8, [gz8, gz8t, partial, amax], lambda: torch._scaled_mm(
                gy8, w2t8.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16)),
            "bf16 forward (h, dh/dz)": (fwd16, [out["h"], out["dh"]], lambda: x @ w.t()),
            "bf16 dgrad (grad_z, bias partials)": (dgrad16, [out["gz"], partial], lambda: gy @ w2)}


def ptxas(mods, only=""):
    """Each case's kernel compiled for sm_90a through the module's real launcher (its _run replaced), then ptxas -v
    and the number of SASS instructions (both consumers and the loader)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    for case, (launch, _, _) in cases("cpu").items():
        if not case.startswith(only):
            continue
        for name, pp in mods.items():
            built = []

            def compile_only(args, consts, tiles, device, pp=pp):
                signature, constexprs, args = {}, {}, list(args)
                for i, p in enumerate(pp.pingpong_kernel.params):
                    arg = consts[p.name] if p.is_constexpr else args.pop(0)
                    signature[p.name] = "constexpr" if p.is_constexpr else mangle_type(arg)
                    if signature[p.name] == "constexpr":
                        constexprs[(i,)] = arg
                warps = consts["CONSUMER_WARPS"]
                built.append(triton.compile(GluonASTSource(pp.pingpong_kernel, signature, constexprs),
                                            target=GPUTarget("cuda", 90, 32),
                                            options=dict(num_warps=warps, maxnreg=pp.registers(warps)[0])))

            pp._run = compile_only
            launch(pp)
            print(f"{case:<38} {name:<8} {sass_report(built[0].asm['ptx'])}")


def sass_report(ptx):
    """A kernel's PTX assembled for sm_90a by Triton's bundled ptxas: its SASS instruction count, then what ptxas -v
    says of registers and spills."""
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        done = subprocess.run([f"{bin_dir}/ptxas", "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                              capture_output=True, text=True)
        sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    instructions = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line)
    said = " ".join(line.split(":", 1)[-1].strip() for line in done.stderr.splitlines()
                    if "Used" in line or "spill" in line)
    return f"{instructions} instructions; {said}"


def run(specs, rounds=5, ptxas_only=False, only=""):
    """The product against each variant (name -> substitutions), the cases whose name starts with `only`."""
    mods, paths = {"product": pingpong}, []
    for name, subs in specs.items():
        mods[name], path = variant(name, subs)
        paths.append(path)
    try:
        if ptxas_only:
            return ptxas(mods, only)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M={M} C={C} H={H}, GELU + bias; GPU time, "
              f"do_bench median per round (us), {rounds} rounds alternated")
        for case, (launch, outs, cublas) in cases().items():
            if not case.startswith(only):
                continue
            launch(pingpong)
            torch.cuda.synchronize()
            ref = [o.clone() for o in outs]
            fns = {"cuBLAS GEMM alone": cublas}
            for name, pp in mods.items():
                for o in outs:
                    o.view(torch.uint8).fill_(0)  # (as bytes: FP8 tensors have no fill_)
                launch(pp)
                torch.cuda.synchronize()
                differ = [f"output {k}: {(o.float() - r.float()).abs().max().item():.3g}" for k, (o, r) in
                          enumerate(zip(outs, ref)) if not torch.equal(o.view(torch.uint8), r.view(torch.uint8))]
                fns[name + (f" (differs: {', '.join(differ)})" if differ else "")] = (
                    lambda pp=pp, launch=launch: launch(pp))
            times = {n: [] for n in fns}
            names = list(fns)
            for r in range(rounds):
                for n in (names if r % 2 == 0 else names[::-1]):
                    times[n].append(do_bench(fns[n], warmup=25, rep=200, return_mode="median") * 1000)
            print(f"\n{case}")
            for n in names:
                print(f"  {n}\n  {'':<40}" if len(n) > 40 else f"  {n:<40}", end="")
                print("".join(f"{t:8.1f}" for t in times[n]) + f"   median {statistics.median(times[n]):7.1f}")
    finally:
        for p in paths:
            os.remove(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ptxas", action="store_true", help="compile for sm_90a and print ptxas -v's lines (no GPU)")
    ap.add_argument("variants", nargs="*", help="name='old->new;;...' (default: " + str(VARIANTS) + ")")
    args = ap.parse_args()
    run(dict(v.split("=", 1) for v in args.variants) or VARIANTS, args.rounds, args.ptxas)


if __name__ == "__main__":
    main()
