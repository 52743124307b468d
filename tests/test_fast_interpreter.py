"""tests/fast_interpreter.py (the suite's once-a-launch swap of triton.language under Triton's interpreter) keeps the
interpreter's behaviour: device functions compute under it, the builtins are Triton's own again after every launch,
also after a launch that failed."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only")


@triton.jit
def _twice(v):
    return v * 2.0


@triton.jit
def _twice_plus_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _twice(v) + 1.0, mask=offs < n)


@triton.jit
def _failing_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, 2 * BLOCK)))  # (shapes differ: fails)


def test_device_functions_compute_and_the_builtins_come_back():
    from triton.runtime import interpreter
    assert getattr(interpreter._patch_lang, "once_a_launch", False)  # conftest.py applied it
    load = tl.load
    x = torch.arange(37, dtype=torch.float32)
    for _ in range(2):  # (the second launch: after the first one's restore)
        out = torch.empty_like(x)
        _twice_plus_one_kernel[(3,)](x, out, 37, BLOCK=16)
        assert torch.equal(out, 2 * x + 1)
        assert tl.load is load and tl.core.is_builtin(tl.load)
    with pytest.raises(Exception):
        _failing_kernel[(1,)](torch.zeros(32), BLOCK=16)
    assert tl.load is load  # restored after the failure too, and the next launch swaps again
    out = torch.empty_like(x)
    _twice_plus_one_kernel[(3,)](x, out, 37, BLOCK=16)
    assert torch.equal(out, 2 * x + 1)
