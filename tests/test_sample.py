"""sample.py on a checkpoint from a short tiny training run."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import checkpoint
from helpers import data
from helpers import errors
from helpers import prepare_data
import sample
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the fused kernels run: a GPU if there is one (without one, conftest sets Triton's CPU interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    (root / "corpus.txt").write_text("".join(f"KING {i % 7}:\nO, that this too too solid flesh would melt!\n\n"
                                             for i in range(800)))
    prepare_data.prepare(str(root / "data"), source=str(root / "corpus.txt"), tokenizer="char")
    out = str(root / "out")
    train.main(["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8",
                "--gradient_accumulation_steps=1", "--max_iters=60", "--eval_interval=60", "--eval_iters=2",
                "--learning_rate=1e-2", "--warmup_iters=5", "--lr_decay_iters=60", "--dropout=0.1", "--mlp=eager",
                "--device=cpu", "--dtype=float32", "--progress=False", "--plot=False",
                f"--dataset={root / 'data'}", f"--out_dir={out}"])
    shutil.rmtree(root / "data")  # sampling must work from the checkpoint alone
    return out


def gen(out_dir, *args):
    # block_size is 32: 40 new tokens after a 5-character prompt also exercise the cropped-context path
    return sample.main([f"--out_dir={out_dir}", "--device=cpu", "--start=KING ", "--num_samples=2",
                        "--max_new_tokens=40", *args])


def test_greedy_same_with_and_without_kv_cache(out_dir):
    cached, uncached = gen(out_dir, "--top_k=1"), gen(out_dir, "--top_k=1", "--no_kv_cache")
    assert cached == uncached
    assert cached[0] == cached[1]  # greedy ignores the seed
    assert cached[0].startswith("KING ") and len(cached[0]) == 45
    assert "that" in cached[0] or "flesh" in cached[0] or "O," in cached[0]  # it learned something of the text


def test_sampling_same_seed_same_tokens(out_dir):
    a = gen(out_dir, "--seed=3", "--temperature=1.0", "--top_k=0")
    assert a == gen(out_dir, "--seed=3", "--temperature=1.0", "--top_k=0", "--no_kv_cache")
    assert a == gen(out_dir, "--seed=3", "--temperature=1.0", "--top_k=0")
    assert a != gen(out_dir, "--seed=4", "--temperature=1.0", "--top_k=0")
    assert a[0] != a[1]  # two different samples from one call


def test_loads_into_another_mlp_kind(out_dir):
    # Trained with mlp="eager"; the fused MLP (on the GPU, or run by Triton's CPU interpreter under the test
    # conftest) owns the same parameters, so the checkpoint loads and greedy decoding agrees.
    model, _ = checkpoint.load_model(out_dir, DEVICE, mlp="fused")
    assert model.config.mlp == "fused"
    common = [f"--out_dir={out_dir}", f"--device={DEVICE}", "--dtype=float32", "--start=KING", "--num_samples=1",
              "--max_new_tokens=4", "--top_k=1"]
    assert sample.main(common) == sample.main(common + ["--mlp=fused"])


def test_prompt_from_file(out_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("KING 3:\nO")
    out = sample.main([f"--out_dir={out_dir}", "--device=cpu", f"--start=FILE:{prompt}", "--num_samples=1",
                       "--max_new_tokens=5", "--top_k=1"])
    assert out[0].startswith("KING 3:\nO") and len(out[0]) == 14


def test_clear_errors(out_dir, tmp_path):
    with pytest.raises(errors.UsageError, match=r"no checkpoint at .*ckpt.pt"):
        sample.main([f"--out_dir={tmp_path}", "--device=cpu"])
    with pytest.raises(errors.UsageError, match="--start: character 'Z' is not in this dataset's vocabulary"):
        sample.main([f"--out_dir={out_dir}", "--device=cpu", "--start=Z"])
    latin1 = tmp_path / "prompt.txt"
    latin1.write_bytes("KING caf\u00e9".encode("latin-1"))
    with pytest.raises(errors.UsageError, match=re.escape(f"--start=FILE:{latin1}: {latin1} is not UTF-8 text "
                                                          "(byte 0xe9 at offset 8)")):
        sample.main([f"--out_dir={out_dir}", "--device=cpu", f"--start=FILE:{latin1}"])
    with pytest.raises(errors.UsageError, match=r"--start=FILE:no/such.txt: cannot read no/such.txt"):
        sample.main([f"--out_dir={out_dir}", "--device=cpu", "--start=FILE:no/such.txt"])
    proc = subprocess.run([sys.executable, "sample.py", f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "sample.py: error: no checkpoint at" in proc.stderr and "Traceback" not in proc.stderr


def test_the_hint_without_a_checkpoint_is_a_command_that_makes_one(tmp_path, monkeypatch):
    """sample.py with no checkpoint names a train.py command; run as given (cut short here, its data in tmp_path), it
    writes the very checkpoint this sample.py looks for: the hint names --out_dir, the config's own is another."""
    out = str(tmp_path / "my run")  # (a space: the command quotes it)
    with pytest.raises(errors.UsageError, match=r"no checkpoint at .*; train one first, e\.g\. python train\.py") as e:
        sample.main([f"--out_dir={out}", "--device=cpu"])
    command = shlex.split(str(e.value).partition("e.g. ")[2])
    assert command[:2] == ["python", "train.py"] and f"--out_dir={out}" in command
    monkeypatch.chdir(ROOT)  # (where the README runs it: the config's path is relative)
    # (--mlp=eager: the config's "auto" takes the kernels through the interpreter the tests turn on, far too slow)
    train.main(command[2:] + ["--max_iters=1", "--eval_iters=1", f"--data_root={tmp_path / 'data'}", "--mlp=eager",
                              "--progress=False", "--plot=False", "--sample_after=False"])
    assert len(sample.main([f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=3"])) == 1


def test_vocabulary_without_newline(tmp_path, capsys):
    """A character vocabulary from text with no newline: the default start ("\\n") falls back to the first
    token, both in the sample train.py prints and in sample.py; a --start it cannot encode names the characters."""
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    prepare_data.prepare(str(tmp_path / "data"), source=str(tmp_path / "corpus.txt"), tokenizer="char")
    assert "\n" not in data.load_meta(str(tmp_path / "data"))["chars"]
    out = str(tmp_path / "out")
    train.main(["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
                "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
                "--mlp=eager", "--device=cpu", "--dtype=float32", "--progress=False", "--plot=False",
                "--sample_after=True", f"--dataset={tmp_path / 'data'}", f"--out_dir={out}"])
    captured = capsys.readouterr()
    assert "--- sample after 2 iterations ---\n " in captured.out  # ' ' is the first (sorted) character
    assert "no '\\n'" in captured.err and "first token ' '" in captured.err
    samples = sample.main([f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=5"])
    assert samples[0].startswith(" ") and len(samples[0]) == 6
    assert "no '\\n'" in capsys.readouterr().err
    with pytest.raises(errors.UsageError, match=r"characters 'Z', '\\n' are not in this dataset's vocabulary"):
        sample.main([f"--out_dir={out}", "--device=cpu", "--start=the Zoo\nZ"])


def test_output_cut_short_by_its_reader_is_quiet(out_dir):
    """`sample.py ... | head`: the reader goes away; no BrokenPipeError traceback, status 141 (128 + SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "sample.py", f"--out_dir={out_dir}", "--device=cpu", "--num_samples=50",
                             "--max_new_tokens=10"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0"})
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err
