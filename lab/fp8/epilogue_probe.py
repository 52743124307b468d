"""Where the FP8 ping-pong kernels' time goes past their GEMM: the same kernel with parts of its epilogue taken
out, one at a time, against cuBLAS's FP8 GEMM of the same shape, rounds alternated. Hopper GPU.

The variants are built from fused_ops/hopper/pingpong.py's source with exact string edits (each must match once), written
beside it as fused_ops/hopper/_probe_<name>.py and imported: the product keeps no probe switches. A variant computes
wrong values (that is the point); only its time is read.

    PYTHONPATH=. python lab/fp8/epilogue_probe.py [--M 12288 --C 768 --rounds 3]
"""

import argparse
import atexit
import importlib
import pathlib

import torch
from triton.testing import do_bench

from fused_ops.fp8 import hopper as fp8_hopper, kernels as fp8, state as fp8_state
from fused_ops.hopper import pingpong

SOURCE = pathlib.Path(pingpong.__file__)

# (old, new) edits of the forward's FP8_OUT epilogue (_act_epilogue)
FWD_NO_QT = [  # no transposed copy h8ᵀ: neither the permuted shared-memory store nor its TMA store
    ("                qt_bufs.index(q_base + p % 2).store(gl.permute(q, (1, 0)))\n", ""),
    ("                tma_store(out2_desc, [col, off_m], qt_bufs.index(q_base + p % 2))\n", ""),
    ("STORES: gl.constexpr = (2 + PER_PART - AUX) if FP8_OUT", "STORES: gl.constexpr = (1 + PER_PART - AUX) if FP8_OUT"),
]
FWD_NO_SAVE = [  # no dh/dz
    ("            elif SAVE:\n                stage_bufs.index(bufs + 1)", "            elif False:\n                stage_bufs.index(bufs + 1)"),
    ("            if SAVE:\n                tma_store(aux_desc", "            if False:\n                tma_store(aux_desc"),
    ("STORES: gl.constexpr = (2 + PER_PART - AUX) if FP8_OUT", "STORES: gl.constexpr = (1 + PER_PART - AUX) if FP8_OUT"),
]
FWD_NO_MATH = [("gate, gate_grad = gelu_and_grad_16bit(gates[p])", "gate, gate_grad = gates[p], gates[p]")]
FWD_NO_H8 = [  # no row-major h8
    ("                q_bufs.index(q_base + p % 2).store(q)\n", ""),
    ("                tma_store(out_desc, [off_m, col], q_bufs.index(q_base + p % 2))\n", "                pass\n"),
]
FWD_BARE = FWD_NO_H8 + [FWD_NO_QT[0], FWD_NO_QT[1], FWD_NO_SAVE[0], FWD_NO_SAVE[1],
                        ("STORES: gl.constexpr = (2 + PER_PART - AUX) if FP8_OUT",
                         "STORES: gl.constexpr = 0 if FP8_OUT")] + FWD_NO_MATH
# the dgrad's (non-gated _mul_epilogue)
DGRAD_NO_QT = [
    ("                    qt_buf.store(gl.permute(q, (1, 0)))\n", ""),
    ("                    tma_store(out2_desc, [col, off_m], qt_buf)\n", ""),
    ("tma.store_wait(2)  # (the part", "tma.store_wait(1)  # (the part"),
]
FWD_DHDZ_FIRST = [  # dh/dz written to shared memory before h is quantized (its registers free sooner?)
    ("            elif SAVE:\n                stage_bufs.index(bufs + 1).store(gate_grad.to(aux_desc.dtype))\n", ""),
    ("            if FP8_OUT:  # (rows past M",
     "            if SAVE and not GATE_UP_B:\n                stage_bufs.index(bufs + 1).store(gate_grad.to(aux_desc.dtype))\n"
     "            if FP8_OUT:  # (rows past M"),
]
FWD_ROW_AMAX = [  # the forward's amax across warps once a tile, as the dgrad's (each part's rows zeroed past M)
    ("            tile_amax = 0.0\n        for p in",
     "            row_amax = gl.zeros([BM], gl.float32, gl.SliceLayout(1, gates[0].type.layout))\n        for p in"),
    ("                tile_amax = gl.maximum(tile_amax, gl.max(gl.max(gl.abs(h), axis=1), axis=0))",
     "                row_amax = gl.maximum(row_amax, gl.max(gl.abs(h), axis=1))"),
    ("            gl.atomic_max(amax_ptr, tile_amax)\n\n", "            gl.atomic_max(amax_ptr, gl.max(row_amax, axis=0))\n\n"),
]
DGRAD_PART_AMAX = [  # the dgrad's amax across warps at every part (as in ae2c34f)
    ("row_amax = gl.zeros([parts[0].shape[0]], gl.float32, gl.SliceLayout(1, parts[0].type.layout))",
     "tile_amax = 0.0"),
    ("row_amax = gl.maximum(row_amax, gl.max(gl.abs(grad), axis=1))",
     "tile_amax = gl.maximum(tile_amax, gl.max(gl.max(gl.abs(grad), axis=1), axis=0))"),
    ("gl.atomic_max(amax_ptr, gl.max(row_amax, axis=0))", "gl.atomic_max(amax_ptr, tile_amax)"),
]
VARIANTS = {"fwd_no_qt": FWD_NO_QT, "fwd_no_save": FWD_NO_SAVE, "fwd_no_math": FWD_NO_MATH, "fwd_no_h8": FWD_NO_H8,
            "fwd_bare": FWD_BARE, "fwd_dhdz_first": FWD_DHDZ_FIRST, "fwd_row_amax": FWD_ROW_AMAX,
            "dgrad_no_qt": DGRAD_NO_QT, "dgrad_part_amax": DGRAD_PART_AMAX}



