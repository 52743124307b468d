"""
Train a GPT (model.py) on a prepared dataset (data.py): one process, or many with torchrun.

    python train.py configs/shakespeare_char_cpu.py --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    python train.py configs/shakespeare_char_cpu.py --init_from=resume     # continue a run exactly
    python train.py --dataset=shakespeare --init_from=gpt2 --learning_rate=3e-5 --max_iters=20  # fine-tune GPT-2

Settings: DEFAULTS below, overridden by config files, then by --key=value (configurator.py checks both).
Writes out_dir/ckpt.pt (atomically, keeping the one before as ckpt.pt.prev), out_dir/log.jsonl (every eval
and logged step) and out_dir/loss.png. Ctrl-C (or SIGTERM) stops at the end of the step, saves a checkpoint
and prints the command that resumes; a second Ctrl-C quits at once. With always_save_checkpoint=False the
best checkpoint (lowest val loss) is also kept as out_dir/ckpt_best.pt, which a stop's checkpoint never replaces.

Read main() and train() first: they are the whole story, and each function below them is one step of it.
"""

import contextlib
import dataclasses
import json
import math
import os
import pickle
import random
import shlex
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
import errors
import model
from configurator import ConfigError, parse_config
from model import GPT, GPTConfig

DEFAULTS = dict(
    # I/O
    out_dir="out",
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,  # evaluate once and exit
    always_save_checkpoint=True,  # False: save only when the val loss improves
    init_from="scratch",  # "scratch", "resume" (out_dir/ckpt.pt), gpt2 | gpt2-medium | gpt2-large | gpt2-xl, or
    # a folder holding a Hugging Face GPT-2 checkpoint (config.json and model.safetensors or pytorch_model.bin)
    # data
    dataset="shakespeare",  # a name data.DATASETS knows, or a folder with train.bin, val.bin, meta.json
    data_root="data",
    batch_size=12,  # micro-batch size of each process
    block_size=1024,
    gradient_accumulation_steps=40,  # over all processes together; divided by the world size
    # model (GPT-2 small)
    n_layer=12,
    n_head=12,
    n_embd=768,
    dropout=0.0,
    bias=False,
    mlp="auto",  # "eager" | "fused" | "auto"
    activation="gelu",
    fuse_ln=False,  # fold each block's second LayerNorm into the fused MLP (mlp="fused" or "auto")
    vocab_size=None,  # None: the dataset's vocabulary size
    # AdamW
    learning_rate=6e-4,
    max_iters=600000,
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # 0 disables clipping
    # learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
    decay_lr=True,
    warmup_iters=2000,
    lr_decay_iters=600000,
    min_lr=6e-5,
    # system
    device="auto",  # "auto" (cuda > mps > cpu), "cpu", "cuda", "cuda:1", "mps"
    dtype="auto",  # "auto" (bf16 on GPUs that have it, else fp16 on cuda, fp32 elsewhere) | bfloat16 | float16 | float32
    compile=False,  # True (torch.compile), or a torch.compile mode: "reduce-overhead" adds CUDA graphs
    seed=1337,
    # extras
    sample_after=False,  # print a short sample when training ends
    plot=True,  # write out_dir/loss.png when training ends
    progress=True,  # tqdm progress bar
)
KEY_TYPES = {"vocab_size": (int, type(None)), "compile": (bool, str)}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that add CUDA graphs
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "mlp", "activation", "fuse_ln")
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "activation")  # fixed by a checkpoint
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # OpenAI's GPT-2 sizes, as GPT.from_pretrained names them
CHECKPOINT_KEYS = ("model", "optimizer", "model_args", "config", "meta", "iter_num", "best_val_loss", "rng")


class TrainingDiverged(errors.RunError):
    """The loss became NaN or inf; nothing was saved after the last good checkpoint."""


# -----------------------------------------------------------------------------
# The run, top to bottom: settings and processes (main), then data, model, optimizer and the loop (train).

