"""train.py's optimizer step (train.train_step) under DDP, checked against one process: the worker that
tests/test_ddp_steps.py runs in 2 processes (Gloo on the CPU, NCCL on 2 GPUs).

Every process takes train_step as train.py runs it: the model wrapped by runtime.wrap_model (DDP inside
torch.compile), `accum` micro-steps each, no_sync on all but the last, the loss all-reduced before the last backward.
The micro-batches are fixed: step s has world * accum of them, and process r takes r * accum ... r * accum + accum - 1,
so one process that accumulates all of them computes the same gradient. Two checks:

- gradients: with the learning rate 0 (AdamW then leaves the weights as they are), each step's .grad after
  train_step, against one process's float64 accumulation of the same micro-batches. The rule is the repo's: the error
  at most twice that of one uncompiled process accumulating in the same dtype, plus a small epsilon. A skipped
  backward, a micro-batch counted twice or one lost, or a gradient that is one micro-batch's alone, is off by a
  large fraction of the gradient and fails it.
- parameters: after optimizer steps with a real learning rate and gradient clipping, every process's parameters
  are bit-for-bit equal.
"""

import contextlib
import os
import signal

import torch
import torch.distributed as dist

import train
from fused_ops.adamw import FusedAdamW
from helpers import runtime, stopping
from model import GPT, GPTConfig
from tests import fast_interpreter

VOCAB = 96
# (layers, sequence length, micro-batch size) by device type: on the CPU 2 layers (1.6 MB of float32 parameters:
# still 2 DDP buckets of 1 MB) and micro-batches of 16 x 2, where the interpreter runs the fused classifier one
# program per row
SHAPE = {"cuda": (4, 32, 4), "cpu": (2, 16, 2)}
# Steps checked at lr 0: on GPUs 4 (under CUDA graphs a warm-up run, the capture, then replays), on the CPU 2 (the
# second shows that the first step's gradients were cleared; no graphs there)
GRAD_STEPS = {"cuda": 4, "cpu": 2}


def model_config(mlp, fp8=False, device="cuda"):
    """mlp as bench.py names variants: "eager", "fused", with "+cls" the fused classifier, "+cls8" its FP8 form;
    fp8: False, True (the MLP in FP8) or "blocks" (fp8_reach="blocks": the attention's projections too)."""
    mlp, cls, eight = mlp.partition("+cls")
    layers, t, _ = SHAPE[device.split(":")[0]]
    return GPTConfig(block_size=t, vocab_size=VOCAB, n_layer=layers, n_head=4, n_embd=128, mlp=mlp, fp8=bool(fp8),
                     fp8_reach="blocks" if fp8 == "blocks" else "mlp", dropout=0.0, bias=True,
                     classifier="fp8" if eight == "8" else "fused" if cls else "eager")


def micro_batch(step, index, device):
    g = torch.Generator().manual_seed(1000 * step + index)
    _, t, batch = SHAPE[device.split(":")[0]]
    xy = torch.randint(0, VOCAB, (batch, t + 1), generator=g)
    return xy[:, :-1].contiguous().to(device), xy[:, 1:].contiguous().to(device)


class FixedBatches:
    """Batches-like (next, prefetch): this process's share of each step's fixed micro-batches, in order."""

    def __init__(self, rank, accum, device):
        self.rank, self.accum, self.device, self.count = rank, accum, device, 0

    def next(self):
        step, micro = divmod(self.count, self.accum)
        self.count += 1
        return micro_batch(step, self.rank * self.accum + micro, self.device)

    def prefetch(self):
        pass


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])


def reference_grads(step, micro_batches, device, dtype, mlp="eager", fp8=False):
    """One uncompiled process's gradient of step's micro-batches (all of them, each loss / their count): dtype
    float64 (the reference) or float32 runs the model in that dtype, a 16-bit one under autocast."""
    torch.manual_seed(0)
    model = GPT(model_config(mlp, fp8, device)).to(device, dtype=torch.float64 if dtype == torch.float64 else None)
    device_type = device.split(":")[0]
    wide = dtype in (torch.float64, torch.float32)
    for i in range(micro_batches):
        x, y = micro_batch(step, i, device)
        with contextlib.nullcontext() if wide else torch.autocast(device_type, dtype=dtype):
            loss = model(x, y)[1] / micro_batches
        loss.backward()
    return flat_grads(model)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def run_steps(rank, world, device, compile, accum, mlp, fp8, dtype):
    """(this process's flat gradient after each of GRAD_STEPS' steps at lr 0, its flat parameters after 3 more steps
    at a real learning rate), train.py's step under DDP."""
    torch.manual_seed(0)
    raw = GPT(model_config(mlp, fp8, device)).to(device)
    device_type = device.split(":")[0]
    torch._dynamo.reset()
    regions = isinstance(compile, str) and compile.startswith("regions:")  # "regions:reduce-overhead": compile_regions
    if regions:
        compile = compile.removeprefix("regions:")
        compile = True if compile == "True" else compile
    if compile == "aot_eager":  # the CPU's stand-in for inductor: DDP split at its buckets, no kernels compiled
        model = torch.compile(runtime.wrap_model(raw, False, world, device_type, bucket_cap_mb=1), backend=compile)
    else:
        model = runtime.wrap_model(raw, compile, world, device_type, bucket_cap_mb=1, regions=regions)  # several buckets (1 MB: the least DDPOptimizer takes)
    optimizer = raw.configure_optimizers(0.1, 0.0, (0.9, 0.95), device_type)
    if device_type == "cpu":  # the GPUs' optimizer here too (FusedAdamW, through the interpreter): the clipped steps
        # below hand it grad_scale, and under DDP its gradients are views of the buckets
        optimizer = FusedAdamW([{"params": g["params"], "weight_decay": g["weight_decay"]}
                                for g in optimizer.param_groups], lr=0.0, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler(device_type, enabled=False)
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    cfg = {"compile": compile, "grad_clip": 0.0}
    batches = FixedBatches(rank, accum, device)
    grads = []
    for _ in range(GRAD_STEPS[device_type]):
        train.train_step(model, batches, optimizer, scaler, cfg, autocast, accum, world)
        grads.append(flat_grads(raw).cpu())
    cfg["grad_clip"] = 1.0
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    for _ in range(3):
        train.train_step(model, batches, optimizer, scaler, cfg, autocast, accum, world)
    params = torch.cat([p.detach().reshape(-1) for p in raw.parameters()]).cpu()
    return grads, params


def stop_agreement(rank, device):
    """(the signal StopOnSignal.requested agrees on when only process 1 got SIGTERM, whether the GPU was still busy
    after it): the agreement must not wait for the GPU's queued work (on the CPU: None for busy)."""
    with stopping.StopOnSignal(master=False) as stop:
        stop.signum = signal.SIGTERM if rank == 1 else None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued ahead of the agreement
        agreed = stop.requested()
        busy = not torch.cuda.current_stream().query() if device.startswith("cuda") else None
    return int(agreed or 0), busy


def worker(rank, world, port, backend, cases, out):
    """Runs every case (compile, accum, mlp, fp8) in this process and saves what run_steps returned for each, and
    what stop_agreement returned under "stop"."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    fast_interpreter.patch_once_a_launch()  # (a spawned process does not load conftest.py)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if backend == "nccl" else torch.float32
    try:
        with torch.autograd.set_multithreading_enabled(True):  # as train.main under DDP
            results = {case: run_steps(rank, world, device, *case, dtype) for case in cases}
        results["stop"] = stop_agreement(rank, device)
        torch.save(results, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()