def fp8_launcher(mod, name):
    """fp8/hopper.py's launcher `name` (linear_act_forward_fp8, dgrad_fp8), launching mod's kernel: hopper/pingpong.py
    or a variant module of it."""
    def run(*args):
        kept, fp8_hopper.pingpong = fp8_hopper.pingpong, mod
        try:
            return getattr(fp8_hopper, name)(*args)
        finally:
            fp8_hopper.pingpong = kept
    return run

def variant(name, edits=None, source=SOURCE):
    """fused_ops.hopper._probe_<name>: pingpong.py (or source) with VARIANTS[name]'s edits (or edits), the file removed when
    the probe exits."""
    text = source.read_text()
    for old, new in VARIANTS[name] if edits is None else edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = SOURCE.with_name(f"_probe_{name}.py")
    path.write_text(text)
    atexit.register(path.unlink, missing_ok=True)
    return importlib.import_module(f"fused_ops.hopper._probe_{name}")


def bench(fn):
    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def alternated(rows, rounds, title, width=34):
    """Time each of rows (name -> fn) once a round, the order reversed every other round, and print the times under
    title with each row's median."""
    times = {k: [] for k in rows}
    for r in range(rounds):
        for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            times[k].append(bench(rows[k]))
    print(f"\n{title}, GPU time, us, do_bench median per round (alternated)")
    for k, v in times.items():
        print(f"{k:{width}s} " + " ".join(f"{t:7.1f}" for t in v) + f"   median {sorted(v)[len(v) // 2]:7.1f}")


def arguments(rounds=3):
    """The probes' command line: the MLP's rows and width (GPT-2 small's by default) and the rounds to alternate."""
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=12288)
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--rounds", type=int, default=rounds)
    return p


