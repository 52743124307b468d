"""
End-to-end training throughput: mlp="eager" vs mlp="fused", each with and without torch.compile.

    python bench.py configs/gpt2_124m.py                       # GPU: full training steps, bf16
    python bench.py configs/shakespeare_char_cpu.py --device=cpu --mlps=eager --compile=False --steps=3  # (CPU: no kernels)
    python bench.py --mlp_widths=768,1024,2048,4096             # GPU: the MLP alone, gelu and swiglu
    TRITON_INTERPRET=1 python bench.py --mlp_widths=32,64 --mlp_tokens=32,32 --device=cpu --compile=False

Every variant starts from the same weights and batches (random tokens): the first losses, printed beside the timings,
must agree. A step is train.py's (train_step: forward and backward over gradient_accumulation_steps micro-batches, the
loss read, clipping, AdamW), timed as train.py times it, steps back to back. Reported: median ms/step, tokens/s, MFU,
peak GPU memory (allocated; reserved holds CUDA graphs' pools). Writes JSON, CSV and a PNG to --out (default
out-bench/bench_<config>.*; results/ holds what the docs cite, only with --out=results/...). --compile takes a
torch.compile mode too. --mlps=fp8: the fused MLP in FP8; fp8blocks: the attention's projections too; torchao: the
eager MLP through torchao's float8 (where installed); +cls adds the fused classifier (fused+cls), +cls8 its FP8 form.
+portable runs a variant on the portable kernels (FUSED_OPS_PINGPONG=0: what a GPU without the Hopper kernels runs),
+pointer also with the pointer main loop (FUSED_OPS_TMA=0: Ampere's and Ada's), beside the others in the same process;
an entry's own compile setting after "@" runs it under that one only:

    python bench.py configs/gpt2_124m.py --mlps=eager@True,fused+cls,fused+cls+portable --compile=reduce-overhead --rounds=4
--rounds=N builds every variant, then times them in N rounds, the order reversed each time (a first variant can run slower: results/bench_gpt2_124m_uncompiled_orders_h100.txt):

    python bench.py configs/gpt2_124m.py --compile=False --rounds=4 --steps=10

--gpus=1,2,4: torchrun on 1, 2, 4 GPUs of this host, same micro-batch per GPU (as train.py), tokens/s per GPU:

    python bench.py configs/gpt2_124m.py --gpus=1,2,4 --mlps=eager,fused,fp8 --compile=reduce-overhead --rounds=2

--mlp_widths times the MLP alone (bench_mlp.py) per width C and activation: eager, fused, compiled, their ms and % of the
matmul floor (a GPU: also as one CUDA graph); tokens 12288 at 768, 16384 at 1024, else 8192 (--mlp_tokens).
"""

import contextlib
import csv
import gc
import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import triton
from tqdm import tqdm

import bench_mlp
import train
from fused_ops import env as fused_env
from helpers import config, errors, runtime
from helpers.variants import MLPS, compile_setting, kernel_family, parse_variant, variant_list  # noqa: F401 (the lab's)
from model import GPT, GPTConfig

MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "activation")
OUT_DIR = "out-bench"  # a user's own runs: untracked (.gitignore's out*/), where results/ is the docs' record


