"""Round 23: do the FP8 ping-pong kernels' main loops starve for operands? Nsight Compute's stall sampling put the
gated dgrad's consumers at their ring-slot waits (lab/results/fp8_round23.txt): its ring has 3 slots of 32 KB (a K
slice of 128 bytes), the others 4. Variants with slices of 64 bytes in twice as many slots (the same bytes in flight,
refilled at finer steps), each kernel against the product, rounds alternated, outputs compared bit for bit. Hopper GPU.

    PYTHONPATH=. python lab/fp8/ring_probe.py [--rounds 5]
"""


import torch

from fused_ops.hopper import pingpong
from lab.fp8.epilogue_probe import alternated, arguments, setup, variant
from lab.fp8.round22_probe import rows_for


def k64(epilogue, gated, stages):
    """pingpong.py with 64-byte FP8 K slices and `stages` ring slots for one (EPILOGUE, GATED) variant."""
    plan = {("act", True): (4, 8)}
    staging = {("act", False): 8, ("mul", False): 8, ("act", True): 8, ("mul", True): 16}[epilogue, gated]
    plan[epilogue, gated] = (stages, staging)
    return [
        ("    bk = 2 * BLOCK_K if FP8_IN else BLOCK_K",
         f"    bk = 2 * BLOCK_K if FP8_IN and not (FP8_OUT and (EPILOGUE, GATED) == {(epilogue, gated)!r}) else BLOCK_K"),
        ("FP8_SHARED_MEMORY_PLAN = {(\"act\", True): (4, 8)}", f"FP8_SHARED_MEMORY_PLAN = {plan!r}"),
    ]


VARIANTS = {  # name -> (edits, which kernel it changes)
    "dgrad_swiglu_k64x6": (k64("mul", True, 6), ("dgrad", True)),
    "dgrad_gelu_k64x8": (k64("mul", False, 8), ("dgrad", False)),
    "fwd_swiglu_k64x8": (k64("act", True, 8), ("fwd", True)),
    "fwd_gelu_k64x8": (k64("act", False, 8), ("fwd", False)),
}


def main():
    p = arguments(5)
    a = p.parse_args()
    for gated in (False, True):
        d = setup(a.M, a.C, gated)
        for kernel in ("fwd", "dgrad"):
            row = f" {kernel} FP8 out"
            mods = {"product": pingpong, **{name: variant(name, edits) for name, (edits, which) in VARIANTS.items()
                                            if which == (kernel, gated)}}
            rows, outs = {}, {}
            for name, mod in mods.items():
                rows[name] = rows_for(mod, d, "")[row]
                ran = rows[name]()
                assert (ran[0] if isinstance(ran, tuple) else ran) is not False, name
                outs[name] = [d[k].view(torch.uint8).clone() if d[k].dtype.itemsize == 1 else d[k].clone()
                              for k in (("h8", "h8t", "saved") if kernel == "fwd" else ("gz8", "gz8t"))]
            torch.cuda.synchronize()
            print(f"{d['act']} {kernel}: outputs bit for bit the product's:",
                  {k: all(torch.equal(u, v) for u, v in zip(o, outs["product"])) for k, o in outs.items()})
            for name, mod in mods.items():
                for key, k in mod._compiled.items():
                    if key[0][1] != ("act" if kernel == "fwd" else "mul") or key[0][4] != gated or not key[0][-2]:
                        continue
                    print(f"  {name:22s} {'/'.join(str(c) for c in key[0][:5])}: {k.n_regs} registers, "
                          f"{k.n_spills} spilled, {k.metadata.shared} bytes of shared memory")
            alternated(rows, a.rounds, f"M={a.M} C={a.C} {d['act']} {kernel} FP8 out", 24)


if __name__ == "__main__":
    main()
