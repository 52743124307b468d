"""The "lse" epilogue's variants for lse_gemm_probe.py, each as a module: pingpong.py's source with _row_lse replaced
(the first epilogue; one pass with a running max; two passes with the special values resolved once a row, on the
stored values or the fp32 accumulator), the log-sum-exp before or after the tile's stores, and the tile order's
GROUP_M. Each writes fused_ops/hopper/_probe_<name>.py (not part of the product; delete them after) and returns it.

The probe's sections 1-4 (results/classifier_lse/probe_h200.txt) ran when the product's epilogue was the first one
(FIRST here, before the stores, GROUP_M 8), so their "ours + partials" and their "plain" are that one; the product
is now TWO_PASS after the stores with LOGITS_GROUP_M = 64 (their two_pass_after_g64)."""

import importlib
import inspect
import os

# What every variant shares: the NaN-propagating max, the signature, the tile's shape.
HEAD = '''
    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _row_lse(parts, off_m, off_n, M, N, partial_ptr, dtype: gl.constexpr, TN: gl.constexpr):
        BM: gl.constexpr = parts[0].shape[0]
        PART_: gl.constexpr = parts[0].shape[1]
        P: gl.constexpr = TN // PART_
        rows_layout: gl.constexpr = gl.SliceLayout(1, parts[0].type.layout)
        cols = gl.arange(0, PART_, layout=gl.SliceLayout(0, parts[0].type.layout))
        LOG2E: gl.constexpr = 1.4426950408889634
        m = gl.full([BM], float("-inf"), gl.float32, rows_layout)
'''
STORE = '''
        rows = off_m + gl.arange(0, BM, layout=rows_layout)
        gl.store(partial_ptr + rows * gl.cdiv(N, TN) + off_n // TN, lse, mask=rows < M)
'''
MASKED = "gl.where(gl.expand_dims(off_n + p * PART_ + cols < N, 0), VALUE, float('-inf'))"

# The first epilogue (the probe's sections 1-3 call it the product's): two passes, the rule per element (x == m
# counts 1, so that m = ±inf gives no inf - inf), the special values from the sum.
FIRST = HEAD + f'''
        for p in gl.static_range(P):
            m = gl.maximum(m, gl.max({MASKED}, axis=1))
        s = gl.zeros([BM], gl.float32, rows_layout)
        for p in gl.static_range(P):
            x = {MASKED}
            s = s + gl.sum(gl.where(x == gl.expand_dims(m, 1), 1.0, gl.exp(x - gl.expand_dims(m, 1))), axis=1)
        lse = gl.where(s != s, float("nan"), gl.where(m == float("inf"), float("inf"),
                       gl.where(m == float("-inf"), float("-inf"), m + gl.log(s))))
''' + STORE

# One pass: a running max and a rescaled sum (as flash attention), the special values resolved once a row.
LEAN = HEAD + f'''
        s = gl.zeros([BM], gl.float32, rows_layout)
        for p in gl.static_range(P):
            x = {MASKED}
            m_new = gl.maximum(m, gl.reduce(x, 1, _max_nan), propagate_nan=tl.PropagateNan.ALL)
            ok = (m_new > float("-inf")) & (m_new < float("inf"))  # (finite: NaN is neither)
            shift = gl.where(ok, m_new, 0.0) * LOG2E
            s = s * gl.exp2(gl.where(ok, m, 0.0) * LOG2E - shift) + gl.sum(
                gl.exp2(x * LOG2E - gl.expand_dims(shift, 1)), axis=1)
            m = m_new
        lse = gl.where(ok, m + gl.log(s), m)
''' + STORE

