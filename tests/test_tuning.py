"""fused_ops.tuning: the launch plan's bookkeeping (what decides which compiled kernel a launch may reuse).

The direct launches themselves need a GPU (test_fused_gpu.py::test_direct_launch_across_specializations);
these tests check, on any machine, the parts that decide whether they are safe.
"""

import inspect
import json

import pytest
import torch

from fused_ops import env, tuning
from fused_ops.dgrad import dgrad_kernel
from fused_ops.linear_act import linear_act_kernel


def test_specialization_separates_what_triton_compiles_separately():
    base = torch.zeros(64, dtype=torch.float16)
    aligned, misaligned = base[:16], base[1:17]
    spec = lambda *args: tuning._specialization(args)
    assert spec(aligned, 64) == spec(base[8:24], 4096)  # both 16-byte aligned, both multiples of 16
    assert spec(aligned, 64) != spec(misaligned, 64)  # a 2-byte offset
    assert len({spec(aligned, m) for m in (1, 16, 17)}) == 3  # M = 1 is a constant to Triton; 17 not a multiple of 16
    assert spec(aligned, 2 ** 31) != spec(aligned, 2 ** 31 - 16)  # 64-bit integers
    assert spec(aligned, 1e-5) == spec(aligned, 0.5)  # floats are not specialized
    assert spec(aligned, 64) != spec(aligned.float(), 64)  # another dtype is another compiled kernel


def test_specialization_is_at_least_as_fine_as_tritons():
    """Two argument values that _specialization cannot tell apart must be ones the installed Triton compiles
    alike too (its own per-argument rule, native_specialize_impl): else a kept kernel could be reused for
    arguments it was not compiled for. Checked against whichever Triton is installed, so a new Triton with
    new rules fails here before it gives a wrong result on a GPU. A Triton whose rule cannot be read here (the
    internal API moved or changed its signature) fails too, never skips: _specialization is then unchecked against
    it, and its rules may have changed with the API (update this test and _specialization together)."""
    import triton
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        triton_spec = lambda a: native_specialize_impl(BaseBackend, a, False, True, True)  # noqa: E731
        triton_spec(1)
    except (ImportError, TypeError, AttributeError) as e:
        pytest.fail(f"Triton {triton.__version__} does not expose native_specialize_impl as 3.6-3.9 do ({e!r}): "
                    "its specialization rule cannot be compared with tuning._specialization; read the new rule and "
                    "update both")
    base = torch.zeros(256, dtype=torch.float16)
    values = [base[:16], base[1:17], base[8:24], base[4:20], base.float()[:16], base.float()[1:17],
              base.to(torch.bfloat16)[:16], 0, 1, 2, 8, 15, 16, 17, 32, 768, 12288, -16, -1, 2 ** 31 - 16,
              2 ** 31 - 1, 2 ** 31, 2 ** 32, 0.0, 1e-5, 0.5, None]
    for a in values:
        for b in values:
            if tuning._specialization([a]) == tuning._specialization([b]):
                assert triton_spec(a) == triton_spec(b), (a, b)


def _param_names(kernel):
    return list(inspect.signature(kernel.fn).parameters)


def test_plan_puts_constexprs_in_parameter_order(monkeypatch):
    """A direct launch passes the runtime arguments and then the constexprs in the kernel's parameter
    order; the plan derives that order from the kernel, whatever order the caller's dict had."""
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setattr(env, "DIRECT_LAUNCH", True)
    cfg = tuning._config(128, 128, 64, 4, 3)
    consts = dict(B_KMAJOR=True, TMA=True, INT64=False, PRECISION="ieee", ACC_DTYPE=None, GATED=False,
                  BIAS_GRAD=True)
    plan = tuning.LaunchPlan(dgrad_kernel, cfg, consts, K=768)
    names = _param_names(dgrad_kernel)
    assert plan.direct
    tail = names[len(names) - len(plan.const_values):]
    assert plan.const_values == [plan.consts[n] for n in tail]
    assert set(tail) == set(consts) | set(cfg.kwargs) | {"EVEN_K"} and plan.consts["EVEN_K"]


def test_plan_without_matching_constexprs_uses_the_jit(monkeypatch):
    """Constexprs that are not exactly the kernel's trailing parameters: no direct launch (Triton's JIT
    binds the arguments by name instead)."""
    monkeypatch.setattr(env, "INTERPRET", False)
    cfg = tuning._config(128, 128, 64, 4, 3)
    plan = tuning.LaunchPlan(linear_act_kernel, cfg, dict(GATED=False), K=100)
    assert not plan.direct and not plan.consts["EVEN_K"]


