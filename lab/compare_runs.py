"""Print the eval losses of two or more training runs side by side (from their out_dir/log.jsonl), then each run's
median logged step time and its mean training loss over the last 100 logged steps.

    python lab/compare_runs.py out-a out-b
"""

import json
import os
import statistics
import sys


def records(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def evals(out_dir):
    return {r["iter"]: r["val_loss"] for r in records(out_dir) if r.get("type") == "eval"}


if __name__ == "__main__":
    runs = {d: evals(d) for d in sys.argv[1:]}
    iters = sorted(set().union(*runs.values()))
    print("iter " + " ".join(f"{os.path.basename(d.rstrip('/')):>12}" for d in runs) + "  max diff")
    for it in iters:
        vals = [runs[d].get(it) for d in runs]
        known = [v for v in vals if v is not None]
        diff = max(known) - min(known) if len(known) > 1 else float("nan")
        print(f"{it:4d} " + " ".join(f"{v:12.4f}" if v is not None else f"{'-':>12}" for v in vals) + f"  {diff:8.4f}")
    print(f"{'run':<28}{'median ms/step':>15}{'last-100 loss':>14}")
    for d in runs:
        steps = [r for r in records(d) if r.get("type") == "step"]
        ms = statistics.median(r["ms"] for r in steps[len(steps) // 5:])  # (past the first fifth: compile, capture)
        print(f"{os.path.basename(d.rstrip('/')):<28}{ms:15.2f}{statistics.fmean(r['loss'] for r in steps[-100:]):14.4f}")
