"""
Where a training run's time goes (RunTimer): its phases (data, model), every step, evaluation and checkpoint.
Printed twice: the start-up once, after the first steady steps (issue: a faster step can still lose on the clock a
user watches, if start-up eats the gain); and at the run's end, where all of its time went.

A run pays before its steps reach their steady speed: reading or preparing the data, building the model, then
the first steps, which also compile (torch.compile, the fused MLP's Triton kernels), tune the kernels' tiles
(fused_ops/tuning.py), capture CUDA graphs and grow the allocator's pool. Those happen lazily inside the first
steps, so they are told apart by what each keeps count of: dynamo's compile timers, our tuning log; the rest
is the first steps' time beyond what steady steps take.
"""

import contextlib
import statistics
import sys
import time

from tqdm import tqdm

WARMUP_STEPS = 3  # CUDA graphs: a warm-up run, then the capture, then replays; compile's backward on the first
STEADY_STEPS = 5  # steps after the warm-up that give the steady time a step takes


class RunTimer:
    """The seconds of a run's phases, steps, evaluations and checkpoints (train.py times each and hands it here);
    device_type picks the words of the printout (no GPU words for a CPU run)."""

    def __init__(self, master, device_type):
        self.master, self.device_type, self.t0 = master, device_type, time.perf_counter()
        self.seconds = {}  # phase -> seconds (data, model, first steps, evals...); what train.main returns
        self.step_times, self.evals, self.reported = [], [], False
        self.before_steps = {}  # compile and tuning seconds spent before the first step (the first eval's)
        self.checkpoints = 0  # checkpoints written (their seconds: phase "checkpoints")

    @contextlib.contextmanager
    def phase(self, name):
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def step(self, seconds):
        """A training step's time; once the steady steps are in, the start-up breakdown is printed."""
        self.step_times.append(seconds)
        if len(self.step_times) == 1:
            self.seconds["to first step"] = time.perf_counter() - self.t0
        if len(self.step_times) == WARMUP_STEPS + STEADY_STEPS:
            self.report()

    def eval(self, seconds):
        self.evals.append(seconds)
        self.seconds["evals"] = sum(self.evals)
        if not self.step_times:  # what the eval before the first step compiled and tuned is its own
            self.before_steps = lazy_work()

    def report(self):
        """Print the breakdown once (after the steady steps, or at the end of a shorter run)."""
        if self.reported or not self.master or not self.step_times:
            return
        self.reported = True
        warm = self.step_times[:WARMUP_STEPS]
        steady = statistics.median(self.step_times[WARMUP_STEPS:] or warm[-1:])
        self.seconds["first steps"] = sum(warm)
        self.seconds["steady step"] = steady
        parts = {k: v - self.before_steps.get(k, 0.0) for k, v in lazy_work().items()}
        parts = {k: v for k, v in parts.items() if v > 0}
        self.seconds.update(parts)
        rest = sum(warm) - len(warm) * steady - sum(parts.values())
        rest_is = ("kernel compiles, CUDA graphs and allocation" if self.device_type == "cuda"
                   else "first calls and allocation")  # no GPU words for a CPU (or MPS) run
        inside = ", ".join([*(f"{k} {v:.1f} s" for k, v in parts.items()),
                            f"the rest {max(rest, 0):.1f} s for {rest_is}"])  # (no parentheses inside the parentheses)
        evals = ""
        if self.evals:
            lazy = ", ".join(f"{k} {v:.1f} s" for k, v in self.before_steps.items() if v > 0)
            evals = f"; eval {self.evals[0]:.2f} s" + (f" ({lazy})" if lazy else "")
            evals += f", then {self.evals[-1]:.2f} s" if len(self.evals) > 1 else ""
        tqdm.write(f"start-up {self.seconds['to first step']:.1f} s to the first step: data "
              f"{self.seconds.get('data', 0):.1f} s, model {self.seconds.get('model', 0):.1f} s; first "
              f"{plural(len(warm), 'step')} {sum(warm):.1f} s ({inside}); "
              f"then {steady * 1000:.1f} ms a step{evals}")  # (through tqdm: a live progress bar stays whole)


    def summary(self):
        """Where the whole run's time went, printed once at its end: the phases, the steps, evaluations and
        checkpoints, and the rest (the loop's own bookkeeping). Returns the seconds by part."""
        total = time.perf_counter() - self.t0
        parts = {"data": self.seconds.get("data", 0.0), "model": self.seconds.get("model", 0.0),
                 "steps": sum(self.step_times), "evals": sum(self.evals),
                 "checkpoints": self.seconds.get("checkpoints", 0.0)}
        parts["the rest"] = max(total - sum(parts.values()), 0.0)
        if self.master:
            median = f" (median {statistics.median(self.step_times) * 1000:.1f} ms)" if self.step_times else ""
            tqdm.write(f"run {total:.1f} s: data {parts['data']:.1f} s, model {parts['model']:.1f} s, "
                       f"{plural(len(self.step_times), 'step')} {parts['steps']:.1f} s{median}, "
                       f"{plural(len(self.evals), 'eval')} {parts['evals']:.1f} s, "
                       f"{plural(self.checkpoints, 'checkpoint')} {parts['checkpoints']:.1f} s, the rest "
                       f"{parts['the rest']:.1f} s")
        self.seconds["run"] = total
        return parts


def plural(n, word, words=None):
    """'1 step', '2 steps', '0 steps'; words where adding an s is not the plural ('processes')."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def lazy_work():
    """Seconds spent so far compiling (torch.compile) and tuning (the fused MLP's tiles): work done lazily, in
    whichever forward or step first needs it."""
    return {"compile": torch_compile_seconds() or 0.0, "kernel tuning": kernel_tuning_seconds() or 0.0}


def torch_compile_seconds():
    """Seconds torch.compile spent compiling so far in this process (dynamo's own timers: forward graphs, and
    the backward graphs it compiles on their first call); None if this torch keeps no such timers."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    return sum(sum(compilation_time_metrics.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl"))


def kernel_tuning_seconds():
    """Seconds the fused MLP spent tuning its tiles (fused_ops/tuning.py's log), if its kernels were loaded."""
    tuning = sys.modules.get("fused_ops.tuning")
    return sum(entry[-1] for entry in tuning.TUNING_LOG) if tuning is not None else None
