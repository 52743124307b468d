"""Config parsing (helpers/config.py) and train.py's rejection of bad settings, before any training."""

import glob
import os
import subprocess
import sys

import pytest

from helpers import config
import train
from helpers.config import ConfigError, coerce, parse_config
from model import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {"max_iters": 100, "dropout": 0.0, "learning_rate": 1e-3, "compile": False, "out_dir": "out",
            "vocab_size": None}
TYPES = {"vocab_size": (int, type(None))}


def test_overrides_parse_python_literals_and_plain_strings():
    cfg = parse_config(DEFAULTS, ["--max_iters=5e3", "--dropout=0.1", "--learning_rate=1", "--compile=True",
                                  "--out_dir=123", "--vocab_size=65"], TYPES)
    assert cfg == {"max_iters": 5000, "dropout": 0.1, "learning_rate": 1.0, "compile": True, "out_dir": "123",
                   "vocab_size": 65}
    assert isinstance(cfg["learning_rate"], float) and isinstance(cfg["max_iters"], int)
    assert parse_config(DEFAULTS, ["--compile"])["compile"] is True  # bare flag for booleans
    assert parse_config(DEFAULTS, ["--compile=false"])["compile"] is False
    assert parse_config(DEFAULTS, ["--max-iters=7"])["max_iters"] == 7  # dashes work too
    assert parse_config(DEFAULTS, ["--out_dir=out dir/x"])["out_dir"] == "out dir/x"
    assert DEFAULTS["max_iters"] == 100  # the defaults dict is not modified