def test_direct_launches_get_all_three_grid_dimensions(monkeypatch):
    """A compiled kernel's runner indexes grid[0], grid[1], grid[2]: the plan hands it three dimensions whatever the
    caller gave (FusedAdamW's one-dimensional grid once made every step after the first fall back)."""
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setattr(env, "DIRECT_LAUNCH", True)
    from fused_ops.adamw import adamw_kernel
    consts = dict(HAS_SCALE=False, ALIGNED=True, BLOCK=1024)
    plan = tuning.LaunchPlan(adamw_kernel, tuning.triton.Config({}, num_warps=4, num_stages=1), consts)
    assert plan.direct
    grids = []

    class Compiled:  # what the JIT returns on a GPU: runner[grid](*args, *constexprs)
        def __getitem__(self, grid):
            grid[0], grid[1], grid[2]
            grids.append(grid)
            return lambda *args: None
    args = [torch.empty(4), 7, 1.5]
    monkeypatch.setattr(tuning, "_jit_launch", lambda kernel, grid, a, c, cfg: Compiled()[grid] and Compiled())
    plan.kernel = type("K", (), {"arg_names": ["a", "b", "c", *consts]})()  # (the parameter count these args fill)
    plan.launch_grid((5,), args)  # through the JIT, then kept
    plan.launch_grid((5,), args)  # direct
    assert grids == [(5, 1, 1), (5, 1, 1)] and len(plan.compiled) == 1


def test_interpreter_never_launches_directly(monkeypatch):
    monkeypatch.setattr(env, "INTERPRET", True)
    consts = dict(B_KMAJOR=False, TMA=False, INT64=False, PRECISION="ieee", ACC_DTYPE=None, GATED=False,
                  BIAS_GRAD=True)
    plan = tuning.LaunchPlan(dgrad_kernel, tuning._config(32, 32, 32, 4, 1), consts, K=64)
    assert not plan.direct


def test_tuning_choices_are_kept_on_disk(monkeypatch, tmp_path):
    """Tuned once, a key's choice is written to the cache file; a later run (here: the in-memory plans
    forgotten) launches that config without timing any candidate. A damaged file means tuning again."""
    if not torch.cuda.is_available() and not env.INTERPRET:
        pytest.skip("the kernels cannot run here")
    from fused_ops.linear_act import linear_act_forward

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = tmp_path / "tuning.json"
    candidates = [tuning._config(32, 32, 32, 4, 1, group_m=2), tuning._config(16, 32, 32, 4, 1, group_m=2)]
    monkeypatch.setattr(env, "TUNING_CACHE", str(cache))
    monkeypatch.setattr(tuning, "matmul_configs", lambda gated=False, dtype=None: candidates)
    monkeypatch.setattr(tuning, "_plans", {})
    timed = []

    def fake_bench(fn, **kwargs):  # the second candidate wins
        timed.append(fn())
        return 2.0 if len(timed) % 2 else 1.0
    monkeypatch.setattr(tuning, "do_bench", fake_bench)
    x, w = torch.randn(40, 32, device=device), torch.randn(48, 32, device=device)
    expected = torch.nn.functional.gelu(x @ w.T)

    def forward():
        out, _ = linear_act_forward(x, w, None, "gelu")
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        return [tuning._describe(plan.cfg) for plan in tuning._plans.values()]

    assert forward() == [tuning._describe(candidates[1])] and len(timed) == 2
    assert list(json.loads(cache.read_text()).values()) == [tuning._describe(candidates[1])]
    monkeypatch.setattr(tuning, "_plans", {})
    assert forward() == [tuning._describe(candidates[1])] and len(timed) == 2  # from the file: nothing timed
    cache.write_text("{not json")
    monkeypatch.setattr(tuning, "_plans", {})
    assert forward() == [tuning._describe(candidates[1])] and len(timed) == 4  # tuned again, and written again
    assert json.loads(cache.read_text())
    # a cached choice that no longer launches (an edited kernel, a new Triton): tuned again, not an error
    real_launch, failures = tuning.LaunchPlan.launch, []

    def launch_failing_once(plan, *args, **kwargs):
        if not failures:
            failures.append(plan.cfg)
            raise RuntimeError("out of resource: shared memory")
        return real_launch(plan, *args, **kwargs)
    monkeypatch.setattr(tuning.LaunchPlan, "launch", launch_failing_once)
    monkeypatch.setattr(tuning, "_plans", {})
    assert forward() == [tuning._describe(candidates[1])] and len(timed) == 6 and len(failures) == 1


