"""The portable kernels' tile space, timed config by config against cuBLAS at GPT-2 small's MLP shapes.

    python lab/portable/sweep.py [--quick] > results/portable/sweep_h200.txt

For each kernel of the core (the plain and gated forward, their dgrads, the FP8 forward and dgrad) and each main
loop (TMA and pointers), every candidate config of a wider space than tuning.matmul_configs: tile, warps, stages,
split epilogue, persistent grid (programs per SM) and flattened loop; for the gated forward through TMA also the plain
space with the gate and up rows paired into one B tile ("paired", matmul_loop's B_PAIRS). --loops tma (or pointer)
times one main loop only. Also, on one config each: the epilogue's
activation math the old way (FAST16=False: libdevice erf for the value and again for the derivative), and no dh/dz
saved, to see where the time goes. The peers: cuBLAS's plain GEMM of each shape, and cuBLASLt's bias + GELU epilogue
(torch._addmm_activation). Floors: FLOPs at the measured matmul peak, bytes at the measured copy bandwidth. GPU
time, do_bench medians. Needs a Hopper GPU for the TMA rows; the pointer rows run on any CUDA GPU.
"""

import argparse
import os
import sys
import time

SMOKE = "--smoke" in sys.argv  # the plumbing on a CPU, through Triton's interpreter, at toy sizes (no timing meaning)
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, ".")
from fused_ops import env, tuning  # noqa: E402
from fused_ops.activations import kernel_activations  # noqa: E402
from fused_ops.dgrad import dgrad_kernel  # noqa: E402
from fused_ops.fp8 import kernels as fp8k  # noqa: E402
from fused_ops.linear_act import linear_act_kernel  # noqa: E402
from fused_ops.matmul import dot_settings, pair_descriptor, pairs_fit, tma_operands  # noqa: E402
from fused_ops.tuning import _config as C  # noqa: E402

env.PINGPONG = False
M, WIDTH, HIDDEN = (64, 32, 64) if SMOKE else (12288, 768, 3072)
DT = torch.float16 if SMOKE else torch.bfloat16
DEV = "cpu" if SMOKE else "cuda"


def ms(fn):
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


PLAIN_SPACE = [  # (block_m, block_n, block_k, warps, stages, split epilogue, programs per SM (0: a grid), flatten)
    (128, 256, 64, 8, 3, True, 0, False), (128, 256, 64, 8, 3, True, 1, True), (128, 256, 64, 8, 4, True, 0, False),
    (128, 128, 64, 4, 3, True, 0, False), (128, 128, 64, 4, 3, True, 2, True), (128, 128, 64, 4, 4, True, 0, False),
    (128, 128, 64, 4, 3, False, 0, False), (128, 128, 64, 8, 3, True, 0, False), (128, 128, 64, 8, 4, True, 1, True),
    (256, 128, 64, 8, 3, True, 0, False),
]
GATED_SPACE = [
    (128, 128, 64, 8, 3, True, 0, False), (128, 128, 64, 8, 3, True, 1, True), (128, 128, 64, 8, 4, True, 0, False),
    (128, 64, 64, 4, 4, False, 0, False), (128, 64, 64, 4, 4, False, 2, True), (128, 64, 64, 4, 3, True, 2, True),
    (128, 128, 64, 4, 3, True, 0, False), (64, 128, 64, 4, 4, True, 0, False),
]
FP8_SPACE = [
    (128, 128, 64, 4, 3, False, 0, False), (128, 128, 128, 8, 3, False, 0, False), (128, 128, 128, 4, 3, False, 2, True),
    (128, 64, 128, 4, 4, False, 0, False), (128, 128, 128, 8, 4, False, 1, True),
]


def named(entries):
    if SMOKE:  # the interpreter's tile, each variant of the rest
        entries = [(32, 32, 32, 4, 1, sp, p, f) for *_, sp, p, f in entries[:3]]
    return [(f"{bm}x{bn}x{bk} w{w} s{s} {'split' if sp else 'whole'} " + (f"pers{p}{'f' if f else ''}" if p else "grid"),
             C(bm, bn, bk, w, s, split=sp, persistent=p, flatten=f)) for bm, bn, bk, w, s, sp, p, f in entries]


def space(gated, pointer):
    """(name, config) candidates."""
    return named(GATED_SPACE if gated else PLAIN_SPACE)