# Two passes (every part's row max, independent of the others, then every part's sum of exponentials), the special
# values resolved once a row: the product's since (hopper/pingpong.py's _row_lse).
TWO_PASS = HEAD + f'''
        for p in gl.static_range(P):
            m = gl.maximum(m, gl.reduce({MASKED}, 1, _max_nan), propagate_nan=tl.PropagateNan.ALL)
        ok = (m > float("-inf")) & (m < float("inf"))
        shift = gl.expand_dims(gl.where(ok, m, 0.0) * LOG2E, 1)
        s = gl.zeros([BM], gl.float32, rows_layout)
        for p in gl.static_range(P):
            s = s + gl.sum(gl.exp2({MASKED} * LOG2E - shift), axis=1)
        lse = gl.where(ok, m + gl.log(s), m)
''' + STORE


def variant_module(name, after=False, group_m=None):
    """"plain" (the product's as it is now), "first", "lean" or "two_pass" (above, of the values as stored), or
    "two_pass_fp32" (of the fp32 accumulator); after: the log-sum-exp computed once the tile's TMA stores are issued
    (they run while it does) instead of before them (the product: after); group_m: the tile order's GROUP_M (row
    tiles walked before the next column tile: a chunk's 20 at 64, so that each tile of W is read from memory once a
    chunk, not three times; the product's LOGITS_GROUP_M)."""
    body = None if name == "plain" else {"first": FIRST, "lean": LEAN}.get(name, TWO_PASS)
    if body is not None:
        body = body.replace("VALUE", "parts[p]" if name.endswith("fp32") else "parts[p].to(dtype).to(gl.float32)")
    tag = name + ("_after" if after else "") + (f"_g{group_m}" if group_m else "")
    return _module(body, "_probe_" + tag, after, group_m)


def knob_module(stages, group_m):
    """The product's "lse" GEMM as it is, with `stages` ring slots of 32 KB (the product: 4; 5 fill 224 KB of shared
    memory with the staging tiles) and LOGITS_GROUP_M = group_m (the product: 64)."""
    from fused_ops.hopper import pingpong
    src = inspect.getsource(pingpong)
    old = '    ("lse", False): (4, 8),'
    assert src.count(old) == 1 and src.count("\nLOGITS_GROUP_M = 64\n") == 1
    src = src.replace(old, old.replace("(4, 8)", f"({stages}, 8)"))
    src = src.replace("\nLOGITS_GROUP_M = 64\n", f"\nLOGITS_GROUP_M = {group_m}\n")
    return _write_module(src, f"_probe_s{stages}_g{group_m}")


def lean_module():
    return variant_module("lean")


CALL = "            _row_lse(gates, off_m, off_n, M, N, partial_ptr, out_desc.dtype, TN)\n"


def _module(body, module_name, after=False, group_m=None):
    from fused_ops.hopper import pingpong
    src = inspect.getsource(pingpong)
    if body is not None:
        start = src.index("    @gluon.jit\n    def _max_nan(")
        end = src.index("    @gluon.jit\n    def _mul_epilogue(")
        src = src[:start] + body.lstrip("\n") + "\n" + src[end:]
    placed = "        if LSE:  # after the stores are issued, so that they leave while it runs\n" + CALL
    assert src.count(placed) == 1
    if not after:  # before the parts' stores, as the first epilogue was
        src = src.replace(placed, "")
        loop = src.index("        for p in gl.static_range(TN // PART):\n            # parts alternate")
        src = src[:loop] + "        if LSE:\n" + CALL + src[loop:]
    group_m = group_m or 8  # (8: every kernel's order when sections 1-3 ran)
    for old in ("\nGROUP_M = 8  #", "\nLOGITS_GROUP_M = 64\n"):
        assert src.count(old) == 1
        src = src.replace(old, old.replace("8", str(group_m)).replace("64", str(group_m)))
    return _write_module("import triton.language as tl\n" + src, module_name)


def _write_module(src, module_name):
    """src written as fused_ops/hopper/<module_name>.py (a probe's, to delete after) and imported."""
    from fused_ops.hopper import pingpong
    path = os.path.join(os.path.dirname(pingpong.__file__), module_name + ".py")
    with open(path, "w") as f:
        f.write(src)
    return importlib.import_module("fused_ops.hopper." + module_name)