def parse_args(argv=None):
    ap = errors.ArgumentParser("bench.py", description=__doc__)
    ap.add_argument("config", nargs="?", help="a config file from configs/ (model size, batch size)")
    ap.add_argument("--batch_size", type=int, help="default: the config's")
    ap.add_argument("--block_size", type=int, help="default: the config's")
    ap.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--activation", help="default: the config's")
    ap.add_argument("--vocab_size", type=int, default=None, help="default: 50304 for BPE configs, else 256")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cuda:1 or cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    ap.add_argument("--mlps", default="eager,fused",
                    help="of eager, fused, auto, fp8 (fused in FP8), fp8blocks (attention's linears too), torchao (the "
                         "eager MLP through torchao's float8, if installed); +cls: the fused classifier, +cls8 in FP8; "
                         "+portable: on the portable kernels (FUSED_OPS_PINGPONG=0), +pointer: also FUSED_OPS_TMA=0")
    ap.add_argument("--compile", default="False,True",
                    help="compile settings to run: False, True (torch.compile's default mode) or a torch.compile "
                         "mode, e.g. reduce-overhead (CUDA graphs: no per-kernel host time)")
    ap.add_argument("--compile_regions", action="store_true",
                    help="compile each block apart, as train.py's compile_regions=True (helpers/runtime.py)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (per round, with --rounds)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: build every variant first, then time them in this many rounds, alternating their order")
    ap.add_argument("--out", default=None, help=f"output path without extension (default: {OUT_DIR}/bench_<config>)")
    ap.add_argument("--bucket_mb", type=float, default=runtime.BUCKET_MB, help="DDP's gradient bucket size (torchrun)")
    ap.add_argument("--gpus", default=None,
                    help="e.g. 1,2,4: run under torchrun on that many GPUs of this host, one count after another "
                         "(with --device=cpu: that many processes, over Gloo)")
    ap.add_argument("--mlp_widths", default=None, help="time the MLP alone at these widths C, e.g. 768,1024,2048,4096")
    ap.add_argument("--mlp_tokens", default=None, help="tokens M per width (default: bench_mlp.DEFAULT_TOKENS)")
    ap.add_argument("--mlp_activations", default="gelu,swiglu", help="with --mlp_widths")
    bench_mlp.add_backward_thread_arg(ap)
    args = ap.parse_args(argv)
    if not args.config and not args.mlp_widths:
        ap.error("give a config file, or --mlp_widths")
    if args.gpus and (args.mlp_widths or not all(n.isdigit() and int(n) > 0 for n in args.gpus.split(","))):
        raise errors.UsageError(f"--gpus={args.gpus}: expected GPU counts such as 1,2,4, with a config file")
    if args.gpus and args.device.startswith("cuda") and max(map(int, args.gpus.split(","))) > torch.cuda.device_count():
        raise errors.UsageError(f"--gpus={args.gpus}: this host has {torch.cuda.device_count()} GPU(s)")
    if args.config and not os.path.isfile(args.config):
        raise errors.UsageError(f"config file not found: {args.config} (e.g. configs/gpt2_124m.py)")
    errors.check_device(args.device)
    if args.dtype not in (None, "bfloat16", "float16", "float32"):
        raise errors.UsageError(f"--dtype={args.dtype}: expected bfloat16, float16 or float32")
    dtype, mlps = str(pick_dtype(args)).removeprefix("torch."), args.mlps.split(",")
    for mlp in (kernel_family(m.partition("@")[0])[0].partition("+cls")[0] for m in mlps):  # all checked first
        if mlp not in MLPS:
            raise errors.UsageError(f"--mlps={args.mlps}: {mlp!r} is not one of {', '.join(MLPS)}")
        runtime.check_interpreter_dtype("fused" if "fp8" in mlp else mlp, args.device, dtype, f"--mlps={mlp}")
    runtime.check_fp8(any("fp8" in m or "cls8" in m for m in mlps), args.device, dtype, "--mlps=fp8",
                      "leave fp8 out of --mlps")
    return args


def pick_dtype(args):
    return getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))


def load_config(args):
    try:
        cfg = {k: v for k, v in runpy.run_path(args.config).items() if not k.startswith("_")}
    except Exception as e:  # the config file's own error, named with the file
        raise errors.UsageError(f"config file {args.config} failed to run: {type(e).__name__}: {e}") from e
    model = {k: cfg[k] for k in MODEL_KEYS if k in cfg}
    for k in ("block_size", "activation"):
        if getattr(args, k) is not None:
            model[k] = getattr(args, k)
    bpe = "char" not in str(cfg.get("dataset", ""))
    model["vocab_size"] = args.vocab_size or (50304 if bpe else 256)
    return model, args.batch_size or cfg.get("batch_size", 12)


def setup(args):
    """(model_args, batch_size, dtype, batches, state): what all variants share; state: the initial weights (seed 0)."""
    model_args, batch_size = load_config(args)
    batches = make_batches(model_args, batch_size, args)
    torch.manual_seed(0)
    state = GPT(GPTConfig(mlp="eager", dropout=0.0, **model_args)).state_dict()
    return model_args, batch_size, pick_dtype(args), batches, state


def label(row):
    """A variant's name in tables and charts: "fused", "fused +compile", "fused +reduce-overhead", and with
    --compile_regions "fused +compile regions" (each block compiled apart)."""
    c = row["compile"]
    regions = " regions" if c and row.get("regions") else ""
    return row["mlp"] + ("" if not c else " +compile" if c is True else f" +{c}") + regions


