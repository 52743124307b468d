"""Block sizes, autotuning and the launch of the matmul kernels: the one place they live.

The configs target Hopper (H100/H200): 128-wide tiles feed its warpgroup MMA, 3-4 pipeline stages hide
load latency.

Tuning is our own few lines rather than triton.autotune, for two reasons. The key holds the weight's
shape (N, K), dtype and kernel flags, never M, so a new batch size reuses the tuned choice instead of
tuning again. And after the first call a launch is a dict lookup and a call of the kept compiled kernel
(see LaunchPlan), where triton.autotune's per-call bookkeeping costs as much host time as a small
kernel takes on the GPU (measured in docs/performance.md). TUNING_LOG records what was tuned, the choice
and how long it took.

The choices are kept on disk (FUSED_OPS_TUNING_CACHE, see env.py; default ~/.cache/fused_ops/tuning.json; "0" turns it
off), keyed by the GPU, the Triton version and the tuning key: tuning is paid once per machine, and a later
run compiles only the chosen config instead of compiling and timing every candidate.

Under TRITON_INTERPRET=1 (CPU tests) one small config keeps the interpreter fast and exercises masking.
FUSED_OPS_AUTOTUNE=0 skips tuning and uses the first config (the test suite sets
it: it compiles hundreds of kernel variants, and tuning each would take far longer than checking it).
"""

import functools
import hashlib
import inspect
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

from . import env

try:  # host-side tensor descriptors (Triton >= 3.4); without them every kernel uses the pointer loop
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

TRANSPOSE_WEIGHT_MIN_M = 2048  # rows of x from which the pointer-loop forward reads an N-major copy of W
LAYERNORM_ROWS_PER_PROGRAM = 16  # rows one LayerNorm-backward program walks, summing its share of dγ, dβ
TUNING_LOG = []  # (kernel name, key, chosen config, seconds spent tuning)
# Run before any candidate is timed (precompile.py adds its wait: a child compiling on the same GPU would skew the
# timings that are kept). Hooks, so that this module needs nothing of the speed machinery above it.
BEFORE_TIMING = []
_plans = {}  # tuning key -> LaunchPlan


def _config(block_m, block_n, block_k, warps, stages, group_m=8, maxnreg=None, split=True, persistent=0,
            flatten=False):
    """split: run the epilogue on half the tile's columns at a time (SPLIT_EPILOGUE, see split_columns).
    persistent: launch that many programs per SM, each walking output tiles grid-stride, instead of one program per
    tile (0); flatten: let the compiler pipeline across the tiles a program walks (matmul.tiles)."""
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m, "SPLIT_EPILOGUE": split,
            "PERSISTENT": persistent, "FLATTEN": flatten}
    cfg = triton.Config(meta, num_warps=warps, num_stages=stages)
    cfg.maxnreg = maxnreg  # an attribute of Config only in newer Triton: set here, passed at launch
    return cfg


# Shared memory a block may use, by compute capability (CUDA's opt-in limit): a config whose pipeline buffers need more
# is left out of the space there. Newer GPUs than these are asked (torch's device properties).
SHARED_MEMORY = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024}


def shared_memory(cfg, itemsize, gated=False):
    """Bytes of the main loop's pipeline buffers: num_stages copies of an A tile and one B tile (two when gated: the
    gate and up halves), in operands of itemsize bytes. The kernels' other shared memory (the epilogue's layout
    changes) reuses these buffers or is small beside them."""
    m = cfg.kwargs
    return cfg.num_stages * (m["BLOCK_M"] * m["BLOCK_K"] + (2 if gated else 1) * m["BLOCK_K"] * m["BLOCK_N"]) * itemsize


@functools.lru_cache(maxsize=None)
def _device_shared_memory():
    if not torch.cuda.is_available():
        return SHARED_MEMORY[(9, 0)]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return SHARED_MEMORY.get((props.major, props.minor)) or props.shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)  # called on launch paths: the Config objects are built once