def main(argv=None):
    """Train as configured by argv (default sys.argv[1:]); returns a summary dict, or None after --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, ckpt = load_settings(argv)
    if cfg is None:
        return None
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    if cfg["gradient_accumulation_steps"] % world:
        raise ConfigError(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be divisible by "
                          f"the number of processes ({world}): each does an equal share of the micro-steps")
    device = resolve_device(cfg["device"], int(os.environ["LOCAL_RANK"]) if ddp else None)
    device_type = device.split(":")[0]
    check_mlp(cfg["mlp"], device)  # before any data is prepared
    if ddp:
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    # One process driving one GPU runs backward on its own thread. By default the autograd engine hands a CUDA
    # backward to a thread of its own and waits for it: that buys nothing here, and on the H100 hosts measured
    # the handoff cost more host time than the work (lab/launch_overhead.py, bench.py --backward_thread;
    # docs/performance.md). Not tried under DDP, which keeps PyTorch's default.
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # train() turns TF32 on
    try:
        with torch.autograd.set_multithreading_enabled(ddp or device_type != "cuda"):
            return train(Run(cfg, argv, device, rank, world), ckpt)
    except torch.OutOfMemoryError as e:
        raise out_of_memory(cfg, device, e) from None
    finally:
        # put back for whatever runs next in this process (a test suite, a notebook)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if ddp:
            dist.destroy_process_group()


def train(run, ckpt):
    """Data, model, optimizer, then the loop; on resume each piece continues from the checkpoint."""
    cfg = run.cfg
    if run.device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    run.dtype, run.autocast = precision(cfg["dtype"], run.device_type)
    run.data_dir, run.meta = prepare_data(cfg, run.world)
    run.raw_model, run.model_args = build_model(cfg, ckpt, run.meta, run.data_dir)
    run.raw_model.to(run.device)
    run.optimizer, run.scaler = make_optimizer(run.raw_model, cfg, run.dtype, run.device_type)
    torch.manual_seed(cfg["seed"] + run.rank)  # dropout differs between processes
    run.batches = Batches(run.data_dir, cfg["batch_size"], cfg["block_size"], run.device,
                          seed=cfg["seed"] * 1000 + 1 + run.rank)
    if ckpt is not None:
        restore(run, ckpt)
    run.model, run.eval_model = compile_model(run.raw_model, cfg, run.world, run.device_type, run.master)
    start_logging(run)
    with StopOnSignal(run.master, grace=1.0 if run.world > 1 else 0.0) as stop:
        training_loop(run, stop)
    finish(run)
    return {"iter_num": run.iter_num, "best_val_loss": run.best_val, "losses": run.losses, "out_dir": cfg["out_dir"]}


def training_loop(run, stop):
    """Evaluate (and save) on the eval grid, step, report; until max_iters, or a stop asked by a signal."""
    cfg = run.cfg
    run.batch_state = run.batches.gen.get_state()  # the generator's state before the pending batch was drawn
    run.x, run.y = run.batches.get("train")
    bar = tqdm(total=cfg["max_iters"], initial=run.iter_num, disable=not (run.master and cfg["progress"]),
               dynamic_ncols=True)
    try:
        while True:
            lr = get_lr(run.iter_num, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            if run.stop_agreed:
                stop_and_save(run, stop.signum or signal.SIGTERM)
            if cfg["eval_only"] or (run.iter_num != run.evaluated_at and
                                    (run.iter_num % cfg["eval_interval"] == 0 or run.iter_num >= cfg["max_iters"])):
                evaluate(run, lr, bar)
                if cfg["eval_only"]:
                    break
            if run.iter_num >= cfg["max_iters"]:
                break
            lossf, dt = train_step(run, lr, stop)
            report_step(run, bar, lossf, lr, dt)
            run.iter_num += 1
            run.local_iter += 1
    finally:
        bar.close()


# -----------------------------------------------------------------------------
# settings

def load_settings(argv):
    """(cfg, checkpoint): the checked settings, and on --init_from=resume the checkpoint they continue."""
    cfg = parse_config(DEFAULTS, argv, KEY_TYPES)
    if cfg is None:
        return None, None
    ckpt, ckpt_path = None, os.path.join(cfg["out_dir"], "ckpt.pt")
    if cfg["init_from"] == "resume":
        if not os.path.isfile(ckpt_path):
            raise ConfigError(f"init_from='resume' but there is no checkpoint at {ckpt_path}")
        ckpt = read_checkpoint(ckpt_path)
        # The run's own config is the base; only what this command line says changes it (e.g. max_iters).
        base = {**DEFAULTS, **{k: v for k, v in ckpt["config"].items() if k in DEFAULTS}}
        cfg = dict(parse_config(base, argv, KEY_TYPES), out_dir=cfg["out_dir"])  # where the checkpoint was found, not
        # where it was first written (the folder may have been renamed): read and write the folder asked for.
        for k in ARCH_KEYS:  # the weights fix the architecture: a different value given now cannot apply
            if cfg[k] not in (base[k], ckpt["model_args"][k]) and os.environ.get("RANK", "0") == "0":
                print(f"warning: {k}={cfg[k]!r} ignored on resume: the checkpoint's model has {k}={ckpt['model_args'][k]!r}",
                      file=sys.stderr)
            cfg[k] = ckpt["model_args"][k]
    check_config(cfg)
    return cfg, ckpt


def check_config(cfg):
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    need(cfg["init_from"] in ("scratch", "resume", *PRETRAINED) or os.path.isdir(cfg["init_from"]),
         f"config key 'init_from' must be scratch, resume, {', '.join(PRETRAINED)} or a folder with a Hugging Face "
         f"GPT-2 checkpoint; got {cfg['init_from']!r}, which is none of these (and no such folder)")
    need(cfg["dtype"] in ("auto", *DTYPES), f"config key 'dtype' must be one of auto, {', '.join(DTYPES)}; got {cfg['dtype']!r}")
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


def resolve_device(name, local_rank):
    """The device to run on, checked to exist here (errors.check_device names the key otherwise)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"  # one GPU per torchrun process
    return errors.check_device(name, arg="--device")


