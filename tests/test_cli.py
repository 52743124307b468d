"""Every entry point fails like a tool (issue 23): expected failures are one line `<script>: error: ...` naming
the argument, file or key, with exit status 2 (bad usage) or 1 (failed run); Ctrl-C and SIGTERM stop training
at the end of a step with a checkpoint and the command that resumes; a second Ctrl-C quits at once."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import data
from helpers import errors
from helpers import prepare_data
from helpers import runtime
from helpers import stopping
from helpers import timing
import train
from test_train import TINY, dataset  # noqa: F401 (dataset: test_train's fixture, the tiny char dataset)
# (in-process runs for the errors raised before any work; each script's own process is still run by one test at
# least: train.py by test_fused_mlp_where_the_kernels_cannot_run, test_damaged_checkpoint_... and the Ctrl-C tests,
# sample.py by test_a_bad_value_from_a_shell_..., bench.py by test_bad_arguments_are_one_line_..., bench_mlp.py by
# test_bench_mlp_needs_a_gpu)
from in_process import main_in_process  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1"}
ENV.pop("DEBUG", None)


def script(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=timeout)


def one_line_error(proc, script_name, status):
    """The error line, after checking that it is the only output on stderr and that the exit status is right."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{script_name}: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """A finished tiny run with two checkpoints written (iters 2 and 4): ckpt.pt and ckpt.pt.prev."""
    out = str(tmp_path_factory.mktemp("cli_run") / "out")
    train.main(TINY + [f"--dataset={dataset}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2",
                       "--lr_decay_iters=4", "--eval_iters=2"])
    return out


def copy_run(trained, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    return out


# --- a device that is not there ------------------------------------------------------------------------------

def missing_devices():
    """Devices this machine lacks: CUDA when it has none (else one past its GPUs), and MPS off a Mac."""
    cuda = [f"cuda:{torch.cuda.device_count()}"] if torch.cuda.is_available() else ["cuda", "cuda:7"]
    return cuda + ([] if torch.backends.mps.is_available() else ["mps"])


@pytest.mark.parametrize("device", missing_devices())
def test_train_names_a_missing_device(dataset, tmp_path, device):
    with pytest.raises(errors.UsageError, match=rf"--device={device}, but "):
        train.main(TINY[:-3] + [f"--device={device}", f"--dataset={dataset}", f"--out_dir={tmp_path}"])
    assert not os.listdir(tmp_path)  # checked before anything was written


def test_scripts_name_a_missing_device(tmp_path, monkeypatch, capsys):
    import bench
    import sample

    device = missing_devices()[0]
    line = one_line_error(main_in_process(monkeypatch, capsys, "train.py", "configs/shakespeare_char_cpu.py",
                                          f"--device={device}"), "train.py", 2)
    assert f"--device={device}, but" in line
    with pytest.raises(errors.UsageError, match=f"--device={device}, but"):
        sample.main([f"--out_dir={tmp_path}", f"--device={device}"])
    with pytest.raises(errors.UsageError, match=f"--device={device}, but"):
        bench.main([os.path.join(ROOT, "configs", "shakespeare_char_cpu.py"), f"--device={device}"])


def test_fused_mlp_where_the_kernels_cannot_run(dataset, tmp_path):
    """--mlp=fused on the CPU without Triton's interpreter: one line naming --mlp, before any work."""
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--mlp=fused", "--device=cpu", f"--dataset={dataset}",
                           f"--out_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    line = one_line_error(proc, "train.py", 2)
    assert "--mlp=fused runs Triton kernels, which need a CUDA GPU" in line and "use --mlp=auto or --mlp=eager" in line
    assert not os.path.exists(tmp_path / "out")