def make_step(model_args, state, mlp, compiled, batches, args, dtype):
    """(model, step): one variant's model from `state`; step(i): train.py's step on batches[i % len(batches)], which
    returns the loss (a float, read once the last forward is done)."""
    torch.manual_seed(0)
    mlp, switches = kernel_family(mlp)
    mlp, cls, eight = mlp.partition("+cls")
    classifier = "fp8" if eight == "8" else "fused" if cls else "eager"
    fp8 = mlp.startswith("fp8")  # the fused MLP with its GEMMs in FP8 (fused_ops/fp8/); fp8blocks: attention's too
    kind, reach = "fused" if fp8 else "eager" if mlp == "torchao" else mlp, "blocks" if mlp == "fp8blocks" else "mlp"
    model = GPT(GPTConfig(mlp=kind, fp8=fp8, fp8_reach=reach, dropout=0.0, classifier=classifier, **model_args))
    model.to(args.device).load_state_dict(state)
    if mlp == "torchao":
        torchao_float8_mlps(model)
    device_type = args.device.split(":")[0]
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device_type)
    world = dist.get_world_size() if dist.is_initialized() else 1
    step_model = runtime.wrap_model(model, compiled, world, device_type, args.bucket_mb, args.compile_regions)
    autocast = torch.autocast(device_type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)  # (as train.py)
    cfg = {"compile": compiled, "grad_clip": config.DEFAULTS["grad_clip"]}

    def step(i):  # train.py's own step: its micro-steps, its loss read, its clipping and optimizer step
        micro = batches[i % len(batches)]
        draws = SimpleNamespace(next=iter(micro).__next__, prefetch=lambda: None)  # as helpers.data.Batches
        with fused_env.overridden(**switches):  # (the kernel family: read by the launchers at each call)
            return train.train_step(step_model, draws, opt, scaler, cfg, autocast, len(micro), world)

    return model, step


def torchao_float8_mlps(model):
    """The MLPs' two Linears swapped for torchao's Float8Linear (tensorwise scaling, its default recipe), in place:
    the anchor for the FP8 fused MLP. Attention and the head stay bf16, as in --mlps=fp8."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise errors.RunError("--mlps=torchao needs torchao (pip install torchao); it is not installed") from None
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn.endswith(("mlp.c_fc", "mlp.c_proj")))


def run_variant(model_args, state, mlp, compiled, batches, args, dtype):
    """One variant's row (warm-up, then --steps timed steps); out of memory is one line saying what to lower."""
    with out_of_memory_says(mlp, compiled):
        run = start_variant(model_args, state, mlp, compiled, batches, args, dtype)
        timed_steps(run, args.steps)
        return summarize(run, batches)


def run_interleaved(model_args, state, variants, batches, args, dtype):
    """Every variant built and warmed up first, then --rounds rounds of --steps timed steps each, the variants'
    order reversed every other round: the order a process runs them in (the first runs slower on some hosts)
    and the host's drift then fall on all alike. Each row also gives its per-round medians."""
    runs = []
    for mlp, compiled in variants:
        with out_of_memory_says(mlp, compiled):
            runs.append(start_variant(model_args, state, mlp, compiled, batches, args, dtype))
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for r in range(args.rounds):
        for run in (runs if r % 2 == 0 else runs[::-1]):
            run["rounds"].append(statistics.median(timed_steps(run, args.steps)) * 1e3)
    return [summarize(run, batches, memory=False) for run in runs]


@contextlib.contextmanager
def out_of_memory_says(mlp, compiled):
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise errors.RunError(f"out of memory running {label({'mlp': mlp, 'compile': compiled})} "
                              f"({str(e).splitlines()[0][:120]}): lower --batch_size, --block_size or --grad_accum, "
                              "or use a smaller config") from None


def start_variant(model_args, state, mlp, compiled, batches, args, dtype):
    """Build a variant, run its warm-up: (first losses, seconds from building to the end of its first step)."""
    if args.device.startswith("cuda"):  # blocks cached by earlier variants would count in this one's reserved peak
        gc.collect()
        torch.cuda.empty_cache()
    t_build = time.perf_counter()
    model, step = make_step(model_args, state, mlp, compiled, batches, args, dtype)
    run = {"mlp": mlp, "compile": compiled, "regions": args.compile_regions, "model": model, "step": step,
           "cuda": args.device.startswith("cuda"), "i": 0, "losses": [], "warmup": [], "timed": [], "rounds": []}
    run["warmup"] = timed_steps(run, 1, timed=False)
    run["to_first_step_s"] = time.perf_counter() - t_build
    run["warmup"] += timed_steps(run, args.warmup - 1, timed=False)
    if run["cuda"]:
        # Peak memory of the timed steps only: one-time work in the first steps (torch.compile, the
        # kernels' tuning with do_bench's 256 MB cache-flush buffer) is not what training holds.
        torch.cuda.reset_peak_memory_stats()
    return run


def timed_steps(run, n, timed=True):
    """n more steps of a variant, each timed as train.py times its steps, from one step's end to the next's: a step
    ends when its loss is read, which waits for its last forward only; the GPU runs the backward meanwhile while the
    host queues the optimizer and the next step, with no synchronization between steps (seconds)."""
    times = []
    if run["cuda"]:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run["losses"].append(run["step"](run["i"]))
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0, run["i"] = t1, run["i"] + 1
    if run["cuda"]:
        torch.cuda.synchronize()
    if timed:
        run["timed"] += times
    return times


def summarize(run, batches, memory=True):
    """A variant's row: median ms/step of its timed steps, tokens/s, MFU, peak memory (memory: of its own timed
    steps; interleaved variants share one peak, so none is given), first losses, start-up."""
    dt = statistics.median(run["timed"])
    tokens = sum(x.numel() for x, _ in batches[0])
    mfu = run["model"].estimate_mfu(len(batches[0]) * batches[0][0][0].size(0), dt)
    cuda = run["cuda"] and memory
    return {"mlp": run["mlp"], "compile": run["compile"], "regions": run["regions"], "ms_per_step": dt * 1e3,
            "tokens_per_s": tokens / dt, "mfu": mfu,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            # reserved by the caching allocator: includes the private pools CUDA graphs (reduce-overhead)
            # allocate from, which the allocated figure leaves out
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None,
            "first_losses": run["losses"][:3], "first_step_s": run["warmup"][0],
            "to_first_step_s": run["to_first_step_s"], "round_ms": run["rounds"] or None}


def make_batches(model_args, batch_size, args):
    """A few distinct step inputs (random ids: real-valued work, never zeros), cycled through."""
    T, V = model_args.get("block_size", 1024), model_args["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    return [[tuple(torch.randint(0, V, (batch_size, T), generator=gen).to(args.device) for _ in range(2))
             for _ in range(args.grad_accum)] for _ in range(4)]


def main(argv=None):
    args = parse_args(argv)
    if args.gpus:
        return several_gpus(args, sys.argv[1:] if argv is None else argv)
    distributed = "WORLD_SIZE" in os.environ  # launched by torchrun (several_gpus)
    if distributed:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        if args.device.startswith("cuda"):
            args.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(args.device)
    try:
        with bench_mlp.backward_thread(args):
            return run(args)
    finally:
        if distributed:
            dist.destroy_process_group()