def test_tuning_compiles_every_candidate_then_waits_for_a_precompiling_child(monkeypatch, tmp_path):
    """A child compiling kernels on the same GPU (precompile.py) would skew the timings: tuning compiles each
    candidate first (untimed, overlapping the child), waits for the child, and only then times them."""
    if not torch.cuda.is_available() and not env.INTERPRET:
        pytest.skip("the kernels cannot run here")
    from fused_ops import precompile
    from fused_ops.linear_act import linear_act_forward

    candidates = [tuning._config(32, 32, 32, 4, 1, group_m=2), tuning._config(16, 32, 32, 4, 1, group_m=2)]
    monkeypatch.setattr(env, "TUNING_CACHE", "0")
    monkeypatch.setattr(tuning, "matmul_configs", lambda gated=False, dtype=None: candidates)
    monkeypatch.setattr(tuning, "_plans", {})
    events, run_config = [], tuning.run_config
    monkeypatch.setattr(tuning, "run_config", lambda *a: events.append(("run", a[6])) or run_config(*a))
    monkeypatch.setattr(precompile, "wait", lambda: events.append(("wait", None)))
    monkeypatch.setattr(tuning, "do_bench", lambda fn, **k: events.append(("time", None)) or 1.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    linear_act_forward(torch.randn(40, 32, device=device), torch.randn(48, 32, device=device), None, "gelu")
    assert events == [("run", candidates[0]), ("run", candidates[1]), ("wait", None), ("time", None), ("time", None)]


# ---- the tile space: what fits each GPU, and the persistent grid ------------------------------------------------

ARCHITECTURES = {"sm_80 (A100)": (8, 0), "sm_86 (RTX 30)": (8, 6), "sm_89 (RTX 40, L4)": (8, 9), "sm_90 (H100)": (9, 0)}


def _gpu_space(monkeypatch):
    """matmul_configs / fp8_configs as a GPU sees them (the interpreter's one small config aside)."""
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setattr(env, "AUTOTUNE", True)
    tuning.matmul_configs.cache_clear()  # (and again after the test: the cache holds the GPU space meanwhile)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_config_fits_the_shared_memory_of_each_architecture(monkeypatch, arch):
    """Every candidate left in the space for a GPU fits that GPU's shared memory (tuning.SHARED_MEMORY: 99 KB on
    sm_86/89, 163 KB on sm_80), counted by arithmetic: num_stages copies of the A tile and of the B tile (two B tiles
    when gated), in the operands' dtype; and each kernel family keeps candidates on each (the pointer loop's
    Ampere / Ada configs among them)."""
    from fused_ops.fp8.kernels import fp8_configs
    _gpu_space(monkeypatch)
    limit = tuning.SHARED_MEMORY[ARCHITECTURES[arch]]
    try:
        for gated in (False, True):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                space = tuning.matmul_configs(gated, dtype, False, limit)
                assert space, (arch, gated, dtype)
                for cfg in space:
                    m = cfg.kwargs
                    need = cfg.num_stages * (m["BLOCK_M"] * m["BLOCK_K"] + (1 + gated) * m["BLOCK_K"] * m["BLOCK_N"])
                    assert need * dtype.itemsize <= limit, (arch, cfg)
            space = fp8_configs(gated, torch.bfloat16, limit)
            assert space, (arch, "fp8", gated)
            for cfg in space:
                m = cfg.kwargs
                assert cfg.num_stages * (m["BLOCK_M"] + (1 + gated) * m["BLOCK_N"]) * m["BLOCK_K"] <= limit, cfg
        # and the limit does remove something where it is small: the 128x256 tile needs 144 KB in bf16
        if limit < 144 * 1024:
            assert all(c.kwargs["BLOCK_N"] < 256 for c in tuning.matmul_configs(False, torch.bfloat16, False, limit))
    finally:
        tuning.matmul_configs.cache_clear()


def test_persistent_configs_can_be_left_out(monkeypatch):
    """FUSED_OPS_PERSISTENT=0 keeps only one-program-per-tile configs; by default the space holds both kinds."""
    _gpu_space(monkeypatch)
    try:
        assert any(c.kwargs["PERSISTENT"] for c in tuning.matmul_configs(False, torch.bfloat16))
        assert any(not c.kwargs["PERSISTENT"] for c in tuning.matmul_configs(False, torch.bfloat16))
        monkeypatch.setattr(env, "PERSISTENT", False)
        tuning.matmul_configs.cache_clear()
        assert not any(c.kwargs["PERSISTENT"] for g in (False, True) for c in tuning.matmul_configs(g, torch.bfloat16))
    finally:
        tuning.matmul_configs.cache_clear()


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("programs", [1, 3])  # (2 or 6 programs for the 35 tiles: 4 adds no case)
def test_a_persistent_grid_computes_what_one_program_per_tile_does(monkeypatch, activation, programs):
    """The same tiles walked by fewer programs (a persistent grid, flattened or not) give bit for bit the output of one
    program per tile, for the forward and the dgrad (whose bias sums are written per row-tile): every tile visited
    once (the outputs start as NaN). 7 x 5 tiles of 16 x 16 over `programs` x 2 programs (the interpreter's stand-in for SMs)."""
    from fused_ops.activations import kernel_activations
    from fused_ops.matmul import dot_settings
    act, up, gated = kernel_activations(activation)
    monkeypatch.setattr(tuning, "_processors", lambda index=None: 2)
    torch.manual_seed(0)
    M, K, N = 7 * 16 - 5, 32, 5 * 16  # (a ragged last row-tile)
    rows = 2 * N if gated else N
    x, w, b = torch.randn(M, K), torch.randn(rows, K), torch.randn(rows)
    acc, prec = dot_settings(torch.float32)

    def forward(cfg):
        out, saved = torch.full((M, N), float("nan")), torch.full((M, rows), float("nan"))
        args = (x, w, b, out, saved, out, w, w, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                out.stride(0), saved.stride(0))
        consts = dict(ACTIVATION=act, UP_ACTIVATION=up, GATED=gated, HAS_BIAS=True, SAVE=True, FAST16=False,
                      LN_FOLD=False, LN_WEIGHT=False, LN_BIAS=False, ACC_DTYPE=acc, PRECISION=prec, INT64=False,
                      TMA=False, B_KMAJOR=False, PAIRED=False)
        tuning.run_config(linear_act_kernel, M, N, K, args, consts, cfg)
        return out, saved

    def dgrad(cfg, saved):
        gy, w2 = torch.randn(M, K, generator=torch.Generator().manual_seed(1)), w[:N].t().contiguous()
        out, partial = torch.full_like(saved, float("nan")), torch.full((7, saved.shape[1]), float("nan"))
        args = (gy, w2, saved, out, partial, M, N, K, gy.stride(0), gy.stride(1), w2.stride(0), w2.stride(1),
                saved.stride(0), out.stride(0), partial.stride(0))
        consts = dict(GATED=gated, BIAS_GRAD=True, ACC_DTYPE=acc, PRECISION=prec, INT64=False, TMA=False,
                      B_KMAJOR=False)
        tuning.run_config(dgrad_kernel, M, N, K, args, consts, cfg)
        return out, partial

    grid = tuning._config(16, 16, 16, 4, 1, group_m=2, split=False)
    base = forward(grid)
    base_dgrad = dgrad(grid, base[1])
    for flatten in (False, True):
        cfg = tuning._config(16, 16, 16, 4, 1, group_m=2, split=False, persistent=programs, flatten=flatten)
        assert tuning._grid_and_args(cfg, M, N, (), ())[0][0] == 2 * programs
        ours = forward(cfg)
        for a, r in zip(ours, base):
            assert not a.isnan().any() and torch.equal(a, r)
        for a, r in zip(dgrad(cfg, base[1]), base_dgrad):
            assert not a.isnan().any() and torch.equal(a, r)


def test_env_overridden_switches_back(monkeypatch):
    """env.overridden changes the run-time switches for a block and puts them back, an exception included; the
    interpreter switch, frozen into kernels at import, and unknown names are refused."""
    before = (env.PINGPONG, env.TMA_MODE)
    with pytest.raises(RuntimeError):
        with env.overridden(PINGPONG=False, TMA_MODE="0"):
            assert (env.PINGPONG, env.TMA_MODE) == (False, "0")
            raise RuntimeError
    assert (env.PINGPONG, env.TMA_MODE) == before
    for bad in ("INTERPRET", "PINGPONGS"):
        with pytest.raises(ValueError, match=bad):
            env.overridden(**{bad: False})


def test_no_tuning_starts_inside_a_cuda_graph_capture(monkeypatch):
    """A kernel's first launch tunes it, timing its candidates (synchronizing): inside a CUDA graph capture that
    invalidates the capture, and the failure surfaced later, at a launch that had nothing to do with it. It raises at
    once instead, naming the kernel, with nothing tuned; a kernel already tuned still launches."""
    monkeypatch.setattr(tuning, "matmul_configs", lambda gated=False, dtype=None: [  # two candidates: a tuning
        tuning._config(32, 32, 32, 4, 1, group_m=2), tuning._config(16, 16, 16, 4, 1, group_m=2)])
    monkeypatch.setattr(env, "TUNING_CACHE", "0")
    from fused_ops.linear_act import linear_act_forward
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    linear_act_forward(x, w, None, "gelu")  # tuned outside the capture
    monkeypatch.setattr(tuning, "_capturing", lambda: True)
    out, _ = linear_act_forward(x, w, None, "gelu")  # its plan exists: a launch, no tuning
    assert torch.isfinite(out).all()
    before = len(tuning.TUNING_LOG)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        linear_act_forward(x, torch.randn(48, 16), None, "gelu")  # a new weight shape: a new key
    assert len(tuning.TUNING_LOG) == before
