"""
How a training run ends early, each way in one line that says what was kept and what to do next:

- Ctrl-C or SIGTERM: the first asks the run to stop at the end of its step and save a checkpoint, then prints
  the command that resumes it; a second one quits at once (the last checkpoint is kept whole).
- a loss that becomes NaN or inf: stop before it reaches the weights, without saving over a good checkpoint; where
  a token id outside the vocabulary made it so, say that instead (check_tokens).
- out of memory: which settings lower the memory a step needs.

Under torchrun each process gets Ctrl-C twice, from the terminal and forwarded by torchrun (which then waits its
--shutdown_timeout before killing): signals within `grace` seconds of the first count as that one.
"""

import contextlib
import os
import shlex
import shutil
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from helpers import checkpoint, errors


class TrainingDiverged(errors.RunError):
    """The loss became NaN or inf; nothing was saved after the last good checkpoint."""


_GROUPS = {}


def agreement_group():
    """A process group for CPU tensors: the default one where it is Gloo, else a Gloo group over the same processes
    (made once, on the first call, which every process makes at the same point of the loop)."""
    if dist.get_backend() == "gloo":
        return None
    if _GROUPS.get("world") is not dist.group.WORLD:  # none yet, or one of an earlier (destroyed) default group
        _GROUPS.update(world=dist.group.WORLD, gloo=dist.new_group(backend="gloo"))
    return _GROUPS["gloo"]


def check_tokens(batches, world):
    """Where the loss is NaN: the batch of a token id out of the vocabulary, if any process drew one, as the one-line
    error naming the file (every process raises it; rank 0 prints it). In one process Batches raised it already;
    under torchrun the process that drew it trained that batch with every target ignored, whose NaN loss brought
    every process here (helpers/data.Batches)."""
    found = [batches.bad_tokens]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, batches.bad_tokens, group=agreement_group())
    message = next(filter(None, found), None)
    if message:
        raise errors.UsageError(message)


class StopOnSignal:
    """While active, the first SIGINT or SIGTERM only records itself in .signum; a second one raises
    KeyboardInterrupt at once (a checkpoint write it cuts short leaves the previous checkpoint whole)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, master, grace=0.0):
        self.master, self.grace, self.signum, self.first_at, self.previous = master, grace, None, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def requested(self):
        """The signal that asks this run to stop, once any process has received one (all processes agree:
        under torchrun one all_reduce, so that they all stop at the same step), else None. The agreement runs on
        the CPU (agreement_group): over NCCL, reading the flag back would wait for the GPU to finish the step
        queued before it, idling the GPU while the host queues the next one (and hiding that step's last backward
        from the step time train.py reports; docs/performance.md#several-gpus)."""
        signum = self.signum or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor(signum)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=agreement_group())
            signum = int(flag)
        return signal.Signals(signum) if signum else None

    def handle(self, signum, frame):
        # Messages go straight to file descriptor 2: print() here could interrupt a write to sys.stderr in
        # progress (tqdm's) and fail with "reentrant call".
        if self.signum is not None:
            if time.monotonic() - self.first_at < self.grace:
                return
            self.say(f"train.py: {signal.Signals(signum).name} again: quitting now, without saving; the last "
                     "checkpoint is kept\n")
            raise KeyboardInterrupt
        self.first_at = time.monotonic()  # before signum: a second signal arriving between them reads it
        self.signum = signum
        self.say(f"\ntrain.py: {signal.Signals(signum).name}: stopping after this step to save a checkpoint "
                 "(Ctrl-C again to quit at once)\n")

    def say(self, text):
        if self.master:
            with contextlib.suppress(OSError):
                os.write(2, text.encode())


def resume_command(argv, world):
    """This run's command line with --init_from=resume (the checkpoint holds the rest of the settings)."""
    args = [a for a in argv if a[2:].partition("=")[0].replace("-", "_") != "init_from"]
    launcher = [python_command()] if world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
    return shlex.join([*launcher, "train.py", *args, "--init_from=resume"])


def python_command():
    """"python" when that is the interpreter running now (found first on PATH), else this interpreter's path."""
    found, here = shutil.which("python"), sys.executable
    if found and os.path.basename(here).startswith("python") and os.path.dirname(os.path.abspath(found)) == \
            os.path.dirname(os.path.abspath(here)):
        with contextlib.suppress(OSError):
            if os.path.samefile(found, here):
                return "python"
    return here


def stopped_by_signal(cfg, progress, signum, argv, world, save, master):
    """Save where the loop is (between two steps) and say how to continue. With always_save_checkpoint=False
    ckpt.pt may hold the best model so far: it is kept as ckpt_best.pt first."""
    if progress.saved_by_eval:
        checkpoint.keep_best(cfg, master)
    save(evaluated=False)
    best, best_path = "", checkpoint.best_path(cfg["out_dir"])
    if not cfg["always_save_checkpoint"] and os.path.isfile(best_path):
        best = f" (the best checkpoint, val loss {progress.best_val:.4f}, is kept as {best_path})"
    return errors.Stopped(signum, f"stopped by {signum.name} at iter {progress.iter_num}; checkpoint written to "
                                  f"{checkpoint.path(cfg['out_dir'])}{best}. Resume with:\n  "
                                  f"{resume_command(argv, world)}")


def diverged(cfg, progress, what, value, lr, dtype):
    """The error for a NaN/inf loss: where, what was kept, what to change."""
    kept = (f"the last good checkpoint ({checkpoint.path(cfg['out_dir'])}, iter {progress.last_saved}) is kept"
            if progress.last_saved is not None else "no checkpoint was written")
    tips = [f"a lower learning_rate (now {cfg['learning_rate']:g})", "more warmup_iters"]
    tips += ["grad_clip=1.0"] if cfg["grad_clip"] <= 0 else []
    tips += ["dtype=bfloat16 or float32"] if dtype == "float16" else []
    return TrainingDiverged(f"{what} became {value} at iter {progress.iter_num} (lr {lr:.3g}); training stopped "
                            f"without saving, and {kept}. Try {', '.join(tips)}.")


def out_of_memory(cfg, device, e):
    """The error for torch.OutOfMemoryError: which settings lower the memory a step needs."""
    path = checkpoint.path(cfg["out_dir"])
    kept = f"; {path} is kept as it was" if os.path.isfile(path) else ""
    compile_tip = ", compile=True (fuses away some activations)" if not cfg["compile"] else ""
    if not cfg["compile"] and cfg.get("mlp") != "eager":  # fused_ops/graphs.py's buffers (FP8's graphs too)
        compile_tip += ", FUSED_OPS_GRAPHS=0 in the environment (the fused MLP's CUDA graphs keep memory)"
    return errors.RunError(
        f"out of memory on {device} ({str(e).splitlines()[0][:120]}): lower batch_size (now {cfg['batch_size']}; "
        f"raise gradient_accumulation_steps, now {cfg['gradient_accumulation_steps']}, to keep the tokens per "
        f"step), or block_size (now {cfg['block_size']}), or the model (n_layer, n_embd){compile_tip}{kept}")