def run_cfg(kernel, Mr, N, K, args, consts, cfg, desc):
    try:
        tuning.run_config(kernel, Mr, N, K, args, consts, cfg, desc)  # compile
        if not SMOKE:
            torch.cuda.synchronize()
        return ms(lambda: tuning.run_config(kernel, Mr, N, K, args, consts, cfg, desc))
    except Exception as e:  # (shared memory, registers, an unsupported combination)
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def forward_rows(activation, pointer, quick):
    act, up, gated = kernel_activations(activation)
    H = 2048 if gated else HIDDEN
    rows = 2 * H if gated else H
    x = torch.randn(M, WIDTH, device=DEV, dtype=DT)
    w = torch.randn(rows, WIDTH, device=DEV, dtype=DT) / WIDTH ** 0.5
    b = torch.randn(rows, device=DEV, dtype=DT)
    out = torch.empty(M, H, device=DEV, dtype=DT)
    saved = torch.empty(M, rows, device=DEV, dtype=DT)
    with env.overridden(TMA_MODE="0" if pointer else "auto"):
        desc, kmaj = tma_operands(x, w.t())
    wt = w if desc else w.t().contiguous().t()  # (the launcher's N-major copy for the pointer loop)
    acc, prec = dot_settings(DT)
    args = (x, wt, b, out, saved, out, wt, wt, M, H, WIDTH, x.stride(0), x.stride(1), wt.stride(0), wt.stride(1),
            out.stride(0), saved.stride(0))
    base = dict(ACTIVATION=act, UP_ACTIVATION=up, GATED=gated, HAS_BIAS=True, SAVE=True, FAST16=True, LN_FOLD=False,
                LN_WEIGHT=False, LN_BIAS=False, ACC_DTYPE=acc, PRECISION=prec, INT64=False, TMA=bool(desc),
                B_KMAJOR=kmaj, PAIRED=False)
    res = []
    cands = space(gated, pointer)[:3 if quick else None]
    for name, cfg in cands:
        res.append((name, run_cfg(linear_act_kernel, M, H, WIDTH, args, base, cfg, desc)))
    if gated and desc and kmaj:  # the plain tiles, gate and up rows paired into one B tile (matmul_loop's B_PAIRS)
        paired = [desc[0], (1, lambda meta: pair_descriptor(wt, meta["BLOCK_N"], meta["BLOCK_K"]), None)]
        for name, cfg in named(PLAIN_SPACE)[:3 if quick else None]:
            if pairs_fit(H, cfg):
                res.append((f"paired {name}", run_cfg(linear_act_kernel, M, 2 * H, WIDTH, args,
                                                      {**base, "PAIRED": True}, cfg, paired)))
    best = min((r for r in res if isinstance(r[1], float) and not r[0].startswith("paired")), key=lambda r: r[1])
    bcfg = dict(cands)[best[0]]
    extra = [("best, old epilogue math (FAST16=False)", run_cfg(linear_act_kernel, M, H, WIDTH, args,
                                                                  {**base, "FAST16": False}, bcfg, desc)),
             ("best, no dh/dz saved", run_cfg(linear_act_kernel, M, H, WIDTH, args, {**base, "SAVE": False}, bcfg, desc))]
    return res, best, extra, (x, w, b)


def dgrad_rows(gated, pointer, quick):
    H = 2048 if gated else HIDDEN
    width = 2 * H if gated else H
    gy = torch.randn(M, WIDTH, device=DEV, dtype=DT)
    w2 = torch.randn(WIDTH, H, device=DEV, dtype=DT) / H ** 0.5
    saved = torch.randn(M, width, device=DEV, dtype=DT)
    out = torch.empty_like(saved)
    with env.overridden(TMA_MODE="0" if pointer else "auto"):
        desc, kmaj = tma_operands(gy, w2)
    acc, prec = dot_settings(DT)
    partial = torch.empty(tuning.cdiv(M, 32), width, device=DEV)
    args = (gy, w2, saved, out, partial, M, H, WIDTH, gy.stride(0), gy.stride(1), w2.stride(0), w2.stride(1),
            saved.stride(0), out.stride(0), partial.stride(0))
    base = dict(GATED=gated, BIAS_GRAD=True, ACC_DTYPE=acc, PRECISION=prec, INT64=False, TMA=bool(desc),
                B_KMAJOR=kmaj)
    cands = space(gated, pointer)[:3 if quick else None]
    res = [(n, run_cfg(dgrad_kernel, M, H, WIDTH, args, base, c, desc)) for n, c in cands]
    best = min((r for r in res if isinstance(r[1], float)), key=lambda r: r[1])
    return res, best, (gy, w2)


