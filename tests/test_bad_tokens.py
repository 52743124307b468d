"""A token id at or above meta.json's vocab_size (helpers/data.Batches checks every batch on the host) stops train.py
with one line naming the file, the id and the vocabulary size, and exit status 2, where it crashed in the embedding
(IndexError on the CPU, a device-side assert on a GPU): in train.bin or val.bin, found in an eval or a training
step, eager and (in train.bin) fused classifier, one process and two under torchrun (where only one process draws the
bad id, the others must stop too, not hang in the next collective)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fused_ops import env
from helpers import data, errors, stopping
from in_process import main_in_process
from test_train import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, N, SEED = 64, 6000, 1337  # (SEED: train.py's default)
B, T, EVAL_ITERS = 8, 32, 4  # TINY's batch_size, block_size and eval_iters


def write_dataset(folder, train_ids, val_ids, vocab_size=VOCAB, dtype="uint16"):
    os.makedirs(folder, exist_ok=True)
    for split, ids in (("train", train_ids), ("val", val_ids)):
        np.asarray(ids, dtype=dtype).tofile(os.path.join(folder, f"{split}.bin"))
    chars = [chr(ord("0") + i) for i in range(min(vocab_size, VOCAB))]
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "char", "vocab_size": vocab_size, "chars": chars, "dtype": dtype}, f)
    return str(folder)


def clean(seed):
    return np.random.default_rng(seed).integers(0, VOCAB, N)


def covered(batches, draws, split="train", gen=None):
    """The token positions `draws` batches of `batches` read (on a dataset whose ids are their positions)."""
    seen = set()
    for _ in range(draws):
        x, y = batches.get(split, gen)
        for start in x[:, 0].tolist():
            seen.update(range(start, start + T + 1))
    return seen


@pytest.fixture(scope="module")
def positions(tmp_path_factory):
    """Which positions each process of train.py reads, from train.py's own Batches on a dataset whose ids are their
    positions: {rank: (positions its first eval reads in train.bin, in its first two training batches)}."""
    probe = write_dataset(tmp_path_factory.mktemp("probe"), np.arange(N), np.arange(N), vocab_size=2 ** 31,
                          dtype="uint32")
    out = {}
    for rank in (0, 1):
        batches = data.Batches(probe, B, T, "cpu", seed=SEED * 1000 + 1 + rank)  # as train.py makes them
        evals = covered(batches, EVAL_ITERS, gen=torch.Generator().manual_seed(SEED + 7 + rank))  # estimate_loss's
        out[rank] = evals, covered(batches, 2)
    return out


def one_bad_token(positions, finder, world):
    """train.bin with one id VOCAB where process `finder`'s first training batch reads it and no eval, nor any other
    process's first two batches, does."""
    others = set().union(*(positions[r][0] for r in range(world)),
                         *(positions[r][1] for r in range(world) if r != finder))
    mine = sorted(positions[finder][1] - others)
    assert mine, "no position only that process reads (a larger N would do)"
    ids = clean(0)
    ids[mine[len(mine) // 2]] = VOCAB
    return ids


def train_py(folder, out, *args, world=1, classifier="eager"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TRITON_INTERPRET": "1" if classifier != "eager" else "0"}  # (the fused classifier on the CPU)
    env.pop("DEBUG", None)
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    return subprocess.run([sys.executable, *launcher, "train.py", *TINY, f"--dataset={folder}", f"--out_dir={out}",
                           f"--classifier={classifier}", "--max_iters=3", "--eval_interval=100", *args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def train_here(monkeypatch, capsys, folder, out, classifier="eager"):
    """train_py's one-process run in this process (tests/in_process.py; test_in_val_bin_one_process keeps a real
    process). The fused classifier on the CPU needs Triton's interpreter, chosen at import: where this process runs
    without it (a GPU machine), a process of its own."""
    if classifier != "eager" and not env.INTERPRET:
        return train_py(folder, out, classifier=classifier)
    return main_in_process(monkeypatch, capsys, "train.py", *TINY, f"--dataset={folder}", f"--out_dir={out}",
                           f"--classifier={classifier}", "--max_iters=3", "--eval_interval=100")


def the_error_line(proc, world):
    """train.py's one error line (under torchrun: its own lines, then torchrun's report of a failed process)."""
    assert proc.returncode != 0 and 'train.py", line' not in proc.stderr, proc.stderr[-4000:]  # (no traceback of ours)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    if world == 1:
        assert proc.returncode == 2 and proc.stderr.strip() == lines[0], (proc.returncode, proc.stderr[-4000:])
    assert lines[0].startswith("train.py: error: ")
    return lines[0]


def expect(line, folder, split):
    path = os.path.join(folder, f"{split}.bin")
    assert f"{path} holds token id {VOCAB}, but meta.json's vocab_size is {VOCAB} (ids 0 to {VOCAB - 1})" in line, line
    assert "IndexError" not in line and "prepare" in line


@pytest.mark.parametrize("classifier", ["eager", "fused"])
def test_in_train_bin_one_process(tmp_path, monkeypatch, capsys, classifier):
    """An id of 64 with vocab_size 64 throughout train.bin: the first eval's first batch finds it."""
    ids = clean(0)
    ids[::20] = VOCAB
    folder = write_dataset(tmp_path / "d", ids, clean(1))
    proc = train_here(monkeypatch, capsys, folder, tmp_path / "out", classifier=classifier)
    expect(the_error_line(proc, 1), folder, "train")
    assert not os.path.exists(tmp_path / "out" / "ckpt.pt")


def test_in_val_bin_one_process(tmp_path):
    ids = clean(1)
    ids[::20] = VOCAB
    folder = write_dataset(tmp_path / "d", clean(0), ids)
    expect(the_error_line(train_py(folder, tmp_path / "out"), 1), folder, "val")


def test_in_a_training_batch_one_process(tmp_path, monkeypatch, capsys, positions):
    """The eval passes; the first training batch holds it (drawn by Batches.next): no step is taken. (Eager only: the
    fused classifier on a batch of all ignored targets is test_classifier's; through train.py it runs above, where
    its interpreted eval would cost a minute here.)"""
    folder = write_dataset(tmp_path / "d", one_bad_token(positions, 0, 1), clean(1))
    expect(the_error_line(train_here(monkeypatch, capsys, folder, tmp_path / "out"), 1), folder, "train")


@pytest.mark.parametrize("where", ["eval", "step"])
def test_under_torchrun_when_only_rank_1_draws_it(tmp_path, positions, where):
    """Two processes (Gloo): only rank 1 reads the bad id, in its first eval (the eval's NaN brings both to the
    check) or its first training batch (trained as all ignored targets: the step's NaN loss, averaged, brings both);
    both stop, rank 0 prints the one line, and neither hangs nor prints a traceback."""
    if where == "eval":
        others = positions[0][0] | positions[0][1] | positions[1][1]
        ids = clean(0)
        ids[sorted(positions[1][0] - others)[0]] = VOCAB
    else:
        ids = one_bad_token(positions, 1, 2)
    folder = write_dataset(tmp_path / "d", ids, clean(1))
    proc = train_py(folder, tmp_path / "out", "--gradient_accumulation_steps=2", world=2)
    expect(the_error_line(proc, 2), folder, "train")


def test_batches_defer_the_error_under_torchrun(tmp_path):
    """Batches(defer_errors=True) hands the bad batch out with every target ignored and keeps the message, which
    stopping.check_tokens raises; without defer_errors the draw raises it."""
    ids = clean(0)
    ids[::20] = VOCAB
    folder = write_dataset(tmp_path / "d", ids, clean(1))
    with pytest.raises(errors.UsageError, match=r"train\.bin holds token id 64, but meta\.json's vocab_size is 64"):
        data.Batches(folder, B, T, "cpu", seed=0).get("train")
    batches = data.Batches(folder, B, T, "cpu", seed=0, defer_errors=True)
    x, y = batches.get("train")
    assert not x.any() and (y == -1).all() and "holds token id 64" in batches.bad_tokens
    with pytest.raises(errors.UsageError, match="holds token id 64"):
        stopping.check_tokens(batches, 1)
    stopping.check_tokens(data.Batches(write_dataset(tmp_path / "ok", clean(0), clean(1)), B, T, "cpu", seed=0), 1)
