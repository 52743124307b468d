"""AdamW as one Triton kernel over every parameter of a group: the optimizer step at the memory's rate.

AdamW's update is elementwise. For each parameter p with gradient g (divided by grad_scale, the clipping's factor,
where one is given), moments m and v, step count t, learning rate lr and weight decay wd:

    p <- p · (1 - lr·wd)                                       (decoupled weight decay)
    m <- m + (1 - β1)·(g - m),   v <- β2·v + (1 - β2)·g²
    p <- p - (lr / (1 - β1^t)) · m / (sqrt(v) / sqrt(1 - β2^t) + ε)

which is torch.optim.AdamW's arithmetic, in its order. In fp32 it reads p, g, m and v and writes p, m and v: 28 bytes
a parameter, 3.5 GB a step at GPT-2 small's 124M, nothing to compute that the memory would wait for. So the step's
floor is those bytes at the copy rate, and the question is only how close a kernel gets.

PyTorch's fused AdamW (`fused=True`) launches multi_tensor_apply: every launch carries a fixed-size list of tensor
chunks in its kernel arguments, so a model's parameters go out in many launches of small chunks. Here each program
finds its own tensor instead: the launcher builds, once per group, a table of every tensor's addresses (parameter,
gradient, both moments, step count) and numel, plus, per program, which tensor and which BLOCK of it is its own.
One launch then covers the group, every program a full block but the last of each tensor; the programs cast the
table's integers to pointers (tl.pointer_type). Addresses change when a gradient is reallocated (or a parameter or
state replaced), and only then is the table checked and copied to the GPU again (asynchronously, from pinned memory).

The step counts live on the device, one float32 per parameter as in PyTorch's fused AdamW (so checkpoints are
interchangeable with torch.optim.AdamW, fused or not): one _foreach_add_ increments them, and each program computes
its bias corrections from its tensor's count. The gradients are only read: where grad_scale divides them, .grad keeps
the unclipped values (PyTorch's fused AdamW writes the divided ones back, 4 more bytes a parameter).

A kernel that fails to compile or launch (a Triton that moved, a GPU it does not fit) warns once (FallbackWarning)
and PyTorch's fused AdamW, which keeps the same state, takes over for the rest of the process (it leaves .grad
divided by grad_scale).

Special values follow the arithmetic: a NaN or infinite gradient makes its element's p, m and v NaN (inf/inf), and
every other element is untouched by it.
"""

import contextlib
import math
import warnings

import torch
import triton
import triton.language as tl

from . import env
from .backends import FallbackWarning
from .tuning import LaunchPlan

BLOCK = 1024  # elements a program updates (8 a thread, two 16-byte vectors): the fastest of those tried (results/glue/)
# On the CPU interpreter (tests, CPU runs) each program is emulated in numpy at a fixed cost: fewer, larger blocks.
INTERPRETER_BLOCK = 32768
NUM_WARPS = 4
FAILURE = None  # the exception that turned the kernel off for this process, if one did