def fp8_rows(activation, quick):
    """The FP8 forward (h8 + dh/dz out) and dgrad (gz8 + gz8ᵀ out) kernels, FP8 MMAs (native) against the upcast
    main loop, TMA and pointers."""
    from fused_ops.fp8.state import FP8State
    act, up, gated = kernel_activations(activation)
    H = 2048 if gated else HIDDEN
    rows = 2 * H if gated else H
    state = FP8State().to(DEV)
    x8 = (torch.randn(M, WIDTH, device=DEV) * 50).to(fp8k.E4M3)
    w8 = (torch.randn(rows, WIDTH, device=DEV) * 50).to(fp8k.E4M3)
    inv = (torch.full((1,), 1e-3, device=DEV), torch.full((1,), 1e-3, device=DEV))
    bias = torch.randn(rows, device=DEV, dtype=DT)
    res = []
    configs = named(FP8_SPACE[:2] if quick else FP8_SPACE)
    Mp = fp8k._padded(M)
    h8 = torch.empty(M, H, device=DEV, dtype=fp8k.E4M3)
    saved = torch.empty(M, rows, device=DEV, dtype=DT)
    for variant in ("native TMA", "native pointers", "upcast pointers"):
        native = variant.startswith("native")
        with env.overridden(TMA_MODE="auto" if "TMA" in variant else "0"):
            desc, kmaj = tma_operands(x8, w8.t(), fp8k.FP8_DTYPES) if native else ([], True)
        args = (x8, w8, bias, h8, saved, *state.slot(fp8k.H)[:2], *inv, M, Mp, H, WIDTH, x8.stride(0), x8.stride(1),
                w8.stride(0), w8.stride(1), saved.stride(0))
        consts = dict(ACTIVATION=act, UP_ACTIVATION=up, GATED=gated, HAS_BIAS=True, ACC_DTYPE=triton.language.float32,
                      PRECISION="ieee", INT64=False, TMA=bool(desc), B_KMAJOR=kmaj, EMULATE=False, UPCAST=not native)
        for n, c in (configs if variant == "native TMA" else configs[:2]):
            res.append((f"fwd {variant}: {n}", run_cfg(fp8k.fp8_linear_act_kernel, M, H, WIDTH, args, consts, c, desc)))
    # dgrad (plain only: the gated one has the same main loop)
    gy8 = (torch.randn(M, WIDTH, device=DEV) * 50).to(fp8k.E5M2)
    w2t8 = (torch.randn(H, WIDTH, device=DEV) * 50).to(fp8k.E4M3)  # W2ᵀ, K-major
    w2 = w2t8.t()
    sv = torch.randn(M, H, device=DEV, dtype=DT)
    gz8 = torch.empty(M, H, device=DEV, dtype=fp8k.E5M2)
    gzt8 = torch.empty(H, Mp, device=DEV, dtype=fp8k.E5M2)
    partial = torch.empty(tuning.cdiv(M, 32), H, device=DEV)
    for variant in ("native TMA", "native pointers", "upcast pointers"):
        native = variant.startswith("native")
        with env.overridden(TMA_MODE="auto" if "TMA" in variant else "0"):
            desc, kmaj = tma_operands(gy8, w2, fp8k.FP8_DTYPES) if native else ([], False)
        args = (gy8, w2, sv, gz8, gzt8, partial, *state.slot(fp8k.GRAD_Z)[:2], *inv, M, Mp, H, WIDTH,
                gy8.stride(0), gy8.stride(1), w2.stride(0), w2.stride(1), sv.stride(0), partial.stride(0))
        consts = dict(GATED=False, BIAS_GRAD=True, ACC_DTYPE=triton.language.float32, PRECISION="ieee", INT64=False,
                      TMA=bool(desc), B_KMAJOR=kmaj, EMULATE=False, UPCAST=not native)
        if not gated:
            for n, c in (configs if variant == "native TMA" else configs[:2]):
                res.append((f"dgrad {variant}: {n}", run_cfg(fp8k.fp8_dgrad_kernel, M, H, WIDTH, args, consts, c, desc)))
    return res