def matmul_configs(gated=False, dtype=None, all_configs=False, shared_limit=None):
    """Candidate tiles for the fused matmul kernels, best first at GPT-2 small's MLP on an H200 (the sweep in
    results/portable/). Gated kernels hold two accumulators, so their tiles are smaller.

    What decides is whether the epilogue spills and whether the GEMM's MMAs keep running while an epilogue does.
    Two ways to get the second: two programs per SM (the 4-warp 128x128 tile: while one's epilogue runs, the
    other's MMAs do) and a persistent grid whose tile loop is flattened (the compiler issues the next tile's loads
    under this tile's epilogue): the winner does both (PERSISTENT=2, FLATTEN). The 8-warp 128x256 tile halves the
    reads of x per output. Which wins depends on the GPU and the shape, so all are timed. Configs whose pipeline
    buffers exceed the GPU's shared memory (shared_limit, default this GPU's: 99 KB on the RTX 30/40 series and
    L4, 163 KB on an A100) are left out there. all_configs: every candidate even when FUSED_OPS_AUTOTUNE=0 (which
    keeps the first)."""
    if env.INTERPRET:  # (persistent: two programs, each walking several tiles of the tests' shapes)
        return [_config(32, 32, 32, 4, 1, group_m=2, persistent=1)]
    if gated:
        configs = [
            _config(128, 128, 64, 8, 3, persistent=1, flatten=True),
            _config(128, 128, 64, 8, 3),
            _config(128, 64, 64, 4, 4, split=False, persistent=2, flatten=True),
            _config(128, 128, 64, 8, 4),  # the pointer loop's forward winner (results/portable/sweep_swiglu_h200.txt)
            _config(128, 64, 64, 4, 3, split=False),  # (fits 99 KB)
            _config(64, 64, 64, 4, 4, split=False),
        ]
    else:
        configs = [
            _config(128, 128, 64, 4, 3, persistent=2, flatten=True),  # two programs per SM, each persistent
            _config(128, 256, 64, 8, 3, persistent=1, flatten=True),
            _config(128, 128, 64, 4, 3),
            _config(128, 128, 64, 4, 3, split=False),
            _config(128, 256, 64, 8, 4),
            _config(128, 256, 64, 8, 3),
            _config(256, 128, 64, 8, 3),
            _config(128, 64, 64, 4, 4, split=False),
            _config(64, 64, 64, 4, 4, split=False),
        ]
    if dtype is not None and dtype.itemsize >= 4:
        # fp32/fp64 operands take twice the shared memory per tile (BLOCK_K halved to fit), and an exact
        # fp32 dot runs on the FMA units, whose accumulator layout splits only through shared memory
        # (more than an H100 has, for a 128x256 tile): the whole-tile epilogue there.
        configs = [_config(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], 32, c.num_warps, c.num_stages,
                           c.kwargs["GROUP_M"], c.maxnreg, split=False, persistent=c.kwargs["PERSISTENT"],
                           flatten=c.kwargs["FLATTEN"]) for c in configs]
    limit = shared_limit or _device_shared_memory()
    itemsize = dtype.itemsize if dtype is not None else 2
    configs = [c for c in configs if shared_memory(c, itemsize, gated) <= limit
               and (env.PERSISTENT or not c.kwargs["PERSISTENT"])]
    return configs if env.AUTOTUNE or all_configs else configs[:1]