def check_mlp(mlp, device, source="--mlp=fused"):
    """mlp="fused" runs the Triton kernels: Triton must import, and they take CUDA tensors (or CPU ones under
    Triton's interpreter, TRITON_INTERPRET=1 set before Triton is imported). Otherwise one line naming --mlp,
    before any work; source says where the setting came from (the command line, or a checkpoint)."""
    if mlp != "fused":
        return
    try:
        fused_ops = model.import_fused_ops(required=True)
    except ImportError as e:
        raise errors.UsageError(f"{source} needs Triton, which cannot be imported here ({e.__cause__ or e}): "
                                "use --mlp=auto or --mlp=eager (or install triton)") from None
    if not (device.startswith("cuda") or (device == "cpu" and fused_ops.kernels_can_run(torch.empty(0)))):
        raise errors.UsageError(f"{source} runs Triton kernels, which need a CUDA GPU (or TRITON_INTERPRET=1 on the "
                                f"CPU, very slow), and the device is {device}: use --mlp=auto or --mlp=eager")


def precision(dtype, device_type):
    """(dtype name, autocast context): "auto" is bf16 on GPUs that have it, else fp16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if device_type == "cuda" else "float32"
    autocast = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=DTYPES[dtype])
    return dtype, autocast


def get_lr(it, cfg):
    if not cfg["decay_lr"]:
        return cfg["learning_rate"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it >= cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


@dataclasses.dataclass
class Run:
    """What the steps of a run share: set up by train(), then advanced by the loop."""

    cfg: dict
    argv: list  # the command line, for the resume command printed when a signal stops the run
    device: str
    rank: int
    world: int
    dtype: str = None
    autocast: object = None
    data_dir: str = None
    meta: dict = None  # the dataset's tokenizer and vocabulary (data.py), saved in checkpoints for sample.py
    raw_model: GPT = None  # the parameters; `model` runs the training step (compiled, DDP-wrapped)
    model: object = None
    eval_model: object = None  # `model` without the DDP wrapper: evaluation needs no gradient sync
    model_args: dict = None  # GPTConfig's arguments, saved in checkpoints to rebuild the model
    optimizer: object = None
    scaler: object = None
    batches: object = None
    iter_num: int = 0
    best_val: float = math.inf
    last_saved: int = None  # the iteration of the last checkpoint written (or resumed from)
    resumed_at: int = None
    evaluated_at: int = None  # an iteration whose eval is already done (the resumed checkpoint's)
    batch_state: object = None  # the batch generator's state before the pending batch (x, y) was drawn
    x: torch.Tensor = None
    y: torch.Tensor = None
    local_iter: int = 0
    mfu: float = None
    losses: dict = None
    stop_agreed: bool = False  # every process has seen a stop request by the end of this step
    ckpt_evaluated: bool = False  # ckpt.pt was written after an eval (with always_save_checkpoint=False: the best)

    @property
    def master(self):
        return self.rank == 0

    @property
    def device_type(self):
        return self.device.split(":")[0]

    @property
    def accum(self):  # micro-steps per optimizer step, in each process
        return self.cfg["gradient_accumulation_steps"] // self.world

    @property
    def tokens_per_iter(self):
        return self.accum * self.world * self.cfg["batch_size"] * self.cfg["block_size"]

    @property
    def ckpt_path(self):
        return os.path.join(self.cfg["out_dir"], "ckpt.pt")

    @property
    def best_path(self):  # the best checkpoint, kept when always_save_checkpoint=False (see keep_best)
        return os.path.join(self.cfg["out_dir"], "ckpt_best.pt")

    @property
    def log_path(self):
        return os.path.join(self.cfg["out_dir"], "log.jsonl")


# -----------------------------------------------------------------------------
# data

def prepare_data(cfg, world=1):
    """The dataset's folder (prepared on first use, data.py) and its metadata. Under torchrun only rank 0
    prepares it (several processes writing the same files would collide); the others wait for its answer."""
    if world == 1:
        data_dir = find_or_prepare(cfg)
    else:
        answer = [None]
        if dist.get_rank() == 0:
            try:
                answer[0] = data_dir = find_or_prepare(cfg)
            finally:  # on failure the others get None and stop too (rank 0's error is the one printed)
                dist.broadcast_object_list(answer, src=0)
        else:
            dist.broadcast_object_list(answer, src=0)
            if answer[0] is None:
                raise errors.RunError(f"rank 0 could not prepare dataset {cfg['dataset']!r}")
            data_dir = answer[0]
    return data_dir, data.load_meta(data_dir)


def find_or_prepare(cfg):
    try:
        return data.ensure_dataset(cfg["dataset"], data_root=cfg["data_root"])
    except FileNotFoundError as e:
        raise ConfigError(f"dataset {cfg['dataset']!r}: {e}") from e


class Batches:
    """Random windows of the token files, drawn with a private generator so that the data order is
    reproducible and its exact position can be saved in a checkpoint (a global RNG would be shared with dropout)."""

    def __init__(self, data_dir, batch_size, block_size, device, seed):
        self.data_dir, self.batch_size, self.block_size, self.device = data_dir, batch_size, block_size, device
        self.gen = torch.Generator().manual_seed(seed)
        for split in ("train", "val"):
            n = len(data.load_tokens(data_dir, split))
            if n <= block_size:
                raise ConfigError(f"the {split} split of {data_dir} has {n} tokens; block_size={block_size} needs more")

    def get(self, split, gen=None):
        # A fresh memmap per batch, as in nanoGPT: a long-lived one keeps pages referenced and memory grows.
        tokens = data.load_tokens(self.data_dir, split)
        starts = torch.randint(len(tokens) - self.block_size, (self.batch_size,), generator=gen or self.gen)
        windows = tokens[starts.numpy()[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        xy = torch.from_numpy(windows)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if self.device.startswith("cuda"):  # pinned + non_blocking: the copy overlaps the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)


# -----------------------------------------------------------------------------
# model and optimizer

def build_model(cfg, ckpt, meta, data_dir):
    """(the GPT on the CPU, the GPTConfig arguments saved with it): new, resumed from ckpt, or GPT-2's weights."""
    torch.manual_seed(cfg["seed"])  # the same initial weights whatever the world size
    if cfg["init_from"] not in ("scratch", "resume"):
        return load_pretrained(cfg, meta)
    # The architecture comes from the checkpoint on resume; dropout and mlp may change freely.
    model_args = {k: cfg[k] for k in MODEL_KEYS}
    model_args["vocab_size"] = cfg["vocab_size"] or meta["vocab_size"]
    if ckpt is not None:
        model_args.update({k: ckpt["model_args"][k] for k in ARCH_KEYS})
        check_same_vocabulary(ckpt, meta, cfg, data_dir)
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"config key 'vocab_size' ({model_args['vocab_size']}) is smaller than the dataset's ({meta['vocab_size']})")
    try:
        model = GPT(GPTConfig(**model_args))
    except ValueError as e:  # model.py names the bad key (mlp, activation, n_head...)
        raise ConfigError(str(e)) from e
    if ckpt is not None:
        try:
            model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
        except RuntimeError as e:  # names the tensors that differ
            path = os.path.join(cfg["out_dir"], "ckpt.pt")
            raise errors.RunError(f"checkpoint {path} does not fit its own model_args ({str(e).splitlines()[0]}); "
                                  f"{older_checkpoint(path)}") from e
    return model, model_args


