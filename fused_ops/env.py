"""Every environment switch of fused_ops, read once, here, when the package is imported.

A leaf module (it imports nothing of the repository): every other module reads its switch as `env.NAME` when it
needs it, so a test that changes one patches it here (monkeypatch.setattr(env, "PINGPONG", False)).
A few are frozen into compile-time constants at import (the interpreter's: activations.py, matmul.py, fp8/kernels.py).

| variable                | default                           | constant       | meaning                                                                                    |
|-------------------------|-----------------------------------|----------------|--------------------------------------------------------------------------------------------|
| TRITON_INTERPRET        | 0                                 | INTERPRET      | Triton's own: run the kernels on CPU through its interpreter (the test suite sets it)      |
| FUSED_OPS_AUTOTUNE      | 1                                 | AUTOTUNE       | time every candidate tile config (tuning.py); 0 keeps the first (the test suite sets it)   |
| FUSED_OPS_TMA           | auto                              | TMA_MODE       | the TMA main loop (matmul.py): auto on Hopper+ GPUs, 0 never, 1 also under the interpreter |
| FUSED_OPS_DIRECT_LAUNCH | 1                                 | DIRECT_LAUNCH  | call kept compiled kernels (tuning.LaunchPlan); 0 launches through Triton's JIT            |
| FUSED_OPS_TUNING_CACHE  | ~/.cache/fused_ops/tuning.json    | TUNING_CACHE   | file of the tuned tile choices (tuning.py); 0 keeps none                                   |
| FUSED_OPS_PINGPONG      | 1                                 | PINGPONG       | Hopper's Gluon ping-pong kernels (hopper/); 0 leaves everything to Triton's and cuBLAS's   |
| FUSED_OPS_GRAPHS        | 1                                 | GRAPHS         | per-shape CUDA graphs of the uncompiled fused MLP (graphs.py); 0 off                        |
| FUSED_OPS_PRECOMPILE    | 1                                 | PRECOMPILE     | compile the fused kernels in a child process at start-up (precompile.py); 0 off            |
| FUSED_OPS_PERSISTENT    | 1                                 | PERSISTENT     | persistent-grid tile configs among the tuning candidates (tuning.py); 0 leaves them out   |
| FUSED_OPS_ADAMW         | 1                                 | ADAMW          | model.configure_optimizers' AdamW: adamw.py's one-launch kernel on CUDA; 0 PyTorch's fused |
| FUSED_OPS_GATE_PAIRS    | 1                                 | GATE_PAIRS     | the gated forward's TMA loop reads gate and up rows paired, one dot a tile (matmul.py); 0 two |

(The default cache file sits under $XDG_CACHE_HOME when that is set.) precompile.py starts its child with
FUSED_OPS_AUTOTUNE=0 and FUSED_OPS_TUNING_CACHE=0.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AUTOTUNE = os.environ.get("FUSED_OPS_AUTOTUNE", "1") == "1"
TMA_MODE = os.environ.get("FUSED_OPS_TMA", "auto")
DIRECT_LAUNCH = os.environ.get("FUSED_OPS_DIRECT_LAUNCH", "1") == "1"
TUNING_CACHE = os.environ.get("FUSED_OPS_TUNING_CACHE", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fused_ops", "tuning.json"))
PINGPONG = os.environ.get("FUSED_OPS_PINGPONG", "1") == "1"
GRAPHS = os.environ.get("FUSED_OPS_GRAPHS", "1") != "0"
PRECOMPILE = os.environ.get("FUSED_OPS_PRECOMPILE", "1") != "0"
PERSISTENT = os.environ.get("FUSED_OPS_PERSISTENT", "1") != "0"
ADAMW = os.environ.get("FUSED_OPS_ADAMW", "1") != "0"
GATE_PAIRS = os.environ.get("FUSED_OPS_GATE_PAIRS", "1") != "0"


def interpreter_problem():
    """Why Triton's CPU interpreter (TRITON_INTERPRET=1) cannot run the kernels here, or None. Triton 3.6's turns a
    scalar into an index as int(array), and NumPy 2.4 refuses that for a 1-element array, so every kernel's first loop
    fails inside the interpreter (triton-lang/triton#9171; Triton 3.9's squeezes the array first)."""
    import inspect
    import warnings

    import numpy
    import triton
    from triton.runtime import interpreter
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (NumPy 1.25 to 2.3 deprecate the conversion, and still make it)
            int(numpy.zeros(1))
        return None
    except TypeError:
        pass
    try:
        source = inspect.getsource(interpreter._patch_lang_tensor)
    except (AttributeError, OSError, TypeError):
        return None  # (an interpreter laid out otherwise: let it run)
    if "int(self.handle.data)" not in source:
        return None
    return (f"TRITON_INTERPRET=1: the CPU interpreter of Triton {triton.__version__} cannot run with NumPy "
            f"{numpy.__version__} (it reads scalars with int(array), which NumPy 2.4 refuses: triton-lang/triton#9171); "
            "install a later Triton (3.9 is tested) or numpy<2.4")


class overridden:
    """with env.overridden(PINGPONG=False, TMA_MODE="0"): these switches changed for the block, then put back: the
    benchmarks time the portable kernels (what a GPU without the Hopper kernels runs) beside the ping-pong ones in
    one process. Switches frozen into kernels at import (INTERPRET) cannot be changed so."""

    def __init__(self, **switches):
        unknown = [k for k in switches if k not in globals() or k == "INTERPRET"]
        if unknown:
            raise ValueError(f"env.overridden: no switch {unknown[0]!r} can be changed at run time")
        self.switches, self.before = switches, {}

    def __enter__(self):
        self.before = {k: globals()[k] for k in self.switches}
        globals().update(self.switches)
        return self

    def __exit__(self, *exc):
        globals().update(self.before)
        return False
