"""train.train_step under DDP against one process (tests/ddp_steps.py says how): gradients within the repo's rule
and parameters equal bit for bit on every process. Over Gloo on the CPU (uncompiled, and compiled with aot_eager:
DDP split at its buckets as inductor splits it), and over NCCL on 2 GPUs in every compile mode, the fused MLP
in bf16 and in FP8 (and every linear in FP8 with reduce-overhead), with 1, 2 and 4 micro-steps per process (on the
CPU 1, with the fused classifier, and 4 uncompiled, 2 compiled)."""

import signal
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests import ddp_steps

WORLD = 2


def spawn(backend, cases, out):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(ddp_steps.worker, args=(WORLD, port, backend, cases, str(out)), nprocs=WORLD)
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


def check(results, cases, device, dtype):
    """Every case: the processes' gradients equal and within the rule of the float64 reference; parameters equal."""
    for case in cases:
        compile, accum, mlp, fp8 = case
        (grads0, params0), (grads1, params1) = results[0][case], results[1][case]
        assert len(grads0) == len(grads1) == ddp_steps.GRAD_STEPS[device.split(":")[0]], case
        for step, (g0, g1) in enumerate(zip(grads0, grads1)):
            assert torch.equal(g0, g1), (case, step)
        check_grads(grads0, case, WORLD * accum, device, dtype)
        assert torch.equal(params0, params1), case


def check_grads(grads, case, micro_batches, device, dtype):
    """Each step's gradient within the repo's rule of one process's float64 accumulation of the same micro-batches."""
    mlp, fp8 = case[2:]
    for step, g in enumerate(grads):
        exact = ddp_steps.reference_grads(step, micro_batches, device, torch.float64).cpu()
        same_dtype = ddp_steps.reference_grads(step, micro_batches, device, dtype, mlp, fp8).cpu()
        bound = 2 * ddp_steps.rel(same_dtype, exact) + 1e-5
        assert ddp_steps.rel(g, exact) <= bound, (case, step, ddp_steps.rel(g, exact), bound)


def check_stop(results, gpu):
    """Both processes stop on the one's SIGTERM, and (on GPUs) agreeing did not wait for the GPU's queued work."""
    for rank in range(WORLD):
        agreed, busy = results[rank]["stop"]
        assert agreed == signal.SIGTERM.value and busy == (True if gpu else None), (rank, agreed, busy)


def test_stop_agreement_over_gloo(tmp_path):
    check_stop(spawn("gloo", [], tmp_path), gpu=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")
def test_stop_agreement_on_two_gpus_does_not_wait_for_the_gpu(tmp_path):
    """Issue 50: the agreement read back over NCCL waited for the step queued before it, so train.py's step time left
    out each step's last backward and the GPU idled while the next step was queued."""
    check_stop(spawn("nccl", [], tmp_path), gpu=True)


# (the fused classifier rides along: its dW, made in the forward, must reach the all-reduce like any gradient; its
# FP8 form, emulated by the interpreter at this size, would add ~150 s to the suite)
CPU_CASES = [(False, 1, "eager+cls", False), (False, 4, "eager", False), ("aot_eager", 2, "eager", False)]


def test_ddp_steps_match_one_process_over_gloo(tmp_path):
    check(spawn("gloo", CPU_CASES, tmp_path), CPU_CASES, "cpu", torch.float32)


GPU_CASES = [(compile, accum, "fused", False) for compile in (False, True, "reduce-overhead") for accum in (1, 2, 4)]
GPU_CASES += [(compile, accum, "fused", True) for compile in (True, "reduce-overhead") for accum in (1, 2)]
GPU_CASES += [("reduce-overhead", 2, "fused+cls8", "blocks")]  # the fastest setting: every linear in FP8
GPU_CASES += [("regions:reduce-overhead", 2, "fused+cls8", "blocks")]  # the same, compile_regions (DDP around blocks)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")
def test_ddp_steps_match_one_process_on_two_gpus(tmp_path):
    check(spawn("nccl", GPU_CASES, tmp_path), GPU_CASES, "cuda:0", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [("reduce-overhead", 1, "fused", False), ("reduce-overhead", 1, "fused+cls8", "blocks"),
                                  ("reduce-overhead", 2, "fused", False), ("regions:reduce-overhead", 1, "fused+cls8", "blocks"),
                                  ("regions:reduce-overhead", 2, "fused", False), ("regions:True", 2, "eager", False)])
def test_one_process_steps_under_cuda_graphs(case):
    """One process under CUDA graphs: with one micro-step the gradients are handed over from the graphs' memory, with
    two they are accumulated in place (runtime.zero_grads). A gradient that a replay overwrote before the optimizer
    read it, or one step's left in the next, is off by a large fraction and fails the rule."""
    compile, accum, mlp, fp8 = case
    grads, params = ddp_steps.run_steps(0, 1, "cuda", compile, accum, mlp, fp8, torch.bfloat16)
    assert len(grads) == ddp_steps.GRAD_STEPS["cuda"]
    check_grads(grads, case, accum, "cuda", torch.bfloat16)
    assert torch.isfinite(params).all()