@pytest.mark.parametrize("arg, words", [
    ("--max_iters=abc", ["max_iters", "int", "'abc'"]),
    ("--max_iters=1.5", ["max_iters", "int"]),
    ("--dropout=high", ["dropout", "float", "'high'"]),
    ("--compile=2", ["compile", "bool"]),
    ("--learning_rate=True", ["learning_rate", "float"]),
    ("--vocab_size=big", ["vocab_size", "int or None"]),
    ("--max_iters", ["max_iters", "needs a value"]),
    ("--max_itres=10", ["unknown config key 'max_itres'", "Did you mean 'max_iters'", "Valid keys:", "dropout"]),
])
def test_bad_overrides_name_the_key(arg, words):
    with pytest.raises(ConfigError) as e:
        parse_config(DEFAULTS, [arg], TYPES)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_file_then_command_line(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nmax_iters = 50\ndropout = math.sqrt(0.01)\n_private = 'ignored'\n")
    cfg = parse_config(DEFAULTS, [str(f), "--max_iters=60"])
    assert cfg["max_iters"] == 60 and cfg["dropout"] == pytest.approx(0.1)
    f.write_text("max_iter = 50\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'max_iter' \(in .*c.py\).*max_iters"):
        parse_config(DEFAULTS, [str(f)])
    f.write_text("dropout = 'lots'\n")
    with pytest.raises(ConfigError, match="'dropout' expects float"):
        parse_config(DEFAULTS, [str(f)])
    with pytest.raises(ConfigError, match="config file not found: nope.py"):
        parse_config(DEFAULTS, ["nope.py"])


def test_coerce_rejects_bool_for_numbers():
    assert coerce("k", 3, (float,)) == 3.0
    with pytest.raises(ConfigError):
        coerce("k", True, (int,))


def test_help_lists_keys(capsys):
    assert train.main(["--help"]) is None
    out = capsys.readouterr().out
    assert all(k in out for k in ("gradient_accumulation_steps", "mlp", "sample_after", "init_from"))


@pytest.mark.parametrize("arg, match", [
    ("--mlp=turbo", r"'mlp' must be one of \('eager', 'fused', 'auto'\), got 'turbo'"),
    ("--activation=swish", r"'activation' must be one of"),
    ("--n_head=5", r"'n_embd' \(32\) must be divisible by 'n_head' \(5\)"),
    ("--init_from=gpt3", r"'init_from' must be scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl or a folder"),
    ("--dtype=float8", r"'dtype' must be one of"),
    ("--batch_size=0", r"'batch_size' must be positive"),
    ("--dropout=1.5", r"'dropout' must be in \[0, 1\)"),
])
def test_train_rejects_bad_values(tmp_path, arg, match):
    # All fail fast, before the (here missing) dataset is looked for.
    args = ["--n_embd=32", "--n_head=2", "--dataset=no_such_data", f"--data_root={tmp_path}", "--max_iters=0",
            f"--out_dir={tmp_path}", "--progress=False", "--plot=False", arg]
    with pytest.raises(ConfigError, match=match):
        train.main(args)


def test_missing_dataset_and_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"dataset 'no_such_data'.*not found.*shakespeare_char"):
        train.main(["--dataset=no_such_data", f"--data_root={tmp_path}", f"--out_dir={tmp_path}/o"])
    # as train.py prints it: one line that names the dataset once (it said "dataset 'x': dataset 'x' not found")
    from helpers import errors
    argv = ["--dataset=no_such_data", f"--data_root={tmp_path}", f"--out_dir={tmp_path}/o"]
    assert errors.run_main("train.py", train.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: dataset 'no_such_data' not found: no train.bin/val.bin/meta.json in ") and \
        err.count("dataset 'no_such_data'") == 1 and err.count("\n") == 1, err
    assert f"--out_dir={tmp_path / 'no_such_data'}" in err  # (where prepare.py would put it)
    with pytest.raises(ConfigError, match=r"init_from='resume' but there is no checkpoint at .*ckpt.pt"):
        train.main(["--init_from=resume", f"--out_dir={tmp_path}/o"])


def test_cli_exits_nonzero_with_clear_message():
    proc = subprocess.run([sys.executable, "train.py", "configs/shakespeare_char_cpu.py", "--dropout=high"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "train.py: error: config key 'dropout' expects float, got 'high'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_shipped_configs_are_valid(path):
    cfg = parse_config(config.DEFAULTS, [path], config.KEY_TYPES)
    config.check(cfg)
    GPTConfig(**{k: cfg[k] for k in config.MODEL_KEYS}, vocab_size=cfg["vocab_size"] or 65)  # model.py accepts it


def test_config_values():
    base = os.path.join(ROOT, "configs")
    baby = parse_config(config.DEFAULTS, [os.path.join(base, "shakespeare_char.py")], config.KEY_TYPES)
    assert {k: baby[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "dropout", "max_iters",
                                 "lr_decay_iters", "min_lr", "beta2", "warmup_iters", "eval_interval", "eval_iters",
                                 "learning_rate", "dataset")} == {
        "n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 64, "dropout": 0.2,
        "max_iters": 5000, "lr_decay_iters": 5000, "min_lr": 1e-4, "beta2": 0.99, "warmup_iters": 100,
        "eval_interval": 250, "eval_iters": 200, "learning_rate": 1e-3, "dataset": "shakespeare_char"}
    cpu = parse_config(config.DEFAULTS, [os.path.join(base, "shakespeare_char_cpu.py")], config.KEY_TYPES)
    assert (cpu["device"], cpu["dtype"], cpu["compile"], cpu["mlp"]) == ("cpu", "float32", False, "auto")
    gpt2 = parse_config(config.DEFAULTS, [os.path.join(base, "gpt2_124m.py")], config.KEY_TYPES)
    assert (gpt2["n_layer"], gpt2["n_head"], gpt2["n_embd"], gpt2["block_size"], gpt2["vocab_size"]) == (12, 12, 768, 1024, 50304)
    assert gpt2["batch_size"] * gpt2["gradient_accumulation_steps"] * gpt2["block_size"] == 491520


def test_compile_takes_booleans_or_a_mode():
    """train.py's compile: True / False in any spelling, or a torch.compile mode; anything else is rejected
    by name before training starts."""
    parse = lambda *argv: parse_config(config.DEFAULTS, list(argv), config.KEY_TYPES)
    assert [parse(a)["compile"] for a in ("--compile", "--compile=True", "--compile=false", "--compile=off")] == \
        [True, True, False, False]
    assert parse("--compile=reduce-overhead")["compile"] == "reduce-overhead"
    config.check(parse("--compile=reduce-overhead"))
    with pytest.raises(ConfigError, match="config key 'compile' must be True, False or one of default, reduce-overhead"):
        config.check(parse("--compile=fast"))
    config.check(parse("--compile=reduce-overhead", "--compile_regions=True"))
    with pytest.raises(ConfigError, match="config key 'compile_regions' .* needs compile=True or a compile mode"):
        config.check(parse("--compile_regions=True"))


def test_resume_with_compile_off_turns_the_checkpoints_compile_regions_off(tmp_path):
    """A run trained with --compile_regions resumes with --compile=False as asked (its compile_regions goes with its
    compile), where it stopped on 'compile_regions needs compile'; asked for on the command line, it still does."""
    from helpers import checkpoint
    run = {**config.DEFAULTS, "compile": True, "compile_regions": True}
    arch = {k: run[k] for k in config.ARCH_KEYS if k in run}
    ckpt = {"model": {}, "optimizer": {}, "model_args": {**arch, "vocab_size": 65}, "config": run, "meta": {},
            "iter_num": 10, "best_val_loss": 2.0, "rng": {}}
    checkpoint.save(ckpt, checkpoint.path(str(tmp_path)))
    resume = ["--init_from=resume", f"--out_dir={tmp_path}"]
    cfg, _ = config.load(resume)
    assert cfg["compile"] is True and cfg["compile_regions"] is True  # (the checkpoint's settings)
    cfg, _ = config.load([*resume, "--compile=False"])
    assert cfg["compile"] is False and cfg["compile_regions"] is False
    with pytest.raises(ConfigError, match="'compile_regions'.*needs compile=True"):
        config.load([*resume, "--compile=False", "--compile_regions=True"])
