"""Round 22: the FP8 ping-pong kernels before and after this round's epilogue changes, and the x / grad_y cast pass
against a persistent version of it, at GPT-2 small's MLP size (GELU H = 3072, SwiGLU H = 2048), rounds alternated.
Hopper GPU.

"before" is pingpong.py as it was (each part's amax reduced across the 8 warps, SiLU and SiLU' with a sigmoid
each), copied to fused_ops/hopper/_probe_before.py by whoever runs this (it is not kept in the tree):

    git show afa429e:fused_ops/pingpong.py > fused_ops/hopper/_probe_before.py
    PYTHONPATH=. python lab/fp8/round22_probe.py [--rounds 3]
"""

import importlib
import pathlib

import torch
import triton
import triton.language as tl

from fused_ops.casts import quantize
from fused_ops.fp8 import kernels as fp8, state as fp8_state
from fused_ops.hopper import pingpong
from lab.fp8 import epilogue_probe
from lab.fp8.epilogue_probe import alternated, arguments, setup


@triton.jit
def cast_persistent_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, C, Mp, stride_xm, BLOCK_M: tl.constexpr,
                           BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """cast_transpose_kernel (row-major and transposed copies) over tiles in a loop, its amax kept per element and
    folded in once per program."""
    tiles_c = tl.cdiv(C, BLOCK_C)
    scale = tl.load(scale_ptr)
    amax = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    out = q_ptr.dtype.element_ty
    for tile in tl.range(tl.program_id(0), tl.cdiv(Mp, BLOCK_M) * tiles_c, tl.num_programs(0), num_stages=STAGES):
        offs_m = (tile // tiles_c) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_c = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (offs_m[:, None] < M) & (offs_c[None, :] < C)
        v = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        tl.store(q_ptr + offs_m[:, None] * C + offs_c[None, :], quantize(v, scale, out, False), mask=ok)
        tl.store(qt_ptr + offs_c[:, None] * Mp + offs_m[None, :], quantize(tl.trans(v), scale, out, False),
                 mask=(offs_c[:, None] < C) & (offs_m[None, :] < Mp))
    tl.atomic_max(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0), sem="relaxed")

SOURCE = pathlib.Path(pingpong.__file__).with_name("_probe_before.py")
# (old, new) edits of the "before" dgrad (_mul_epilogue and the consumer's prefetch of the saved tile): the first three
# are diagnostics (wrong values, timing only), the last a candidate (a smaller K slice: room for separate FP8 tiles)
VARIANTS = {
    "dg_nowait": [("                    if GATED or not FP8_OUT:  # (the last tile's stores leave from these buffers, but FP8_OUT's\n"
                   "                        tma.store_wait(0)",
                   "                    if not FP8_OUT:  # (the last tile's stores leave from these buffers, but FP8_OUT's\n"
                   "                        tma.store_wait(0)")],
    "dg_noload": [("                    mbarrier.expect(bar, (2 if GATED else 1) * (TN // PART) * aux_desc.block_type.nbytes)",
                   "                    mbarrier.arrive(bar)"),
                  ("                        tma_load(aux_desc, [off_m, off_n + p * PART], bar, stage_bufs.index(base + p))",
                   "                        pass"),
                  ("                            tma_load(aux2_desc, [off_m, off_n + p * PART], bar, stage_bufs.index(base + 4 + p))",
                   "                            pass")],
    "dg_nostore": [("                    q_buf.store(q)\n                    qt_buf.store(gl.permute(q, (1, 0)))\n", ""),
                   ("                    tma_store(out_desc, [off_m, col], q_buf)\n                    tma_store(out2_desc, [col, off_m], qt_buf)\n", "")],
    "dg_gated_bk64": [
        ("    bk = 2 * BLOCK_K if FP8_IN else BLOCK_K",
         "    bk = 2 * BLOCK_K if FP8_IN and not (FP8_OUT and GATED and EPILOGUE == \"mul\") else BLOCK_K"),
        ("FP8_SHARED_MEMORY_PLAN = {(\"act\", True): (4, 8)}", "FP8_SHARED_MEMORY_PLAN = {(\"act\", True): (4, 8), (\"mul\", True): (4, 16)}"),
        ("            if GATED and EPILOGUE == \"mul\":\n                q_bufs = stage_bufs", "            if False:\n                q_bufs = stage_bufs"),
        ("                    if GATED:\n                        q_buf = buf.reinterpret", "                    if False:\n                        q_buf = buf.reinterpret"),
        ("                    if GATED or not FP8_OUT:  # (the last tile's", "                    if not FP8_OUT:  # (the last tile's"),
    ],
}


def variant(name):
    """fused_ops.hopper._probe_<name>: the "before" pingpong.py with VARIANTS[name]'s edits (removed when the probe exits)."""
    return epilogue_probe.variant(name, VARIANTS[name], SOURCE)