def test_fused_mlp_without_triton_or_from_a_checkpoint(trained, tmp_path, monkeypatch):
    import fused_ops
    import sample

    def no_triton(required):
        try:
            raise ModuleNotFoundError("No module named 'triton'")
        except ImportError as e:
            raise ImportError("mlp='fused' needs Triton") from e

    with monkeypatch.context() as m:
        m.setattr(runtime.model, "import_fused_ops", no_triton)
        with pytest.raises(errors.UsageError, match=r"^--mlp=fused needs Triton, which cannot be imported here \(No "
                                                    r"module named 'triton'\): use --mlp=auto or --mlp=eager"):
            runtime.check_mlp("fused", "cpu")
        runtime.check_mlp("auto", "cpu")  # "auto" runs PyTorch where the kernels cannot run
    # A checkpoint trained with the kernels (on a GPU), sampled where they cannot run: names the file and --mlp.
    out = tmp_path / "out"
    out.mkdir()
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["model_args"]["mlp"] = "fused"
    torch.save(ckpt, out / "ckpt.pt")
    monkeypatch.setattr(fused_ops, "kernels_can_run", lambda x: False)  # as on a CPU without the interpreter
    with pytest.raises(errors.UsageError, match=rf"^{re.escape(str(out / 'ckpt.pt'))} has mlp='fused', which runs "
                                                r"Triton kernels, .* the device is cpu: use --mlp=auto or --mlp=eager"):
        sample.main([f"--out_dir={out}", "--device=cpu"])
    assert sample.main([f"--out_dir={out}", "--device=cpu", "--mlp=eager", "--num_samples=1", "--max_new_tokens=2"])


def test_fp8_names_what_it_needs_before_any_work(dataset, tmp_path, monkeypatch, capsys):
    """--fp8=True where it cannot run: one line naming the flag and the requirement, before any data, model or
    checkpoint: FP8 tensor cores (named before --mlp's own check, which they imply), then 16-bit activations."""
    import fused_ops.fp8.state
    import train

    out = tmp_path / "out"
    args = [*TINY, f"--dataset={dataset}", f"--out_dir={out}", "--mlp=fused", "--fp8=True"]
    monkeypatch.setattr(fused_ops.fp8.state, "fp8_supported", lambda device: False)  # a CPU or an A100
    assert errors.run_main("train.py", train.main, args + ["--dtype=float16"]) == 2
    assert capsys.readouterr().err.strip() == ("train.py: error: --fp8=True needs FP8 tensor cores (an NVIDIA Ada or "
                                               "Hopper GPU, compute capability 8.9+); the device is cpu: use --fp8=False")
    monkeypatch.setattr(fused_ops.fp8.state, "fp8_supported", lambda device: True)  # as the interpreter: the dtype's turn
    assert errors.run_main("train.py", train.main, args + ["--dtype=float32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "train.py: error: --fp8=True needs 16-bit activations (its GEMMs take bf16 or fp16 inputs under autocast), "
        "and the dtype is float32: use --dtype=bfloat16 or --dtype=float16")
    assert not out.exists()


def test_bf16_through_the_interpreter_is_refused(dataset, tmp_path, monkeypatch, capsys):
    """The kernels on a CPU run through Triton's interpreter, whose bf16 dot is wrong: --dtype=bfloat16 with mlp
    "fused" or "auto" (which takes the kernels wherever they run) is one line naming --dtype, not wrong losses."""
    import fused_ops
    import sample
    import train

    monkeypatch.setattr(fused_ops, "kernels_can_run", lambda x: True)  # as under TRITON_INTERPRET=1
    for mlp in ("fused", "auto"):
        args = [*TINY, f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", f"--mlp={mlp}", "--dtype=bfloat16"]
        assert errors.run_main("train.py", train.main, args) == 2
        assert capsys.readouterr().err.strip() == (
            f"train.py: error: --mlp={mlp} with --dtype=bfloat16 on the CPU runs the kernels through Triton's "
            "interpreter, whose bf16 matmuls are wrong: use --dtype=float16 or float32")
        with pytest.raises(errors.UsageError, match=rf"^--mlp={mlp} with --dtype=bfloat16 on the CPU"):
            sample.main([f"--out_dir={tmp_path}", "--device=cpu", f"--mlp={mlp}", "--dtype=bfloat16"])
    runtime.check_interpreter_dtype("eager", "cpu", "bfloat16")  # PyTorch's own bf16
    runtime.check_interpreter_dtype("fused", "cpu", "float16")
    monkeypatch.setattr(fused_ops, "kernels_can_run", lambda x: x.is_cuda)  # no interpreter: "auto" runs PyTorch
    runtime.check_interpreter_dtype("auto", "cpu", "bfloat16")
    assert not (tmp_path / "out").exists()


def test_bench_checks_every_variant_before_timing(monkeypatch):
    """bench.py's --mlps and --dtype: one line naming the argument before the first variant is built."""
    import bench
    import fused_ops.fp8.state

    monkeypatch.setattr(fused_ops.fp8.state, "fp8_supported", lambda device: True)
    base = ["configs/shakespeare_char_cpu.py", "--device=cpu"]
    for extra, message in [(["--mlps=eager,bogus"], "--mlps=eager,bogus: 'bogus' is not one of eager, fused, auto, "
                                                    "fp8, fp8blocks, torchao"),
                           (["--dtype=half"], "--dtype=half: expected bfloat16, float16 or float32"),
                           (["--mlps=eager,fp8"], "--mlps=fp8 needs 16-bit activations"),
                           (["--mlps=fp8", "--dtype=bfloat16"], "--mlps=fp8 with --dtype=bfloat16 on the CPU")]:
        if extra[-1] == "--dtype=bfloat16":
            monkeypatch.setattr(fused_ops, "kernels_can_run", lambda x: True)
        with pytest.raises(errors.UsageError, match=f"^{re.escape(message)}"):
            bench.parse_args(base + extra)
    monkeypatch.setattr(fused_ops.fp8.state, "fp8_supported", lambda device: False)
    with pytest.raises(errors.UsageError, match=r"^--mlps=fp8 needs FP8 tensor cores .*: leave fp8 out of --mlps$"):
        bench.parse_args(base + ["--mlps=fp8", "--dtype=float16"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_bench_mlp_needs_a_gpu():
    line = one_line_error(script("bench_mlp.py"), "bench_mlp.py", 2)
    assert "CUDA GPU" in line and "bench.py --mlp_widths" in line  # what to run on the CPU instead


def test_bad_arguments_are_one_line_errors(capsys):
    import bench_mlp

    with pytest.raises(SystemExit) as e:
        bench_mlp.main(["--widths=7x"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "bench_mlp.py: error: argument --widths: expected comma-separated integers, " \
                                      "got '7x'\n"
    assert "config file not found: nope.py" in one_line_error(script("bench.py", "nope.py"), "bench.py", 2)


# --- every script's arguments: typos and bad values are one line, --help shows the defaults ---------------------

def scripts():
    """Each script's name and main, as its __main__ runs it."""
    import bench
    import bench_classifier
    import bench_mlp
    import export
    import prepare
    import sample
    return {"train.py": train.main, "sample.py": sample.main, "prepare.py": prepare.main, "export.py": export.main,
            "bench.py": bench.main, "bench_mlp.py": bench_mlp.main, "bench_classifier.py": bench_classifier.main}


def run_in_process(capsys, name, argv):
    """(exit status, stdout, stderr) of the script `name` run with argv, in this process (argparse exits)."""
    try:
        status = errors.run_main(name, scripts()[name], argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name, argv, meant", [
    ("train.py", ["--max_iter=3"], "Did you mean 'max_iters'?"),
    ("sample.py", ["--num_sample=2"], "(did you mean --num_samples?)"),  # not taken as --num_samples
    ("prepare.py", ["--datset=shakespeare_char"], "(did you mean --dataset?)"),
    ("export.py", ["--out-dir=out"], "(did you mean --out_dir?)"),
    ("bench.py", ["configs/shakespeare_char_cpu.py", "--step=3"], "(did you mean --steps?)"),
    ("bench_mlp.py", ["--width=768"], "(did you mean --widths?)"),
    ("bench_classifier.py", ["--shape=1x2x3"], "(did you mean --shapes?)"),
])
def test_every_script_rejects_a_mistyped_option_in_one_line(capsys, name, argv, meant):
    """No script guesses an option from a prefix or ignores one it does not know: one line naming it and the option
    probably meant, exit status 2, before any work."""
    status, out, err = run_in_process(capsys, name, argv)
    assert status == 2 and out == "", (status, out)
    assert err.count("\n") == 1 and err.startswith(f"{name}: error: ") and meant in err, err
    assert argv[-1].partition("=")[0] in err


@pytest.mark.parametrize("name, argv, says", [
    ("sample.py", ["--mlp=fast"], "argument --mlp: invalid choice: 'fast'"),
    ("prepare.py", ["--dataset=shakespeare_char", "--tokenizer=bytes"], "argument --tokenizer: invalid choice"),
    ("prepare.py", ["--tokenizer=char"], "give exactly one of --dataset or --source"),
    ("export.py", ["--to"], "argument --to: expected one argument"),
    ("bench.py", ["configs/shakespeare_char_cpu.py", "--steps=many"], "argument --steps: invalid int value: 'many'"),
    ("bench_classifier.py", ["--rounds=x"], "argument --rounds: invalid int value: 'x'"),
])
def test_a_bad_value_is_one_line_without_the_usage(capsys, name, argv, says):
    status, out, err = run_in_process(capsys, name, argv)
    assert status == 2 and out == "", (status, out)
    assert err.count("\n") == 1 and err.startswith(f"{name}: error: {says}") and "usage:" not in err, err


def test_a_bad_value_from_a_shell_is_the_one_line_the_readme_promises():
    proc = script("sample.py", "--mlp=fast")
    assert proc.stdout == ""
    assert one_line_error(proc, "sample.py", 2).startswith("sample.py: error: argument --mlp: invalid choice: 'fast'")


@pytest.mark.parametrize("name, shown", [
    ("sample.py", ["--num_samples NUM_SAMPLES  samples to print (default: 3)", "(default: 500)", "(default: out)"]),
    ("prepare.py", ["(default: char)", "(default: 0.1)"]),
    ("export.py", ["(default: out)", "<out_dir>/hf"]),
    ("bench.py", ["(default: 20)", "(default: eager,fused)", "out-bench/bench_<config>"]),
    ("bench_mlp.py", ["(default: gelu,swiglu)", "(default: out-bench/mlp.json)"]),
    ("bench_classifier.py", ["(default: 4)"]),
])
def test_help_names_the_script_and_shows_the_defaults(capsys, name, shown):
    status, out, err = run_in_process(capsys, name, ["--help"])
    assert status == 0 and err == ""
    text = " ".join(out.split())  # (argparse wraps the lines to the terminal's width)
    assert out.startswith(f"usage: {name} ") and all(" ".join(s.split()) in text for s in shown), out


def test_train_help_says_what_each_key_is_and_where_the_runs_are(capsys):
    from helpers import config
    assert train.main(["--help"]) is None
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py [config_file.py ...] [--key=value ...]\n")
    assert "GPT-2 small" in out and "configs/" in out and "shakespeare_char_cpu.py" in out
    described = config.describe_keys()
    assert list(described) == list(config.DEFAULTS)  # every key, in order, read from DEFAULTS' source
    assert described["block_size"] == ("data", "context length, in tokens")
    assert described["wandb_project"] == ("wandb logging (off by default; pip install wandb)", "")
    lines = {line.split()[0]: line for line in out.splitlines() if re.match(r"  \w", line)}
    assert set(lines) == set(config.DEFAULTS)
    assert re.fullmatch(r"  block_size +1024 +context length, in tokens", lines["block_size"])
    assert "\nAdamW:\n" in out and "\nmodel (GPT-2 small):\n" in out  # the groups' headings
    # after a config file, the values it sets: what the run would use
    train.main(["configs/shakespeare_char_cpu.py", "--help"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if re.match(r"  \w", line)}
    assert "'out-shakespeare-char-cpu'" in lines["out_dir"] and re.match(r"  max_iters +1300 ", lines["max_iters"])


# --- what a run says: where it resumed, in the singular where there is one --------------------------------------

def test_a_resumed_run_says_from_where_and_counts_in_the_singular(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=5"])
    printed = capsys.readouterr().out
    assert f"resuming from {os.path.join(out, 'ckpt.pt')} at iteration 4 (max_iters=5)\n" in printed, printed
    assert ", 1 process, data " in printed, printed  # (under torchrun: "2 processes")
    assert [timing.plural(n, "process", "processes") for n in (1, 2)] == ["1 process", "2 processes"]
    # one step (4), then the final eval at 5 and its checkpoint (the eval at 4 was the resumed checkpoint's)
    assert re.search(r", 1 step \d+\.\d s \(median \d+\.\d ms\), 1 eval \d+\.\d s, 1 checkpoint \d+\.\d s, the rest",
                     printed), printed
    assert printed.rstrip().endswith(", ".join(os.path.join(out, f) for f in ("ckpt.pt", "ckpt.pt.prev", "log.jsonl")))


# --- damaged and foreign checkpoints ---------------------------------------------------------------------------

def test_damaged_checkpoint_names_the_file_and_the_older_one(trained, tmp_path, monkeypatch, capsys):
    out = copy_run(trained, tmp_path)
    path = os.path.join(out, "ckpt.pt")
    with open(path, "r+b") as f:  # a copy cut short
        f.truncate(os.path.getsize(path) // 2)
    line = one_line_error(script("train.py", "--init_from=resume", f"--out_dir={out}"), "train.py", 1)
    assert f"checkpoint {path} is damaged" in line
    assert f"mv {path}.prev {path} to continue from its iter 2" in line, line
    line = one_line_error(main_in_process(monkeypatch, capsys, "sample.py", f"--out_dir={out}", "--device=cpu"),
                          "sample.py", 1)
    assert f"checkpoint {path} is damaged" in line and "iter 2" in line
    # following the advice works
    os.replace(path + ".prev", path)
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=3"])["iter_num"] == 3


def test_damaged_checkpoint_without_an_older_one(trained, tmp_path):
    out = copy_run(trained, tmp_path)
    path = os.path.join(out, "ckpt.pt")
    os.remove(path + ".prev")
    for content in (b"PK\x03\x04 not much of a zip", b""):
        with open(path, "wb") as f:
            f.write(content)
        with pytest.raises(errors.RunError, match=rf"{path} is damaged .*no older checkpoint is kept .*init_from=scratch"):
            train.main(["--init_from=resume", f"--out_dir={out}"])


def test_foreign_checkpoint(trained, tmp_path, monkeypatch, capsys):
    out = copy_run(trained, tmp_path)
    path = os.path.join(out, "ckpt.pt")
    torch.save({"weights": torch.zeros(3)}, path)  # somebody's tensors, not a train.py checkpoint
    line = one_line_error(main_in_process(monkeypatch, capsys, "train.py", "--init_from=resume", f"--out_dir={out}"),
                          "train.py", 2)
    assert f"{path} is not a train.py checkpoint (it has no model, optimizer, model_args" in line
    assert "the one before it is intact" in line
    torch.save(torch.nn.Linear(2, 2), path)  # a pickled module: weights_only loading refuses it
    with pytest.raises(errors.UsageError, match=rf"{path} is not a train.py checkpoint \(it holds Python objects"):
        train.main(["--init_from=resume", f"--out_dir={out}"])


def test_each_save_keeps_the_one_before(trained):
    now = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    before = torch.load(os.path.join(trained, "ckpt.pt.prev"), weights_only=True)
    assert (before["iter_num"], now["iter_num"]) == (2, 4)
    assert not [f for f in os.listdir(trained) if ".tmp" in f]


# --- a checkpoint whose vocabulary is not the dataset's --------------------------------------------------------

def test_resume_on_another_vocabulary(trained, tmp_path, monkeypatch, capsys):
    (tmp_path / "other.txt").write_text("abcdefg hijk\n" * 400)  # another, smaller character set
    prepare_data.prepare(str(tmp_path / "other"), source=str(tmp_path / "other.txt"), tokenizer="char")
    out = copy_run(trained, tmp_path)
    proc = main_in_process(monkeypatch, capsys, "train.py", "--init_from=resume", f"--out_dir={out}",
                           f"--dataset={tmp_path / 'other'}")
    line = one_line_error(proc, "train.py", 2)
    assert f"{os.path.join(out, 'ckpt.pt')} was trained on a char vocabulary of" in line
    assert f"dataset '{tmp_path / 'other'}'" in line and "a char vocabulary of 13" in line and "--dataset=" in line


# --- out of memory ---------------------------------------------------------------------------------------------

def test_out_of_memory_says_what_to_lower(dataset, trained, tmp_path, monkeypatch, capsys):
    """torch.OutOfMemoryError raised in a real run's third training forward: one line naming the settings."""
    out = copy_run(trained, tmp_path)
    forward, calls = train.GPT.forward, []

    def forward_running_out(self, *args, **kwargs):
        calls.append(self.training)
        if sum(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(train.GPT, "forward", forward_running_out)
    status = errors.run_main("train.py", train.main, ["--init_from=resume", f"--out_dir={out}", "--max_iters=10"])
    line = capsys.readouterr().err.strip()
    assert status == 1 and "\n" not in line
    assert line.startswith("train.py: error: out of memory on cpu (CUDA out of memory. Tried to allocate 20.00 GiB")
    for key in ("batch_size (now 8", "gradient_accumulation_steps, now 2", "block_size (now 32)", "n_layer",
                "compile=True", f"{os.path.join(out, 'ckpt.pt')} is kept"):
        assert key in line, (key, line)
    mlp = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]["mlp"]
    assert ("FUSED_OPS_GRAPHS=0" in line) == (mlp != "eager"), (mlp, line)  # the graphs' memory, where they run
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 4


@pytest.mark.parametrize("mlp,compile,fp8,tip", [("fused", False, False, True), ("auto", False, False, True),
                                                  ("eager", False, False, False), ("fused", True, False, False),
                                                  ("fused", False, True, True), ("fused", True, True, False)])
def test_out_of_memory_names_the_mlp_graphs_where_they_run(tmp_path, mlp, compile, fp8, tip):
    from helpers import stopping
    cfg = dict(out_dir=str(tmp_path), compile=compile, mlp=mlp, fp8=fp8, batch_size=8, gradient_accumulation_steps=1,
               block_size=64)
    line = str(stopping.out_of_memory(cfg, "cuda", torch.OutOfMemoryError("CUDA out of memory.")))
    assert ("FUSED_OPS_GRAPHS=0" in line) == tip, line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_out_of_memory_on_the_gpu(dataset, tmp_path):
    """A batch far too big for any GPU (each 16384 x 1024 x 1024 activation is 32 GiB in bf16): one line."""
    proc = script("train.py", *TINY[:-3], "--device=cuda", "--dtype=bfloat16", "--mlp=fused", "--n_embd=1024",
                  "--n_head=8", "--block_size=1024", "--batch_size=16384", "--eval_iters=1", "--max_iters=2",
                  f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", timeout=300)
    line = one_line_error(proc, "train.py", 1)
    assert "out of memory on cuda" in line and "lower batch_size (now 16384" in line and "block_size (now 1024)" in line


# --- Ctrl-C and SIGTERM ----------------------------------------------------------------------------------------

def start_training(dataset, out, *args):
    """A tiny run in a subprocess with plain log lines; returns it once it has logged a few steps."""
    cmd = [sys.executable, "train.py", *TINY, f"--dataset={dataset}", f"--out_dir={out}", "--max_iters=100000",
           "--eval_interval=100000", "--eval_iters=2", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    for line in proc.stdout:
        if line.startswith("iter 3:"):
            return proc
    raise AssertionError(f"no steps logged: {proc.wait()} {proc.stderr.read()[-3000:]}")


def test_ctrl_c_saves_and_prints_the_resume_command(dataset, tmp_path):
    out = str(tmp_path / "out")
    proc = start_training(dataset, out, "--seed=5")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    resume = err.strip().splitlines()[-1].strip()
    assert resume.startswith(f"{shlex.quote(stopping.python_command())} train.py --n_layer=2"), err
    assert resume.endswith("--init_from=resume"), err
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    stopped_at = ckpt["iter_num"]
    assert stopped_at >= 4 and ckpt["evaluated"] is False
    assert f"stopped by SIGINT at iter {stopped_at}; checkpoint written to {out}/ckpt.pt" in err
    # The printed command continues the run (here in-process, for one more iteration); that a resumed run
    # matches one never stopped, bit for bit, is test_train.py's test_resume_continues_exactly.
    args = shlex.split(resume)[2:] + [f"--max_iters={stopped_at + 1}"]
    assert train.main(args)["iter_num"] == stopped_at + 1


def test_resume_command_names_the_running_python(monkeypatch, tmp_path):
    here = tmp_path / "bin" / "python"
    here.parent.mkdir()
    here.write_text("")
    monkeypatch.setattr(sys, "executable", str(here))
    monkeypatch.setattr(shutil, "which", lambda name: str(here))
    assert stopping.python_command() == "python"  # "python" on PATH is this interpreter
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/python")
    assert stopping.python_command() == str(here)  # another python comes first on PATH
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert stopping.python_command() == str(here)  # no python on PATH at all


def sigterm_after_iter(iter_num, monkeypatch):
    """Send this process SIGTERM right after train.py reports step iter_num."""
    report = train.report_step

    def report_then_signal(log, bar, cfg, it, *args):
        report(log, bar, cfg, it, *args)
        if it == iter_num:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train, "report_step", report_then_signal)


def test_sigterm_stops_the_same_way(dataset, trained, tmp_path, monkeypatch):
    """SIGTERM (what schedulers and torchrun send) arriving mid-run, in-process: stop, save, exit status 143."""
    out = copy_run(trained, tmp_path)
    sigterm_after_iter(5, monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    resume = rf"\n  {re.escape(shlex.quote(stopping.python_command()))} train.py --out_dir=.* --max_iters=50 --init_from=resume$"
    with pytest.raises(errors.Stopped, match=r"stopped by SIGTERM at iter 6; .*" + resume) as e:
        train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=50"])
    assert e.value.exit_status == 128 + signal.SIGTERM
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 6  # the end of the step it came in
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_a_stop_keeps_the_best_checkpoint(dataset, trained, tmp_path, monkeypatch):
    """always_save_checkpoint=False (configs/finetune_shakespeare.py) keeps only the best model: a stop's
    checkpoint goes to ckpt.pt, where resume finds it, and the best one so far stays whole as ckpt_best.pt."""
    out = copy_run(trained, tmp_path)  # its ckpt.pt (iter 4) was written by an eval
    sigterm_after_iter(5, monkeypatch)
    with pytest.raises(errors.Stopped, match=r"stopped by SIGTERM at iter 6; checkpoint written to .*ckpt.pt \(the "
                                             r"best checkpoint, val loss \d\.\d{4}, is kept as .*ckpt_best.pt\)"):
        train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=50", "--always_save_checkpoint=False"])
    stop = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    best = torch.load(os.path.join(out, "ckpt_best.pt"), weights_only=True)
    assert (stop["iter_num"], stop["evaluated"]) == (6, False)  # saved before the eval due at 6
    assert best["evaluated"] is True and best["iter_num"] == 4
    assert best["best_val_loss"] == stop["best_val_loss"]


def test_second_ctrl_c_quits_at_once_and_keeps_the_checkpoint(dataset, trained, tmp_path, monkeypatch, capfd):
    """The first Ctrl-C asks for a save; a second one arriving while that checkpoint is being written quits at
    once, and the checkpoint before it is untouched."""
    out = copy_run(trained, tmp_path)
    path = os.path.join(out, "ckpt.pt")
    report, real_save, saves, second_at = train.report_step, torch.save, [], []

    def report_then_ctrl_c(log, bar, cfg, it, *args):
        report(log, bar, cfg, it, *args)
        if it == 5:
            os.kill(os.getpid(), signal.SIGINT)

    def slow_save(obj, f, *args, **kwargs):
        saves.append(obj["iter_num"])
        f.write(b"PK\x03\x04 the first bytes")
        second_at.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C
        time.sleep(60)  # never reached in full: the handler raises as soon as the signal is seen
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(train, "report_step", report_then_ctrl_c)
    monkeypatch.setattr(train.torch, "save", slow_save)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=50", "--eval_interval=1000"])
    assert time.perf_counter() - second_at[0] < 30  # the 60 s sleep was cut short (generous for a loaded machine)
    assert saves == [6]  # the stop's save (after iter 5's Ctrl-C, at the end of that step) was the one cut short
    assert "SIGINT: stopping after this step" in capfd.readouterr().err  # written to fd 2 by the handler
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["iter_num"] == 4  # the checkpoint from before the run
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_second_ctrl_c_in_a_real_process(dataset, trained, tmp_path):
    """SIGINT, then SIGINT again while the process is busy in a long eval: it exits at once (status 130) without
    the resume message, and the last checkpoint is whole."""
    out = copy_run(trained, tmp_path)
    # resumed at 4; the eval due at iter 6 is slow (many eval batches), and the signals arrive during it
    cmd = [sys.executable, "train.py", "--init_from=resume", f"--out_dir={out}", "--max_iters=100000",
           "--eval_interval=6", "--eval_iters=100000", "--log_interval=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    for line in proc.stdout:
        if line.startswith("iter 5:"):
            break
    time.sleep(0.5)  # now in the eval at iter 6
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # The eval it interrupted had minutes left; 30 s leaves room for a slow exit on a loaded machine.
    assert time.perf_counter() - t0 < 30
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "stopping after this step" in err and "SIGINT again: quitting now" in err, err
    assert err.strip().endswith("train.py: interrupted"), err
    assert "Resume with" not in err and "Traceback" not in err
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 4


def test_under_torchrun_a_signal_forwarded_twice_is_one_stop_request():
    """Ctrl-C under torchrun reaches each process twice (terminal, then torchrun): within the grace period the
    second is the same request, not the quit-at-once one; without a grace period it quits."""
    with stopping.StopOnSignal(master=False, grace=60) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    assert stop.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt), stopping.StopOnSignal(master=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