@triton.jit
def _pointer(address_ptr, ALIGNED: tl.constexpr):
    """The fp32 pointer whose address the table holds. A pointer made from an integer carries no alignment, so its
    loads would be 4 bytes wide (about 3x the time at GPT-2 small's size: results/glue/); where the launcher found
    every address 16-byte aligned and every numel a multiple of 4, the kernel is told so."""
    ptr = tl.load(address_ptr).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def adamw_kernel(table_ptr, block_tensor_ptr, block_index_ptr, n_tensors, lr, beta1, beta2, eps, weight_decay,
                 log2_beta1, log2_beta2, grad_scale_ptr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    program = tl.program_id(0)
    t = tl.load(block_tensor_ptr + program)
    p_ptr = _pointer(table_ptr + t, ALIGNED)
    g_ptr = _pointer(table_ptr + n_tensors + t, ALIGNED)
    m_ptr = _pointer(table_ptr + 2 * n_tensors + t, ALIGNED)
    v_ptr = _pointer(table_ptr + 3 * n_tensors + t, ALIGNED)
    step_ptr = tl.load(table_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
    numel = tl.load(table_ptr + 5 * n_tensors + t)
    if ALIGNED:  # (and the tail's mask is constant over each 16 bytes: vector loads there too)
        numel = tl.multiple_of(numel, 4)
    offs = tl.load(block_index_ptr + program).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel

    step = tl.load(step_ptr)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)  # 1 - β1^t
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))

    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_SCALE:
        g = g / tl.load(grad_scale_ptr)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * (g * g)
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * (m / denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def kernel_can_run(t):
    """The kernel's parameters: dense contiguous fp32, on a GPU, or on the CPU under Triton's interpreter (tests)."""
    return (t.dtype == torch.float32 and t.layout == torch.strided and t.is_contiguous()
            and (t.is_cuda or (env.INTERPRET and t.device.type == "cpu")))


class _Plan:
    """One group's launch, for one set of parameters with gradients: the per-program block map, the device table of
    every tensor's address and numel (copied anew only when an address changed), the kept compiled kernels."""

    def __init__(self, params):
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.block, self.num_warps = BLOCK if self.device.type == "cuda" else INTERPRETER_BLOCK, NUM_WARPS
        blocks = [triton.cdiv(n, self.block) for n in self.numels]
        self.n_blocks = sum(blocks)
        self.block_tensor = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                                    torch.tensor(blocks)).to(self.device)
        self.block_index = torch.cat([torch.arange(b, dtype=torch.int32) for b in blocks]).to(self.device)
        self.addresses, self.table, self.aligned, self.launches = None, None, False, {}

    def table_for(self, params, grads, exp_avgs, exp_avg_sqs, steps):
        """The device table for these tensors. Rebuilt when any address changed (a gradient reallocated, a parameter's
        .data replaced, a state loaded), after checking that each tensor still is what the kernel reads: fp32, on the
        plan's GPU, of its parameter's numel (else the kernel would read or write past a tensor)."""
        columns = (params, grads, exp_avgs, exp_avg_sqs, steps)
        addresses = [t.data_ptr() for ts in columns for t in ts]
        if addresses != self.addresses:
            for k, (p, g, m, v, t) in enumerate(zip(*columns)):
                for name, x, n in (("param", p, self.numels[k]), ("grad", g, self.numels[k]), ("exp_avg", m, p.numel()),
                                   ("exp_avg_sq", v, p.numel()), ("step", t, 1)):
                    if x.dtype != torch.float32 or x.device != self.device or x.numel() != n or not x.is_contiguous():
                        raise ValueError(f"FusedAdamW: a parameter's {name} is now {x.dtype} {tuple(x.shape)} on "
                                         f"{x.device}; the step expects contiguous float32 of {n} elements on "
                                         f"{self.device} (was the model converted or moved after the optimizer was "
                                         "made? make the optimizer after)")
            n = len(params)
            rows = torch.tensor([addresses[i * n:(i + 1) * n] for i in range(5)] + [self.numels], dtype=torch.int64)
            if self.device.type == "cuda":  # (the caching host allocator keeps the pinned copy until the copy is done)
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            self.addresses, self.table = addresses, rows
            self.aligned = all(a % 16 == 0 for a in addresses[:4 * n]) and all(m % 4 == 0 for m in self.numels)
        return self.table

    def launch(self, table, group, grad_scale):
        consts = {"HAS_SCALE": grad_scale is not None, "ALIGNED": self.aligned, "BLOCK": self.block}
        key = (consts["HAS_SCALE"], consts["ALIGNED"])
        if key not in self.launches:  # (direct launches of the compiled kernel: tuning.LaunchPlan)
            self.launches[key] = LaunchPlan(adamw_kernel, triton.Config({}, num_warps=self.num_warps, num_stages=1),
                                            consts)
        beta1, beta2 = group["betas"]
        args = [table, self.block_tensor, self.block_index, len(self.numels), float(group["lr"]), beta1, beta2,
                group["eps"], group["weight_decay"], _log2(beta1), _log2(beta2),
                grad_scale if grad_scale is not None else table]
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.launches[key].launch_grid((self.n_blocks,), args)


class FusedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step is one Triton launch a parameter group (see the module docstring), for dense fp32
    parameters on one GPU. The same hyperparameters, state and state_dict as torch.optim.AdamW (no amsgrad, maximize,
    capturable or differentiable): its checkpoints say fused=True, the layout of their state, so that PyTorch's
    AdamW continues them fused. `grad_scale`, a tensor set on the optimizer before step() (clip_and_step in
    helpers/runtime.py sets it), divides every gradient in the same pass: the clipping costs no pass of its own."""

    folds_grad_scale = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        # (fused=False for PyTorch's constructor: fused=True would have GradScaler hand step() its found_inf)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)
        for group in self.param_groups:
            for p in group["params"]:
                if not kernel_can_run(p):
                    raise TypeError(f"FusedAdamW: params must be contiguous float32 tensors on a CUDA device; one is "
                                    f"{p.dtype} of shape {tuple(p.shape)} on {p.device}: use torch.optim.AdamW")
            if len({p.device for p in group["params"]}) > 1:
                raise TypeError("FusedAdamW: a parameter group's params must be on one device; this one spans "
                                f"{sorted(str(d) for d in {p.device for p in group['params']})}")
        self._plans = {}

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            group["fused"], group["foreach"] = True, None
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for p, state in self.state.items():  # step counts where the kernel reads them (AdamW's loader puts them on
            if "step" in state:             # the host unless fused)
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        self._plans = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            key = (i, tuple(map(id, params)))  # (host time: a plan a set of parameters, kept)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = _Plan(params)
            states = [self._state_of(p) for p in params]
            grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            table = plan.table_for(params, grads, exp_avgs, exp_avg_sqs, steps)  # (raises if a tensor changed kind)
            torch._foreach_add_(steps, 1.0)  # (PyTorch's fused AdamW, below, also takes them counted)
            if FAILURE is None:
                try:
                    plan.launch(table, group, grad_scale)
                    continue
                except Exception as error:  # (compile or launch: a Triton that moved, a GPU it does not fit)
                    _fails(error)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=float(group["lr"]),
                                beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False, grad_scale=grad_scale)
        return loss

    def _state_of(self, p):
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state


def _fails(error):
    """Turn the kernel off for the rest of the process, with one warning: PyTorch's fused AdamW (the same state)
    takes over, so a Triton the kernel does not compile on costs speed, never the run."""
    global FAILURE
    FAILURE = error
    warnings.warn(f"FusedAdamW's kernel failed ({type(error).__name__}: {error}); PyTorch's fused AdamW runs instead "
                  f"for the rest of this process (FUSED_OPS_ADAMW=0 chooses it from the start)", FallbackWarning,
                  stacklevel=4)


def _log2(beta):
    """log2(β) for the kernel's β^t = exp2(t·log2 β); β = 0 gives -inf (β^t = 0 for t >= 1)."""
    return math.log2(beta) if beta > 0 else -math.inf
