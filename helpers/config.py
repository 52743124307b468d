"""
train.py's configuration, all in one place: its defaults (DEFAULTS below), how config files and --key=value
override them (parse_config), and the checks that run before any work (check), so that a bad value is one line
naming its key. On --init_from=resume the checkpoint's own config is the base, and its weights fix the
architecture keys whatever the command line says (load, fix_architecture).

    python train.py configs/shakespeare_char.py --batch_size=32 --compile=False

Overrides in nanoGPT style, but checked: each config file (a plain Python file) is executed and its top-level
names override the defaults; then each --key=value does, its value parsed with ast.literal_eval (falling back to
the raw string). Unlike nanoGPT's exec-into-globals, unknown keys and values of the wrong type stop with a message
naming the key, instead of silently creating a new global or crashing later.

The checks of a setting against the machine it runs on (is there Triton, FP8 tensor cores, a GPU) need the
device first, so they live in helpers/runtime.py beside it: check_mlp, check_fp8, check_interpreter_dtype;
train.py calls them right after load(). The checks that need the dataset (vocab_size, the vocabulary a resumed
model was trained on) are train.py's build_model and check_same_vocabulary.
"""

import ast
import difflib
import os
import runpy
import sys
import tokenize
import types

from helpers import checkpoint, errors, runtime
from model import GPTConfig

# train.py's settings and their defaults (GPT-2 small, as in nanoGPT); configs/*.py and --key=value override them.
# The comments are train.py --help's text (describe_keys): a key's on its line, its group's on a line of its own.
DEFAULTS = dict(
    # I/O
    out_dir="out",  # the run's folder: ckpt.pt, ckpt.pt.prev, log.jsonl, loss.png
    eval_interval=2000,  # iterations between evals (each may save a checkpoint)
    log_interval=1,  # iterations between log lines
    eval_iters=200,  # batches per eval, of train and of val
    eval_only=False,  # evaluate once and exit
    always_save_checkpoint=True,  # False: save only when the val loss improves (and keep it as ckpt_best.pt)
    init_from="scratch",  # scratch, resume (out_dir/ckpt.pt), gpt2[-medium|-large|-xl], or a Hugging Face GPT-2 folder
    # wandb logging (off by default; pip install wandb)
    wandb_log=False,
    wandb_project="owt",
    wandb_run_name="gpt2",
    # data
    dataset="shakespeare",  # a name data.DATASETS knows, or a folder with train.bin, val.bin, meta.json
    data_root="data",  # where a named dataset's folder is (prepared there on first use)
    batch_size=12,  # micro-batch size of each process
    block_size=1024,  # context length, in tokens
    gradient_accumulation_steps=40,  # over all processes together; divided by the world size
    # model (GPT-2 small)
    n_layer=12,
    n_head=12,
    n_embd=768,  # the model's width
    dropout=0.0,
    bias=False,  # biases in the Linears and LayerNorms
    mlp="auto",  # "eager" | "fused" | "auto"
    activation="gelu",  # gelu, gelu_tanh, relu, relu2 | gated: swiglu, geglu, geglu_tanh, sigmoid_tanh
    fuse_ln=False,  # fold each block's second LayerNorm into the fused MLP (mlp="fused" or "auto")
    fp8=False,  # FP8 GEMMs in the fused MLP (mlp="fused", an Ada or Hopper GPU): fused_ops/fp8/
    fp8_reach="mlp",  # with fp8: "mlp" | "blocks" (the attention's two projections in FP8 too)
    classifier="eager",  # "eager" | "fused" (LM head + cross-entropy as one operator) | "fp8" (its FP8 form)
    vocab_size=None,  # None: the dataset's vocabulary size
    # AdamW
    learning_rate=6e-4,  # the peak, after warmup
    max_iters=600000,  # optimizer steps in all
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # 0 disables clipping
    # learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
    decay_lr=True,  # False: learning_rate throughout
    warmup_iters=2000,
    lr_decay_iters=600000,
    min_lr=6e-5,
    # system
    device="auto",  # "auto" (cuda > mps > cpu), "cpu", "cuda", "cuda:1", "mps"
    dtype="auto",  # "auto" (bf16 on GPUs that have it, else fp16 on cuda, fp32 elsewhere) | bfloat16 | float16 | float32
    compile=False,  # True (torch.compile), or a torch.compile mode: "reduce-overhead" adds CUDA graphs
    compile_regions=False,  # with compile: each block compiled apart, once for all (a shorter start; runtime.py)
    seed=1337,  # each process adds its rank
    # extras
    sample_after=False,  # print a short sample when training ends
    plot=True,  # write out_dir/loss.png when training ends
    progress=True,  # tqdm progress bar
)
# the keys whose default does not say every type they take
KEY_TYPES = {"vocab_size": (int, type(None)), "compile": (bool, str)}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "mlp", "activation", "fuse_ln", "fp8",
              "fp8_reach", "classifier")
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "activation")  # fixed by the weights
PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # OpenAI's GPT-2 sizes, as GPT.from_pretrained names them



# -----------------------------------------------------------------------------
# parsing: defaults < config files < --key=value

class ConfigError(errors.UsageError, ValueError):
    """A bad config file, key or value; the message says which and what would be valid."""


def _type_name(types_):
    return " or ".join("None" if t is type(None) else t.__name__ for t in types_)


def coerce(key, value, allowed, raw=None):
    """Return value converted to one of the allowed types, or raise ConfigError.

    raw is the command-line text, if any: str keys take it verbatim (so --out_dir=123 is the folder '123').
    """
    if value is None and type(None) in allowed:
        return None
    if bool in allowed:  # before the verbatim-string rule, for keys that take both: --compile=True
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
    if str in allowed and raw is not None:
        return value if isinstance(value, str) else raw
    if int in allowed and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():  # --max_iters=5e3
            return int(value)
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    raise ConfigError(f"config key '{key}' expects {_type_name(allowed)}, got {value!r} ({type(value).__name__})")


