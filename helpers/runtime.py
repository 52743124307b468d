"""
Where and how a script runs: the device, the precision (autocast), and whether the fused MLP can run there.
train.py and sample.py ask these before any work, so a wrong setting is one line naming the flag. Then what train.py
and bench.py run a step with: the model under DDP and torch.compile (wrap_model), the steps' marks and gradients
under CUDA graphs (new_step, zero_grads), to_host, how a step's loss is read without stalling the GPU, and
clip_and_step, the clipping and the optimizer's step.
"""

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import errors, inductor_fix
import model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name, local_rank=None, arg="--device"):
    """The device to run on ("auto": cuda > mps > cpu), checked to exist here; under torchrun, one GPU a process."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"
    return errors.check_device(name, arg=arg)


def precision(dtype, device_type, auto_fp16=True):
    """(dtype name, autocast context): "auto" is bf16 on GPUs that have it, else fp16 on CUDA (auto_fp16) or
    fp32, and fp32 elsewhere. The model's weights stay fp32; autocast runs the matmuls in 16 bits."""
    if dtype == "auto":
        fallback = "float16" if auto_fp16 else "float32"
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else fallback) if device_type == "cuda" else "float32"
    autocast = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=DTYPES[dtype])
    return dtype, autocast


def check_mlp(mlp, device, source="--mlp=fused", instead="use --mlp=auto or --mlp=eager"):
    """mlp="fused" runs the Triton kernels: Triton must import, and they take CUDA tensors (or CPU ones under
    Triton's interpreter, TRITON_INTERPRET=1 set before Triton is imported). Otherwise one line naming --mlp,
    before any work; source says where the setting came from (the command line, or a checkpoint)."""
    if mlp != "fused":
        return
    try:
        fused_ops = model.import_fused_ops(required=True)
    except ImportError as e:
        raise errors.UsageError(f"{source} needs Triton, which cannot be imported here ({e.__cause__ or e}): "
                                f"{instead} (or install triton)") from None
    if not (device.startswith("cuda") or (device == "cpu" and fused_ops.kernels_can_run(torch.empty(0)))):
        raise errors.UsageError(f"{source} runs Triton kernels, which need a CUDA GPU (or TRITON_INTERPRET=1 on the "
                                f"CPU, very slow), and the device is {device}: {instead}")


def check_fp8(fp8, device, dtype=None, setting="--fp8=True", instead="use --fp8=False"):
    """fp8=True needs FP8 tensor cores (fused_ops/fp8.py) and 16-bit activations (dtype: the resolved --dtype, as
    precision() names it): one line naming the requirement where either is missing."""
    if not fp8:
        return
    try:
        model.import_fused_ops(required=True).check_fp8_device(torch.device(device), setting, instead)
    except ImportError as e:
        raise errors.UsageError(f"{setting} needs Triton, which cannot be imported here ({e.__cause__ or e}): "
                                f"{instead}") from None
    except RuntimeError as e:
        raise errors.UsageError(str(e)) from None
    if dtype == "float32":
        raise errors.UsageError(f"{setting} needs 16-bit activations (its GEMMs take bf16 or fp16 inputs under "
                                "autocast), and the dtype is float32: use --dtype=bfloat16 or --dtype=float16")


def check_interpreter_dtype(mlp, device, dtype, setting=None):
    """Triton's interpreter (the fused MLP on a CPU) computes bf16 matmuls wrong (fp16 and fp32 right): where the
    kernels would run there in bf16 (mlp "fused", or "auto", which takes them wherever they can run), one line
    naming --dtype instead of wrong numbers (setting: how the caller's user chose mlp, default --mlp=<mlp>)."""
    if mlp in ("fused", "auto") and device == "cpu" and dtype == "bfloat16":
        fused_ops = model.import_fused_ops(required=False)
        if fused_ops is not None and fused_ops.kernels_can_run(torch.empty(0)):
            raise errors.UsageError(f"{setting or f'--mlp={mlp}'} with --dtype=bfloat16 on the CPU runs the kernels "
                                    "through Triton's interpreter, whose bf16 matmuls are wrong: use --dtype=float16 "
                                    "or float32")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the torch.compile modes that add CUDA graphs


# DDP's gradient bucket size: GPT-2 124M on 4 H100s kept 95.0% of the 1-GPU rate per GPU with 100 MB against 92.2% with
# DDP's default 25 MB (fewer graph pieces; results/several_gpus_h100.txt)
BUCKET_MB = 100


def wrap_model(model, compile, world, device_type, bucket_cap_mb=BUCKET_MB, regions=False):
    """The model a training step runs: DDP-wrapped when world > 1, then compiled as asked (compile: False, True or a
    torch.compile mode). DDP goes inside torch.compile, so that compile splits the graph at DDP's gradient buckets
    and each bucket's all-reduce can run while the backward computes the next (docs/performance.md); CUDA-graph modes
    then graph each piece. No buffer broadcast: the only buffers are the FP8 MLP's scales, which each process keeps
    for itself (docs/numerics.md). bucket_cap_mb: DDP's gradient bucket size (docs/performance.md).
    regions: compile the model's blocks and output apart (compile_regions: a shorter start), DDP around them."""
    if compile and regions:
        compile_regions(model, compile)
    if world > 1:
        # (torch 2.13 renamed broadcast_buffers; a sync at start-up is harmless: every process starts uncalibrated)
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
        model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None,
                    gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb, **{no_sync: False})
    if compile and not regions:
        inductor_fix.apply()  # (a race in some of Inductor's LayerNorm kernels above width 1024)
        cache_autograd_functions()
        model = torch.compile(model, mode=None if compile in (True, "default") else compile)
    return model


