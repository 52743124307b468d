"""The test suite's one change to Triton's CPU interpreter: it swaps triton.language's builtins once a launch, not
again at every device-function call. conftest.py applies it, and so do the tests' spawned DDP workers (they do not
load conftest.py).

Why: the interpreter swaps the language's builtins for interpreted ones at each launch (_patch_lang) and puts them
back when the launch ends. It does it again at every call of a @triton.jit device function inside the kernel
(quantize, _encode_fp8, ...). By then the builtins are already swapped, so those calls change nothing, but each
lists every member of the language's modules (inspect.getmembers) to find that out. That was about a fifth of the
FP8 tests' time: cProfile of tests/test_train.py::test_fp8_trains_and_resumes, 8232 calls, 26 of 117 s, 96% of them
nested. The launch's own swap lists the modules too; that listing is made once here.

With both, on a 2-core CPU (`python -m pytest -q -n 2`), the whole suite took 9:22 and 9:39 (two runs) where it
took 13:01; within it, test_fp8_trains_and_resumes 45-49 s where it took 61, test_layernorm_fold's float64 gradcheck
22 where it took 39.

What is kept: outside a launch (a device function called from Python), and for a device function whose module sees
a language module the launch did not swap, or none, Triton's own _patch_lang runs; a Triton without these names is
left as it is."""

import inspect
import os


def patch_once_a_launch():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        original, Scope, Launch = interpreter._patch_lang, interpreter._LangPatchScope, interpreter.GridExecutor
        launch_call = Launch.__call__
    except (ImportError, AttributeError):
        return
    if getattr(original, "once_a_launch", False):
        return  # (applied already in this process)
    launch = []  # while a launch runs: the ids of the language modules its own swap covered

    def languages(fn):  # the modules _patch_lang swaps for fn
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def run_launch(self, *args, **kwargs):
        launch.clear()
        launch.append(None)  # (a launch has begun; its first _patch_lang is its own swap)
        try:
            return launch_call(self, *args, **kwargs)  # (it restores its swap in a finally)
        finally:
            launch.clear()

    def patch_lang(fn):
        seen = languages(fn)
        if launch and launch[0] is not None and seen and seen <= launch[0]:
            return Scope()  # a device function inside a launch that has swapped its modules: nothing to do
        scope = original(fn)
        if launch and launch[0] is None:  # the launch's own swap
            launch[0] = seen
        return scope

    patch_lang.once_a_launch = True
    interpreter._patch_lang = patch_lang
    Launch.__call__ = run_launch

    # A launch's own swap lists the members of each module too: list them once, then look up only the builtins'
    # names (a builtin already swapped is left alone, as Triton's own listing would find it no longer a builtin).
    builtins = {}

    def patch_builtin(pkg, builder, scope):
        names = builtins.get(id(pkg))
        if names is None:
            names = builtins[id(pkg)] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin
