import os
import sys

import torch

# Without a GPU the Triton kernels run through Triton's CPU interpreter, which must be chosen before
# Triton is first imported (fused_ops imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite compiles hundreds of kernel variants: check each with one config instead of tuning it.
os.environ.setdefault("FUSED_OPS_AUTOTUNE", "0")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import fast_interpreter  # noqa: E402  (the interpreter swaps triton.language once a launch: see there)

fast_interpreter.patch_once_a_launch()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
