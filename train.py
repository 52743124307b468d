"""
Train a GPT (model.py) on a prepared dataset (prepare.py): one process, or many with torchrun.

    python train.py configs/shakespeare_char_cpu.py --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    python train.py configs/shakespeare_char_cpu.py --init_from=resume     # continue a run exactly
    python train.py --dataset=shakespeare --init_from=gpt2 --learning_rate=3e-5 --max_iters=20  # fine-tune GPT-2

Settings: DEFAULTS in helpers/config.py, overridden by config files, then by --key=value (checked there too).
Writes out_dir/ckpt.pt and ckpt.pt.prev, the one before it (helpers/checkpoint.py), out_dir/log.jsonl and loss.png
(helpers/runlog.py). Ctrl-C or SIGTERM stops at the end of the step, saves, and prints the command that resumes
(helpers/stopping.py).

Read main() and train(): they are the whole story, in nanoGPT's order (settings, setup, data, model,
optimizer, loop); the functions below them are its steps.
"""

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from helpers import checkpoint, config, data, errors, runtime
from helpers.config import DEFAULTS, ConfigError
from helpers.prepare_data import ensure_dataset
from helpers.runlog import RunLog, check_wandb, closing, plot_losses
from helpers.stopping import StopOnSignal, check_tokens, diverged, out_of_memory, stopped_by_signal
from helpers.timing import RunTimer, plural
from model import GPT, GPTConfig


def main(argv=None):
    """Train as configured by argv (default sys.argv[1:]); returns a summary dict, or None after --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, ckpt = config.load(argv)
    if cfg is None:
        return None
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    if cfg["gradient_accumulation_steps"] % world:
        raise ConfigError(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be divisible by "
                          f"the number of processes ({world}): each does an equal share of the micro-steps")
    device = runtime.resolve_device(cfg["device"], int(os.environ["LOCAL_RANK"]) if ddp else None)
    dtype = runtime.precision(cfg["dtype"], device.split(":")[0])[0]  # (what "auto" is here)
    runtime.check_fp8(cfg["fp8"], device, dtype)  # before any data is prepared; before check_mlp, which it implies
    runtime.check_mlp(cfg["mlp"], device)
    runtime.check_mlp("fused" if cfg["classifier"] != "eager" else "eager", device,
                      source=f"--classifier={cfg['classifier']}", instead="use --classifier=eager")
    runtime.check_fp8(cfg["classifier"] == "fp8", device, dtype, "--classifier=fp8", "use --classifier=fused")
    runtime.check_interpreter_dtype(cfg["mlp"], device, dtype)
    check_wandb(cfg)
    if ddp:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    # One process driving one GPU runs backward on its own thread: the autograd engine's handoff to a device
    # thread of its own cost more host time than it saved on the hosts measured (docs/performance.md).
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # train() turns TF32 on
    try:
        with torch.autograd.set_multithreading_enabled(ddp or not device.startswith("cuda")):
            return train(cfg, ckpt, argv, device, rank, world)
    except torch.OutOfMemoryError as e:
        raise out_of_memory(cfg, device, e) from None
    finally:  # put back for whatever runs next in this process (a test suite, a notebook)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if ddp:
            dist.destroy_process_group()


def train(cfg, ckpt, argv, device, rank, world):
    """Data, model, optimizer, then the loop; on resume each piece continues from the checkpoint."""
    master, device_type = rank == 0, device.split(":")[0]
    accum = cfg["gradient_accumulation_steps"] // world  # micro-steps per optimizer step, in each process
    tokens_per_iter = accum * world * cfg["batch_size"] * cfg["block_size"]
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dtype, autocast = runtime.precision(cfg["dtype"], device_type)
    timer = RunTimer(master, device_type)

    # data
    with timer.phase("data"):
        data_dir, meta = prepare_data(cfg, world)
        batches = data.Batches(data_dir, cfg["batch_size"], cfg["block_size"], device,
                               seed=cfg["seed"] * 1000 + 1 + rank, defer_errors=world > 1)

    # model and optimizer
    with timer.phase("model"):
        raw_model, model_args = build_model(cfg, ckpt, meta, data_dir)
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # the fused kernels compile meanwhile (one child per machine)
            raw_model.precompile_kernels(cfg["batch_size"], None if dtype == "float32" else runtime.DTYPES[dtype],
                                         device, cfg["grad_clip"])
        raw_model.to(device)
        optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                                   (cfg["beta1"], cfg["beta2"]), device_type)
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling
        torch.manual_seed(cfg["seed"] + rank)  # dropout differs between processes
        progress = checkpoint.Progress()
        if ckpt is not None:  # the optimizer, the iteration and every process's random streams continue
            progress = checkpoint.resume(ckpt, cfg, optimizer, scaler, batches, rank, world, device_type)
        model = runtime.wrap_model(raw_model, cfg["compile"], world, device_type, regions=cfg["compile_regions"])

    log = RunLog(cfg["out_dir"], master, progress.last_saved, cfg)
    log.write({"type": "run", "iter": progress.iter_num, "resumed": ckpt is not None, "world_size": world,
               "device": device, "dtype": dtype, "config": cfg})
    if master:
        print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens per iteration, "
              f"{device} {dtype}, {plural(world, 'process', 'processes')}, data {data_dir}")
        if ckpt is not None:
            print(f"resuming from {checkpoint.path(cfg['out_dir'])} at iteration {progress.iter_num} "
                  f"(max_iters={cfg['max_iters']})")
        print(f"writing to {cfg['out_dir']}: {', '.join(output_files(cfg))}")

    def save(evaluated):
        """A checkpoint of this moment: before iteration iter_num's step, with every process's random states."""
        with timer.phase("checkpoints"):
            states = checkpoint.rng_states(batches.state, device_type, world)
            if master:
                checkpoint.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                                 "model_args": model_args, "config": cfg, "meta": meta, "iter_num": progress.iter_num,
                                 "best_val_loss": progress.best_val, "rng": states, "evaluated": evaluated},
                                checkpoint.path(cfg["out_dir"]))
            progress.last_saved, progress.saved_by_eval = progress.iter_num, evaluated
            if evaluated:
                checkpoint.keep_best(cfg, master)
        timer.checkpoints += 1

    # the loop (wandb, when on, is closed however it ends)
    bar = tqdm(total=cfg["max_iters"], initial=progress.iter_num, dynamic_ncols=True,
               disable=not (master and cfg["progress"]))
    losses, mfu, local_iter = None, None, 0
    with StopOnSignal(master, grace=1.0 if world > 1 else 0.0) as stop, bar, closing(log):
        while True:
            t0 = time.perf_counter()  # an iteration's time: the stop agreement and the step (an eval's is its own)
            lr = get_lr(progress.iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            signum = stop.requested()  # the stop asked for by a signal, agreed by every process (on the CPU)
            if signum:
                raise stopped_by_signal(cfg, progress, signum, argv, world, save, master)

            if eval_due(progress, cfg):
                e0 = time.perf_counter()
                losses = estimate_loss(model, batches, cfg, autocast, device, rank, world)
                timer.eval(time.perf_counter() - e0)
                if not all(map(math.isfinite, losses.values())):
                    check_tokens(batches, world)  # (a token id out of the vocabulary makes the loss NaN first)
                    raise diverged(cfg, progress, "val/train loss", losses, lr, dtype)
                log.write({"type": "eval", "iter": progress.iter_num, "train_loss": losses["train"],
                           "val_loss": losses["val"], "lr": lr})
                if master:
                    bar.write(f"iter {progress.iter_num}: train loss {losses['train']:.4f}, "
                              f"val loss {losses['val']:.4f} ({timer.evals[-1]:.2f} s)")
                if cfg["eval_only"]:
                    break
                if losses["val"] < progress.best_val or cfg["always_save_checkpoint"]:
                    progress.best_val = min(progress.best_val, losses["val"])
                    save(evaluated=True)
                t0 = time.perf_counter()  # (the eval and its checkpoint are timed apart)
            if progress.iter_num >= cfg["max_iters"]:
                break

            lossf = train_step(model, batches, optimizer, scaler, cfg, autocast, accum, world)
            dt = time.perf_counter() - t0
            timer.step(dt)
            if not math.isfinite(lossf):
                check_tokens(batches, world)
                raise diverged(cfg, progress, "loss", lossf, lr, dtype)
            if local_iter >= 3:  # the first steps include warm-up (compilation, autotuning, allocation)
                step_mfu = raw_model.estimate_mfu(cfg["batch_size"] * accum, dt)
                if step_mfu is not None:
                    mfu = step_mfu if mfu is None else 0.9 * mfu + 0.1 * step_mfu
            report_step(log, bar, cfg, progress.iter_num, lossf, lr, dt, tokens_per_iter / dt, mfu, master)
            progress.iter_num += 1
            local_iter += 1

    timer.report()
    timer.summary()
    if master:
        if cfg["plot"]:
            plot_losses(log.path, os.path.join(cfg["out_dir"], "loss.png"))
        written = output_files(cfg, saved=timer.checkpoints > 0,
                               prev=os.path.isfile(checkpoint.path(cfg["out_dir"]) + ".prev"))
        print(f"wrote {', '.join(os.path.join(cfg['out_dir'], name) for name in written)}")
        if cfg["sample_after"]:
            print_sample(raw_model, meta, autocast, device, progress.iter_num)
    return {"iter_num": progress.iter_num, "best_val_loss": progress.best_val, "losses": losses,
            "out_dir": cfg["out_dir"], "startup": timer.seconds}


# -----------------------------------------------------------------------------
# the schedule

def get_lr(it, cfg):
    if not cfg["decay_lr"]:
        return cfg["learning_rate"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it >= cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def output_files(cfg, saved=True, prev=True):
    """The files a run writes in out_dir (what it will write, at its start; what it wrote, at its end: saved says
    whether it wrote a checkpoint, prev whether ckpt.pt.prev, the one a save replaced, is there). An eval_only run
    writes no checkpoint."""
    checkpoints = [] if cfg["eval_only"] or not saved else ["ckpt.pt", *(["ckpt.pt.prev"] if prev else [])] + \
        ([] if cfg["always_save_checkpoint"] else ["ckpt_best.pt"])
    return [*checkpoints, "log.jsonl", *(["loss.png"] if cfg["plot"] else [])]


def eval_due(progress, cfg):
    """On the eval grid, at the end, or the one eval of eval_only; never twice at one iteration (a resumed
    checkpoint written by an eval has its eval done already)."""
    if cfg["eval_only"]:
        return True
    on_grid = progress.iter_num % cfg["eval_interval"] == 0 or progress.iter_num >= cfg["max_iters"]
    return on_grid and progress.iter_num != progress.evaluated_at


# -----------------------------------------------------------------------------
# data and model

def prepare_data(cfg, world=1):
    """The dataset's folder (prepared on first use) and its metadata. Under torchrun only rank 0 prepares it
    (several processes writing the same files would collide); the others wait for its answer."""
    answer = [None]
    if world == 1 or dist.get_rank() == 0:
        try:
            answer[0] = ensure_dataset(cfg["dataset"], data_root=cfg["data_root"])
        except FileNotFoundError as e:  # ensure_dataset's message names the dataset; an OS error's may not
            named = str(e).startswith(f"dataset {cfg['dataset']!r}")
            raise ConfigError(str(e) if named else f"dataset {cfg['dataset']!r}: {e}") from e
        finally:  # on failure the others get None and stop too (rank 0's error is the one printed)
            if world > 1:
                dist.broadcast_object_list(answer, src=0)
    else:
        dist.broadcast_object_list(answer, src=0)
        if answer[0] is None:
            raise errors.RunError(f"rank 0 could not prepare dataset {cfg['dataset']!r}")
    return answer[0], data.load_meta(answer[0])


def build_model(cfg, ckpt, meta, data_dir):
    """(the GPT on the CPU, the GPTConfig arguments saved with it): new, resumed from ckpt, or GPT-2's weights."""
    torch.manual_seed(cfg["seed"])  # the same initial weights whatever the world size
    if cfg["init_from"] not in ("scratch", "resume"):
        return load_pretrained(cfg, meta)
    model_args = {k: cfg[k] for k in config.MODEL_KEYS}  # on resume cfg holds the checkpoint's architecture
    model_args["vocab_size"] = cfg["vocab_size"] or meta["vocab_size"]
    if ckpt is not None:
        check_same_vocabulary(ckpt, meta, cfg, data_dir)
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"config key 'vocab_size' ({model_args['vocab_size']}) is smaller than the dataset's "
                          f"({meta['vocab_size']})")
    try:
        model = GPT(GPTConfig(**model_args))
    except ValueError as e:  # model.py names the bad key (mlp, activation, n_head...)
        raise ConfigError(str(e)) from e
    if ckpt is not None:
        checkpoint.load_weights(model, ckpt, checkpoint.path(cfg["out_dir"]))
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
                                    fuse_ln=cfg["fuse_ln"], fp8=cfg["fp8"], fp8_reach=cfg["fp8_reach"],
                                    classifier=cfg["classifier"])
    except (OSError, ValueError) as e:  # not downloadable offline, a folder without the files, a bad block_size
        raise ConfigError(f"init_from={name!r}: {e}") from e
    model_args = {k: getattr(model.config, k) for k in (*config.MODEL_KEYS, "vocab_size")}
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"init_from={name!r} has a vocabulary of {model_args['vocab_size']} tokens, fewer than "
                          f"dataset {cfg['dataset']!r}'s {meta['vocab_size']}")
    # saved with the run's config, so that a resume and sample.py see the model actually trained
    config.fix_architecture(cfg, model_args, DEFAULTS, f"init_from={name!r} has",
                     keys=[k for k in config.ARCH_KEYS if k != "block_size"])
    return model, model_args


def check_same_vocabulary(ckpt, meta, cfg, data_dir):
    """A resumed model must see the token ids it was trained on: the same tokenizer and vocabulary."""
    vocabulary = lambda m: (m["tokenizer"], m["vocab_size"], m.get("chars"))
    (tok0, n0, chars0), (tok1, n1, chars1) = vocabulary(ckpt["meta"]), vocabulary(meta)
    if (tok0, n0, chars0) == (tok1, n1, chars1):
        return
    same = " (the same size, other characters)" if (tok0, n0) == (tok1, n1) else ""
    raise ConfigError(f"checkpoint {checkpoint.path(cfg['out_dir'])} was trained on a {tok0} vocabulary of {n0} "
                      f"tokens, but dataset {cfg['dataset']!r} ({data_dir}) has a {tok1} vocabulary of {n1}{same}: "
                      f"resume with the dataset it was trained on (--dataset={ckpt['config'].get('dataset')}), or "
                      "train on this one in a new out_dir")


# -----------------------------------------------------------------------------
# the steps of the loop

def train_step(model, batches, optimizer, scaler, cfg, autocast, accum, world):
    """One optimizer step of `accum` micro-steps (gradients synced across processes on the last only); returns
    the loss, averaged over processes. Its one host sync (reading the loss, which waits for the last forward only, so
    the GPU runs the backward meanwhile) lets a NaN stop the run before it reaches the weights."""
    loss_sum, on_host = 0.0, None
    runtime.zero_grads(model, optimizer, cfg["compile"], accum, world)
    for micro in range(accum):
        last = micro == accum - 1
        with model.no_sync() if world > 1 and not last else contextlib.nullcontext():
            runtime.new_step(cfg["compile"])
            x, y = batches.next()
            with autocast:
                loss = model(x, y)[1] / accum
            loss_sum += loss.detach()
            if last:  # queued before the backward: reading it waits for the forward (and the loss's all-reduce) only
                if world > 1:
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                on_host = runtime.to_host(loss_sum)
            batches.prefetch()  # the next batch is drawn while the GPU runs this forward: its copy overlaps it
            scaler.scale(loss).backward()
    lossf = on_host()
    if math.isfinite(lossf):
        runtime.clip_and_step(optimizer, model.parameters(), cfg["grad_clip"], scaler)
    return lossf


def report_step(log, bar, cfg, it, lossf, lr, dt, tokens_per_s, mfu, master):
    """The step's loss, time and MFU: in log.jsonl, and on the progress bar (or as a plain line without one)."""
    if it % cfg["log_interval"] == 0:
        log.write({"type": "step", "iter": it, "loss": lossf, "lr": lr, "ms": dt * 1000, "tokens_per_s": tokens_per_s,
                   "mfu": mfu})
    if cfg["progress"]:
        bar.set_postfix({"loss": f"{lossf:.4f}", "tok/s": f"{tokens_per_s:,.0f}",
                         **({"mfu": f"{mfu:.1%}"} if mfu is not None else {})}, refresh=False)
    elif master and it % cfg["log_interval"] == 0:  # no bar (e.g. logging to a file): plain lines
        mfu_text = f", mfu {mfu:.1%}" if mfu is not None else ""
        print(f"iter {it}: loss {lossf:.4f}, {dt * 1000:.1f} ms, {tokens_per_s:,.0f} tok/s{mfu_text}", flush=True)
    bar.update()


@torch.no_grad()
def estimate_loss(model, batches, cfg, autocast, device, rank, world):
    """Mean loss over eval_iters batches of each split, averaged over all processes. The batches come from
    their own generator, reseeded every time: evals are comparable and never move the training RNG."""
    model.eval()
    out = torch.zeros(2, device=device)
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(cfg["seed"] + 7 + rank)
        for _ in range(cfg["eval_iters"]):
            x, y = batches.get(split, gen)
            runtime.new_step(cfg["compile"])
            with autocast:
                out[i] += model(x, y)[1].float() / cfg["eval_iters"]
    model.train()
    if world > 1:
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return dict(zip(("train", "val"), out.tolist()))


def print_sample(raw_model, meta, autocast, device, iter_num):
    encode, decode = data.get_tokenizer(meta)
    raw_model.eval()
    # eager, as without compile_regions (which compiled raw_model's blocks in place): no graphs for each length
    with autocast, torch.compiler.set_stance("force_eager"):
        start = data.start_ids(meta, encode)  # a newline, or the first token if the vocabulary has none
        out = raw_model.generate(torch.tensor([start], device=device), 300, temperature=0.8, top_k=200)
    ids = [i for i in out[0].tolist() if i < meta["vocab_size"]]  # padded-vocab rows have no text
    print(f"--- sample after {iter_num} iterations ---\n{decode(ids)}\n---")


def cli():
    """main() with a one-line message (from rank 0 only) and an exit status instead of a traceback."""
    return errors.run_main("train.py", main, quiet=os.environ.get("RANK", "0") != "0")


if __name__ == "__main__":
    sys.exit(cli())