def load_pretrained(cfg, meta):
    """GPT-2's weights (a name or a local Hugging Face folder), for a dataset tokenized with GPT-2's BPE."""
    name = cfg["init_from"]
    if meta["tokenizer"] != "gpt2":
        raise ConfigError(f"init_from={name!r} is GPT-2 with its BPE vocabulary, but dataset {cfg['dataset']!r} has a "
                          f"{meta['tokenizer']} vocabulary of {meta['vocab_size']} tokens: use a dataset prepared with "
                          "--tokenizer=gpt2 (e.g. --dataset=shakespeare)")
    try:
        model = GPT.from_pretrained(name, mlp=cfg["mlp"], dropout=cfg["dropout"], block_size=cfg["block_size"],
                                    fuse_ln=cfg["fuse_ln"])
    except (OSError, ValueError) as e:  # not downloadable offline, a folder without the files, a bad block_size
        raise ConfigError(f"init_from={name!r}: {e}") from e
    model_args = {k: getattr(model.config, k) for k in (*MODEL_KEYS, "vocab_size")}
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"init_from={name!r} has a vocabulary of {model_args['vocab_size']} tokens, fewer than "
                          f"dataset {cfg['dataset']!r}'s {meta['vocab_size']}")
    for k in ARCH_KEYS:  # saved with the run's config, so a resume and sample.py see the model actually trained
        if k != "block_size" and cfg[k] not in (DEFAULTS[k], model_args[k]) and os.environ.get("RANK", "0") == "0":
            print(f"warning: {k}={cfg[k]!r} ignored: init_from={name!r} has {k}={model_args[k]!r}", file=sys.stderr)
        cfg[k] = model_args[k]
    return model, model_args


def vocabulary(meta):
    """What a token id means: the tokenizer, the number of ids, and a char vocabulary's characters."""
    return meta["tokenizer"], meta["vocab_size"], meta.get("chars")


