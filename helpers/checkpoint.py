"""
Checkpoints: the files train.py writes in out_dir and what train.py, sample.py and export.py read back.

    ckpt.pt       the latest checkpoint, replaced atomically (a crash mid-write leaves the old one whole)
    ckpt.pt.prev  the one before it: a fallback should ckpt.pt be damaged later (a disk error, a bad copy)
    ckpt_best.pt  with always_save_checkpoint=False, the best one (lowest val loss), which a stop never replaces

A checkpoint holds the model, the optimizer, the settings, the dataset's tokenizer (meta) and every process's
random states, so that a resumed run draws the same batches and dropout masks as one that never stopped.
"""

import contextlib
import dataclasses
import math
import os
import pickle
import random
import shlex
import shutil

import numpy as np
import torch
import torch.distributed as dist

from helpers import errors, runtime
from model import GPT, GPTConfig

KEYS = ("model", "optimizer", "model_args", "config", "meta", "iter_num", "best_val_loss", "rng")


@dataclasses.dataclass
class Progress:
    """Where the run is, and what its checkpoints hold: all that the loop changes, and all a checkpoint restores."""

    iter_num: int = 0
    best_val: float = math.inf
    last_saved: int = None  # the iteration of the last checkpoint written (or resumed from)
    saved_by_eval: bool = False  # ckpt.pt was written by an eval (with always_save_checkpoint=False: the best)
    evaluated_at: int = None  # an iteration whose eval is done already (the resumed checkpoint's)


def path(out_dir):
    return os.path.join(out_dir, "ckpt.pt")


def best_path(out_dir):
    return os.path.join(out_dir, "ckpt_best.pt")


# -----------------------------------------------------------------------------
# writing

def save(ckpt, path):
    """Write to a temp file in the same folder, fsync, then rename over the old one (os.replace is atomic);
    the file it replaces stays as path.prev."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isfile(path):
            link_or_copy(path, f"{path}.prev")  # a hard link costs no space until path is replaced
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


def keep_best(cfg, master):
    """With always_save_checkpoint=False, ckpt.pt written by an eval is the best so far: give it a second name,
    ckpt_best.pt, which a stop's checkpoint written to ckpt.pt later does not replace."""
    ckpt_path = path(cfg["out_dir"])
    if master and not cfg["always_save_checkpoint"] and os.path.isfile(ckpt_path):
        link_or_copy(ckpt_path, best_path(cfg["out_dir"]))


def rng_states(batch_state, device_type, world):
    """Every process's random states (torch, CUDA, numpy, Python, the batch generator's), gathered on all."""
    np_state = np.random.get_state()  # plain lists, so that torch.load(weights_only=True) reads it
    state = {"torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None,
             "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
             "python": random.getstate(),
             "batches": batch_state}
    if world == 1:
        return [state]
    states = [None] * world
    dist.all_gather_object(states, state)
    return states


def set_rng_state(state, device_type):
    """Restore one process's random states; returns the batch generator's, which the caller owns."""
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    random.setstate(state["python"])
    return state["batches"]


# -----------------------------------------------------------------------------
# reading

def read(path, keys=KEYS):
    """The checkpoint dict at path (an existing file). A file that is damaged or is not one of our checkpoints
    is one line naming it and saying whether the one before it (path.prev) is there to fall back on."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (PermissionError, IsADirectoryError) as e:
        raise errors.UsageError(f"cannot read checkpoint {path}: {e.strerror}") from e
    except pickle.UnpicklingError as e:  # a pickle of other objects: weights_only loading refuses to run it
        raise errors.UsageError(f"{path} is not a train.py checkpoint (it holds Python objects, not tensors and "
                                f"plain data); {older(path)}") from e
    except Exception as e:  # torn or foreign files fail in torch.load's many ways (zip, EOF)
        why = str(e).strip().splitlines()[0][:150] if str(e).strip() else type(e).__name__
        raise errors.RunError(f"checkpoint {path} is damaged or is not a checkpoint ({why}); {older(path)}") from e
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise errors.UsageError(f"{path} is not a train.py checkpoint (it has no {', '.join(missing)}); "
                                f"{older(path)}")
    return ckpt


def older(path):
    """Whether the checkpoint before path (path.prev) is there, and how to use it."""
    prev = f"{path}.prev"
    if not os.path.isfile(prev):
        return f"no older checkpoint is kept ({prev} does not exist): start again with --init_from=scratch"
    try:  # mmap: the iteration number without reading gigabytes of weights
        iter_num = torch.load(prev, map_location="cpu", weights_only=True, mmap=True)["iter_num"]
    except Exception:
        return f"the older {prev} cannot be read either: start again with --init_from=scratch"
    return f"the one before it is intact: mv {prev} {path} to continue from its iter {iter_num}"


def load_weights(model, ckpt, path):
    """The checkpoint's weights into model (a torch.compile'd model's names carry an _orig_mod. prefix)."""
    try:
        model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    except RuntimeError as e:  # names the tensors that differ
        raise errors.RunError(f"checkpoint {path} does not fit its own model_args ({str(e).splitlines()[0]}); "
                              f"{older(path)}") from e
    return model


def load_model(out_dir, device="cpu", mlp=None):
    """(the model of out_dir/ckpt.pt in eval mode on device, the checkpoint dict), for sampling and export.
    mlp overrides the checkpoint's MLP kind; None keeps it, checked to run on device."""
    ckpt_path = path(out_dir)
    if not os.path.isfile(ckpt_path):
        # the hint names out_dir: the config writes elsewhere (out-shakespeare-char-cpu), where this would not look
        raise errors.UsageError(f"no checkpoint at {ckpt_path}; train one first, e.g. python train.py "
                                f"configs/shakespeare_char_cpu.py --out_dir={shlex.quote(out_dir)}")
    ckpt = read(ckpt_path, keys=("model", "model_args", "meta"))
    # FP8 and the fused classifier are ways to train: inference runs bf16 and needs the logits
    model_args = {**ckpt["model_args"], "dropout": 0.0, "fp8": False, "fp8_reach": "mlp",
                  "classifier": "eager"}
    if mlp is None:  # the checkpoint's choice, which may not run here (trained with the kernels on a GPU)
        runtime.check_mlp(model_args["mlp"], device, source=f"{ckpt_path} has mlp='fused', which")
    else:
        model_args["mlp"] = mlp
        if mlp == "eager":  # folding the LayerNorm is a way to compute, not a parameter: eager simply does not fold
            model_args["fuse_ln"] = False
    model = load_weights(GPT(GPTConfig(**model_args)), ckpt, ckpt_path)
    return model.eval().to(device), ckpt


def resume(ckpt, cfg, optimizer, scaler, batches, rank, world, device_type):
    """Continue from a checkpoint: optimizer, scaler, progress, and every process's random streams."""
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler.is_enabled() and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    it, evaluated = ckpt["iter_num"], ckpt.get("evaluated", True)
    if len(ckpt["rng"]) == world:
        batches.set_state(set_rng_state(ckpt["rng"][rank], device_type))
    else:  # fresh streams that at least do not repeat the first iterations' batches
        torch.manual_seed(cfg["seed"] + rank + 1_000_003 * it)
        batches.gen.manual_seed(cfg["seed"] * 1000 + 1 + rank + 1_000_003 * it)
        if rank == 0:
            print(f"warning: the checkpoint was written by {len(ckpt['rng'])} processes, now {world}: "
                  "the resumed run cannot replay the same batches and dropout")
    return Progress(iter_num=it, best_val=ckpt["best_val_loss"], last_saved=it, saved_by_eval=evaluated,
                    evaluated_at=it if evaluated else None)
