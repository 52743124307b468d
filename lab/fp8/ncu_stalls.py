"""Run the SwiGLU (or GELU) FP8 ping-pong forward and dgrad a few times each, for Nsight Compute to read what their
warps stall on (no timing here). Hopper GPU.

    PYTHONPATH=. ncu --section WarpStateStats --section SpeedOfLight -k regex:pingpong --launch-skip 4 \
        --launch-count 2 python lab/fp8/ncu_stalls.py [--gelu]
"""

import argparse

import torch

from fused_ops.hopper import pingpong
from lab.fp8.epilogue_probe import setup
from lab.fp8.round22_probe import rows_for

p = argparse.ArgumentParser()
p.add_argument("--gelu", action="store_true")
p.add_argument("--M", type=int, default=12288)
p.add_argument("--C", type=int, default=768)
a = p.parse_args()
d = setup(a.M, a.C, not a.gelu)
rows = rows_for(pingpong, d, "")
for _ in range(3):  # launches 0-5: warm-up (compiles); then one forward and one dgrad
    rows[" fwd FP8 out"]()
    rows[" dgrad FP8 out"]()
rows[" fwd FP8 out"]()
rows[" dgrad FP8 out"]()
torch.cuda.synchronize()