def check_same_vocabulary(ckpt, meta, cfg, data_dir):
    """A resumed model must see the token ids it was trained on: the same tokenizer and vocabulary."""
    if vocabulary(ckpt["meta"]) == vocabulary(meta):
        return
    (tok0, n0, _), (tok1, n1, _) = vocabulary(ckpt["meta"]), vocabulary(meta)
    same = " (the same size, other characters)" if (tok0, n0) == (tok1, n1) else ""
    raise ConfigError(f"checkpoint {os.path.join(cfg['out_dir'], 'ckpt.pt')} was trained on a {tok0} vocabulary of "
                      f"{n0} tokens, but dataset {cfg['dataset']!r} ({data_dir}) has a {tok1} vocabulary of "
                      f"{n1}{same}: "
                      f"resume with the dataset it was trained on (--dataset={ckpt['config'].get('dataset')}), or "
                      "train on this one in a new out_dir")


def make_optimizer(raw_model, cfg, dtype, device_type):
    """AdamW (model.configure_optimizers), and the gradient scaler float16 needs (disabled otherwise)."""
    optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                               device_type)
    scaler = torch.amp.GradScaler("cuda" if device_type == "cuda" else "cpu", enabled=dtype == "float16")
    return optimizer, scaler


def effective_compile(compile, world):
    """What to compile with: CUDA graphs were only tried on one GPU, so under DDP a mode that adds them
    becomes plain torch.compile."""
    return True if world > 1 and compile in CUDA_GRAPH_MODES else compile


def compile_model(raw_model, cfg, world, device_type, master):
    """(the model a training step runs: compiled as asked and DDP-wrapped, the model evaluation runs)."""
    compile_as = effective_compile(cfg["compile"], world)
    if compile_as != cfg["compile"]:
        if master:
            print(f"note: compile={cfg['compile']!r} adds CUDA graphs, not tried with DDP here: using plain torch.compile")
        cfg["compile"] = compile_as
    compile_mode = None if cfg["compile"] in (True, "default") else cfg["compile"]
    model = torch.compile(raw_model, mode=compile_mode) if cfg["compile"] else raw_model
    if world > 1:
        return DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None), model
    return model, model


# -----------------------------------------------------------------------------
# the steps of the loop

def new_step(cfg):
    """Under CUDA graphs (compile modes with them) a new run of the model may overwrite the last one's
    outputs: say so before each forward. The losses read from a run are used before the next one starts."""
    if cfg["compile"] in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def train_step(run, lr, stop):
    """One optimizer step of `accum` micro-steps (gradients synced across processes on the last only).
    Returns (the loss, seconds); sets run.stop_agreed when any process was asked to stop."""
    cfg, model = run.cfg, run.model
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        sync = model.no_sync() if run.world > 1 and micro < run.accum - 1 else contextlib.nullcontext()
        with sync:
            new_step(cfg)
            with run.autocast:
                loss = model(run.x, run.y)[1] / run.accum
            run.batch_state = run.batches.gen.get_state()
            run.x, run.y = run.batches.get("train")  # prefetch the next batch while the GPU runs this forward
            run.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    if run.world > 1:  # the processes' mean loss, and whether any of them was asked to stop: one all_reduce
        both = torch.stack([loss_sum, torch.tensor(float(stop.signum is not None), device=run.device)])
        dist.all_reduce(both)
        lossf, stops = both.tolist()
        lossf /= run.world
        run.stop_agreed = stops > 0
    else:
        lossf = loss_sum.item()
        run.stop_agreed = stop.signum is not None
    # One sync per step (the .item() / .tolist() above); it lets a NaN stop us before it reaches the weights.
    if not math.isfinite(lossf):
        raise diverged(run, "loss", lossf, lr)
    if cfg["grad_clip"] > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg["grad_clip"])
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return lossf, time.perf_counter() - t0


def report_step(run, bar, lossf, lr, dt):
    """The step's loss, time and MFU: in log.jsonl, and on the progress bar (or as a plain line without one)."""
    cfg = run.cfg
    if run.local_iter >= 3:  # the first steps include warm-up (compilation, autotuning, allocation)
        step_mfu = run.raw_model.estimate_mfu(cfg["batch_size"] * run.accum, dt)
        if step_mfu is not None:
            run.mfu = step_mfu if run.mfu is None else 0.9 * run.mfu + 0.1 * step_mfu
    tokens_per_s = run.tokens_per_iter / dt
    if run.iter_num % cfg["log_interval"] == 0:
        write_log(run, {"type": "step", "iter": run.iter_num, "loss": lossf, "lr": lr, "ms": dt * 1000,
                        "tokens_per_s": tokens_per_s, "mfu": run.mfu})
    if cfg["progress"]:
        postfix = {"loss": f"{lossf:.4f}", "tok/s": f"{tokens_per_s:,.0f}"}
        postfix.update({"mfu": f"{run.mfu:.1%}"} if run.mfu is not None else {})
        bar.set_postfix(postfix, refresh=False)
    elif run.master and run.iter_num % cfg["log_interval"] == 0:  # no bar (e.g. logging to a file): plain lines
        mfu_text = f", mfu {run.mfu:.1%}" if run.mfu is not None else ""
        print(f"iter {run.iter_num}: loss {lossf:.4f}, {dt * 1000:.1f} ms, {tokens_per_s:,.0f} tok/s{mfu_text}",
              flush=True)
    bar.update()