def rows_for(mod, d, tag):
    s = d["state"]
    return {
        f"{tag} fwd FP8 out": lambda: epilogue_probe.fp8_launcher(mod, "linear_act_forward_fp8")(
            d["x8"], d["w18"], d["inv1"], None, d["act"], d["h8"], d["h8t"], d["saved"], s.scale[fp8.H:], d["amax"],
            gated=d["gated"]),
        f"{tag} dgrad FP8 out": lambda: epilogue_probe.fp8_launcher(mod, "dgrad_fp8")(d["gy8"], d["w2t8"], d["inv2"], d["saved"], d["gz8"], d["gz8t"],
                                                      False, s.scale[fp8.GRAD_Z:], d["amax"], d["gated"]),
        f"{tag} fwd FP8 in, 16-bit out": lambda: mod.linear_act_forward(
            d["x8"], d["w18"], None, d["act"], "identity", d["gated"], True, d["h16"], d["saved"], inv=d["inv1"]),
    }


def cast_rows(d, sms):
    x, s, M, C, Mp = d["x"], d["state"], *d["x"].shape, d["Mp"]
    q = torch.empty(M, C, device=x.device, dtype=fp8.E4M3)
    qt = torch.empty(C, Mp, device=x.device, dtype=fp8.E4M3)
    rows = {"cast x (product)": lambda: fp8.cast_transpose(x, s, fp8.X, row_major=True),
            "copy x (x.clone(), the same bytes)": lambda: x.clone()}
    for bm, bc, warps, per_sm, stages in ((64, 64, 4, 4, 2), (64, 64, 4, 8, 2), (128, 64, 4, 4, 2),
                                          (64, 128, 4, 4, 2), (64, 64, 2, 8, 3)):
        def run(bm=bm, bc=bc, warps=warps, per_sm=per_sm, stages=stages):
            cast_persistent_kernel[(per_sm * sms,)](x, q, qt, s.scale[fp8.X:], s.amax[fp8.X:], M, C, Mp, x.stride(0),
                                                    BLOCK_M=bm, BLOCK_C=bc, STAGES=stages, num_warps=warps)
        rows[f"cast x persistent {bm}x{bc} w{warps} {per_sm}/SM s{stages}"] = run
    return rows, (q, qt)


def main():
    p = arguments()
    p.add_argument("--dgrad", action="store_true", help="the dgrad variants only (VARIANTS)")
    p.add_argument("--before", default="fused_ops.hopper._probe_before", help="the module the product is compared with")
    a = p.parse_args()
    if a.dgrad:
        return dgrad_variants(a)
    before = importlib.import_module(a.before)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for gated in (False, True):
        d = setup(a.M, a.C, gated)
        rows = {**rows_for(before, d, "before"), **rows_for(pingpong, d, "after ")}
        if not gated:
            crows, (q, qt) = cast_rows(d, sms)
            rows.update(crows)
        for name, fn in rows.items():  # compile, and check that each ran its kernel, not a fallback
            ran = fn()
            assert (ran[0] if isinstance(ran, tuple) else ran) is not False, name
        torch.cuda.synchronize()
        fwd8 = {}
        for tag in ("before", "after "):  # the FP8 forward's outputs, before and after (the same scale and inputs)
            rows[f"{tag} fwd FP8 out"]()
            fwd8[tag] = (d["h8"].view(torch.uint8).clone(), d["h8t"].view(torch.uint8).clone(), d["saved"].clone())
        print(f"{d['act']}: FP8 forward outputs (h8, h8t, dh/dz) bit for bit those of before:",
              [torch.equal(u, v) for u, v in zip(fwd8["before"], fwd8["after "])])
        if not gated:  # the persistent cast writes what the product's does
            q0, qt0 = fp8.cast_transpose(d["x"], d["state"], fp8.X, row_major=True)
            print("persistent cast == product:", torch.equal(q.view(torch.uint8), q0.view(torch.uint8)),
                  torch.equal(qt.view(torch.uint8), qt0.view(torch.uint8)))
        print("registers and spills:")
        for mod in (before, pingpong):
            for key, k in mod._compiled.items():
                print(f"  {mod.__name__.split('.')[-1]:14s} {'/'.join(str(c) for c in key[0][:5])}"
                      f"{' FP8_OUT' if key[0][-2] else ''}: {k.n_regs} registers, {k.n_spills} spilled")
        alternated(rows, a.rounds, f"M={a.M} C={a.C} H={2048 if gated else 4 * a.C} {d['act']}", 44)


def dgrad_variants(a):
    mods = {"before": importlib.import_module("fused_ops.hopper._probe_before"), **{name: variant(name) for name in VARIANTS},
            "product": pingpong}
    for gated in (False, True):
        d = setup(a.M, a.C, gated)
        rows = {name: rows_for(mod, d, name)[f"{name} dgrad FP8 out"] for name, mod in mods.items()}
        outs = {}
        for name, fn in rows.items():
            assert fn()[0], name
            outs[name] = (d["gz8"].view(torch.uint8).clone(), d["gz8t"].view(torch.uint8).clone())
        torch.cuda.synchronize()
        print(f"{d['act']}: outputs (gz8, gz8t) bit for bit those of before:",
              {k: (torch.equal(v[0], outs["before"][0]), torch.equal(v[1], outs["before"][1])) for k, v in outs.items()})
        alternated(rows, a.rounds, f"M={a.M} C={a.C} {d['act']} dgrad FP8 out", 44)
    print("registers and spills:")
    for name, mod in mods.items():
        for key, k in mod._compiled.items():
            print(f"  {name:14s} {'/'.join(str(c) for c in key[0][:5])}: {k.n_regs} registers, {k.n_spills} spilled")


if __name__ == "__main__":
    main()
