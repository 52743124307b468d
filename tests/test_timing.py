"""Where a run's time goes (helpers/timing.py), printed by train.py; and evaluation through the fused MLP's fastest
forward: under torch.no_grad() it writes no dh/dz and keeps nothing for a backward that never comes."""

import re

import pytest
import torch

import fused_ops
from helpers import timing
import train
from test_train import TINY, dataset, read_log  # noqa: F401 (dataset: test_train's fixture, the tiny char dataset)


def test_train_prints_where_start_up_went(dataset, tmp_path, capsys):
    summary = train.main(TINY + [f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", "--max_iters=12",
                                 "--eval_interval=6", "--lr_decay_iters=12"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("start-up ")]
    assert len(lines) == 1, out  # once, after the steady steps
    line = lines[0]
    assert re.search(r"start-up \d+\.\d s to the first step: data \d+\.\d s, model \d+\.\d s; first 3 steps "
                     r"\d+\.\d s \(.*the rest \d+\.\d s for first calls and allocation\); "
                     r"then \d+\.\d ms a step; eval \d+\.\d\d s", line), line
    assert not re.search(r"CUDA|GPU", out), out  # a CPU run: no GPU words
    s = summary["startup"]
    assert 0 < s["data"] < 60 and 0 < s["model"] < 60 and 0 < s["steady step"] < 10
    assert s["to first step"] >= s["data"] + s["model"]  # after both (and the eval at iter 0)
    assert 0 < s["first steps"] < 60
    assert "compile" not in s  # nothing was compiled (compile=False)
    evals = re.findall(r"iter (\d+): train loss \d\.\d{4}, val loss \d\.\d{4} \((\d+\.\d\d) s\)", out)
    # each eval's time is printed, and the printed times (rounded to 0.01 s each) add up to the evals' total
    assert [int(i) for i, _ in evals] == [0, 6, 12]
    assert abs(sum(float(t) for _, t in evals) - s["evals"]) <= 0.005 * len(evals) + 1e-9, (evals, s["evals"])
    # the steps' times in log.jsonl are the ones the timer adds up (start-up line: the first 3, to 0.1 s)
    step_ms = [r["ms"] for r in read_log(str(tmp_path / "out")) if r["type"] == "step"]
    assert len(step_ms) == 12 and abs(sum(step_ms[:3]) / 1000 - s["first steps"]) < 1e-6, (step_ms, s)
    first = re.search(r"first 3 steps (\d+\.\d) s", line)
    assert abs(float(first[1]) - s["first steps"]) <= 0.05 + 1e-9, line
    # and once at the end, the whole run: its parts add up to its time (the rest is the loop's bookkeeping)
    runs = re.findall(r"^run (\d+\.\d) s: data \d+\.\d s, model \d+\.\d s, 12 steps (\d+\.\d) s \(median "
                      r"\d+\.\d ms\), 3 evals (\d+\.\d) s, (\d+) checkpoints (\d+\.\d) s, the rest (\d+\.\d) s$", out, re.M)
    assert len(runs) == 1, out
    total, steps, evals_s, n_ckpt, ckpt_s, rest = map(float, runs[0])
    assert n_ckpt == 3  # always_save_checkpoint: one per eval
    # the run's steps and evals: the sums of what each step logged and each eval printed (to 0.1 s)
    assert abs(steps - sum(step_ms) / 1000) <= 0.05 + 1e-9 and abs(evals_s - s["evals"]) <= 0.05 + 1e-9, (runs, s)
    assert total >= s["to first step"] and abs(s["data"] + s["model"] + steps + evals_s + ckpt_s + rest - total) < 0.5


def test_a_short_run_reports_at_its_end(capsys):
    """Fewer steps than the steady ones: the breakdown still comes, once, from what there is."""
    s = timing.RunTimer(master=True, device_type="cpu")
    for dt in (2.0, 0.5):
        s.step(dt)
    s.report()
    s.report()
    out = capsys.readouterr().out
    assert out.count("start-up ") == 1 and "first 2 steps 2.5 s" in out and "then 500.0 ms a step" in out


@pytest.mark.parametrize("grad", [True, False])
def test_no_grad_forward_saves_nothing(monkeypatch, grad):
    """The eval forward (torch.no_grad) asks the kernel for h only; with grad enabled it asks for dh/dz too."""
    if not fused_ops.kernels_can_run(torch.empty(0)):
        pytest.skip("the kernels cannot run here (no GPU, no TRITON_INTERPRET=1)")
    saves, op = [], fused_ops.mlp.linear_act_op
    monkeypatch.setattr(fused_ops.mlp, "linear_act_op", lambda *a: (saves.append(a[-1]), op(*a))[1])
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    x = torch.randn(4, 8, 32)
    with torch.set_grad_enabled(grad):
        y = fused_ops.fused_mlp_layers(x, fc, proj, "gelu")
    assert saves == [grad] and y.requires_grad == grad
    with torch.no_grad():
        expected = proj(torch.nn.functional.gelu(fc(x)))
    torch.testing.assert_close(y.detach(), expected, rtol=1e-4, atol=1e-5)
