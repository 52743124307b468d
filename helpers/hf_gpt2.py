"""
GPT-2 checkpoints in Hugging Face's format: reading them into our GPT, and writing ours out.

Our GPT is GPT-2's network, so a checkpoint moves both ways with no custom code on the other side:

    reading  GPT.from_pretrained(name_or_folder)   gpt2 ... gpt2-xl from the Hugging Face cache or hub, or a folder
    writing  GPT.save_pretrained(folder, meta)     a folder transformers' GPT2LMHeadModel.from_pretrained loads

What differs between the two layouts is handled here, once:
- GPT-2 stores its linear layers as Conv1D, whose weight is (in, out): the transpose of nn.Linear's.
- lm_head is tied to wte, so files hold wte only.
- GPT-2 always has biases: a model trained with bias=False is written with zero biases (adding 0 is exact).
- activations: ours <-> transformers' activation_function in ACTIVATIONS_OUT / ACTIVATIONS_IN. A gated MLP
  (swiglu, ...) has no GPT-2 equivalent and is refused. fuse_ln is a way to compute, not a parameter: it exports.
- vocabulary: training pads it (GPT-2's 50257 tokens to 50304, for speed); the rows past the dataset's vocabulary
  are never a target, so an export with the dataset's meta cuts them off. Logits of real tokens are unchanged.
This module never imports transformers: it reads and writes the files itself. Nor does it import model.py: GPT's
from_pretrained and save_pretrained call it, handing over the classes (imports point one way: model -> here).
"""

import json
import logging
import os
import pickle
import shutil
import threading

import torch
import torch.nn as nn

from helpers import data, errors

GPT2_NAMES = {  # our name -> its Hugging Face hub repository
    "gpt2": "openai-community/gpt2",  # 124M parameters
    "gpt2-medium": "openai-community/gpt2-medium",  # 350M
    "gpt2-large": "openai-community/gpt2-large",  # 774M
    "gpt2-xl": "openai-community/gpt2-xl",  # 1558M
}
# how to run it, not its architecture
PRETRAINED_OVERRIDES = ("mlp", "dropout", "block_size", "fuse_ln", "fp8", "fp8_reach", "classifier")
# Our activation -> transformers' name for the same function. gelu_new is GPT-2's own tanh GELU, which every
# GPT-2 runtime knows (gelu_pytorch_tanh is the same function, also read back).
ACTIVATIONS_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "relu2": "relu2"}
ACTIVATIONS_IN = {**{v: k for k, v in ACTIVATIONS_OUT.items()}, "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh"}
GPT2_EOT = "<|endoftext|>"  # GPT-2's one special token: beginning, end and unknown all at once
# The checkpoint files, preferred first; a sharded checkpoint has an index naming its files instead.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Seconds for config.json (under 1 KB) to arrive: a slower hub means no usable network. The hub client's own
# timeouts do not bound it (it retries; a server that accepts and never answers held it for minutes).
HUB_TIMEOUT = 10
FOLDER_HINT = "pass --init_from=<folder> with a local checkpoint (config.json + model.safetensors)"
# The first line of the README.md an export writes: how a later export knows it may replace the folder.
EXPORT_MARK = "<!-- a GPT-2 checkpoint written by GPT.save_pretrained (hf_gpt2.py) -->"


# -----------------------------------------------------------------------------------------------------
# reading: GPT.from_pretrained

def from_pretrained(cls, config_cls, name_or_path, **overrides):
    """GPT.from_pretrained's work (see its docstring): a model of class cls (GPT), built from a config_cls
    (GPTConfig) of the checkpoint's shape, with the checkpoint's weights."""
    unknown = sorted(set(overrides) - set(PRETRAINED_OVERRIDES))
    if unknown:
        raise errors.UsageError(f"from_pretrained: override {unknown[0]!r} is not allowed: the checkpoint fixes "
                                f"the architecture; only {', '.join(PRETRAINED_OVERRIDES)} can change")
    config_file, weight_files = gpt2_checkpoint_files(name_or_path)
    shape = read_gpt2_config(config_file)
    block_size = overrides.pop("block_size", None)
    if block_size is not None and not (isinstance(block_size, int) and 0 < block_size <= shape["block_size"]):
        n = shape["block_size"]
        raise errors.UsageError(f"block_size={block_size!r}: GPT-2 from {name_or_path} has {n} positions "
                                f"(n_positions in {config_file}); pass an integer in 1..{n}")
    try:  # GPT-2 has biases everywhere (zeros where our model had none)
        config = config_cls(**shape, bias=True, **overrides)
    except ValueError as e:  # a bad mlp or dropout, fuse_ln with mlp="eager"
        raise errors.UsageError(str(e)) from e
    model = cls(config)
    load_gpt2_weights(model, weight_files)
    if block_size is not None and block_size < config.block_size:
        model.crop_block_size(block_size)
    return model


