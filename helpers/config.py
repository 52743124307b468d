"""
train.py's settings: parsed by configurator.py, then checked here before any work, so that a bad value is one
line naming its key. On --init_from=resume the checkpoint's own config is the base, and its weights fix the
architecture keys whatever the command line says.
"""

import os
import sys

import checkpoint
import runtime
from configurator import ConfigError, parse_config
from model import GPTConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that add CUDA graphs
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "mlp", "activation", "fuse_ln", "fp8")
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "activation")  # fixed by the weights
PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # OpenAI's GPT-2 sizes, as GPT.from_pretrained names them


def load(defaults, argv, key_types):
    """(cfg, checkpoint): the checked settings, and on --init_from=resume the checkpoint they continue;
    (None, None) after --help."""
    cfg = parse_config(defaults, argv, key_types)
    if cfg is None:
        return None, None
    ckpt = None
    if cfg["init_from"] == "resume":
        path = checkpoint.path(cfg["out_dir"])
        if not os.path.isfile(path):
            raise ConfigError(f"init_from='resume' but there is no checkpoint at {path}")
        ckpt = checkpoint.read(path)
        # Only what this command line says changes the run's config (e.g. max_iters). The out_dir is where the
        # checkpoint was found, not where it was first written (the folder may have been renamed).
        base = {**defaults, **{k: v for k, v in ckpt["config"].items() if k in defaults}}
        cfg = dict(parse_config(base, argv, key_types), out_dir=cfg["out_dir"])
        fix_architecture(cfg, ckpt["model_args"], base, "on resume: the checkpoint's model has")
    check(cfg)
    return cfg, ckpt


def fix_architecture(cfg, model_args, unchanged, why, keys=ARCH_KEYS):
    """Set cfg's architecture keys from the weights' model_args, warning about any value given otherwise."""
    for k in keys:
        if cfg[k] not in (unchanged[k], model_args[k]) and os.environ.get("RANK", "0") == "0":
            print(f"warning: {k}={cfg[k]!r} ignored {why} {k}={model_args[k]!r}", file=sys.stderr)
        cfg[k] = model_args[k]


def check(cfg):
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    need(cfg["init_from"] in ("scratch", "resume", *PRETRAINED) or os.path.isdir(cfg["init_from"]),
         f"config key 'init_from' must be scratch, resume, {', '.join(PRETRAINED)} or a folder with a Hugging Face "
         f"GPT-2 checkpoint; got {cfg['init_from']!r}, which is none of these (and no such folder)")
    need(cfg["dtype"] in ("auto", *runtime.DTYPES),
         f"config key 'dtype' must be one of auto, {', '.join(runtime.DTYPES)}; got {cfg['dtype']!r}")
    for k in ("batch_size", "block_size", "gradient_accumulation_steps", "eval_interval", "log_interval", "eval_iters"):
        need(cfg[k] > 0, f"config key '{k}' must be positive, got {cfg[k]}")
    need(cfg["max_iters"] >= 0, f"config key 'max_iters' must be >= 0, got {cfg['max_iters']}")
    need(0.0 <= cfg["dropout"] < 1.0, f"config key 'dropout' must be in [0, 1), got {cfg['dropout']}")
    need(isinstance(cfg["compile"], bool) or cfg["compile"] in COMPILE_MODES,
         f"config key 'compile' must be True, False or one of {', '.join(COMPILE_MODES)}; got {cfg['compile']!r}")
    try:  # model.py validates mlp, activation, n_embd % n_head: ask it now, before any data is prepared
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise ConfigError(str(e)) from e
