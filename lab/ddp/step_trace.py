"""Probe: does train.py's step under torchrun do the work one GPU does? One process or several
(torchrun), GPT-2 124M at 12x1024, train.train_step itself (the loop's step, not bench.py's), random tokens.

Per step: the host time train.py reports (dt), the GPU time between CUDA events recorded at each micro-step's start
(runtime.new_step) and after the step, and, for one traced step on rank 0, the summed kernel time by kind
(NCCL apart) and the kernel count. Ends with the gradient norm of 4 fixed micro-batches split over the
processes, at lr 0 (3 times): the same on any world size if every micro-batch's backward reached .grad.

    torchrun --standalone --nproc_per_node=2 lab/ddp/step_trace.py --compile=reduce-overhead --accum=2 [--fp8]
"""

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

import train
from helpers import runtime
from model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--compile", default="reduce-overhead")
p.add_argument("--accum", type=int, default=2)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--fp8", action="store_true")
p.add_argument("--multithreading", default="auto", help="auto (train.py's choice), on or off")
args = p.parse_args()
compile = {"True": True, "False": False}.get(args.compile, args.compile)

ddp = "RANK" in os.environ
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
torch.cuda.set_device(device)
if ddp:
    dist.init_process_group("nccl")
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
torch.manual_seed(0)
raw = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False,
                    dropout=0.0, mlp="fused", fp8=args.fp8)).to(device)
model = runtime.wrap_model(raw, compile, world, "cuda")
optimizer = raw.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
scaler = torch.amp.GradScaler("cuda", enabled=False)
autocast = torch.autocast("cuda", dtype=torch.bfloat16)
cfg = {"compile": compile, "grad_clip": 1.0}


class RandomBatches:
    """Random micro-batches; with check_accum, the fixed ones of a 4-micro-batch step split over the processes
    (process r takes r * check_accum ...), the same whatever the world size."""

    def __init__(self, seed, check_accum=None):
        self.gen, self.check_accum, self.count = torch.Generator().manual_seed(seed), check_accum, 0

    def next(self):
        if self.check_accum:
            self.gen.manual_seed(rank * self.check_accum + self.count % self.check_accum)
            self.count += 1
        xy = torch.randint(0, 50257, (2, 12, 1024), generator=self.gen).pin_memory().to(device, non_blocking=True)
        return xy[0], xy[1]

    def prefetch(self):
        pass


marks = []  # CUDA events at each micro-step's start (train_step calls runtime.new_step there)
new_step = runtime.new_step


def marked_new_step(c):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    marks.append(e)
    new_step(c)


runtime.new_step = marked_new_step
batches = RandomBatches(1 + rank)
multithreading = {"auto": ddp, "on": True, "off": False}[args.multithreading]
rows = []
with torch.autograd.set_multithreading_enabled(multithreading):
    for i in range(args.steps):
        marks.clear()
        t0 = time.perf_counter()
        train.train_step(model, batches, optimizer, scaler, cfg, autocast, args.accum, world)
        dt = time.perf_counter() - t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
        micro = [a.elapsed_time(b) for a, b in zip(marks, marks[1:] + [end])]
        rows.append((dt * 1e3, sum(micro), micro))
    # one traced step: kernel time by kind on this rank
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train.train_step(model, batches, optimizer, scaler, cfg, autocast, args.accum, world)
        torch.cuda.synchronize()
    kinds, count = collections.Counter(), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = "nccl" if "nccl" in e.name.lower() else "compute"
            kinds[k] += e.device_time / 1e3
            count += k == "compute"
    # the gradient of fixed micro-batches at lr 0: the same on any world size if every backward ran
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    cfg["grad_clip"] = 0.0
    batches = RandomBatches(0, check_accum=4 // world)
    norms = []
    for _ in range(3):
        train.train_step(model, batches, optimizer, scaler, cfg, autocast, 4 // world, world)
        norms.append(float(torch.cat([p.grad.reshape(-1) for p in raw.parameters()]).norm()))

if rank == 0:
    steady = rows[4:]
    med = lambda xs: statistics.median(xs)
    micro_med = [med([r[2][j] for r in steady]) for j in range(args.accum)]
    print(f"RESULT world={world} compile={args.compile} accum={args.accum} fp8={args.fp8} mt={multithreading}: "
          f"host dt {med([r[0] for r in steady]):.1f} ms, GPU events {med([r[1] for r in steady]):.1f} ms, "
          f"per micro-step {' / '.join(f'{m:.1f}' for m in micro_med)} ms; traced step: compute kernels "
          f"{kinds['compute']:.1f} ms ({count} kernels), nccl {kinds['nccl']:.1f} ms; grad norms at lr 0 "
          f"{' '.join(f'{n:.4f}' for n in norms)}", flush=True)
if ddp:
    dist.destroy_process_group()
