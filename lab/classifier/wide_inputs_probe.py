"""Issue 47, the compiled classifier at width 1536 (wide_compile_probe.py found it): does the operator get different
inputs under torch.compile, or compute wrong on the inputs it gets? The operator's CUDA kernel is replaced by a
wrapper that records, per call, its inputs' layout and checksums, its loss against an fp32 reference on those very
inputs, and its dx against the reference's dx; after each backward, checksums of the gradients. GPTs of 0, 1, 2
layers at width 1536 (and 2 at 768), uncompiled and compiled (default), classifier "fused"; the eager classifier's
loss beside them.

    python lab/classifier/wide_inputs_probe.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import model
from fused_ops import classifier
from helpers import inductor_fix

call = classifier.linear_cross_entropy_op
fn = dict(zip(call.__code__.co_freevars, (c.cell_contents for c in call.__closure__)))["fn"]
LOG = []


def recorded(x, weight, targets, ignore_index, dtype, grad):
    """The operator, with what it was given and how far its outputs are from an fp32 reference on those inputs."""
    with torch.no_grad():  # LayerNorm's output (γ = 1 at init) has rows of mean square 1: which rows do not?
        bad = ((x.float().pow(2).mean(-1) - 1).abs() > 0.05).nonzero().flatten().tolist()
        before = (f"{x.double().sum().item():.6e}", len(bad), bad[:3], bad[-3:])
    out = fn(x, weight, targets, ignore_index, dtype, grad)
    with torch.no_grad():
        logits = (x.to(dtype) @ weight.to(dtype).t()).float()
        ref = F.cross_entropy(logits, targets, ignore_index=ignore_index)
        p = logits.softmax(-1)
        keep = targets != ignore_index
        p[torch.arange(len(targets), device=p.device)[keep], targets[keep]] -= 1
        p[~keep] = 0
        p /= keep.sum()
        dx_ref = (p.to(dtype) @ weight.to(dtype)).float()
        dx = out[1].float()
        LOG.append(dict(before=before, x=(str(x.dtype), tuple(x.stride()), x.storage_offset(), x.is_contiguous(),
                           f"{x.double().sum().item():.6e}", f"{x.double().abs().sum().item():.6e}"),
                        w=(tuple(weight.stride()), f"{weight.double().sum().item():.6e}"),
                        t=(tuple(targets.stride()), targets.sum().item()),
                        loss=f"{out[0].item():.6f}", ref=f"{ref.item():.6f}",
                        dx=(tuple(dx.stride()), f"{((dx - dx_ref).norm() / dx_ref.norm()).item():.2e}")))
    return out


LIB = torch.library.Library("fused_mlp", "IMPL")
LIB.impl("linear_cross_entropy", recorded, "CUDA")
Function = classifier.loss_function(classifier.linear_cross_entropy_op.op)  # the operator in both modes


def run(width, n_layer, mode, kind, cast=False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = model.GPT(model.GPTConfig(n_layer=n_layer, n_head=width // 128, n_embd=width, bias=False, mlp="eager",
                                  classifier=kind)).cuda()
    if kind == "fused":
        m.fused_classifier = lambda x, w, t: classifier.run_classifier(
            Function, x.to(torch.bfloat16) if cast else x, w, t, -1)
    step = m if mode is None else torch.compile(m, mode=mode)
    idx = torch.randint(0, 50304, (12, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for i in range(3):
        LOG.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(idx, idx.roll(-1, 1))[1]
        loss.backward()
        grads = {n: f"{p.grad.double().norm().item():.6e}" for n, p in m.named_parameters()
                 if n in ("lm_head.weight", "transformer.wpe.weight", "transformer.ln_f.weight")}
        print(f"width={width} n_layer={n_layer} mode={mode} {kind} call {i}: loss {loss.item():.6f} {LOG} {grads}",
              flush=True)
        m.zero_grad(set_to_none=True)


def toggles():
    """The 1536-wide 2-layer GPT compiled, with one Inductor, AOTAutograd or attention setting changed at a time."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.nn.attention import SDPBackend, sdpa_kernel
    settings = [(inductor_config, "allow_buffer_reuse", False), (inductor_config, "reorder_for_peak_memory", False),
                (inductor_config, "comprehensive_padding", False), (functorch_config, "donated_buffer", False),
                (inductor_config, "reorder_for_locality", False)]
    for config, key, value in settings:
        old = getattr(config, key)
        setattr(config, key, value)
        print(f"-- {key}={value}", flush=True)
        run(1536, 2, "default", "fused")
        setattr(config, key, old)
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        print(f"-- sdpa {backend}", flush=True)
        with sdpa_kernel(backend):
            run(1536, 2, "default", "fused")


def barrier_patch():
    """Inductor's fix proposed upstream (pytorch PR 190519), as helpers/inductor_fix.py applies it: a
    tl.debug_barrier() before a load of a buffer stored in an earlier reduction loop of the same kernel."""
    from torch._inductor.codegen.triton import TritonKernel
    load = TritonKernel.load
    TritonKernel.load = inductor_fix.with_barrier(load)
    return lambda: setattr(TritonKernel, "load", load)


def workarounds():
    import torch._inductor.config as inductor_config
    print("-- inplace_buffers=False", flush=True)
    inductor_config.inplace_buffers = False
    run(1536, 2, "default", "fused")
    inductor_config.inplace_buffers = True
    print("-- triton.mix_order_reduction=False", flush=True)
    inductor_config.triton.mix_order_reduction = False
    run(1536, 2, "default", "fused")
    inductor_config.triton.mix_order_reduction = True
    print("-- x cast to bf16 before the operator", flush=True)
    run(1536, 2, "default", "fused", cast=True)
    print("-- barrier patch", flush=True)
    undo = barrier_patch()
    run(1536, 2, "default", "fused")
    run(1536, 2, "default", "eager")
    undo()


if __name__ == "__main__":
    if sys.argv[1:] == ["--workarounds"]:
        workarounds()
        sys.exit()
    if sys.argv[1:] == ["--toggles"]:
        toggles()
        sys.exit()
    for width, n_layer in ((768, 2), (1536, 0), (1536, 1), (1536, 2)):
        for mode in (None, "default"):
            for kind in ("fused", "eager"):
                try:
                    run(width, n_layer, mode, kind)
                except Exception as e:  # noqa: BLE001 (a probe: say what failed and go on)
                    print(f"width={width} n_layer={n_layer} mode={mode} {kind}: {type(e).__name__}: {e}", flush=True)
