"""Does the GPU idle between train.py's steps? train.py reads each step's loss on the host (a NaN must stop the
run before the optimizer step). Read after the backward, as train.py did until 2026-11-26, the host waits for the
whole step and the GPU then waits for the host to queue the clip, the optimizer and the next forward. Copied to
the host before the backward is queued (runtime.to_host, train.train_step now), the read waits for the forward only
and the GPU runs the backward meanwhile.

Both orders, on configs/shakespeare_char.py's model (CUDA graphs, as the config runs), fused and eager MLP, in
one process: rounds of --steps steps, the four variants alternated and reversed every other round; ms per step
is the wall time of a round over its steps (host included, synchronized at the round's ends only).

    PYTHONPATH=. python lab/startup/step_overlap.py [--rounds 6 --steps 200 --compile reduce-overhead]
"""

import argparse
import contextlib
import statistics
import time

import torch

from helpers import data
from helpers import prepare_data
from helpers import runtime
import train
from model import GPT, GPTConfig


def train_step_read_after_backward(*args):
    """train.train_step with the loss read as before 2026-11-26: float() when it is read, after the backward is
    queued, so the read waits for the backward (the only difference between the two variants)."""
    to_host = runtime.to_host
    runtime.to_host = lambda t: (lambda: float(t))
    try:
        return train.train_step(*args)
    finally:
        runtime.to_host = to_host


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compile", default="reduce-overhead")
    args = p.parse_args()
    cfg = {**train.DEFAULTS, "grad_clip": 1.0, "compile": args.compile}
    data_dir = prepare_data.ensure_dataset("shakespeare_char")
    meta = data.load_meta(data_dir)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    torch.backends.cuda.matmul.allow_tf32 = True
    steps = {"after forward (now)": train.train_step, "after backward (before)": train_step_read_after_backward}
    variants = []
    for mlp in ("fused", "eager"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, bias=False,
                              vocab_size=meta["vocab_size"], mlp=mlp)).cuda()
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cuda")
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        compiled = torch.compile(model, mode=None if args.compile == "True" else args.compile)
        batches = data.Batches(data_dir, 64, 256, "cuda", seed=1)
        for name, fn in steps.items():
            variants.append((f"{mlp:5s} read {name}", lambda fn=fn, m=compiled, o=opt, s=scaler, b=batches:
                             fn(m, b, o, s, cfg, autocast, 1, 1), []))
    with torch.autograd.set_multithreading_enabled(False):  # as train.py runs one GPU
        for _, step, _ in variants:  # warm-up: compile, capture
            for _ in range(10):
                step()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            for name, step, times in (variants if r % 2 == 0 else variants[::-1]):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / args.steps * 1e3)
    print(torch.cuda.get_device_name(), torch.__version__, f"compile={args.compile}")
    print(f"{'variant':40s} ms/step median (min-max) of {args.rounds} rounds of {args.steps} steps")
    for name, _, times in variants:
        print(f"{name:40s} {statistics.median(times):6.2f} ({min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
