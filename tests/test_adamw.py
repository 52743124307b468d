"""fused_ops.adamw.FusedAdamW against AdamW's arithmetic in float64: on the CPU through Triton's interpreter, on a
GPU against torch's fused AdamW too. The repo's rule: the fused error at most twice torch.optim.AdamW's fp32 error
(plus a tiny epsilon). Also the clipping's grad_scale, special values, reallocated gradients, and state_dicts
that move between FusedAdamW and torch.optim.AdamW."""

import copy
import math

import warnings

import pytest
import torch

from fused_ops.adamw import BLOCK, INTERPRETER_BLOCK, FusedAdamW
from fused_ops.numerics import EPS, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A kernel that fails would fall back to PyTorch's fused AdamW and pass most tests: here that is an error.
pytestmark = pytest.mark.filterwarnings("error::fused_ops.backends.FallbackWarning")
BLOCK = BLOCK if DEVICE == "cuda" else INTERPRETER_BLOCK  # (a program's block on this device)
SIZES = [(1,), (7, 3), (BLOCK + 5,), (33, 129)]  # one element, odd shapes, a tensor of two blocks with a tail
ALIGNED_SIZES = [(4,), (64, 12), (BLOCK + 4,), (8, 96)]  # numels of whole 16 bytes: the kernel's vector-load path
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_adamw(params, grads_per_step, lr, betas, eps, weight_decay, decays, grad_scale=1.0):
    """AdamW's update (torch.optim.AdamW's documentation) in float64, one step per entry of grads_per_step."""
    ps = [p.double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m, v, decay in zip(ps, grads, ms, vs, decays):
            g = g.to(p.device).double() / grad_scale
            p.mul_(1 - lr * (weight_decay if decay else 0.0))
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            p.sub_(lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps))
    return ps


def make(seed, device=DEVICE, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in sizes]
    grads = [[torch.randn(s, generator=gen) * 10 ** (i - 2) for i, s in enumerate(sizes)] for _ in range(3)]
    return [p.to(device) for p in params], [[g.to(device) for g in step] for step in grads]


def run(optimizer_class, params, grads_per_step, grad_scale=None, **kwargs):
    params = [p.clone().requires_grad_() for p in params]
    groups = [{"params": params[:2], "weight_decay": HYPER["weight_decay"]}, {"params": params[2:], "weight_decay": 0.0}]
    opt = optimizer_class(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], **kwargs)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()  # a new tensor every step: the launch's address table follows
        if grad_scale is not None:
            opt.grad_scale = torch.tensor(grad_scale, device=params[0].device)
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("grad_scale", [None, 4.0])
@pytest.mark.parametrize("sizes", [SIZES, ALIGNED_SIZES], ids=["odd", "aligned"])
def test_matches_float64_adamw(sizes, grad_scale):
    params, grads = make(0, sizes=sizes)
    ref = reference_adamw(params, grads, decays=[True, True, False, False], grad_scale=grad_scale or 1.0,
                          **HYPER)
    ours, opt = run(FusedAdamW, params, grads, grad_scale)
    assert all(plan.aligned == (sizes is ALIGNED_SIZES) for plan in opt._plans.values())  # the path meant
    torch_grads = [[g / grad_scale for g in step] for step in grads] if grad_scale else grads
    theirs, _ = run(torch.optim.AdamW, params, torch_grads, foreach=False)
    for o, t, r in zip(ours, theirs, ref):
        assert rel_err(o, r) <= 2 * rel_err(t, r) + EPS[torch.float32]
    for o, t, r, p in zip(ours, theirs, ref, params):  # the update itself: p's own size would hide an error in it
        assert rel_err(o - p, r - p.double()) <= 2 * rel_err(t - p, r - p.double()) + EPS[torch.float32]


def test_grads_left_unscaled_and_state_like_torch():
    params, grads = make(2)
    ours, opt = run(FusedAdamW, params, grads[:1], grad_scale=2.0)
    p = opt.param_groups[0]["params"][0]
    torch.testing.assert_close(p.grad, grads[0][0], rtol=0, atol=0)  # only read
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 1.0
    assert state["step"].device == p.device and state["step"].dtype == torch.float32


def test_special_values_stay_in_their_element():
    params, grads = make(3)
    grads = grads[:1]
    grads[0][2][0], grads[0][2][1], grads[0][2][2] = float("nan"), float("inf"), -float("inf")
    ours, opt = run(FusedAdamW, params, grads)
    bad = ours[2][:3]
    assert torch.isnan(bad).all()  # NaN in; inf/inf for ±inf
    state = opt.state[opt.param_groups[1]["params"][0]]
    assert torch.isnan(state["exp_avg"][0]) and torch.isinf(state["exp_avg"][1]) and torch.isinf(state["exp_avg_sq"][1])
    ref = reference_adamw([q[3:] for q in params[2:3]], [[grads[0][2][3:]]], decays=[False], **HYPER)
    assert torch.isfinite(ours[2][3:]).all()
    theirs, _ = run(torch.optim.AdamW, [q[3:] for q in params[2:3]] * 4, [[grads[0][2][3:]] * 4])
    assert rel_err(ours[2][3:] - params[2][3:], ref[0] - params[2][3:].double()) <= \
        2 * rel_err(theirs[2] - params[2][3:], ref[0] - params[2][3:].double()) + EPS[torch.float32]


