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