def show(title, res, floor=None):
    print(f"\n## {title}" + (f"  (floor {floor * 1e3:.1f} us)" if floor else ""))
    for name, t in sorted(res, key=lambda r: r[1] if isinstance(r[1], float) else 1e9):
        print(f"  {name:<44} {t * 1e3:8.1f} us" if isinstance(t, float) else f"  {name:<44} {t}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the plumbing on a CPU at toy sizes (tests)")
    ap.add_argument("--parts", default="fwd,dgrad,fp8")
    ap.add_argument("--activations", default="gelu,swiglu")
    ap.add_argument("--loops", default="tma,pointer", help="main loops to time: tma, pointer or both")
    args = ap.parse_args()
    t0 = time.time()
    n = 256 if SMOKE else 8192
    a, b = torch.randn(n, n, device=DEV, dtype=DT), torch.randn(n, n, device=DEV, dtype=DT)
    peak = 2 * n ** 3 / ms(lambda: a @ b) / 1e9
    src = torch.randn(2 ** (16 if SMOKE else 28), device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / ms(lambda: dst.copy_(src)) / 1e6
    print(f"{'cpu (smoke)' if SMOKE else torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{time.strftime('%Y-%m-%d')}\nmeasured: bf16 matmul {peak:.0f} TFLOP/s, copy {bw:.0f} GB/s")
    parts = args.parts.split(",")
    if not set(args.loops.split(",")) <= {"tma", "pointer"}:
        ap.error(f"--loops takes tma, pointer or both, comma-separated; got {args.loops!r}")
    loops = [loop == "pointer" for loop in args.loops.split(",")]
    for activation in args.activations.split(","):
        gated = activation == "swiglu"
        H = 2048 if gated else HIDDEN
        rows = 2 * H if gated else H
        flops = 2 * M * WIDTH * rows
        # bytes a forward must move: x, W, and h + dh/dz (gated: dh/dz is both halves) in bf16
        fwd_bytes = 2 * (M * WIDTH + rows * WIDTH + M * H + M * rows)
        dgrad_bytes = 2 * (M * WIDTH + WIDTH * H + 2 * M * rows)  # grad_y, W2, saved in, grad_z out
        floor = lambda f, by: max(f / peak / 1e9, by / bw / 1e6)  # noqa: E731
        if "fwd" in parts:
            for pointer in loops:
                res, best, extra, (x, w, bias) = forward_rows(activation, pointer, args.quick)
                show(f"{activation} forward, {'pointer' if pointer else 'TMA'} loop: M={M} K={WIDTH} N={rows}",
                     res + extra, floor(flops, fwd_bytes))
            cub = ms(lambda: x @ w.t())
            print(f"  cuBLAS x @ W.T {cub * 1e3:.1f} us ({flops / cub / 1e9:.0f} TFLOP/s); floor of FLOPs alone "
                  f"{flops / peak / 1e6:.1f} us, of bytes alone {fwd_bytes / bw / 1e3:.1f} us")
            if not gated:
                lt = ms(lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True))
                print(f"  cuBLASLt bias + GELU (torch._addmm_activation, h only, no dh/dz) {lt * 1e3:.1f} us")
        if "dgrad" in parts:
            for pointer in loops:
                res, best, (gy, w2) = dgrad_rows(gated, pointer, args.quick)
                show(f"{activation} dgrad, {'pointer' if pointer else 'TMA'} loop: M={M} K={WIDTH} N={H}", res,
                     floor(2 * M * WIDTH * H, dgrad_bytes))
            cub = ms(lambda: gy @ w2)
            print(f"  cuBLAS grad_y @ W2 {cub * 1e3:.1f} us")
        if "fp8" in parts:
            show(f"{activation} FP8 kernels (h8 + dh/dz; gz8 + gz8T)", fp8_rows(activation, args.quick))
            x8 = torch.randn(M, WIDTH, device=DEV).to(fp8k.E4M3)
            w8 = torch.randn(rows, WIDTH, device=DEV).to(fp8k.E4M3)
            one = torch.ones((), device=DEV)
            sm = ms(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=DT))
            print(f"  cuBLAS FP8 x8 @ W8.T (torch._scaled_mm, bf16 out) {sm * 1e3:.1f} us")
    print(f"\n(sweep took {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