# Every FP8State's number, as Dynamo names the attribute in a block's forward (a regular expression it matches from
# the start of the name): L['self']._modules['attn']._modules['fp8']._modules['0'].number, ...mlp.path.state.number
FP8_STATE_NUMBER = r".*\.number$"


def compile_regions(model, compile):
    """Regional compilation, in place: each block of a GPT and its output (GPT.output) compiled apart, the rest
    (the embeddings, the loop over blocks) left eager. The blocks share one forward, so torch.compile traces and
    Inductor compiles one block and the others reuse its code: the cold start's compile shrinks by about the number of
    blocks (docs/performance.md, start-up). What it gives up: fusion across a block's edge (the residual add that
    ends one block and the LayerNorm that starts the next are two kernels), and under CUDA graphs one graph a block.
    FP8State.number (the FP8 layers' operators find their state by it) differs between blocks: as a plain int
    attribute of a module torch.compile would specialize on it and compile every block again. It is named a dynamic
    source, so the first block's graph already takes it as a symbol and the others reuse that graph. Module ints are
    also let become dynamic (measured with that on torch 2.11); alone, that waits until an int has changed, and the
    second block compiled again."""
    import torch._dynamo.config as dynamo_config
    inductor_fix.apply()
    cache_autograd_functions()
    dynamo_config.allow_unspec_int_on_nn_module = True
    sources = torch.compiler.config.dynamic_sources  # (comma-separated; a user's own entries are kept)
    if FP8_STATE_NUMBER not in sources.split(","):
        torch.compiler.config.dynamic_sources = ",".join(filter(None, (sources, FP8_STATE_NUMBER)))
    mode = None if compile in (True, "default") else compile
    for block in model.transformer.h:
        block.compile(mode=mode)
    model.output = torch.compile(model.output, mode=mode)


def cache_autograd_functions():
    """Let AOTAutograd's disk cache keep graphs that hold an autograd.Function (the fused classifier's, the FP8
    layers'): by default it bypasses them, and every run with warm caches traced and partitioned the joint graph
    again (13 s of the fastest setting's warm start against 1.5 s for eager + compile: docs/performance.md,
    start-up). Dynamo traces each Function's forward and backward into the graph the cache key hashes, so a changed
    Function is a cache miss, not a stale hit (tests/test_compile.py). A torch without the switch keeps its default."""
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True


def new_step(compile):
    """Under CUDA graphs a new run of the model may overwrite the last one's outputs: say so before each forward
    (the losses read from a run are used before the next one starts)."""
    if compile in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def zero_grads(model, optimizer, compile, micro_steps=1, world=1):
    """Clear the gradients before an optimizer step's micro-steps (micro_steps of them, in a process of world). A
    gradient that a CUDA graph's backward hands out becomes .grad where it lies, in the graph's memory. With one
    micro-step in one process that is where the optimizer reads it, before the next step's replay: dropped (set to
    None), as without graphs. With several micro-steps the next one's replay would overwrite it, and under DDP the
    gradients are views of its buckets: they stay allocated and are zeroed in place (allocated before the first
    step), and each backward adds into them: a zeroing and an accumulation pass over every gradient a step."""
    if compile not in CUDA_GRAPH_MODES or (micro_steps == 1 and world == 1):
        return optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.zero_grad(set_to_none=False)


def to_host(t):
    """A function returning float(t): on CUDA, t as it is now, its copy to the host queued now (non-blocking, into
    pinned memory, an event behind it), so that the function waits for that event only. train.py asks for the loss
    before it queues the backward, so reading it waits for the forward: the GPU runs the backward while the host
    queues the optimizer step and the next forward, instead of idling between steps (float() after the backward
    queues its copy behind it, and waits for it). Elsewhere float(t) when called."""
    if not t.is_cuda:
        return lambda: float(t)
    host, done = t.to("cpu", non_blocking=True), torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))  # t's device: not always the current one (--device=cuda:1)
    return lambda: (done.synchronize(), float(host))[1]


def clip_and_step(optimizer, parameters, max_norm, scaler):
    """Scale the gradients so that their global norm is at most max_norm (if max_norm > 0; clip_grad_norm_'s rule),
    then the optimizer's step. PyTorch's fused AdamW divides every gradient by a tensor, grad_scale, in the pass
    that reads them for the update (GradScaler hands it the loss scale so): the clipping's factor rides in it, instead
    of a pass of its own that reads and writes every gradient (0.5 GB each way at GPT-2 small's size); so does
    fused_ops.FusedAdamW (model.configure_optimizers' on a GPU), which leaves .grad unclipped (PyTorch's leaves the
    clipped gradients, as after clip_grad_norm_). With a loss scale (fp16) or another optimizer, as
    nanoGPT: unscale, clip_grad_norm_, step."""
    parameters = [p for p in parameters if p.grad is not None]
    fused = getattr(optimizer, "folds_grad_scale", False) or (  # fused_ops.FusedAdamW, or PyTorch's fused AdamW
        isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam))  # (each group: a resumed one keeps the saved flag)
        and all(group.get("fused") for group in optimizer.param_groups))
    if max_norm > 0 and fused and not scaler.is_enabled():
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # 1 / clip_grad_norm_'s factor
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    if max_norm > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    scaler.step(optimizer)
    scaler.update()
