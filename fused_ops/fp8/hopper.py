"""The FP8 MLP's launchers of Hopper's ping-pong kernel (../hopper/pingpong.py): its FP8_OUT variants, FP8 in and
out, whose epilogues write h8 / h8ᵀ and gz8 / gz8ᵀ quantized (see that file's docstring for the kernel, and
kernels.py's for the FP8 MLP). The kernel and its 16-bit and FP8_IN launchers are hopper's; this file adds what only
the FP8 MLP asks for, and its own failure switch: an FP8 output that fails turns off these variants only (the
16-bit-output kernels keep running and a cast pass quantizes), with one FallbackWarning.
"""

import warnings

import torch

from ..hopper import pingpong
from ..hopper.pingpong import BLOCK_M, BLOCK_N, FallbackWarning, cdiv

FP8_FAILURE = None  # the exception that turned the FP8 output off (the 16-bit kernels keep running), if one did


def usable_fp8(a, matrices, vectors, width, split=None, dgrad=False):
    """Whether linear_act_forward_fp8 / dgrad_fp8 can run on these operands (a and the first matrix FP8):
    pingpong.usable()'s conditions (split: a gated op's N), an FP8 output of width columns that TMA can write, and the FP8
    variants not failed before. The gated dgrad writes both halves through one descriptor, so they must meet at a
    tile's edge (N a multiple of BLOCK_N)."""
    return (FP8_FAILURE is None and pingpong.FAILURE is None and width % 16 == 0
            and not (split and dgrad and split % BLOCK_N) and pingpong.usable(a, matrices, vectors, split))


def _launch_fp8(what, *args, **kwargs):
    """pingpong._launch for an FP8_OUT variant: True, or False after a failure (now or before in this process), which
    turns off the FP8 variants only (the 16-bit kernels then run and a cast pass quantizes), with one warning."""
    global FP8_FAILURE
    if FP8_FAILURE is not None or pingpong.FAILURE is not None:
        return False
    try:
        pingpong._launch(*args, **kwargs)
    except Exception as e:
        FP8_FAILURE = e
        warnings.warn(f"the Hopper ping-pong kernel's FP8 output failed ({type(e).__name__}: {e}); {what} is cast by "
                      "a separate pass instead for the rest of this process", FallbackWarning, stacklevel=3)
        return False
    return True


def linear_act_forward_fp8(x8, w8, inv, bias, activation, h8, h8t, saved, scale, amax, up_activation="identity",
                           gated=False):
    """The FP8 MLP's forward GEMM, FP8 in and out: h = act(x8 @ w8.T · inv[0] · inv[1] + bias) for x8 (M, K) and
    w8 (N, K) in e4m3 (gated: w8 (2N, K) = [gate; up], h = act(gate) · up_act(up)), h8 = fp8(h · scale[0]) (M, N),
    h8t its transpose (N, Mp >= M, columns past M zeros), amax[0] = max(amax[0], max |h|), and saved = dh/dz
    (gated: (M, 2N) = [dh/dgate | dh/dup]). Returns False if the kernel failed (see _launch_fp8): the caller then
    runs the 16-bit output and casts."""
    N = h8.shape[1]
    halves = dict(b2=w8[N:], aux2=saved[:, N:]) if gated else {}
    return _launch_fp8("h", x8, w8[:N] if gated else w8, h8, saved[:, :N] if gated else saved, bias, None, True,
                       out2=h8t, scale=scale, amax=amax, inv=inv, **halves, EPILOGUE="act", ACTIVATION=activation,
                       UP_ACTIVATION=up_activation, GATED=gated, HAS_BIAS=bias is not None, SAVE=True, FP8_OUT=True)


def dgrad_fp8(gy8, w2t8, inv, saved, gz8, gz8t, bias_grad, scale, amax, gated=False):
    """The FP8 MLP's dgrad, FP8 in and out: grad_z = (gy8 @ w2t8.T · inv[0] · inv[1]) * saved for gy8 (M, K) in
    e5m2 and W2ᵀ = w2t8 (N, K) in e4m3 (K-major, as FP8 operands must be); gz8 = fp8(grad_z · scale[0]) (M, W) in
    e5m2, gz8t its transpose (W, Mp >= M, columns past M zeros), amax[0] = max(amax[0], max |grad_z|). Gated: saved,
    grad_z (M, W = 2N) = [gate | up] halves, each multiplied by the same grad_h (see usable_fp8 for N).
    Returns (True, the column sums of the unquantized grad_z in fp32 if bias_grad else None), or (False, None)
    as linear_act_forward_fp8."""
    N = w2t8.shape[0]
    partial = (torch.empty((cdiv(gy8.shape[0], BLOCK_M), gz8.shape[1]), device=gz8.device, dtype=torch.float32)
               if bias_grad else None)
    halves = dict(aux2=saved[:, N:]) if gated else {}
    if not _launch_fp8("grad_z", gy8, w2t8, gz8, saved[:, :N] if gated else saved, None, partial, True, out2=gz8t,
                       scale=scale, amax=amax, inv=inv, n=N, **halves, EPILOGUE="mul", ACTIVATION="identity",
                       UP_ACTIVATION="identity", GATED=gated, HAS_BIAS=bias_grad, SAVE=False, FP8_OUT=True):
        return False, None
    return True, (partial.sum(0) if bias_grad else None)