def several_gpus(args, argv):
    """--gpus: the benchmark under torchrun on each GPU count in turn (same per-GPU micro-batch), then one table of
    tokens/s per GPU, each count's against the first's (its spread: the per-round medians' range)."""
    counts = [int(n) for n in args.gpus.split(",")]
    out = args.out or os.path.join(OUT_DIR, "bench_" + os.path.splitext(os.path.basename(args.config))[0] + "_gpus")
    runs, rest, skip = {}, [], False
    for a in argv:  # the same arguments, less --gpus and --out (given as --gpus=N or --gpus N)
        if not skip and not a.startswith(("--gpus", "--out")):
            rest.append(a)
        skip = a in ("--gpus", "--out")
    for n in counts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               *rest, f"--out={out}_{n}"]
        print(f"--- {n} GPU(s): {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise errors.RunError(f"the {n}-GPU run failed (its output is above)")
        with open(f"{out}_{n}.json") as f:
            runs[n] = json.load(f)["rows"]
    rows = []
    for i, r in enumerate(runs[counts[0]]):
        for n in counts:
            row = runs[n][i]
            spread = [row["tokens_per_s"] * row["ms_per_step"] / m for m in (row["round_ms"] or [row["ms_per_step"]])]
            rows.append({"mlp": r["mlp"], "compile": r["compile"], "gpus": n, "ms_per_step": row["ms_per_step"],
                         "tokens_per_s_per_gpu": row["tokens_per_s"], "per_gpu_min": min(spread),
                         "per_gpu_max": max(spread), "first_losses": row["first_losses"],
                         "vs_first": row["tokens_per_s"] / r["tokens_per_s"],
                         # against eager in its fastest mode on as many GPUs
                         "vs_eager": row["tokens_per_s"] / max(
                             (e["tokens_per_s"] for e in runs[n] if e["mlp"] == "eager"), default=float("nan"))})
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write(rows, {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "gpus": counts, "argv": argv}, out)
    print(f"\n{device}  torch {torch.__version__}  tokens/s per GPU (range over rounds)")
    print(f"{'variant':<26}{'GPUs':>5}{'ms/step':>9}{'tok/s/GPU':>11}{'range':>19}{'vs 1st':>8}{'vs eager':>9}")
    for r in rows:
        print(f"{label(r):<26}{r['gpus']:>5}{r['ms_per_step']:9.1f}{r['tokens_per_s_per_gpu']:11,.0f}"
              f"{r['per_gpu_min']:10,.0f}-{r['per_gpu_max']:<8,.0f}{r['vs_first']:7.1%}{r['vs_eager']:8.2f}x")
    print(wrote(out, ".json", ".csv"))
    return rows


def run(args):
    if args.mlp_widths:
        return mlp_widths(args)
    model_args, batch_size, dtype, batches, state = setup(args)
    T = model_args.get("block_size", 1024)
    variants = variant_list(args.mlps, args.compile)
    master = not dist.is_initialized() or dist.get_rank() == 0  # (under torchrun: several_gpus)
    if args.rounds > 1:
        rows = run_interleaved(model_args, state, variants, batches, args, dtype)
    else:
        rows = [run_variant(model_args, state, mlp, compiled, batches, args, dtype)
                for mlp, compiled in tqdm(variants, desc="variants", disable=not master)]

    if not master:
        return rows  # (rank 0 writes and prints)
    name = os.path.splitext(os.path.basename(args.config))[0] + (f"_{args.activation}" if args.activation else "")
    out = args.out or os.path.join(OUT_DIR, f"bench_{name}")
    env = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "dtype": str(dtype),
           "model": model_args, "batch_size": batch_size, "grad_accum": args.grad_accum, "steps": args.steps,
           "backward_thread": args.backward_thread}
    write(rows, env, out)
    plot(rows, out + ".png", f"{name} on {env['device']}, backward on the {args.backward_thread} thread")

    base = next((r for r in rows if r["mlp"] == "eager" and not r["compile"]), rows[0])
    print(f"\n{env['device']}  torch {env['torch']}  {env['dtype']}  batch {batch_size}x{T} x{args.grad_accum}")
    width = max(16, *(len(label(r)) + 1 for r in rows))
    print(f"{'variant':<{width}}{'ms/step':>9}{'tok/s':>11}{'vs eager':>9}{'MFU':>7}{'mem GiB':>9}{'rsv GiB':>9}"
          f"{'1st step s':>11}  first losses" + ("   rounds: median ms/step each" if args.rounds > 1 else ""))
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem, rsv = (f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("peak_mem_gib", "peak_reserved_gib"))
        print(f"{label(r):<{width}}{r['ms_per_step']:9.1f}{r['tokens_per_s']:11,.0f}"
              f"{base['ms_per_step'] / r['ms_per_step']:8.2f}x{mfu:>7}{mem:>9}{rsv:>9}{r['to_first_step_s']:11.1f}  "
              + " ".join(f"{l:.4f}" for l in r["first_losses"])
              + ("   " + " ".join(f"{m:.1f}" for m in r["round_ms"]) if r["round_ms"] else ""))
    print(wrote(out, ".json", ".csv", ".png"))
    return rows


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 3.5))
    labels = [label(r).replace(" ", "\n").replace("reduce-overhead", "reduce-\noverhead") for r in rows]
    ax.bar(labels, [r["tokens_per_s"] for r in rows], color=["#888" if r["mlp"] == "eager" else "#d62" for r in rows])
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mlp_widths(args):
    """The MLP alone across widths and activations: one row per (C, activation, path), measured by bench_mlp."""
    dtype = pick_dtype(args)
    widths = [int(c) for c in args.mlp_widths.split(",")]
    tokens = ([int(m) for m in args.mlp_tokens.split(",")] if args.mlp_tokens
              else [bench_mlp.DEFAULT_TOKENS.get(C, 8192) for C in widths])
    settings = [compile_setting(c) for c in args.compile.split(",")]
    if any(c not in (True, False) for c in settings):
        raise errors.UsageError(f"--mlp_widths takes --compile=True and/or False (torch.compile's default mode), "
                                f"got --compile={args.compile}")
    compiled = True in settings
    paths = ["eager", "fused"] + (["compile"] if compiled else [])
    torch.manual_seed(0)
    tflops, gbps = bench_mlp.measure_peaks(args.device, dtype)
    cases = [(C, M, act) for C, M in zip(widths, tokens, strict=True) for act in args.mlp_activations.split(",")]
    first_call_s, rows = {}, []
    for C, M, act in tqdm(cases, desc="MLP widths"):
        r = bench_mlp.mlp_case(C, M, act, first_call_s, tflops, args.device, dtype, compile=compiled, kernels=False)
        for p in paths:
            rows.append({"C": C, "M": M, "H": r["H"], "activation": act, "path": p,
                         "fwd_ms": r[f"{p}_fwd_ms"], "fwdbwd_ms": r[f"{p}_fwdbwd_ms"],
                         # forward + backward replayed as one CUDA graph: GPU time alone (None on CPU)
                         "graph_fwdbwd_ms": r[f"{p}_graph_fwdbwd_ms"],
                         "graph_fwdbwd_pct_floor": (None if r[f"{p}_graph_fwdbwd_ms"] is None
                                                    else 100 * r["floor_fwdbwd_ms"] / r[f"{p}_graph_fwdbwd_ms"]),
                         "fwd_pct_floor": 100 * r["floor_fwd_ms"] / r[f"{p}_fwd_ms"],
                         "fwdbwd_pct_floor": 100 * r["floor_fwdbwd_ms"] / r[f"{p}_fwdbwd_ms"],
                         "floor_fwd_ms": r["floor_fwd_ms"], "floor_fwdbwd_ms": r["floor_fwdbwd_ms"],
                         # the case's check (fused vs float64, vs eager's error), the same on each of its rows
                         "correct": r["correct"], "fwd_fused_vs_eager": r["fwd_fused_vs_eager"]})

    out = args.out or os.path.join(OUT_DIR, "bench_mlp_widths")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    env = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "dtype": str(dtype), "matmul_tflops": tflops, "copy_gbps": gbps,
           "first_call_seconds": first_call_s}
    write(rows, env, out)
    plot_widths(rows, out + ".png", f"MLP alone on {device}, {dtype}")

    print(f"\n{device}  torch {env['torch']}  triton {env['triton']}  {dtype}  matmul peak {tflops:.1f} TFLOP/s")
    print(f"{'case':<24}{'path':<9}{'fwd ms':>9}{'floor%':>7}{'fwd+bwd ms':>11}{'floor%':>7}{'graphed':>9}  correct")
    for r in rows:
        graphed = "" if r["graph_fwdbwd_ms"] is None else f"{r['graph_fwdbwd_ms']:.3f}"
        print(f"{r['activation'] + ' C=' + str(r['C']) + ' M=' + str(r['M']):<24}{r['path']:<9}{r['fwd_ms']:9.3f}"
              f"{r['fwd_pct_floor']:6.0f}%{r['fwdbwd_ms']:11.3f}{r['fwdbwd_pct_floor']:6.0f}%{graphed:>9}"
              f"  {r['correct']}")
    print(wrote(out, ".json", ".csv", ".png"))
    return rows