@torch.no_grad()
def estimate_loss(run):
    """Mean loss over eval_iters batches of each split, averaged over all processes. The batches come from
    their own generator, reseeded every time: evals are comparable and never move the training RNG."""
    cfg, model = run.cfg, run.eval_model
    model.eval()
    out = torch.zeros(2, device=run.device)
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(cfg["seed"] + 7 + run.rank)
        for _ in range(cfg["eval_iters"]):
            x, y = run.batches.get(split, gen)
            new_step(cfg)
            with run.autocast:
                out[i] += model(x, y)[1].float() / cfg["eval_iters"]
    model.train()
    if run.world > 1:
        dist.all_reduce(out)
        out /= run.world
    return dict(zip(("train", "val"), out.tolist()))


def evaluate(run, lr, bar):
    """Both splits' loss, logged; a checkpoint when the val loss improved (or always_save_checkpoint)."""
    cfg = run.cfg
    run.losses = losses = estimate_loss(run)
    if not all(map(math.isfinite, losses.values())):
        raise diverged(run, "val/train loss", losses, lr)
    write_log(run, {"type": "eval", "iter": run.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                    "lr": lr})
    if run.master:
        bar.write(f"iter {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if not cfg["eval_only"] and (losses["val"] < run.best_val or cfg["always_save_checkpoint"]):
        run.best_val = min(run.best_val, losses["val"])
        save(run, evaluated=True)
        keep_best(run)


def diverged(run, what, value, lr):
    """The error for a NaN/inf loss: where, what was kept, what to change."""
    cfg = run.cfg
    kept = (f"the last good checkpoint ({run.ckpt_path}, iter {run.last_saved}) is kept" if run.last_saved is not None
            else "no checkpoint was written")
    tips = [f"a lower learning_rate (now {cfg['learning_rate']:g})", "more warmup_iters"]
    tips += ["grad_clip=1.0"] if cfg["grad_clip"] <= 0 else []
    tips += ["dtype=bfloat16 or float32"] if run.dtype == "float16" else []
    return TrainingDiverged(f"{what} became {value} at iter {run.iter_num} (lr {lr:.3g}); training stopped without "
                            f"saving, and {kept}. Try {', '.join(tips)}.")


def out_of_memory(cfg, device, e):
    """The error for torch.OutOfMemoryError: which settings lower the memory a step needs."""
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    kept = f"; {ckpt_path} is kept as it was" if os.path.isfile(ckpt_path) else ""
    compile_tip = ", compile=True (fuses away some activations)" if not cfg["compile"] else ""
    return errors.RunError(
        f"out of memory on {device} ({str(e).splitlines()[0][:120]}): lower batch_size (now {cfg['batch_size']}; "
        f"raise gradient_accumulation_steps, now {cfg['gradient_accumulation_steps']}, to keep the tokens per "
        f"step), or block_size (now {cfg['block_size']}), or the model (n_layer, n_embd){compile_tip}{kept}")


# -----------------------------------------------------------------------------
# checkpoints and the log

def save(run, evaluated):
    """A checkpoint of this moment: before iteration iter_num's step (and after its eval, if `evaluated`).
    It holds every process's RNG states and the batch generator's from before the prefetched batch was drawn:
    a run resumed from here draws the same batches and dropout masks as one that never stopped, so its losses
    match bit for bit."""
    state = rng_state(run.batch_state, run.device_type)
    states = [None] * run.world
    if run.world > 1:
        dist.all_gather_object(states, state)
    else:
        states = [state]
    if run.master:
        save_checkpoint({"model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
                         "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
                         "model_args": run.model_args, "config": run.cfg, "meta": run.meta, "iter_num": run.iter_num,
                         "best_val_loss": run.best_val, "rng": states, "evaluated": evaluated}, run.ckpt_path)
    run.last_saved, run.ckpt_evaluated = run.iter_num, evaluated


def keep_best(run):
    """With always_save_checkpoint=False, ckpt.pt written by an eval is the best so far: give it a second name,
    ckpt_best.pt (a hard link, or a copy), which a stop's checkpoint then written to ckpt.pt does not replace."""
    if run.master and not run.cfg["always_save_checkpoint"] and run.ckpt_evaluated and os.path.isfile(run.ckpt_path):
        link_or_copy(run.ckpt_path, run.best_path)


def restore(run, ckpt):
    """Continue from a checkpoint: optimizer, scaler, counters, and every process's random streams."""
    run.optimizer.load_state_dict(ckpt["optimizer"])
    if run.scaler.is_enabled() and ckpt.get("scaler"):
        run.scaler.load_state_dict(ckpt["scaler"])
    run.iter_num, run.best_val = ckpt["iter_num"], ckpt["best_val_loss"]
    run.last_saved = run.resumed_at = run.iter_num
    run.ckpt_evaluated = ckpt.get("evaluated", True)
    run.evaluated_at = run.iter_num if run.ckpt_evaluated else None
    if len(ckpt["rng"]) == run.world:
        set_rng_state(ckpt["rng"][run.rank], run.batches, run.device_type)
    else:  # fresh streams that at least do not repeat the first iterations' batches
        torch.manual_seed(run.cfg["seed"] + run.rank + 1_000_003 * run.iter_num)
        run.batches.gen.manual_seed(run.cfg["seed"] * 1000 + 1 + run.rank + 1_000_003 * run.iter_num)
        if run.master:
            print(f"warning: the checkpoint was written by {len(ckpt['rng'])} processes, now {run.world}: "
                  "the resumed run cannot replay the same batches and dropout")


def rng_state(batch_state, device_type):
    np_state = np.random.get_state()  # stored as plain lists so that torch.load(weights_only=True) reads it
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None,
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "python": random.getstate(),
        "batches": batch_state,
    }