def tokenizer_meta(name_or_path, vocab_size):
    """The dataset metadata (data.get_tokenizer's argument) of a checkpoint: a character vocabulary where an export
    of ours wrote char_vocab.json, else GPT-2's BPE."""
    chars_file = os.path.join(name_or_path, "char_vocab.json")
    if not os.path.isfile(chars_file):
        return {"tokenizer": "gpt2", "vocab_size": vocab_size}
    try:
        with open(chars_file, encoding="utf-8") as f:
            chars = json.load(f)["chars"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise errors.UsageError(f"{chars_file}: not a list of characters under 'chars' ({e!r})") from e
    return {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}


def gpt2_checkpoint_files(name_or_path):
    """(config.json, [weight files]) of a checkpoint folder, or of a GPT-2 name from the Hugging Face cache or hub.
    An existing folder wins over a name, as in transformers."""
    if os.path.isdir(name_or_path):
        return _folder_files(name_or_path)
    if name_or_path in GPT2_NAMES:
        return _hub_files(name_or_path)
    raise errors.UsageError(f"init_from={name_or_path!r} is neither a GPT-2 name ({', '.join(GPT2_NAMES)}) "
                            f"nor an existing folder")


def _folder_files(folder):
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise errors.UsageError(f"{folder} has no config.json: init_from needs a Hugging Face GPT-2 checkpoint "
                                "folder (config.json with model.safetensors or pytorch_model.bin)")
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return config_file, _shards(path) if name.endswith(".index.json") else [path]
    raise errors.UsageError(f"{folder} has config.json but no weights: expected {' or '.join(WEIGHT_FILES)}")


def _shards(index_file):
    """The files a sharded checkpoint's index names (save_pretrained splits large models)."""
    try:
        with open(index_file) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise errors.UsageError(f"{index_file}: not a checkpoint index with a 'weight_map' ({e!r})") from e
    paths = [os.path.join(os.path.dirname(index_file), name) for name in files]
    for path in paths:
        if not os.path.isfile(path):
            raise errors.UsageError(f"{index_file} names {os.path.basename(path)}, which is missing from its folder")
    return paths


def _hub_files(name):
    """The cached files if there are any (no network needed), else a download, which fails fast offline."""
    from huggingface_hub import constants, hf_hub_download

    repo = GPT2_NAMES[name]
    for repo_id in (repo, name):  # older transformers cached GPT-2 under the short name
        for weights in ("model.safetensors", "pytorch_model.bin"):
            try:
                return (hf_hub_download(repo_id, "config.json", local_files_only=True),
                        [hf_hub_download(repo_id, weights, local_files_only=True)])
            except FileNotFoundError:  # huggingface_hub's LocalEntryNotFoundError: not in the cache
                pass
    if constants.HF_HUB_OFFLINE:
        raise errors.UsageError(f"init_from={name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                                f"HF_HUB_OFFLINE is set: {FOLDER_HINT}, or download it once online")
    try:
        config_file = _within(HUB_TIMEOUT, lambda: hf_hub_download(repo, "config.json", etag_timeout=HUB_TIMEOUT))
        return config_file, [hf_hub_download(repo, "model.safetensors", etag_timeout=HUB_TIMEOUT)]
    except Exception as e:  # no network, hub down, proxy...: whatever it is, the way out is the same
        # A download _within left behind keeps retrying in its thread until the process exits, and huggingface_hub
        # logs each retry to stderr: silenced, so that the one-line error below stays the last line.
        logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise errors.UsageError(f"init_from={name!r} is not in the Hugging Face cache and downloading {repo} failed "
                                f"({type(e).__name__}: {reason}): {FOLDER_HINT}") from e


def _within(seconds, fn):
    """fn() in a daemon thread, or TimeoutError if it has not returned after seconds (it is left behind)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def read_gpt2_config(path):
    """GPTConfig's architecture keys from a Hugging Face GPT-2 config.json, after checking that the rest of it
    describes exactly what our GPT computes (anything else would load and silently compute wrong)."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise errors.UsageError(f"{path}: cannot read it as JSON ({e})") from e
    try:
        shape = dict(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], block_size=hf["n_positions"],
                     vocab_size=hf.get("vocab_size", 50257))  # transformers' default: GPT-2's BPE
    except KeyError as e:
        raise errors.UsageError(f"{path} has no {e.args[0]!r}: not a GPT-2 config") from None
    # key: (what transformers assumes when the key is absent, the values our GPT computes)
    required = {
        "model_type": ("gpt2", ("gpt2",)),
        "activation_function": ("gelu_new", tuple(ACTIVATIONS_IN)),
        "n_inner": (None, (None, 4 * shape["n_embd"])),
        "layer_norm_epsilon": (1e-5, (1e-5,)),  # nn.LayerNorm's default
        "scale_attn_weights": (True, (True,)),
        "scale_attn_by_inverse_layer_idx": (False, (False,)),
        "tie_word_embeddings": (True, (True,)),  # lm_head is wte
    }
    for key, (default, allowed) in required.items():
        if hf.get(key, default) not in allowed:
            raise errors.UsageError(f"{path}: {key}={hf[key]!r}, but GPT-2 (and our GPT) needs "
                                    f"{' or '.join(map(repr, allowed))}")
    return {**shape, "activation": ACTIVATIONS_IN[hf.get("activation_function", "gelu_new")]}


def _read_tensors(path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if path.endswith(".safetensors"):
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise errors.RunError(f"{path}: cannot read its tensors ({type(e).__name__}: {e}); "
                              f"the file is damaged or incomplete: download or save it again") from e


def load_gpt2_weights(model, weight_files):
    """Copy a Hugging Face GPT-2 state dict into our GPT, checking every name and shape."""
    hf = {}  # our name without "transformer." -> (tensor, file, its name in the file)
    for path in weight_files:
        for key, tensor in _read_tensors(path).items():
            # OpenAI's original files have no "transformer." prefix; attn.bias / attn.masked_bias are
            # transformers' causal-mask buffers, not weights; lm_head.weight is wte (tied).
            if not key.endswith((".attn.bias", ".attn.masked_bias")) and key != "lm_head.weight":
                hf[key.removeprefix("transformer.")] = (tensor, path, key)
    ours = {k.removeprefix("transformer."): p for k, p in model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = sorted(set(ours) - set(hf)), sorted(set(hf) - set(ours))
    if missing:
        raise errors.UsageError(f"{', '.join(weight_files)} has no tensor {missing[0]!r} ({len(missing)} missing): "
                                f"not a complete GPT-2 checkpoint for its config.json")
    if unexpected:
        _, path, key = hf[unexpected[0]]
        raise errors.UsageError(f"{path} has a tensor {key!r} that GPT-2 does not ({len(unexpected)} unexpected): "
                                f"not a GPT-2 checkpoint for its config.json")
    with torch.no_grad():
        for name, param in ours.items():  # state_dict tensors share storage with the parameters
            tensor, path, key = hf[name]
            conv1d = name.endswith(CONV1D_WEIGHTS)
            want = tuple(param.shape[::-1] if conv1d else param.shape)  # in the file's layout
            if tuple(tensor.shape) != want:
                raise errors.UsageError(f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, but its "
                                        f"config.json implies {want}")
            param.copy_(tensor.t() if conv1d else tensor)  # to fp32, whatever the file holds


# -----------------------------------------------------------------------------------------------------
# writing: GPT.save_pretrained

def save_pretrained(model, folder, meta=None):
    """GPT.save_pretrained's work (see its docstring). The files are written into a new folder beside `folder`,
    which then takes its place: a failure leaves no half-written export, and whatever was in `folder` before."""
    check_exportable(model.config)
    vocab_size = exported_vocab_size(model.config, meta)
    if os.path.lexists(folder) and not _replaceable(folder):
        raise errors.UsageError(f"{folder} exists and is not an earlier export (an export replaces only those): "
                                f"choose another folder, or empty this one")
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    new = os.path.join(parent, f".{os.path.basename(os.path.abspath(folder))}.tmp-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)  # left by an export of ours that was killed
    os.mkdir(new)  # not tempfile.mkdtemp: its folder would stay private (mode 700) once renamed
    try:
        _write_export(model, new, vocab_size, meta)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if os.path.lexists(folder):  # an earlier export, or an empty folder: swapped out, then deleted
        old = new + ".old"
        os.rename(folder, old)
        os.rename(new, folder)
        shutil.rmtree(old)
    else:
        os.rename(new, folder)


def check_exportable(config):
    """A UsageError unless transformers' GPT-2 computes what this config computes."""
    if config.activation not in ACTIVATIONS_OUT:
        raise errors.UsageError(f"activation={config.activation!r} is a gated MLP (c_fc makes a gate and an up "
                                f"projection), which GPT-2 in transformers does not have: only models with "
                                f"{', '.join(ACTIVATIONS_OUT)} export to its format")


def exported_vocab_size(config, meta):
    """The rows of wte an export keeps: the dataset's vocabulary (meta), or all of them without meta."""
    if meta is None:
        return config.vocab_size
    if not 0 < meta["vocab_size"] <= config.vocab_size:
        raise errors.UsageError(f"the tokenizer's vocabulary ({meta['vocab_size']} tokens) does not fit the model's "
                                f"{config.vocab_size} rows: not this model's metadata")
    return meta["vocab_size"]


def gpt2_config(config, vocab_size, tokenizer=None):
    """config.json for transformers' GPT2Config: the architecture, and GPT-2's fixed choices spelled out."""
    eot = 50256 if tokenizer == "gpt2" else None  # <|endoftext|>; a character vocabulary has no special token
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # OpenAI's name for n_positions, still in their GPT-2 config.json
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": ACTIVATIONS_OUT[config.activation],
        "resid_pdrop": config.dropout,  # our one dropout rate is GPT-2's three
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
    }


def gpt2_tensors(model, vocab_size):
    """Our parameters under GPT-2's names and layout, as fp32 CPU tensors that own their memory."""
    tensors = {}
    for name, module in model.named_modules():
        if name == "lm_head" or not isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            continue  # lm_head is wte
        weight = module.weight.detach()
        if not isinstance(module, nn.Embedding):  # Linears and LayerNorms: GPT-2 has their biases
            bias = module.bias
            tensors[f"{name}.bias"] = bias.detach() if bias is not None else torch.zeros(weight.shape[0])
        if name == "transformer.wte":
            weight = weight[:vocab_size]
        tensors[f"{name}.weight"] = weight.t() if f"{name}.weight".endswith(CONV1D_WEIGHTS) else weight
    return {k: t.to("cpu", torch.float32).contiguous().clone() for k, t in tensors.items()}


def _write_export(model, folder, vocab_size, meta):
    from safetensors.torch import save_file

    tokenizer = meta and meta["tokenizer"]
    config_json, weights = os.path.join(folder, "config.json"), os.path.join(folder, "model.safetensors")
    _write_json(config_json, gpt2_config(model.config, vocab_size, tokenizer))
    save_file(gpt2_tensors(model, vocab_size), weights, metadata={"format": "pt"})
    shutil.copymode(config_json, weights)  # safetensors makes its file private (mode 600); the rest follow umask
    if tokenizer == "gpt2":
        _write_gpt2_tokenizer(folder, model.config.block_size)
    elif tokenizer == "char":
        _write_json(os.path.join(folder, "char_vocab.json"), {"chars": meta["chars"]})
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(_readme(model.config, vocab_size, meta))


def _write_gpt2_tokenizer(folder, block_size):
    """What GPT2Tokenizer(Fast) and AutoTokenizer read: GPT-2's own BPE files under their Hugging Face names."""
    encoder_json, vocab_bpe = data.gpt2_vocab_files()
    shutil.copyfile(encoder_json, os.path.join(folder, "vocab.json"))
    shutil.copyfile(vocab_bpe, os.path.join(folder, "merges.txt"))
    specials = {"bos_token": GPT2_EOT, "eos_token": GPT2_EOT, "unk_token": GPT2_EOT}
    _write_json(os.path.join(folder, "tokenizer_config.json"),
                {"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size, "add_prefix_space": False,
                 **specials})
    _write_json(os.path.join(folder, "special_tokens_map.json"), specials)


def _readme(config, vocab_size, meta):
    padded = config.vocab_size - vocab_size
    vocab = (f"{vocab_size} tokens" + (f" (the {padded} padding rows the model was trained with are cut off: they "
                                       f"are never a target)" if padded else ""))
    if meta is None:
        decode = "The tokenizer was not given when it was saved."
    elif meta["tokenizer"] == "gpt2":
        decode = "GPT-2's BPE: `AutoTokenizer.from_pretrained(folder)` reads vocab.json and merges.txt."
    else:
        decode = ("Characters: token id i is `chars[i]` of char_vocab.json; no tokenizer class reads it, so encode "
                  "and decode by hand:\n\n    chars = json.load(open('char_vocab.json'))['chars']\n"
                  "    ids = [chars.index(c) for c in text]; text = ''.join(chars[i] for i in ids)")
    return (f"{EXPORT_MARK}\n# GPT-2 ({config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide, "
            f"{config.block_size} positions, activation {ACTIVATIONS_OUT[config.activation]})\n\n"
            f"Load it with `transformers.GPT2LMHeadModel.from_pretrained(folder)`. Vocabulary: {vocab}.\n\n"
            f"{decode}\n")


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _replaceable(folder):
    """An empty folder, or one an earlier export wrote (its README.md starts with EXPORT_MARK)."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return False
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            return f.readline().rstrip("\n") == EXPORT_MARK
    except (OSError, UnicodeDecodeError):
        return not os.listdir(folder)
