"""What a run records (helpers/runlog.py): log.jsonl, and nanoGPT's wandb_log, tested with a stand-in wandb module
(no network, no account; the real one is not a dependency)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import runlog
from helpers import stopping
import train
from test_train import ROOT, TINY, dataset, read_log  # noqa: F401 (dataset: test_train's fixture)

FAKE_WANDB = '''
import json, os
_calls = []
def _record(*call):
    _calls.append(call)
    with open(os.environ["FAKE_WANDB_OUT"], "w") as f:
        json.dump(_calls, f)
class Run:
    def log(self, data, step=None):
        _record("log", data, step)
    def finish(self, exit_code=0):
        _record("finish", exit_code)
def init(project=None, name=None, config=None):
    if project == "unreachable":
        raise RuntimeError("wandb.errors.CommError: Run initialization has timed out")
    _record("init", project, name, sorted(config))
    return Run()
'''


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    (tmp_path / "site" / "wandb").mkdir(parents=True)
    (tmp_path / "site" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_WANDB_OUT", str(tmp_path / "calls.json"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    yield tmp_path / "calls.json"
    sys.modules.pop("wandb", None)


def test_wandb_log_sends_what_log_jsonl_records(dataset, tmp_path, fake_wandb):
    out = str(tmp_path / "out")
    train.main(TINY + [f"--dataset={dataset}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2",
                       "--lr_decay_iters=4", "--wandb_log=True", "--wandb_project=tiny", "--wandb_run_name=run1"])
    calls = json.load(open(fake_wandb))
    assert calls[0][:3] == ["init", "tiny", "run1"] and "learning_rate" in calls[0][3]
    assert calls[-1] == ["finish", 0]
    logged = [(step, data) for _, data, step in (c for c in calls if c[0] == "log")]
    records = [r for r in read_log(out) if r["type"] != "run"]
    assert len(logged) == len(records)
    for (step, data), record in zip(logged, records):
        assert step == record["iter"] == data["iter"]
        if record["type"] == "eval":  # nanoGPT's names
            assert (data["train/loss"], data["val/loss"], data["lr"]) == \
                   (record["train_loss"], record["val_loss"], record["lr"])
        else:
            assert (data["train/step_loss"], data["lr"], data["ms"]) == (record["loss"], record["lr"], record["ms"])
    assert [d["iter"] for _, d in logged if "val/loss" in d] == [0, 2, 4]


def test_a_failed_run_marks_its_wandb_run_failed(dataset, tmp_path, fake_wandb):
    with pytest.raises(stopping.TrainingDiverged):
        train.main(TINY + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--max_iters=30",
                           "--learning_rate=1e6", "--grad_clip=0.0", "--warmup_iters=0", "--wandb_log=True"])
    assert json.load(open(fake_wandb))[-1] == ["finish", 1]


def test_wandb_init_failing_is_one_line(dataset, tmp_path, fake_wandb):
    with pytest.raises(runlog.errors.UsageError, match=r"^wandb_log=True, but wandb.init failed \(wandb.errors.CommError: "
                                                       r"Run initialization has timed out\): wandb login"):
        train.main(TINY + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--wandb_log=True",
                           "--wandb_project=unreachable"])


def test_wandb_log_off_never_imports_wandb(dataset, tmp_path, fake_wandb):
    train.main(TINY + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2"])
    assert "wandb" not in sys.modules and not os.path.exists(fake_wandb)


def test_wandb_log_without_wandb_is_one_line(dataset, tmp_path, monkeypatch):
    """Checked before any work: the message names the key and the install command."""
    real = importlib.util.find_spec
    monkeypatch.setattr(runlog.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(runlog.errors.UsageError, match=r"^wandb_log=True needs the wandb package, which is not "
                                                       r"installed: pip install wandb"):
        train.main(TINY + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--wandb_log=True"])
    assert not os.path.exists(tmp_path / "out")


def test_wandb_log_without_wandb_from_the_command_line(dataset, tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = subprocess.run([sys.executable, "train.py", *TINY, f"--dataset={dataset}", f"--out_dir={tmp_path / 'o'}",
                           "--wandb_log=True"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("train.py: error: wandb_log=True needs the wandb package")


def test_a_resumed_log_is_cut_back_and_replaced_whole(tmp_path):
    path = str(tmp_path / "log.jsonl")
    records = [{"type": "step", "iter": i} for i in range(6)] + [{"type": "eval", "iter": 4}]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    inode = os.stat(path).st_ino
    runlog.RunLog(str(tmp_path), master=True, resumed_at=4, cfg={"wandb_log": False})
    assert [(r["type"], r["iter"]) for r in read_log(tmp_path)] == [("step", i) for i in range(4)] + [("eval", 4)]
    assert os.stat(path).st_ino != inode  # a new file renamed over the old one, not the old one cut in place
    assert os.listdir(tmp_path) == ["log.jsonl"]
