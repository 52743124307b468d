"""DDP (helpers/runtime.wrap_model) with the fused MLP's speed paths, over Gloo on the CPU: two processes, each with
half of every batch, against one process with the whole batch.

- The fused MLP with and without its CUDA graphs (emulated on the CPU: fused_ops/graphs.py's test double), so the
  graphs' hand-out of parameter gradients meets DDP's gradient hooks: the same losses as one process.
- The FP8 MLP, whose delayed scales each process keeps for itself (no collective inside the MLP, docs/numerics.md):
  its losses follow one process's within the FP8 rule (the gap no larger than twice FP8's own distance from the
  16-bit fused MLP, plus 1e-3), with and without graphs, while the two processes' scales differ.
- The FP8 MLP compiled (aot_eager, DDP's graph split at its buckets, as train.py's torch.compile), its operators
  through their own graphs (fused_ops/fp8/graphs.py, emulated): the uncompiled run's losses.
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_ops
from fused_ops.fp8 import graphs as op_graphs
from fused_ops.graphs import MLPGraphs
from helpers import runtime
from model import GPT, GPTConfig
from tests import fast_interpreter

VARIANTS = ("fused", "fused_graphs", "fp8", "fp8_graphs", "fp8_compiled")
STEPS, BATCH = 4, 4


def train(variant, rank=0, world=1):
    """(losses averaged over the processes, each block's FP8 scales or None, {"local": this process's own losses,
    "params": its parameters after the steps}) of STEPS SGD steps of a 1-layer GPT, this process taking its share of
    every batch, under fp16 autocast (the interpreter's bf16 dots are wrong)."""
    fp8, graphs, compiled = variant.startswith("fp8"), variant.endswith("graphs"), variant.endswith("compiled")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32, mlp="fused", fp8=fp8,
                        dropout=0.0, bias=False))
    usable = fused_ops.layers.graphs_usable
    fused_ops.layers.graphs_usable = (lambda x: True) if graphs else usable  # (emulated graphs run on the CPU)
    op_graphs.EMULATE = compiled
    try:
        for block in gpt.transformer.h:
            block.mlp.path.graphs = MLPGraphs(emulate=True, keep=block.mlp.fp8) if graphs else None
        model = runtime.wrap_model(gpt, False, world, "cpu")
        if compiled:
            torch._dynamo.reset()
            model = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(gpt.parameters(), lr=0.5)
        losses, local = [], []
        for step in range(STEPS):
            runtime.zero_grads(model, opt, False)
            x = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(step))
            share = x.chunk(world)[rank]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(share, share)[1]
            loss.backward()
            opt.step()
            loss = loss.detach().float()
            local.append(loss.item())
            if world > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
    finally:
        fused_ops.layers.graphs_usable = usable
        op_graphs.EMULATE = False
    if graphs:  # every forward after the first sight, the calibrating one (FP8) and the capture replayed
        assert all(next(iter(b.mlp.path.graphs.captured.values())).generation >= STEPS - 3 for b in gpt.transformer.h)
    if compiled:  # forward and backward replayed from the third step on (calibration, kernels, then captured)
        replays = [[g.replays for g in b.mlp.fp8.op_graphs.graphs.values()] for b in gpt.transformer.h]
        assert replays == [[STEPS - 2] * 2] * len(gpt.transformer.h), replays
    return (losses, [b.mlp.fp8.scale.clone() for b in gpt.transformer.h] if fp8 else None,
            {"local": local, "params": [p.detach().clone() for p in gpt.parameters()]})


def assert_ranks_in_step(two_processes, variant):
    """The two processes trained on different halves of each batch (their own losses differ) and DDP averaged their
    gradients (their parameters stay the same, bit for bit: the same averaged gradient, the same SGD update). A
    gradient that skipped DDP's hooks would leave each process with its own parameters."""
    a, b = (two_processes[rank][variant][2] for rank in range(2))
    assert a["local"] != b["local"], variant
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), variant


def _worker(rank, world, port, out):
    fast_interpreter.patch_once_a_launch()  # (a spawned process does not load conftest.py)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save({v: train(v, rank, world) for v in VARIANTS}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2)
    return [torch.load(out / f"{rank}.pt") for rank in range(2)]


def test_fused_mlp_under_ddp_gives_one_process_losses_with_and_without_graphs(two_processes):
    one = train("fused")[0]
    for variant in ("fused", "fused_graphs"):
        assert_ranks_in_step(two_processes, variant)
        assert two_processes[0][variant][0] == pytest.approx(one, rel=1e-4), variant
    assert two_processes[0]["fused_graphs"][0] == two_processes[0]["fused"][0]  # the graphs path is the plain path


def test_fp8_under_ddp_follows_one_process_within_the_fp8_rule(two_processes):
    one_fp8, one_fused = train("fp8")[0], train("fused")[0]
    for variant in ("fp8", "fp8_graphs", "fp8_compiled"):
        assert_ranks_in_step(two_processes, variant)
    for variant in ("fp8", "fp8_graphs"):
        ddp = two_processes[0][variant][0]
        for a, b, ref in zip(ddp, one_fp8, one_fused):
            assert abs(a - b) <= 2 * abs(b - ref) + 1e-3, (variant, ddp, one_fp8, one_fused)
    assert two_processes[0]["fp8_graphs"][0] == two_processes[0]["fp8"][0]
    assert two_processes[0]["fp8_compiled"][0] == two_processes[0]["fp8"][0]
    # each process quantizes with its own scales: no collective made them equal
    scales = [two_processes[rank]["fp8"][1] for rank in range(2)]
    assert any(not torch.equal(a, b) for a, b in zip(*scales))


@pytest.mark.parametrize("micro_steps, world", [(2, 1), (1, 2), (4, 2)])
def test_zero_grads_keeps_gradients_allocated_under_cuda_graphs(micro_steps, world):
    """Under a CUDA-graph mode with several micro-steps or processes the gradients are allocated before the first step
    and zeroed in place after (never handed over from a graph's memory, where the next micro-step's replay would
    overwrite them); elsewhere they are dropped (set to None) as before."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runtime.zero_grads(model, opt, "reduce-overhead", micro_steps, world)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    model(torch.ones(2, 4)).sum().backward()
    assert all(g.any() for g in grads)  # accumulated into the same tensors
    runtime.zero_grads(model, opt, "reduce-overhead", micro_steps, world)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)) and not any(g.any() for g in grads)
    for compile in (True, False):
        runtime.zero_grads(model, opt, compile, micro_steps, world)
        assert all(p.grad is None for p in model.parameters())


def test_zero_grads_drops_gradients_of_one_micro_step_in_one_process():
    """One micro-step, one process: the optimizer reads a graph's gradient before the next replay, so it is handed
    over as it lies (no zeroing, no accumulation pass), as without graphs."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    runtime.zero_grads(model, opt, "reduce-overhead", 1, 1)
    assert all(p.grad is None for p in model.parameters())

