"""Probe: does train.py's reported step time equal the GPU's? Runs train.main (one process or under
torchrun) and puts a CUDA event at each train_step's start; the GPU's time per step is the median interval between
consecutive events, train.py's is the median dt it reports (report_step). --old_stop puts back the stop-signal
agreement of before the fix (an all_reduce over NCCL read back with int(), which waited for the GPU).

    torchrun --standalone --nproc_per_node=2 lab/ddp/train_timing.py [--old_stop] configs/gpt2_124m.py --key=value...
"""

import os
import signal
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

import train
from helpers import stopping

argv = sys.argv[1:]
old_stop = "--old_stop" in argv
argv = [a for a in argv if a != "--old_stop"]
events, dts = [], []
step, report = train.train_step, train.report_step


def timed_step(*args):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    events.append(e)
    return step(*args)


def recorded_report(log, bar, cfg, it, lossf, lr, dt, *rest):
    dts.append(dt * 1e3)
    return report(log, bar, cfg, it, lossf, lr, dt, *rest)


def requested_before_the_fix(self):
    signum = self.signum or 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor(signum, device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag)
    return signal.Signals(signum) if signum else None


train.train_step, train.report_step = timed_step, recorded_report
if old_stop:
    stopping.StopOnSignal.requested = requested_before_the_fix
train.main(argv)
torch.cuda.synchronize()
if int(os.environ.get("RANK", 0)) == 0:
    gpu = [a.elapsed_time(b) for a, b in zip(events, events[1:])][5:-1]  # (the last interval holds the final eval)
    world = int(os.environ.get("WORLD_SIZE", 1))
    print(f"RESULT world={world} old_stop={old_stop} {' '.join(argv[1:])}: train.py median step "
          f"{statistics.median(dts[5:]):.1f} ms, GPU (events between step starts) {statistics.median(gpu):.1f} ms",
          flush=True)