def set_rng_state(state, batches, device_type):
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    random.setstate(state["python"])
    batches.gen.set_state(state["batches"])


def save_checkpoint(ckpt, path):
    """Write to a temp file in the same folder, fsync, then rename over the old one: a crash or a full disk
    mid-write leaves the previous checkpoint whole (os.replace is atomic on POSIX and Windows). The one it
    replaces stays as path.prev, a fallback should this one be damaged later (a disk error, a bad copy)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        keep_previous(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the renames themselves durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def keep_previous(path):
    """Make path.prev a second name of the file at path (a hard link costs no space until path is replaced);
    the old path.prev goes only once the new one is complete. A copy where links are not supported."""
    if os.path.isfile(path):
        link_or_copy(path, f"{path}.prev")


def link_or_copy(path, dest):
    """Make dest a second name of path (a hard link; a copy where links are not supported), replacing dest
    only once the new one is complete."""
    tmp = f"{dest}.tmp{os.getpid()}"
    try:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_checkpoint(path, keys=CHECKPOINT_KEYS):
    """The checkpoint dict at path (an existing file). A file that is damaged or is not one of our checkpoints
    is one line naming it and saying whether the one before it (path.prev) is there to fall back on."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (PermissionError, IsADirectoryError) as e:
        raise errors.UsageError(f"cannot read checkpoint {path}: {e.strerror}") from e
    except pickle.UnpicklingError as e:  # a pickle of other objects: weights_only loading refuses to run it
        raise errors.UsageError(f"{path} is not a train.py checkpoint (it holds Python objects, not tensors and "
                                f"plain data); {older_checkpoint(path)}") from e
    except Exception as e:  # torn or foreign files fail in torch.load's many ways (zip, EOF)
        why = str(e).strip().splitlines()[0][:150] if str(e).strip() else type(e).__name__
        raise errors.RunError(f"checkpoint {path} is damaged or is not a checkpoint ({why}); {older_checkpoint(path)}") from e
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise errors.UsageError(f"{path} is not a train.py checkpoint (it has no {', '.join(missing)}); "
                                f"{older_checkpoint(path)}")
    return ckpt


def older_checkpoint(path):
    """Whether the checkpoint before path (path.prev, see keep_previous) is there, and how to use it."""
    prev = f"{path}.prev"
    if not os.path.isfile(prev):
        return f"no older checkpoint is kept ({prev} does not exist): start again with --init_from=scratch"
    try:  # mmap: the iteration number without reading gigabytes of weights
        iter_num = torch.load(prev, map_location="cpu", weights_only=True, mmap=True)["iter_num"]
    except Exception:
        return f"the older {prev} cannot be read either: start again with --init_from=scratch"
    return f"the one before it is intact: mv {prev} {path} to continue from its iter {iter_num}"


def start_logging(run):
    """out_dir and log.jsonl (a fresh log, or on resume the old one cut back to the checkpoint), the run's record."""
    if run.master:
        os.makedirs(run.cfg["out_dir"], exist_ok=True)
        start_log(run.log_path, run.resumed_at)
    write_log(run, {"type": "run", "iter": run.iter_num, "resumed": run.resumed_at is not None, "world_size": run.world,
                    "device": run.device, "dtype": run.dtype, "config": run.cfg})
    if run.master:
        print(f"{run.raw_model.get_num_params() / 1e6:.2f}M parameters, {run.tokens_per_iter:,} tokens per iteration, "
              f"{run.device} {run.dtype}, {run.world} process(es), data {run.data_dir}")