def _unknown(key, valid, where):
    hint = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{hint[0]}'?" if hint else ""
    return ConfigError(f"unknown config key '{key}' ({where}).{hint} Valid keys: {', '.join(sorted(valid))}")


def parse_config(defaults, argv, key_types=None):
    """Merge defaults, config files and --key=value overrides from argv into a new dict.

    key_types maps keys to a tuple of allowed types where the default's type is not the whole story
    (e.g. keys whose default is None). Returns None when help was asked for (after printing it).
    """
    key_types = key_types or {}
    allowed = {k: key_types.get(k, (type(v),)) for k, v in defaults.items()}
    config = dict(defaults)
    for arg in argv:
        if arg in ("-h", "--help"):
            print_help(config)
            return None
        if not arg.startswith("--"):  # a config file
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg} (expected a .py file or --key=value)")
            try:
                namespace = runpy.run_path(arg)
            except Exception as e:
                raise ConfigError(f"config file {arg} failed to run: {type(e).__name__}: {e}") from e
            for k, v in namespace.items():
                if k.startswith("_") or isinstance(v, (types.ModuleType, types.FunctionType, type)):
                    continue  # helper imports and functions in the config file are not keys
                if k not in allowed:
                    raise _unknown(k, allowed, f"in {arg}")
                config[k] = coerce(k, v, allowed[k])
            continue
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")  # --max-iters works too
        if key not in allowed:
            raise _unknown(key, allowed, f"from {arg}")
        if not eq:
            if bool not in allowed[key]:  # a bare --flag only makes sense for booleans
                raise ConfigError(f"config key '{key}' needs a value: --{key}=VALUE")
            text = "True"
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # not a Python literal: a plain string such as --dataset=shakespeare_char
        config[key] = coerce(key, value, allowed[key], raw=text)
    return config


def print_help(config):
    """train.py --help: the usage, where settings come from, then every key with its value in config (the defaults,
    or what the arguments before --help made of them) and its comment in DEFAULTS, under its group's heading."""
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    names = sorted(n for n in os.listdir(configs) if n.endswith(".py")) if os.path.isdir(configs) else []
    print("usage: python train.py [config_file.py ...] [--key=value ...]\n\n"
          "Each key starts at its default (GPT-2 small, as in nanoGPT), then each config file and --key=value overrides\n"
          "it, in order; the values below are what the arguments before --help make of them. The runs, in configs/:\n"
          f"    {', '.join(names)}\n"
          "e.g. python train.py configs/shakespeare_char_cpu.py --max_iters=500")
    described = describe_keys()
    width = max(map(len, config))
    values = {k: repr(v) for k, v in config.items()}
    value_width = min(max(map(len, values.values())), 14)
    group = None
    for k in [*described, *sorted(set(config) - set(described))]:
        if k not in config:
            continue
        heading, comment = described.get(k, ("", ""))
        if heading != group:
            group = heading
            print(f"\n{heading}:" if heading else "")
        print(f"  {k:<{width}}  {values[k]:<{value_width}}  {comment}".rstrip())


def describe_keys(path=__file__):
    """{key: (its group's heading, its comment)} for DEFAULTS, in order, read from its source in this file: the
    comments there are the one description of the keys (a key's on its line, a group's on a line of its own)."""
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(f.readline))
    start = next(i for i, t in enumerate(tokens) if t.string == "DEFAULTS" and t.start[1] == 0)
    described, heading, key, depth = {}, "", None, 0
    for before, tok in zip(tokens[start:], tokens[start + 1:]):
        depth += {"(": 1, ")": -1}.get(tok.string, 0) if tok.type == tokenize.OP else 0
        if tok.string == ")" and depth == 0:
            break
        if depth == 1 and tok.string == "=" and before.type == tokenize.NAME:
            key = before.string
            described[key] = (heading, "")
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line.lstrip().startswith("#"):
                heading = text
            elif key is not None and tok.start[0] == before.start[0]:
                described[key] = (heading, text)
    return described


# -----------------------------------------------------------------------------
# loading (resume) and checking

def load(argv, defaults=DEFAULTS, key_types=KEY_TYPES):
    """(cfg, checkpoint): the checked settings, and on --init_from=resume the checkpoint they continue;
    (None, None) after --help."""
    cfg = parse_config(defaults, argv, key_types)
    if cfg is None:
        return None, None
    ckpt = None
    if cfg["init_from"] == "resume":
        given = cfg  # this command line's own settings
        path = checkpoint.path(cfg["out_dir"])
        if not os.path.isfile(path):
            raise ConfigError(f"init_from='resume' but there is no checkpoint at {path}")
        ckpt = checkpoint.read(path)
        # Only what this command line says changes the run's config (e.g. max_iters). The out_dir is where the
        # checkpoint was found, not where it was first written (the folder may have been renamed).
        base = {**defaults, **{k: v for k, v in ckpt["config"].items() if k in defaults}}
        cfg = dict(parse_config(base, argv, key_types), out_dir=cfg["out_dir"])
        if not cfg["compile"] and not given["compile_regions"]:  # --compile=False turns off the run's
            cfg["compile_regions"] = False  # compile_regions too, unless this command line asks for it
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
    need(not cfg["compile_regions"] or cfg["compile"],
         "config key 'compile_regions' compiles the blocks apart under torch.compile: it needs compile=True or a "
         "compile mode; got compile=False")
    try:  # model.py validates mlp, activation, n_embd % n_head: ask it now, before any data is prepared
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise ConfigError(str(e)) from e
