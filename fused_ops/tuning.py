"""Block sizes and autotuning: the one place they live.

The configs target Hopper (H100/H200): 128-wide tiles feed its warpgroup MMA, 3-4 pipeline stages hide
load latency. The autotune key holds N and K (the weight's shape) and the dtype, never M, so a new batch
size reuses the tuned choice instead of tuning again.
Under TRITON_INTERPRET=1 (CPU tests) one small config keeps the interpreter fast and exercises masking.
FUSED_OPS_AUTOTUNE=0 skips tuning and uses the first config (the test suite sets it: it compiles
hundreds of kernel variants, and tuning each would take far longer than checking it).
"""

import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AUTOTUNE = os.environ.get("FUSED_OPS_AUTOTUNE", "1") == "1"
AUTOTUNE_KEY = ["N", "K", "GATED", "ACTIVATION", "UP_ACTIVATION"]


def _config(block_m, block_n, block_k, warps, stages, group_m=8):
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def matmul_configs(gated=False):
    """Candidate tiles for the fused matmul kernels. Gated kernels hold two accumulators, so their tiles are smaller."""
    if INTERPRET:
        return [_config(32, 32, 32, 4, 1, group_m=2)]
    if gated:
        configs = [
            _config(128, 128, 64, 8, 3),
            _config(128, 64, 64, 4, 4),
            _config(64, 128, 64, 4, 4),
            _config(128, 128, 64, 4, 3),
            _config(64, 64, 64, 4, 4),
        ]
    else:
        configs = [
            _config(128, 256, 64, 8, 3),
            _config(128, 128, 64, 8, 4),
            _config(128, 128, 64, 4, 4),
            _config(64, 256, 64, 4, 4),
            _config(128, 64, 64, 4, 4),
            _config(64, 128, 64, 4, 4),
            _config(256, 128, 64, 8, 3),
        ]
    return configs if AUTOTUNE else configs[:1]


def smallest_block_m(gated=False):
    return min(c.kwargs["BLOCK_M"] for c in matmul_configs(gated))
