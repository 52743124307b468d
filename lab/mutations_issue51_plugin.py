"""Issue 51: break the code on purpose, one way at a time, to see that the strengthened tests fail.

A pytest plugin: `MUTATION_ISSUE51=<name> python -m pytest -p mutations_issue51_plugin ...` (with lab/ on PYTHONPATH)
applies one mutation at pytest_configure, before any test module is imported, by monkeypatching Python objects in
memory: no file is edited, so nothing has to be restored. Unset (or empty), it does nothing.
lab/mutations_issue51.sh runs the GPU ones (and, with --cpu, the CPU ones) and prints the table.

Each mutation names what it breaks; MUTATIONS maps name -> (the tests it should make fail, what it does).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MUTATIONS = {
    # GPU tests
    "ln_fold_h_zero": ("tests/test_fused_gpu.py::test_layernorm_fold_forward_large_and_odd",
                       "the LayerNorm-folded forward writes zeros into h (dh/dz still right)"),
    "ln_fold_h_unwritten": ("tests/test_fused_gpu.py::test_layernorm_fold_forward_large_and_odd",
                            "the LayerNorm-folded forward never writes the caller's h (left poisoned)"),
    "pingpong_dgate_zero": ("tests/test_pingpong.py::test_gated_fp8_inputs",
                            "the gated ping-pong forward writes zeros into dh/dgate (saved[:, :N])"),
    "fp8_dx_zero": ("tests/test_fp8.py::test_nan_and_inf_rows_on_the_gpu / _on_cpu",
                    "the FP8 MLP's backward returns a zero input gradient"),
    "fp8_backward_skipped": ("tests/test_fp8.py::test_nan_and_inf_rows_on_the_gpu / _on_cpu",
                             "the FP8 MLP's backward returns no gradient at all"),
    "fp8_db2_off": ("tests/test_fp8.py::test_fp8_mlp_matches_the_recipe_on_the_gpu / _on_cpu",
                    "the FP8 MLP's second bias gradient 0.8% off (within the old rel < 1e-2)"),
    # CPU tests
    "fp8_weight_grads_zero": ("tests/test_train.py::test_fp8_trains_and_resumes",
                              "the FP8 MLP's backward returns zero weight gradients"),
    "fp8_y_zero": ("tests/test_train.py::test_fp8_trains_and_resumes", "the FP8 MLP's forward returns zeros"),
    "precompile_eager": ("tests/test_precompile.py::test_the_child_runs_the_three_kernels_paths",
                         "precompile.compile_kernels runs an eager MLP (a silent fallback)"),
    "precompile_eval_eager": ("tests/test_precompile.py::test_the_child_runs_the_three_kernels_paths",
                              "precompile's no_grad forward falls back to eager (the other two paths run)"),
    "specialization_coarser": ("tests/test_tuning.py::test_specialization_is_at_least_as_fine_as_tritons",
                               "tuning._specialization ignores 16-byte alignment (Triton's rule finer than ours)"),
    "specialize_api_moved": ("tests/test_tuning.py::test_specialization_is_at_least_as_fine_as_tritons",
                             "Triton without native_specialize_impl (the internal API moved)"),
    "numerics_old_rule": ("tests/test_numerics.py",
                          "assert_no_worse_than_eager / assert_within_rule as before issue 51 (no finiteness check)"),
    "timing_step_ms_wrong": ("tests/test_timing.py::test_train_prints_where_start_up_went",
                             "log.jsonl's per-step ms half the step's time"),
    "timing_evals_total_wrong": ("tests/test_timing.py::test_train_prints_where_start_up_went",
                                 "the timer's evals total is the last eval's time only"),
    "timing_steps_skip_warmup": ("tests/test_timing.py::test_train_prints_where_start_up_went",
                                 "the run's steps total leaves out the first 3 steps (the rest absorbs them)"),
    "ddp_unwrapped": ("tests/test_ddp.py", "the training processes' models not wrapped in DDP (no gradient all-reduce; "
                      "the losses are still all-reduced)"),
    "graphs_copy_keeps_graphs": ("tests/test_graphs.py::test_a_deep_copy_of_the_model_recaptures",
                                 "a deep copy of MLPGraphs shares the captured graphs (the seen shapes still reset)"),
    "graphs_copy_keeps_seen": ("tests/test_graphs.py::test_a_deep_copy_of_the_model_recaptures",
                               "MLPGraphs.__getstate__ keeps the seen shapes"),
}


def _fp8_backward(change):
    from fused_ops.fp8 import autograd

    original = autograd.FP8MLPFunction.backward

    def backward(ctx, grad_y):
        return change(original(ctx, grad_y))
    autograd.FP8MLPFunction.backward = staticmethod(backward)


def _zero(t):
    import torch
    return None if t is None else torch.zeros_like(t)


def _spawned(rank, name, fn, *args):
    """mp.spawn's entry in a child under a mutation: the mutation first (children do not load pytest plugins)."""
    apply(name)
    return fn(rank, *args)


