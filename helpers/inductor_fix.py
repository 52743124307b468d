"""A fix for a race in the Triton kernels that torch.compile writes (seen with torch 2.11; 2.13's code is the same).

Inductor sometimes writes a reduction kernel that stores a buffer in one loop over a row and reads it back in a later
loop of the same kernel: a LayerNorm whose normalized rows are saved for the backward (stored in place) and then
scaled by γ for the next operator (read back), in rows wider than 1024, where Inductor loops over a row instead of
holding it. Triton spreads each loop's loads and stores over the threads on its own, so the thread that reads an
element back need not be the one that wrote it, and nothing orders the two: the read may see the old value. In this
repo it gave a compiled GPT's fused classifier a final LayerNorm output with about half its rows stale at
n_embd = 1536 (a loss 0.25% off, different at every call; lab/classifier/wide_inputs_probe.py).

The fix proposed upstream (pytorch/pytorch pull request 190519) puts a barrier (`tl.debug_barrier()`, every thread
of the program waits) before such a read; `apply()` adds it by wrapping Inductor's `TritonKernel.load`. It only
touches a kernel that reads back what it stored in an earlier loop, and it leaves Inductor alone (with a warning)
where the code it wraps is not there.
"""

import warnings

_applied = False


def with_barrier(load):
    """Inductor's load, preceded by a barrier where it reads a buffer stored in an earlier loop of the kernel
    (Inductor records those in cse.invalidated_stores to keep the buffer; inside_reduction: within a row loop)."""
    def load_after_barrier(self, name, index):
        if self.inside_reduction and name in getattr(self.cse, "invalidated_stores", ()):
            self.loads.writeline("tl.debug_barrier()")
        return load(self, name, index)
    load_after_barrier.wrapped = load
    return load_after_barrier


def apply():
    """Patch Inductor's Triton code generation (once per process); True if it is patched."""
    global _applied
    if _applied:
        return True
    try:
        from torch._inductor.codegen.triton import TritonKernel
        TritonKernel.load  # noqa: B018 (the method this wraps)
    except (ImportError, AttributeError) as e:
        warnings.warn(f"torch.compile's reduction kernels are not patched (helpers/inductor_fix.py): {e}")
        return False
    TritonKernel.load = with_barrier(TritonKernel.load)
    _applied = True
    return True