def write(rows, env, out):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def wrote(out, *extensions):
    """The line that names the files a run wrote."""
    return f"wrote {', '.join(out + e for e in extensions)}"


def plot_widths(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["activation"], r["C"]) for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    colors = {"eager": "#888", "compile": "#48c", "fused": "#d62"}
    panels = [("fwd_pct_floor", "forward"), ("fwdbwd_pct_floor", "forward + backward")]
    if all(r["graph_fwdbwd_pct_floor"] is not None for r in rows):
        panels.append(("graph_fwdbwd_pct_floor", "forward + backward, one CUDA graph (GPU time)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), sharey=True)
    for ax, (key, what) in zip(axes, panels):
        width = 0.8 / len(paths)
        for i, p in enumerate(paths):
            vals = {(r["activation"], r["C"]): r[key] for r in rows if r["path"] == p}
            ax.bar([j + i * width for j in range(len(cases))], [vals[c] for c in cases], width, label=p,
                   color=colors.get(p))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"{a}\nC={C}" for a, C in cases], fontsize=8)
        ax.axhline(100, color="k", lw=0.8, ls="--")  # the matmul floor
        ax.set_title(what, fontsize=9)
    axes[0].set_ylabel("% of the matmul floor (100 = at the floor)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(errors.run_main("bench.py", main))
