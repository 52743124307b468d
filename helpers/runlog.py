"""
What a run records: out_dir/log.jsonl (one JSON record per eval and logged step, appended and closed each
time, so it survives any crash), out_dir/loss.png at the end, and Weights & Biases when wandb_log is on.
Only rank 0 writes.
"""

import contextlib
import importlib.util
import json
import os

from helpers import errors

WANDB_HINT = "pip install wandb (then wandb login, or WANDB_MODE=offline)"


def check_wandb(cfg):
    """wandb_log=True needs the wandb package: say so before any work."""
    if cfg["wandb_log"] and importlib.util.find_spec("wandb") is None:
        raise errors.UsageError(f"wandb_log=True needs the wandb package, which is not installed: {WANDB_HINT}, "
                                "or leave wandb_log=False")


class RunLog:
    """log.jsonl, and the same records sent to wandb (nanoGPT's keys: iter, train/loss, val/loss, lr, mfu)."""

    def __init__(self, out_dir, master, resumed_at, cfg):
        self.path, self.master, self.wandb = os.path.join(out_dir, "log.jsonl"), master, None
        if not master:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._cut_back(resumed_at)
        if cfg["wandb_log"]:
            import wandb  # only when asked for: it is not in requirements.txt

            try:
                self.wandb = wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)
            except Exception as e:  # not logged in, no network: wandb's own errors, many kinds
                raise errors.UsageError(f"wandb_log=True, but wandb.init failed ({str(e).strip()[:200]}): wandb login, "
                                        "or WANDB_MODE=offline, or wandb_log=False") from e

    def _cut_back(self, resumed_at):
        """A fresh log for a new run; on resume, drop what a crashed run logged after its checkpoint."""
        records = []
        if resumed_at is not None and os.path.exists(self.path):
            with open(self.path) as f:
                records = [json.loads(line) for line in f if line.strip()]
            records = [r for r in records if r["iter"] < resumed_at or (r["iter"] == resumed_at and r["type"] == "eval")]
        tmp = f"{self.path}.tmp{os.getpid()}"  # the old log stays whole until the new one is written
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(tmp, self.path)

    def write(self, record):
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None and record["type"] != "run":
            self.wandb.log(wandb_record(record), step=record["iter"])

    def close(self, failed=False):
        """Mark the wandb run finished, or failed (a stop, a NaN, an error)."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
            self.wandb = None


@contextlib.contextmanager
def closing(log):
    """log.close() however the block ends: a wandb run is never left open (nor reused by a later one)."""
    try:
        yield log
    except BaseException:
        log.close(failed=True)
        raise
    log.close()


def wandb_record(record):
    """A log.jsonl record under nanoGPT's wandb names (the per-step loss as train/step_loss)."""
    names = {"train_loss": "train/loss", "val_loss": "val/loss", "loss": "train/step_loss"}
    return {names.get(k, k): v for k, v in record.items() if k != "type" and v is not None}


def plot_losses(log_path, png_path):
    from matplotlib.figure import Figure  # no pyplot: no global figures, no GUI backend (Agg is used for PNG)

    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [(r["iter"], r["loss"]) for r in records if r["type"] == "step"]
    evals = [(r["iter"], r["train_loss"], r["val_loss"]) for r in records if r["type"] == "eval"]
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    if steps:
        ax.plot(*zip(*steps), alpha=0.35, lw=0.8, label="train (per step)")
    if evals:
        it, tr, va = zip(*evals)
        ax.plot(it, tr, "o-", label="train (eval)")
        ax.plot(it, va, "s-", label="val (eval)")
    ax.set(xlabel="iteration", ylabel="loss", title=os.path.dirname(os.path.abspath(png_path)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