def cdiv(a, b):
    """ceil(a / b) for host code: triton.cdiv is a constexpr function in newer Triton, slow to call from
    Python on a launch path."""
    return -(-a // b)


def row_kernel_warps(block):
    """Warps for a kernel that holds one row of `block` elements: enough threads to load it in 16-byte pieces."""
    return 1 if env.INTERPRET else min(16, max(4, block // 256))


def run_config(kernel, M, N, K, args, consts, cfg, descriptors=()):
    """Launch a tiled matmul kernel (one program per output tile) with one config, through Triton's JIT
    (which compiles on first use). Returns what the launch returned (the compiled kernel on a GPU).

    descriptors: (position in args, tensor, names of its block dims) for operands the kernel reads
    through TMA: each becomes a tensor descriptor whose block is the config's tile.
    """
    grid, call_args = _grid_and_args(cfg, M, N, args, descriptors)
    return _jit_launch(kernel, grid, call_args, _constexprs(consts, cfg, K), cfg)


def _constexprs(consts, cfg, K):
    """The caller's constexprs, the config's tile sizes and EVEN_K: every constexpr the kernels take."""
    meta = cfg.kwargs
    return {**consts, **meta, "EVEN_K": K % meta["BLOCK_K"] == 0}


def _grid_and_args(cfg, M, N, args, descriptors):
    """One program per output tile (or, with a persistent config, at most PERSISTENT per SM), and the arguments with
    TMA operands turned into tensor descriptors."""
    meta = cfg.kwargs
    call_args = list(args)
    for i, t, block in descriptors:  # (t may build its own descriptor from the config: matmul.pair_descriptor)
        call_args[i] = t(meta) if callable(t) else TensorDescriptor.from_tensor(t, [meta[d] for d in block])
    programs = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
    if meta.get("PERSISTENT"):
        programs = min(programs, meta["PERSISTENT"] * _processors())
    return (programs, 1, 1), call_args


@functools.lru_cache(maxsize=None)
def _processors(index=None):
    """Streaming multiprocessors of the current GPU (a persistent grid's unit); 2 under the interpreter, so that
    the CPU tests' persistent programs each walk several tiles."""
    if env.INTERPRET or not torch.cuda.is_available():
        return 2
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).multi_processor_count


def _jit_launch(kernel, grid, args, constexprs, cfg):
    """Launch through Triton's JIT (compiling on first use); maxnreg is passed only where a config sets it."""
    options = {} if getattr(cfg, "maxnreg", None) is None or env.INTERPRET else {"maxnreg": cfg.maxnreg}
    return kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **options)


def _specialization(args):
    """What Triton compiles a kernel for, of the runtime arguments: each tensor's dtype and 16-byte
    alignment, whether each integer is 1 or a multiple of 16 and whether it fits 32 bits, None-ness.
    (Operands read through TMA are passed here as their tensors: the descriptor's block shape is the plan's.)"""
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            spec.append((a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31))
        else:
            spec.append(a is None)  # a float (eps), a tensor descriptor (typed by its block shape) or None
    return tuple(spec)


class LaunchPlan:
    """One kernel at one tuning key: the tuned config and, on a GPU, its compiled kernels, called directly.

    Why: Triton's JIT launch re-derives on every call what is fixed per key (it binds every argument,
    builds a cache key from them, looks the kernel up), and that host time is a large share of a fused
    call's (docs/performance.md, CUDA graphs and the host). A plan keeps the
    compiled kernel of each argument specialization (see _specialization) and launches it with the
    argument list in the kernel's parameter order. A new specialization goes through the JIT once
    (compiling if needed) and is then kept.
    """

    def __init__(self, kernel, cfg, consts, K=None):
        """K None: consts are already every constexpr the kernel takes (a kernel that is not a tiled matmul)."""
        self.kernel, self.cfg = kernel, cfg
        self.consts = consts if K is None else _constexprs(consts, cfg, K)
        self.compiled = {}
        # Direct launches use the compiled kernel's runner (CompiledKernel[grid], Triton 3.x), which takes
        # every parameter in order: ours put the runtime arguments first, then exactly these constexprs.
        names = list(getattr(kernel, "arg_names", []))
        tail = names[len(names) - len(self.consts):]
        self.direct = env.DIRECT_LAUNCH and not env.INTERPRET and sorted(tail) == sorted(self.consts)
        self.const_values = [self.consts[n] for n in tail] if self.direct else None

    def launch(self, M, N, args, descriptors=()):
        self.launch_grid(*_grid_and_args(self.cfg, M, N, args, descriptors))

    def launch_grid(self, grid, args):
        grid = (*grid, 1, 1)[:3]  # (a compiled kernel's runner takes all three grid dimensions)
        spec = _specialization(args) if self.direct else None
        if self.direct:
            compiled = self.compiled.get(spec)
            if compiled is not None:
                compiled[grid](*args, *self.const_values)
                return
        compiled = _jit_launch(self.kernel, grid, args, self.consts, self.cfg)
        if self.direct and (not hasattr(compiled, "__getitem__")
                            or len(args) + len(self.const_values) != len(self.kernel.arg_names)):
            self.direct = False  # not a kernel whose parameters are these runtime arguments and constexprs
        if self.direct:
            self.compiled[spec] = compiled


def launch(kernel, grid, args, consts, num_warps=4):
    """Launch a kernel that is not tuned (one config: its constexprs and warps) through a kept LaunchPlan, so that
    after its first call it costs a dict lookup and the compiled kernel's call, not Triton's JIT launch."""
    key = (kernel, num_warps, *consts.items())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = LaunchPlan(kernel, triton.Config({}, num_warps=num_warps, num_stages=3), consts)
    plan.launch_grid(grid, args)


def launch_matmul(kernel, M, N, K, args, consts, gated, dtype, key, descriptors=(), configs=None):
    """Launch with the tuned config for `key` (tuning on first use: every candidate config timed with
    run_config, unless the disk cache has the choice). Returns the config used (callers that size buffers per
    row-tile need its BLOCK_M). configs: the candidates, if not matmul_configs(gated, dtype)."""
    plan = _plans.get(key)
    if plan is not None:
        plan.launch(M, N, args, descriptors)
        return plan.cfg
    configs = configs or matmul_configs(gated, dtype)
    entry = _cache_entry(kernel, key)
    t0 = time.perf_counter()
    cfg = configs[0] if len(configs) == 1 else _cached_choice(entry, configs)
    if cfg is not None:
        try:
            plan = _plans[key] = LaunchPlan(kernel, cfg, consts, K)
            plan.launch(M, N, args, descriptors)
        except Exception:
            if len(configs) == 1:
                raise
            _plans.pop(key, None)  # a cached choice this kernel no longer compiles: tune again
            cfg = None
    if cfg is None:
        if _capturing():
            # Tuning times the candidates (do_bench synchronizes): that invalidates a CUDA graph capture, whose later
            # launches then fail with a message that names neither. Say what happened instead.
            raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} would be tuned (its candidates timed) inside "
                               f"a CUDA graph capture (key {key[:3]}): run the step once outside the capture first (on "
                               "Hopper: the ping-pong kernel declined or failed inside the capture; see its "
                               "FallbackWarning, or set FUSED_OPS_PINGPONG=0)")
        for c in configs:  # every candidate compiled first, untimed: a precompiling child may be using the GPU
            try:
                run_config(kernel, M, N, K, args, consts, c, descriptors)
            except Exception:  # (timed below as failing)
                pass
        for hook in BEFORE_TIMING:  # ...and whatever must be done before anything is timed (precompile.py)
            hook()
        times = []
        for c in configs:
            try:
                times.append(do_bench(lambda: run_config(kernel, M, N, K, args, consts, c, descriptors),
                                      warmup=5, rep=25, return_mode="median"))
            except Exception:  # e.g. a tile that needs more shared memory than this GPU has
                times.append(float("inf"))
        cfg = configs[min(range(len(configs)), key=times.__getitem__)]
        if min(times) < float("inf"):  # (if none ran, the launch below raises the error; nothing is kept)
            _remember(entry, cfg)
        plan = _plans[key] = LaunchPlan(kernel, cfg, consts, K)
        plan.launch(M, N, args, descriptors)
    TUNING_LOG.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), key, cfg,
                       time.perf_counter() - t0))
    return plan.cfg