def setup(M, C, gated, dev="cuda", dt=torch.bfloat16):
    """The FP8 MLP's operands at M x C (GELU H = 4C, SwiGLU H = 2048), their scales set, the weights' FP8 copies
    (both layouts), x's and grad_y's (both layouts), and the outputs' buffers (the other FP8 probes use them too)."""
    H = 2048 if gated else 4 * C
    torch.manual_seed(0)
    w1 = torch.randn(2 * H if gated else H, C, device=dev, dtype=dt) / C ** 0.5
    w2 = torch.randn(C, H, device=dev, dtype=dt) / H ** 0.5
    x = torch.randn(M, C, device=dev, dtype=dt)
    gy = torch.randn(M, C, device=dev, dtype=dt) * 1e-3
    state = fp8_state.FP8State().to(dev)
    for slot, t in ((fp8.X, x), (fp8.GRAD_Y, gy), (fp8.H, torch.ones(1, device=dev)),
                    (fp8.GRAD_Z, torch.full((1,), 1e-3, device=dev))):
        fp8_state._set_current_scale(state, slot, t)
    w18, w1t8, w1inv, w28, w2t8, w2inv = state.weights(w1, w2)
    x8, xt8 = fp8.cast_transpose(x, state, fp8.X, row_major=True)
    gy8, gyt8 = fp8.cast_transpose(gy, state, fp8.GRAD_Y, row_major=True)
    inv_x, inv_gy = state.inv_scale[fp8.X, :1], state.inv_scale[fp8.GRAD_Y, :1]
    Mp = -(-M // 16) * 16
    W = 2 * H if gated else H
    return dict(x=x, gy=gy, w1=w1, w2=w2, state=state, x8=x8, xt8=xt8, gy8=gy8, gyt8=gyt8, w18=w18, w1t8=w1t8,
                w28=w28, w2t8=w2t8, inv1=(inv_x, w1inv),
                inv2=(inv_gy, w2inv), h8=torch.empty(M, H, device=dev, dtype=fp8.E4M3),
                h8t=torch.empty(H, Mp, device=dev, dtype=fp8.E4M3),
                gz8=torch.empty(M, W, device=dev, dtype=fp8.E5M2), gz8t=torch.empty(W, Mp, device=dev, dtype=fp8.E5M2),
                saved=torch.randn(M, W, device=dev, dtype=dt), h16=torch.empty(M, H, device=dev, dtype=dt),
                amax=torch.zeros(1, device=dev), gated=gated, act="silu" if gated else "gelu", Mp=Mp)


def main():
    p = arguments()
    p.add_argument("--only", help="run just this row a few times (for Nsight Compute), no timing")
    a = p.parse_args()
    d = setup(a.M, a.C, False)
    M, C, H, dt = a.M, a.C, 4 * a.C, torch.bfloat16
    state, x8, gy8, w18, w2t8, saved, h16, amax = (d[k] for k in ("state", "x8", "gy8", "w18", "w2t8", "saved", "h16",
                                                                    "amax"))
    h8, h8t, gz8, gz8t = d["h8"], d["h8t"], d["gz8"], d["gz8t"]
    (inv_x, w1inv), (inv_gy, w2inv) = d["inv1"], d["inv2"]
    one = state.inv_scale[1, :1]

    def fwd(mod):
        return lambda: fp8_launcher(mod, "linear_act_forward_fp8")(x8, w18, (inv_x, w1inv), None, "gelu", h8, h8t, saved,
                                                  state.scale[fp8.H:], amax)

    def dgrad(mod):
        return lambda: fp8_launcher(mod, "dgrad_fp8")(gy8, w2t8, (inv_gy, w2inv), saved, gz8, gz8t, False, state.scale[fp8.GRAD_Z:],
                                     amax)

    rows = {
        "cuBLAS FP8 x8 @ W1T -> bf16": lambda: torch._scaled_mm(x8, w18.t(), scale_a=one, scale_b=w1inv,
                                                                 out_dtype=dt, use_fast_accum=True),
        "cuBLAS FP8 gy8 @ W2 -> bf16": lambda: torch._scaled_mm(gy8, w2t8.t(), scale_a=one, scale_b=w2inv,
                                                                 out_dtype=dt, use_fast_accum=True),
        "pp FP8 in, identity, h bf16": lambda: pingpong.linear_act_forward(
            x8, w18, None, "identity", "identity", False, False, h16, None, inv=(inv_x, w1inv)),
        "pp FP8 in, gelu, h + dh/dz bf16": lambda: pingpong.linear_act_forward(
            x8, w18, None, "gelu", "identity", False, True, h16, saved, inv=(inv_x, w1inv)),
        "fwd FP8 out (product)": fwd(pingpong),
        "dgrad FP8 in, bf16 out": lambda: pingpong.dgrad(gy8, w2t8, saved, h16, False, False, inv=(inv_gy, w2inv)),
        "dgrad FP8 out (product)": dgrad(pingpong),
    }
    for name in VARIANTS:
        if not a.only or a.only == name:
            rows[name] = (fwd if name.startswith("fwd") else dgrad)(variant(name))
    if a.only:
        rows = {a.only: rows[a.only]}
    for name, fn in rows.items():  # compile, and check that each one ran its kernel, not a fallback
        ran = fn()
        assert (ran[0] if isinstance(ran, tuple) else ran) is not False, name
    torch.cuda.synchronize()
    print("registers and spills of each compiled variant (consumers run under setmaxnreg "
          f"{pingpong.CONSUMER_REGS}):")
    for mod in [pingpong] + [importlib.import_module(f"fused_ops.hopper._probe_{n}") for n in VARIANTS if n in rows]:
        for key, k in mod._compiled.items():
            print(f"  {mod.__name__.split('.')[-1]:22s} {'/'.join(str(c) for c in key[0][:3])}"
                  f"{' FP8_OUT' if key[0][-2] else ''}: {k.n_regs} registers, {k.n_spills} spilled")
    if a.only:
        for _ in range(5):
            rows[a.only]()
        torch.cuda.synchronize()
        return
    alternated(rows, a.rounds, f"M={M} C={C} H={H} GELU")


if __name__ == "__main__":
    main()