def apply(name):
    import torch

    if name == "ln_fold_h_zero" or name == "ln_fold_h_unwritten":
        import importlib
        linear_act = importlib.import_module("fused_ops.linear_act")  # (the package exports a function of that name)
        launch = linear_act._launch

        def _launch(x, weight, bias, activation, save, out, saved, ln=None):
            if ln is None:
                return launch(x, weight, bias, activation, save, out, saved, ln=ln)
            if name == "ln_fold_h_unwritten":
                result = launch(x, weight, bias, activation, save, None, saved, ln=ln)
                return (out if out is not None else result[0], *result[1:])
            result = launch(x, weight, bias, activation, save, out, saved, ln=ln)
            result[0].zero_()
            return result
        linear_act._launch = _launch
    elif name == "pingpong_dgate_zero":
        from fused_ops.hopper import pingpong
        forward = pingpong.linear_act_forward

        def linear_act_forward(*args, **kwargs):
            ok = forward(*args, **kwargs)
            gated, out, saved = args[5], args[7], args[8]
            if ok and gated and saved is not None:
                saved[:, :out.shape[1]].zero_()
            return ok
        pingpong.linear_act_forward = linear_act_forward
    elif name == "fp8_dx_zero":
        _fp8_backward(lambda g: (_zero(g[0]), *g[1:]))
    elif name == "fp8_backward_skipped":
        _fp8_backward(lambda g: (None,) * len(g))
    elif name == "fp8_db2_off":
        _fp8_backward(lambda g: (*g[:4], None if g[4] is None else g[4] * 1.008, *g[5:]))
    elif name == "fp8_weight_grads_zero":
        _fp8_backward(lambda g: (g[0], _zero(g[1]), g[2], _zero(g[3]), *g[4:]))
    elif name == "fp8_y_zero":
        from fused_ops.fp8 import autograd
        forward = autograd.FP8MLPFunction.forward

        def forward_zero(ctx, *args):
            return forward(ctx, *args) * 0
        autograd.FP8MLPFunction.forward = staticmethod(forward_zero)
    elif name in ("precompile_eager", "precompile_eval_eager"):
        from fused_ops import precompile
        fused = precompile.fused_mlp_layers

        def eager(x, c_fc, c_proj, activation, norm=None, fuse_ln=False):
            if name == "precompile_eval_eager" and torch.is_grad_enabled():
                return fused(x, c_fc, c_proj, activation, norm, fuse_ln)
            from model import GATED_ACTIVATIONS, PLAIN_ACTIVATIONS
            z = c_fc(norm(x) if norm is not None else x)
            h = GATED_ACTIVATIONS[activation](*z.chunk(2, -1)) if activation in GATED_ACTIVATIONS else \
                PLAIN_ACTIVATIONS[activation](z)
            return c_proj(h)
        precompile.fused_mlp_layers = eager
    elif name == "specialization_coarser":
        from fused_ops import tuning
        specialization = tuning._specialization

        def coarser(args):
            spec = specialization(args)
            return tuple((s[0], True) if isinstance(a, torch.Tensor) else s for a, s in zip(args, spec))
        tuning._specialization = coarser
    elif name == "specialize_api_moved":
        from triton._C import libtriton
        del libtriton.native_specialize_impl
    elif name == "numerics_old_rule":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import numerics

        def assert_within_rule(e_fused, e_eager, eps, what=""):
            assert e_fused <= 2 * e_eager + eps, f"{what}: fused error {e_fused:.3e} > 2 x eager {e_eager:.3e} + eps"

        def assert_no_worse_than_eager(fused, eager, ref, what="", compute_dtype=None):
            assert_within_rule(numerics.rel_err(fused, ref), numerics.rel_err(eager, ref),
                               numerics.EPS[compute_dtype or fused.dtype], what)
        numerics.assert_within_rule = assert_within_rule
        numerics.assert_no_worse_than_eager = assert_no_worse_than_eager
    elif name == "timing_step_ms_wrong":
        import train
        report_step = train.report_step

        def half(log, bar, cfg, it, lossf, lr, dt, *rest):
            return report_step(log, bar, cfg, it, lossf, lr, dt / 2, *rest)
        train.report_step = half
    elif name == "timing_evals_total_wrong":
        from helpers import timing
        record = timing.RunTimer.eval

        def eval_(self, seconds):
            record(self, seconds)
            self.seconds["evals"] = seconds
        timing.RunTimer.eval = eval_
    elif name == "timing_steps_skip_warmup":
        from helpers import timing
        summary = timing.RunTimer.summary

        class WithoutWarmup(list):  # len() still counts every step; sum() and median() see the steady ones
            def __iter__(self):
                return iter(list(self[timing.WARMUP_STEPS:]))

            def __getitem__(self, i):
                return list.__getitem__(self, i)

        def summary_(self):
            steps, self.step_times = self.step_times, WithoutWarmup(self.step_times)
            try:
                return summary(self)
            finally:
                self.step_times = steps
        timing.RunTimer.summary = summary_
    elif name == "ddp_unwrapped":
        import torch.multiprocessing as mp
        from helpers import runtime
        wrap_model, spawn = runtime.wrap_model, mp.spawn
        runtime.wrap_model = lambda model, compile, world, *rest, **kw: (
            model if world > 1 and not compile else wrap_model(model, compile, world, *rest, **kw))
        if not getattr(mp.spawn, "mutated", False):
            mp.spawn = lambda fn, args=(), **kw: spawn(_spawned, args=(name, fn, *args), **kw)
            mp.spawn.mutated = True
    elif name == "graphs_copy_keeps_graphs":
        from fused_ops import graphs
        def deepcopy(self, memo):  # a copy that shares the original's graphs (a captured graph cannot be deep-copied)
            copied = graphs.MLPGraphs(self.emulate, self.keep)
            copied.captured = dict(self.captured)
            return copied
        graphs.MLPGraphs.__deepcopy__ = deepcopy
    elif name == "graphs_copy_keeps_seen":
        from fused_ops import graphs
        getstate = graphs.MLPGraphs.__getstate__
        graphs.MLPGraphs.__getstate__ = lambda self: {**getstate(self), "seen": set(self.seen)}
    else:
        raise ValueError(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")


def pytest_configure(config):
    name = os.environ.get("MUTATION_ISSUE51")
    if name:
        sys.path.insert(0, ROOT)
        apply(name)
        print(f"[mutations_issue51] applied {name}: {MUTATIONS[name][1]}", file=sys.stderr)
