"""
Train a GPT (model.py) on a prepared dataset (data.py): one process, or many with torchrun.

    python train.py configs/shakespeare_char_cpu.py --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    python train.py configs/shakespeare_char_cpu.py --init_from=resume     # continue a run exactly

Settings: DEFAULTS below, overridden by config files, then by --key=value (configurator.py checks both).
Writes out_dir/ckpt.pt (atomically), out_dir/log.jsonl (every eval and logged step) and out_dir/loss.png.
"""

import contextlib
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
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
    init_from="scratch",  # "scratch" or "resume" (from out_dir/ckpt.pt)
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


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; nothing was saved after the last good checkpoint."""


def check_config(cfg):
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    need(cfg["init_from"] in ("scratch", "resume"), f"config key 'init_from' must be 'scratch' or 'resume', got {cfg['init_from']!r}")
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
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"  # one GPU per torchrun process
    return name


def get_lr(it, cfg):
    if not cfg["decay_lr"]:
        return cfg["learning_rate"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it >= cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


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


def effective_compile(compile, world):
    """What to compile with: CUDA graphs were only tried on one GPU, so under DDP a mode that adds them
    becomes plain torch.compile."""
    return True if world > 1 and compile in CUDA_GRAPH_MODES else compile


def new_step(cfg):
    """Under CUDA graphs (compile modes with them) a new run of the model may overwrite the last one's
    outputs: say so before each forward. The losses read from a run are used before the next one starts."""
    if cfg["compile"] in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


@torch.no_grad()
def estimate_loss(model, batches, eval_iters, autocast, seed, world, cfg):
    """Mean loss over eval_iters batches of each split, averaged over all processes. The batches come from
    their own generator, reseeded every time: evals are comparable and never move the training RNG."""
    model.eval()
    out = torch.zeros(2, device=batches.device)
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(eval_iters):
            x, y = batches.get(split, gen)
            new_step(cfg)
            with autocast:
                out[i] += model(x, y)[1].float() / eval_iters
    model.train()
    if world > 1:
        dist.all_reduce(out)
        out /= world
    return dict(zip(("train", "val"), out.tolist()))


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
    mid-write leaves the previous checkpoint whole (os.replace is atomic on POSIX and Windows)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def start_log(path, resume_iter):
    """A fresh log for a new run; on resume, drop what a crashed run logged after its checkpoint."""
    records = []
    if resume_iter is not None and os.path.exists(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [r for r in records if r["iter"] < resume_iter or (r["iter"] == resume_iter and r["type"] == "eval")]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


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


def main(argv=None):
    """Train as configured by argv (default sys.argv[1:]); returns a summary dict, or None after --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(DEFAULTS, argv, KEY_TYPES)
    if cfg is None:
        return None
    ckpt, ckpt_path = None, os.path.join(cfg["out_dir"], "ckpt.pt")
    if cfg["init_from"] == "resume":
        if not os.path.isfile(ckpt_path):
            raise ConfigError(f"init_from='resume' but there is no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
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

    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    if cfg["gradient_accumulation_steps"] % world:
        raise ConfigError(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be divisible by "
                          f"the number of processes ({world}): each does an equal share of the micro-steps")
    device = resolve_device(cfg["device"], int(os.environ["LOCAL_RANK"]) if ddp else None)
    device_type = device.split(":")[0]
    if ddp:
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    # One process driving one GPU runs backward on its own thread. By default the autograd engine hands a CUDA
    # backward to a thread of its own and waits for it: that buys nothing here, and on the H100 hosts measured
    # the handoff cost more host time than the work (tools/launch_overhead.py, bench.py --backward_thread;
    # results/README.md, twelfth round). Not tried under DDP, which keeps PyTorch's default.
    try:
        with torch.autograd.set_multithreading_enabled(ddp or device_type != "cuda"):
            return train(cfg, ckpt, ckpt_path, device, rank, world)
    finally:
        if ddp:
            dist.destroy_process_group()


def train(cfg, ckpt, ckpt_path, device, rank, world):
    master, device_type = rank == 0, device.split(":")[0]
    dtype = cfg["dtype"]
    if dtype == "auto":
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if device_type == "cuda" else "float32"
    accum = cfg["gradient_accumulation_steps"] // world
    tokens_per_iter = accum * world * cfg["batch_size"] * cfg["block_size"]
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        data_dir = data.ensure_dataset(cfg["dataset"], data_root=cfg["data_root"])
    except FileNotFoundError as e:
        raise ConfigError(f"dataset {cfg['dataset']!r}: {e}") from e
    meta = data.load_meta(data_dir)

    # Model: the architecture comes from the checkpoint on resume; dropout and mlp may change freely.
    model_args = {k: cfg[k] for k in MODEL_KEYS}
    model_args["vocab_size"] = cfg["vocab_size"] or meta["vocab_size"]
    if ckpt is not None:
        model_args.update({k: ckpt["model_args"][k] for k in ARCH_KEYS})
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"config key 'vocab_size' ({model_args['vocab_size']}) is smaller than the dataset's ({meta['vocab_size']})")
    torch.manual_seed(cfg["seed"])  # the same initial weights whatever the world size
    try:
        raw_model = GPT(GPTConfig(**model_args))
    except ValueError as e:  # model.py names the bad key (mlp, activation, n_head...)
        raise ConfigError(str(e)) from e
    if ckpt is not None:
        raw_model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]), device_type)
    scaler = torch.amp.GradScaler("cuda" if device_type == "cuda" else "cpu", enabled=dtype == "float16")
    autocast = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=DTYPES[dtype])

    torch.manual_seed(cfg["seed"] + rank)  # dropout differs between processes
    batches = Batches(data_dir, cfg["batch_size"], cfg["block_size"], device, seed=cfg["seed"] * 1000 + 1 + rank)
    iter_num, best_val, last_saved = 0, float("inf"), None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler.is_enabled() and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val, last_saved = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["iter_num"]
        if len(ckpt["rng"]) == world:
            set_rng_state(ckpt["rng"][rank], batches, device_type)
        else:  # fresh streams that at least do not repeat the first iterations' batches
            torch.manual_seed(cfg["seed"] + rank + 1_000_003 * iter_num)
            batches.gen.manual_seed(cfg["seed"] * 1000 + 1 + rank + 1_000_003 * iter_num)
            if master:
                print(f"warning: the checkpoint was written by {len(ckpt['rng'])} processes, now {world}: "
                      "the resumed run cannot replay the same batches and dropout")
        del ckpt  # free the memory it holds
    resumed_at = iter_num if last_saved is not None else None

    compile_as = effective_compile(cfg["compile"], world)
    if compile_as != cfg["compile"]:
        if master:
            print(f"note: compile={cfg['compile']!r} adds CUDA graphs, not tried with DDP here: using plain torch.compile")
        cfg["compile"] = compile_as
    compile_mode = None if cfg["compile"] in (True, "default") else cfg["compile"]
    model = torch.compile(raw_model, mode=compile_mode) if cfg["compile"] else raw_model
    eval_model = model  # evaluated without the DDP wrapper: no gradient sync needed
    if world > 1:
        model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None)
    log_path = os.path.join(cfg["out_dir"], "log.jsonl")
    if master:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        start_log(log_path, resumed_at)

    def write_log(record):
        if master:  # append and close per record: the log survives any crash, and no handle is left open
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    write_log({"type": "run", "iter": iter_num, "resumed": resumed_at is not None, "world_size": world,
               "device": device, "dtype": dtype, "config": cfg})
    if master:
        print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens per iteration, "
              f"{device} {dtype}, {world} process(es), data {data_dir}")

    def diverged(what, value, lr):
        kept = f"the last good checkpoint ({ckpt_path}, iter {last_saved}) is kept" if last_saved is not None else "no checkpoint was written"
        tips = [f"a lower learning_rate (now {cfg['learning_rate']:g})", "more warmup_iters"]
        tips += ["grad_clip=1.0"] if cfg["grad_clip"] <= 0 else []
        tips += ["dtype=bfloat16 or float32"] if dtype == "float16" else []
        return TrainingDiverged(f"{what} became {value} at iter {iter_num} (lr {lr:.3g}); training stopped without "
                                f"saving, and {kept}. Try {', '.join(tips)}.")

    def save():
        # Called after the eval at iter_num, before that iteration's step, with every process's RNG states of
        # this moment and the batch generator's from before the prefetched batch was drawn: a run resumed from
        # here draws the same batches and dropout masks as one that never stopped, so its losses match bit for bit.
        state = rng_state(batch_state, device_type)
        states = [None] * world
        if world > 1:
            dist.all_gather_object(states, state)
        else:
            states = [state]
        if master:
            save_checkpoint({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict() if scaler.is_enabled() else None, "model_args": model_args,
                             "config": cfg, "meta": meta, "iter_num": iter_num, "best_val_loss": best_val,
                             "rng": states}, ckpt_path)

    batch_state = batches.gen.get_state()  # the generator's state before the pending batch was drawn
    x, y = batches.get("train")
    bar = tqdm(total=cfg["max_iters"], initial=iter_num, disable=not (master and cfg["progress"]), dynamic_ncols=True)
    local_iter, mfu, losses = 0, None, None
    try:
        while True:
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if cfg["eval_only"] or (iter_num != resumed_at and (iter_num % cfg["eval_interval"] == 0 or iter_num >= cfg["max_iters"])):
                losses = estimate_loss(eval_model, batches, cfg["eval_iters"], autocast, cfg["seed"] + 7 + rank, world,
                                       cfg)
                if not all(map(math.isfinite, losses.values())):
                    raise diverged("val/train loss", losses, lr)
                write_log({"type": "eval", "iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr})
                if master:
                    bar.write(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                if cfg["eval_only"]:
                    break
                if losses["val"] < best_val or cfg["always_save_checkpoint"]:
                    best_val = min(best_val, losses["val"])
                    save()
                    last_saved = iter_num
            if iter_num >= cfg["max_iters"]:
                break

            # One optimizer step of `accum` micro-steps; gradients are synced across processes on the last only.
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                sync = model.no_sync() if world > 1 and micro < accum - 1 else contextlib.nullcontext()
                with sync:
                    new_step(cfg)
                    with autocast:
                        loss = model(x, y)[1] / accum
                    batch_state = batches.gen.get_state()
                    x, y = batches.get("train")  # prefetch the next batch while the GPU runs this forward
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            if world > 1:
                dist.all_reduce(loss_sum)
                loss_sum /= world
            lossf = loss_sum.item()  # one sync per step; it lets a NaN stop us before it reaches the weights
            if not math.isfinite(lossf):
                raise diverged("loss", lossf, lr)
            if cfg["grad_clip"] > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0

            if local_iter >= 3:  # the first steps include warm-up (compilation, autotuning, allocation)
                step_mfu = raw_model.estimate_mfu(cfg["batch_size"] * accum, dt)
                if step_mfu is not None:
                    mfu = step_mfu if mfu is None else 0.9 * mfu + 0.1 * step_mfu
            if iter_num % cfg["log_interval"] == 0:
                write_log({"type": "step", "iter": iter_num, "loss": lossf, "lr": lr, "ms": dt * 1000,
                           "tokens_per_s": tokens_per_iter / dt, "mfu": mfu})
            if cfg["progress"]:
                postfix = {"loss": f"{lossf:.4f}", "tok/s": f"{tokens_per_iter / dt:,.0f}"}
                postfix.update({"mfu": f"{mfu:.1%}"} if mfu is not None else {})
                bar.set_postfix(postfix, refresh=False)
            elif master and iter_num % cfg["log_interval"] == 0:  # no bar (e.g. logging to a file): plain lines
                mfu_text = f", mfu {mfu:.1%}" if mfu is not None else ""
                print(f"iter {iter_num}: loss {lossf:.4f}, {dt * 1000:.1f} ms, {tokens_per_iter / dt:,.0f} tok/s{mfu_text}")
            bar.update()
            iter_num += 1
            local_iter += 1
    finally:
        bar.close()

    if master:
        if cfg["plot"]:
            plot_losses(os.path.join(cfg["out_dir"], "log.jsonl"), os.path.join(cfg["out_dir"], "loss.png"))
        if cfg["sample_after"]:
            encode, decode = data.get_tokenizer(meta)
            raw_model.eval()
            with autocast:
                start = data.start_ids(meta, encode)  # a newline, or the first token if the vocabulary has none
                out = raw_model.generate(torch.tensor([start], device=device), 300, temperature=0.8, top_k=200)
            ids = [i for i in out[0].tolist() if i < meta["vocab_size"]]  # padded-vocab rows have no text
            print(f"--- sample after {iter_num} iterations ---\n{decode(ids)}\n---")
    return {"iter_num": iter_num, "best_val_loss": best_val, "losses": losses, "out_dir": cfg["out_dir"]}


def cli():
    """main() with a one-line message (from rank 0 only) and an exit code instead of a traceback."""
    say = (lambda msg: print(f"train.py: {msg}", file=sys.stderr)) if os.environ.get("RANK", "0") == "0" else (lambda msg: None)
    try:
        main()
    except ConfigError as e:
        say(f"config error: {e}")
        return 2
    except TrainingDiverged as e:
        say(e)
        return 1
    except KeyboardInterrupt:
        say("interrupted; the last checkpoint is kept")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli())
