"""The two 8-bit float casts of a tile that kernels share, as device functions (no state, no launch):

- to_fp16: an FP8 tile widened to fp16, exactly; matmul.matmul_loop's UPCAST (the FP8 Triton kernels' operands).
- quantize: fp8(v · scale), saturating, NaN for NaN and ±inf (fp8/kernels.py's docstring says why), as every FP8
  kernel writes its output: fp8/kernels.py's Triton kernels and the FP8_OUT epilogue of hopper/pingpong.py's Gluon
  kernel.

A leaf of the core (it imports nothing of the package): the core, hopper/ and fp8/ all use it, and neither the
core nor hopper/ may import fp8/.

Under the Triton interpreter (CPU tests), whose float -> FP8 conversion mis-rounds values that carry into the next
binade and turns NaN into 384, the FP8 encoding is done by hand (_encode_fp8); on a GPU the hardware conversion
(round to nearest even) does it. The way back (to_fp16) is exact everywhere, but there e4m3's NaN reads as 480.
"""

import triton
import triton.language as tl


@triton.jit
def _encode_fp8(v, OUT: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """The interpreter's FP8 conversion, done by hand: v (finite values within range, or NaN) rounded to nearest
    even on the grid of the format with MANTISSA bits and exponent bias BIAS, encoded bit by bit."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)  # subnormals: 1 - BIAS
    ulp = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    steps = (tl.abs(v) / ulp + 12582912.0) - 12582912.0  # 1.5 * 2**23: the fp32 addition rounds to an integer
    steps = tl.where(v != v, 0.0, steps)  # (NaN is encoded below)
    r = steps * ulp  # |v| on the grid; the bits of its fp32 encoding give the FP8 fields
    bits = r.to(tl.int32, bitcast=True)
    r_exp = ((bits >> 23) & 0xFF) - 127
    normal = r >= MIN_NORMAL  # 2**(1 - BIAS)
    field = tl.where(normal, ((r_exp + BIAS) << MANTISSA) | ((bits >> (23 - MANTISSA)) & ((1 << MANTISSA) - 1)),
                     steps.to(tl.int32))
    negative = v.to(tl.int32, bitcast=True) < 0  # the sign bit: -0 stays -0, as the hardware conversion keeps it
    code = tl.where(v != v, 0x7F, field | tl.where(negative, 0x80, 0))  # 0x7F: NaN in both formats
    return code.to(tl.uint8).to(OUT, bitcast=True)


@triton.jit
def quantize(v, scale, OUT: tl.constexpr, EMULATE: tl.constexpr):
    """fp8(v · scale), saturating finite values, NaN for NaN and ±inf (see the module docstring)."""
    if OUT == tl.float8e4nv:
        fp8_max: tl.constexpr = 448.0
    else:
        fp8_max: tl.constexpr = 57344.0
    t = v * scale
    if EMULATE:
        q = tl.minimum(tl.maximum(t, -fp8_max, propagate_nan=tl.PropagateNan.ALL), fp8_max,
                       propagate_nan=tl.PropagateNan.ALL)
        q = tl.where(tl.abs(t) == float("inf"), float("nan"), q)
        if OUT == tl.float8e4nv:
            return _encode_fp8(q, OUT, 3, 7, 0.015625)
        else:
            return _encode_fp8(q, OUT, 2, 15, 6.103515625e-05)
    # On a GPU the conversion saturates by itself (cvt.rn.satfinite: finite values past the range become ±fp8_max,
    # NaN stays NaN), so only ±inf has to become NaN first: t · 0 + t is t for every finite t (exactly, signed zeros
    # too: one rounding) and NaN for ±inf. One FMA an element where the clamps and the inf test took four, in
    # epilogues whose math is on their critical path (docs/performance.md); the GPU tests check saturation
    # and NaN (tests/test_fp8.py, tests/test_pingpong.py).
    return tl.fma(t, 0.0, t).to(OUT)


@triton.jit
def to_fp16(q, EMULATE: tl.constexpr):
    """An FP8 tile in fp16: exact, every e4m3 and e5m2 value is an fp16 value. Under the interpreter, whose
    conversion reads e4m3's NaN as 480 (and e5m2's right), NaN is put back by hand."""
    v = q.to(tl.float16)
    if EMULATE and q.dtype == tl.float8e4nv:
        v = tl.where((q.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    return v