def _capturing():
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cache_entry(kernel, key):
    """What a kept choice is valid for: this GPU model (not its index), this Triton, this kernel's source (Triton's
    hash of it and what it calls: an edited kernel is tuned again), and the tuning key."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    source = getattr(kernel, "cache_key", None) or hashlib.sha256(  # (the interpreter's kernels have no cache_key)
        inspect.getsource(getattr(kernel, "fn", kernel)).encode()).hexdigest()[:16]
    key = tuple(k.type if isinstance(k, torch.device) else k for k in key)
    return f"{gpu} | triton {triton.__version__} | {source} | {key!r}"


def _describe(cfg):
    return repr((sorted(cfg.kwargs.items()), cfg.num_warps, cfg.num_stages, getattr(cfg, "maxnreg", None)))


def _read_cache():
    try:
        with open(env.TUNING_CACHE) as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):  # none yet, unreadable or damaged: tune again (and write a new one)
        return {}


def _cached_choice(entry, configs):
    """The config an earlier run chose for this entry (_cache_entry), if it is still a candidate."""
    if env.TUNING_CACHE == "0":
        return None
    chosen = _read_cache().get(entry)
    return next((c for c in configs if chosen is not None and _describe(c) == chosen), None)


def _remember(entry, cfg):
    """Add a choice to the cache file: read again, merged, written to a temp file and renamed. A reader never sees
    half a file; processes tuning at the same moment (DDP ranks) may drop each other's new entries, which are
    then tuned again next time."""
    if env.TUNING_CACHE == "0":
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(env.TUNING_CACHE)), exist_ok=True)
        cache = {**_read_cache(), entry: _describe(cfg)}
        tmp = f"{env.TUNING_CACHE}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=0, sort_keys=True)
        os.replace(tmp, env.TUNING_CACHE)
    except OSError:  # a read-only home, a full disk: the run goes on, and tunes again next time
        pass


def tuned_config(key):
    """The config tuned for `key`, or None before its first launch."""
    plan = _plans.get(key)
    return plan.cfg if plan is not None else None