def test_state_dict_moves_between_fused_and_torch_adamw():
    """A checkpoint written by either optimizer resumes in the other, and the two continue alike."""
    params, grads = make(4)
    ref = reference_adamw(params, grads, decays=[True, True, False, False], **HYPER)
    for first, second in [(FusedAdamW, torch.optim.AdamW), (torch.optim.AdamW, FusedAdamW)]:
        ps, opt = run(first, params, grads[:2])
        ps = [p.clone().requires_grad_() for p in ps]
        groups = [{"params": ps[:2], "weight_decay": HYPER["weight_decay"]}, {"params": ps[2:], "weight_decay": 0.0}]
        resumed = second(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
        resumed.load_state_dict(opt.state_dict())
        for p, g in zip(ps, grads[2]):
            p.grad = g.clone()
        resumed.step()
        straight, _ = run(second, params, grads)  # the three steps without the checkpoint
        for p, s, r, p0 in zip(ps, straight, ref, params):
            assert rel_err(p.detach() - p0, r - p0.double()) <= 2 * rel_err(s - p0, r - p0.double()) + EPS[torch.float32]


def test_params_without_grad_untouched():
    params, grads = make(5)
    ps = [p.clone().requires_grad_() for p in params]
    opt = FusedAdamW(ps, **HYPER)
    ps[1].grad = grads[0][1].clone()
    opt.step()
    for i, (p, p0) in enumerate(zip(ps, params)):
        assert torch.equal(p.detach(), p0) == (i != 1)
    assert list(opt.state) == [ps[1]]


def test_bad_params_named():
    with pytest.raises(TypeError, match="float32 tensors"):
        FusedAdamW([torch.zeros(3, dtype=torch.float64, device=DEVICE, requires_grad=True)])
    with pytest.raises(TypeError, match="float32 tensors"):
        FusedAdamW([torch.zeros(4, 4, device=DEVICE).t().requires_grad_()])  # not contiguous


def test_bias_correction_over_many_steps():
    """β^t through exp2(t·log2 β) in fp32: steps 1..200 on one element against float64."""
    p = torch.tensor([0.5], device=DEVICE, requires_grad=True)
    opt = FusedAdamW([p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    ref = reference_adamw([p.detach().clone()], [[torch.tensor([math.sin(t)])] for t in range(200)], lr=1e-2,
                          betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decays=[False])[0]
    for t in range(200):
        p.grad = torch.tensor([math.sin(t)], device=DEVICE)
        opt.step()
    assert abs(float(p.detach()) - float(ref)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_against_torch_fused_adamw():
    gen = torch.Generator().manual_seed(6)
    shapes = [(768, 3072), (3072,), (50304, 768), (1000003,)]
    params = [torch.randn(s, generator=gen).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=gen).cuda() * 1e-2 for s in shapes] for _ in range(3)]
    ref = reference_adamw(params, grads, decays=[True, True, False, False], grad_scale=3.0, **HYPER)
    from fused_ops import adamw
    from fused_ops.backends import FallbackWarning
    with warnings.catch_warnings():  # the kernel itself, every step (from the second: the kept compiled kernel's
        warnings.simplefilter("error", FallbackWarning)  # direct launch), not PyTorch's fused AdamW behind a warning
        ours, _ = run(FusedAdamW, params, grads, grad_scale=3.0)
    assert adamw.FAILURE is None
    theirs, _ = run(torch.optim.AdamW, params, grads, grad_scale=3.0, fused=True)
    for o, t, r, p in zip(ours, theirs, ref, params):
        assert rel_err(o - p, r - p.double()) <= 2 * rel_err(t - p, r - p.double()) + EPS[torch.float32]


@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # every step clipped; no step clipped
def test_clip_and_step_folds_the_clip_into_the_launch(max_norm):
    """train.py's clip_and_step hands FusedAdamW the clipping's factor as grad_scale: the same weights and moments as
    clip_grad_norm_ then torch.optim.AdamW's step."""
    from helpers import runtime
    params, grads = make(7)
    runs = []
    for ours in (True, False):
        ps = [p.clone().requires_grad_() for p in params]
        opt = (FusedAdamW if ours else torch.optim.AdamW)(ps, **HYPER)
        scaler = torch.amp.GradScaler(DEVICE, enabled=False)
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = g.clone() * 30  # norms ~30: clipped at 1
            if ours:
                runtime.clip_and_step(opt, ps, max_norm, scaler)
                assert not hasattr(opt, "grad_scale")
            else:
                torch.nn.utils.clip_grad_norm_(ps, max_norm)
                opt.step()
        runs.append([t.detach() for p in ps for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])])
    for o, t in zip(*runs):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-6)  # (rounding: torch takes β^t in float64, lerps)


def test_model_picks_it_on_gpus_only():
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)).to(DEVICE)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), DEVICE)
    assert isinstance(opt, FusedAdamW) == (DEVICE == "cuda")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_a_failing_kernel_falls_back_once(monkeypatch):
    """A kernel that does not compile or launch costs speed, never the run: one FallbackWarning, then PyTorch's fused
    AdamW on the same state, which keeps to the float64 rule."""
    from fused_ops import adamw
    from fused_ops.backends import FallbackWarning

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no such instruction")
            return launch

    monkeypatch.setattr(adamw, "adamw_kernel", Broken())
    monkeypatch.setattr(adamw, "FAILURE", None)
    params, grads = make(8)
    ref = reference_adamw(params, grads, decays=[True, True, False, False], grad_scale=2.0, **HYPER)
    with pytest.warns(FallbackWarning, match="PyTorch's fused AdamW") as caught:
        ours, opt = run(FusedAdamW, params, grads, grad_scale=2.0)
    assert len([w for w in caught if issubclass(w.category, FallbackWarning)]) == 1
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3.0  # counted once a step
    theirs, _ = run(torch.optim.AdamW, params, [[g / 2.0 for g in step] for step in grads], foreach=False)
    for o, t, r, p in zip(ours, theirs, ref, params):
        assert rel_err(o - p, r - p.double()) <= 2 * rel_err(t - p, r - p.double()) + EPS[torch.float32]


def test_loss_scaler_path():
    """fp16 training's GradScaler unscales the gradients itself and skips steps with infs: FusedAdamW takes no
    grad_scale then, and ends where torch.optim.AdamW does."""
    from helpers import runtime
    params, grads = make(9)
    runs = []
    for cls in (FusedAdamW, torch.optim.AdamW):
        ps = [p.clone().requires_grad_() for p in params]
        opt = cls(ps, **HYPER)
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 4)
        for k, step in enumerate(grads):
            scaler.scale(torch.ones((), device=DEVICE))  # (as a loss would be: the scaler's scale comes to exist)
            for p, g in zip(ps, step):
                p.grad = g.clone() * scaler.get_scale() * (float("inf") if k == 1 and p is ps[0] else 1.0)
            runtime.clip_and_step(opt, ps, 1.0, scaler)
        runs.append([p.detach() for p in ps])
    assert all(torch.isfinite(p).all() for p in runs[0])  # the step with an inf was skipped
    for o, t in zip(*runs):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-6)


def stepped_once(seed):
    """(parameters, the gradients of three steps, a FusedAdamW that has taken the first step: its plan is built)."""
    params, grads = make(seed)
    ps = [p.clone().requires_grad_() for p in params]
    opt = FusedAdamW(ps, **HYPER)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()
    return ps, grads, opt


def test_a_reloaded_state_is_the_one_updated():
    """load_state_dict into an optimizer that has stepped (its launch plan and address table built): the next step
    updates the loaded moments, not the ones it had."""
    ps, grads, opt = stepped_once(10)
    saved = copy.deepcopy(opt.state_dict())
    start = [p.detach().clone() for p in ps]
    for p, g in zip(ps, grads[1]):
        p.grad = g.clone()
    opt.step()  # (moves the old moments on)
    opt.load_state_dict(copy.deepcopy(saved))  # (a loaded state may share the dict's tensors: one copy each)
    with torch.no_grad():
        for p, p0 in zip(ps, start):
            p.copy_(p0)
    fresh = [p0.clone().requires_grad_() for p0 in start]
    other = FusedAdamW(fresh, **HYPER)
    other.load_state_dict(copy.deepcopy(saved))
    for a, b, g in zip(ps, fresh, grads[2]):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    other.step()
    for a, b in zip(ps, fresh):
        assert torch.equal(a.detach(), b.detach())


def test_a_parameter_replaced_after_the_optimizer_is_named():
    """p.data swapped for a smaller tensor would send the kernel past its end: a clear error instead."""
    ps, grads, opt = stepped_once(11)
    ps[2].data = torch.zeros(5, device=DEVICE)
    ps[2].grad = torch.zeros(5, device=DEVICE)
    with pytest.raises(ValueError, match="make the optimizer after"):
        opt.step()


def test_its_checkpoint_continues_in_pytorchs_fused_adamw_with_clipping():
    """A FusedAdamW checkpoint says fused=True (its state's layout): PyTorch's AdamW resumes it fused, and the
    clip's grad_scale goes where that optimizer takes it."""
    from helpers import runtime
    params, grads = make(12)
    ps, opt = run(FusedAdamW, params, grads[:2])
    assert all(g["fused"] for g in opt.state_dict()["param_groups"])
    ps = [p.clone().requires_grad_() for p in ps]
    groups = [{"params": ps[:2], "weight_decay": HYPER["weight_decay"]}, {"params": ps[2:], "weight_decay": 0.0}]
    resumed = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], fused=True)
    resumed.load_state_dict(opt.state_dict())
    for p, g in zip(ps, grads[2]):
        p.grad = g.clone()
    runtime.clip_and_step(resumed, ps, 1.0, torch.amp.GradScaler(DEVICE, enabled=False))
    assert all(torch.isfinite(p).all() for p in ps)