def start_log(path, resume_iter):
    """A fresh log for a new run; on resume, drop what a crashed run logged after its checkpoint."""
    records = []
    if resume_iter is not None and os.path.exists(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [r for r in records if r["iter"] < resume_iter or (r["iter"] == resume_iter and r["type"] == "eval")]
    tmp = f"{path}.tmp{os.getpid()}"  # the old log stays whole until the new one is written
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def write_log(run, record):
    if run.master:  # append and close per record: the log survives any crash, and no handle is left open
        with open(run.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def plot_losses(log_path, png_path):
    from matplotlib.figure import Figure  # no pyplot: no global figures, no GUI backend (Agg is used for PNG)

    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [(r["iter"], r["loss"]) for r in records if r["type"] == "step"]
    evals = [(r["iter"], r["train_loss"], r["val_loss"]) for r in records if r["type"] == "eval"]
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    if steps:
        ax.plot(*zip(*steps), alpha=0.35, lw=0.8, label="train (per step)")
    if evals:
        it, tr, va = zip(*evals)
        ax.plot(it, tr, "o-", label="train (eval)")
        ax.plot(it, va, "s-", label="val (eval)")
    ax.set(xlabel="iteration", ylabel="loss", title=os.path.dirname(os.path.abspath(png_path)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(png_path, dpi=110, bbox_inches="tight")


def finish(run):
    """After the last iteration: the loss plot, and a short sample if asked for."""
    cfg = run.cfg
    if not run.master:
        return
    if cfg["plot"]:
        plot_losses(run.log_path, os.path.join(cfg["out_dir"], "loss.png"))
    if cfg["sample_after"]:
        encode, decode = data.get_tokenizer(run.meta)
        run.raw_model.eval()
        with run.autocast:
            start = data.start_ids(run.meta, encode)  # a newline, or the first token if the vocabulary has none
            out = run.raw_model.generate(torch.tensor([start], device=run.device), 300, temperature=0.8, top_k=200)
        ids = [i for i in out[0].tolist() if i < run.meta["vocab_size"]]  # padded-vocab rows have no text
        print(f"--- sample after {run.iter_num} iterations ---\n{decode(ids)}\n---")


# -----------------------------------------------------------------------------
# stopping on a signal

class StopOnSignal:
    """While active, the first SIGINT (Ctrl-C) or SIGTERM only records itself in .signum: the loop finishes its
    step, saves and stops (stop_and_save). A second one raises KeyboardInterrupt at once: whatever checkpoint
    write it cuts short leaves the previous checkpoint whole (save_checkpoint).

    Under torchrun each process gets Ctrl-C twice, from the terminal and forwarded by torchrun (which then waits
    its --shutdown_timeout before killing): signals within `grace` seconds of the first count as that one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, master, grace=0.0):
        self.master, self.grace, self.signum, self.first_at, self.previous = master, grace, None, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        # Messages go straight to file descriptor 2: print() here could interrupt a write to sys.stderr in
        # progress (tqdm's) and fail with "reentrant call".
        if self.signum is not None:
            if time.monotonic() - self.first_at < self.grace:
                return
            self.say(f"train.py: {signal.Signals(signum).name} again: quitting now, without saving; the last "
                     "checkpoint is kept\n")
            raise KeyboardInterrupt
        self.first_at = time.monotonic()  # before signum: a second signal arriving between them reads it
        self.signum = signum
        self.say(f"\ntrain.py: {signal.Signals(signum).name}: stopping after this step to save a checkpoint "
                 "(Ctrl-C again to quit at once)\n")

    def say(self, text):
        if self.master:
            with contextlib.suppress(OSError):
                os.write(2, text.encode())


def stop_and_save(run, signum):
    """Save where the loop is (between two steps) and stop, saying how to continue. With
    always_save_checkpoint=False ckpt.pt may hold the best model so far: it is kept as ckpt_best.pt first."""
    keep_best(run)
    save(run, evaluated=False)
    best = ""
    if not run.cfg["always_save_checkpoint"] and os.path.isfile(run.best_path):
        best = f" (the best checkpoint, val loss {run.best_val:.4f}, is kept as {run.best_path})"
    raise errors.Stopped(signum, f"stopped by {signal.Signals(signum).name} at iter {run.iter_num}; checkpoint "
                                 f"written to {run.ckpt_path}{best}. Resume with:\n  {resume_command(run)}")


def resume_command(run):
    """This run's command line with --init_from=resume (the checkpoint holds the rest of the settings)."""
    args = [a for a in run.argv if a[2:].partition("=")[0].replace("-", "_") != "init_from"]
    launcher = [python_command()] if run.world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={run.world}"]
    return shlex.join([*launcher, "train.py", *args, "--init_from=resume"])


def python_command():
    """"python" when that is the interpreter running now (found first on PATH), else this interpreter's path."""
    found, here = shutil.which("python"), sys.executable
    if found and os.path.basename(here).startswith("python") and os.path.dirname(os.path.abspath(found)) == \
            os.path.dirname(os.path.abspath(here)):
        with contextlib.suppress(OSError):
            if os.path.samefile(found, here):
                return "python"
    return here


def cli():
    """main() with a one-line message (from rank 0 only) and an exit status instead of a traceback."""
    return errors.run_main("train.py", main, quiet=os.environ.get("RANK", "0") != "0")


if __name__ == "__main__":
    sys.exit(cli())
