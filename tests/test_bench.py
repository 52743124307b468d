"""bench.py end to end at tiny sizes (CPU through the interpreter, or the GPU when there is one): every variant runs, outputs are written, losses agree."""

import json
import os
import sys

import pytest
import torch

import bench

# The fused kernels run on CUDA, or on CPU only under the interpreter (set by conftest when there is no GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_runs_and_paths_agree(tmp_path, capsys):
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\n"
                   "dataset = 'shakespeare_char'\nactivation = 'gelu'\n")
    out = str(tmp_path / "bench_tiny")
    rows = bench.main([str(cfg), f"--device={DEVICE}", "--dtype=float32", "--compile=False", "--warmup=1", "--steps=2", f"--out={out}"])
    assert [(r["mlp"], r["compile"]) for r in rows] == [("eager", False), ("fused", False)]
    eager, fused = rows
    for a, b in zip(eager["first_losses"], fused["first_losses"]):  # same weights, same batches
        assert abs(a - b) < 1e-4
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # time to the first step: building the model and its first step, at least that step's own time
    assert all(r["to_first_step_s"] >= r["first_step_s"] > 0 for r in rows)
    for ext in (".json", ".csv", ".png"):
        assert os.path.getsize(out + ext) > 0
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}.json, {out}.csv, {out}.png")  # said, file by file
    with open(out + ".json") as f:
        saved = json.load(f)
    assert saved["env"]["model"]["n_embd"] == 32 and len(saved["rows"]) == 2


def test_a_bench_step_is_train_pys_step(tmp_path, monkeypatch):
    """bench.py times train.py's own step (train.train_step: the micro-steps, the loss read, clipping with train.py's
    default, the optimizer), one call a step with that step's micro-batches, so that its figures are the ones train.py
    prints for the same settings."""
    import train
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\ndataset = 'shakespeare_char'\n")
    calls, real = [], train.train_step

    def recording(model, batches, optimizer, scaler, cfg, autocast, accum, world):
        calls.append((accum, cfg["grad_clip"], cfg["compile"], world))
        return real(model, batches, optimizer, scaler, cfg, autocast, accum, world)
    monkeypatch.setattr(train, "train_step", recording)
    rows = bench.main([str(cfg), "--device=cpu", "--dtype=float32", "--mlps=eager", "--compile=False", "--warmup=2",
                       "--steps=3", "--grad_accum=2", f"--out={tmp_path / 'b'}"])
    assert calls == [(2, 1.0, False, 1)] * 5  # 2 warm-up steps, 3 timed
    assert all(isinstance(loss, float) for loss in rows[0]["first_losses"])


def test_a_users_bench_run_goes_outside_results(tmp_path, monkeypatch, capsys):
    """Without --out, out-bench/ (untracked: .gitignore's out*/), never results/, which holds the docs' record."""
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\ndataset = 'shakespeare_char'\n")
    monkeypatch.chdir(tmp_path)  # (a checkout's root, as far as bench.py can tell)
    bench.main([str(cfg), "--device=cpu", "--dtype=float32", "--mlps=eager", "--compile=False", "--warmup=1",
                "--steps=1"])
    out = os.path.join("out-bench", "bench_tiny")
    assert sorted(os.listdir("out-bench")) == ["bench_tiny.csv", "bench_tiny.json", "bench_tiny.png"]
    assert not os.path.exists("results")
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}.json, {out}.csv, {out}.png")
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "out*/" in f.read().split()  # git leaves it out, as it does the runs' out_dir


def test_bench_several_processes_match_one(tmp_path, capsys):
    """--gpus=1,2 on the CPU: bench.py under torchrun (Gloo), DDP inside the model's wrapper as train.py runs it. Each
    process sees the same batches from the same weights, so the averaged gradient is one process's and the losses of
    the first steps are the 1-process run's; the table gives tokens/s per process for both counts."""
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\ndataset = 'shakespeare_char'\n")
    out = str(tmp_path / "gpus")
    rows = bench.main([str(cfg), "--device=cpu", "--dtype=float32", "--mlps=eager", "--compile=False", "--warmup=3",
                       "--steps=2", "--grad_accum=2", "--gpus=1,2", f"--out={out}"])
    assert [(r["mlp"], r["gpus"]) for r in rows] == [("eager", 1), ("eager", 2)]
    one, two = rows
    assert len(one["first_losses"]) == 3
    assert two["first_losses"] == pytest.approx(one["first_losses"], rel=1e-6)
    assert all(r["tokens_per_s_per_gpu"] > 0 and r["per_gpu_min"] <= r["tokens_per_s_per_gpu"] <= r["per_gpu_max"]
               for r in rows)
    assert one["vs_first"] == 1.0 and os.path.getsize(out + ".json") > 0
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}.json, {out}.csv")


def test_bench_rounds_interleave_the_variants(tmp_path, monkeypatch):
    """--rounds: every variant built first, then timed round by round in alternating order."""
    cfg = tmp_path / "tiny.py"
    cfg.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\ndataset = 'shakespeare_char'\n")
    order = []
    start = bench.timed_steps

    def recording(run, n, timed=True):
        if timed:
            order.append(run["mlp"])
        return start(run, n, timed)
    monkeypatch.setattr(bench, "timed_steps", recording)
    rows = bench.main([str(cfg), f"--device={DEVICE}", "--dtype=float32", "--compile=False", "--warmup=1", "--steps=1",
                       "--rounds=3", "--mlps=eager,fused", f"--out={tmp_path / 'b'}"])
    assert order == ["eager", "fused", "fused", "eager", "eager", "fused"]
    assert all(len(r["round_ms"]) == 3 and r["ms_per_step"] > 0 and r["peak_mem_gib"] is None for r in rows)
    for a, b in zip(*(r["first_losses"] for r in rows)):  # the same weights and batches, whatever the order
        assert abs(a - b) < 1e-4


def test_bench_mlp_widths(tmp_path, capsys):
    """--mlp_widths on CPU at tiny sizes: a row per width, activation and path; fused forward equals eager's."""
    out = str(tmp_path / "widths")
    rows = bench.main(["--mlp_widths=16,64", "--mlp_tokens=16,32", f"--device={DEVICE}", "--dtype=float32",
                       "--compile=False", f"--out={out}"])
    assert {(r["C"], r["activation"], r["path"]) for r in rows} == \
        {(C, a, p) for C in (16, 64) for a in ("gelu", "swiglu") for p in ("eager", "fused")}
    for r in rows:
        assert r["correct"] and r["fwd_fused_vs_eager"] < 1e-5  # float32
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwd_pct_floor"] > 0 and r["fwdbwd_pct_floor"] > 0
        assert (r["graph_fwdbwd_ms"] > 0) if DEVICE == "cuda" else (r["graph_fwdbwd_ms"] is None)
    assert {r["H"] for r in rows if r["C"] == 64} == {256, 192}  # 4C for gelu; 8/3 C rounded up to 64 for swiglu
    for ext in (".json", ".csv", ".png"):
        assert os.path.getsize(out + ext) > 0
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}.json, {out}.csv, {out}.png")
    with open(out + ".json") as f:
        saved = json.load(f)
    assert len(saved["rows"]) == 8 and saved["env"]["matmul_tflops"] > 0


def test_bench_mlp_without_biases():
    """bench_mlp --bias=False (issue 29's MLP): the case runs and checks out bias-free, and the flag takes only
    True or False."""
    import argparse
    import bench_mlp
    row = bench_mlp.mlp_case(32, 32, "gelu", {}, 1.0, DEVICE, torch.float32, compile=False, kernels=False, bias=False)
    assert row["correct"] and row["fwd_fused_vs_eager"] < 1e-5
    assert [bench_mlp.true_or_false(v) for v in ("False", "true")] == [False, True]
    with pytest.raises(argparse.ArgumentTypeError, match="expected True or False, got 'maybe'"):
        bench_mlp.true_or_false("maybe")


def test_compile_settings_and_labels():
    """--compile's entries: booleans, or a torch.compile mode named in the variant's label; the MLP-alone
    table takes only the booleans and says so."""
    assert [bench.compile_setting(c) for c in ("False", "True", "reduce-overhead")] == [False, True, "reduce-overhead"]
    assert [bench.label({"mlp": "fused", "compile": c}) for c in (False, True, "reduce-overhead")] == \
        ["fused", "fused +compile", "fused +reduce-overhead"]
    assert [bench.label({"mlp": "fused", "compile": c, "regions": True}) for c in (False, True, "reduce-overhead")] == \
        ["fused", "fused +compile regions", "fused +reduce-overhead regions"]  # (regions only where it compiles)
    assert [bench.parse_variant(v) for v in ("fused", "fp8+compile", "eager+reduce-overhead")] == \
        [("fused", False), ("fp8", True), ("eager", "reduce-overhead")]  # (the lab's probes' variant names)
    with pytest.raises(bench.errors.UsageError, match="--mlp_widths takes --compile=True and/or False"):
        bench.main(["--mlp_widths=32", "--compile=reduce-overhead", "--device=cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mlp", ["eager", "fused", "compile"])
def test_graphed_fwd_bwd_replays_the_same_gradients(mlp):
    """bench_mlp.graphed_fwd_bwd: each replay computes the MLP's gradients, also after other allocations
    have reused whatever memory was freed since the capture (the graph's inputs must stay alive)."""
    import bench_mlp
    from model import GPTConfig, MLP

    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=256, n_head=1, activation="gelu", mlp="eager" if mlp == "compile" else mlp)
    m = MLP(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    replay, grads = bench_mlp.graphed_fwd_bwd(torch.compile(m) if mlp == "compile" else m, x, dy)
    # new tensors of the sizes of the copies graphed_fwd_bwd made: they would take those blocks if freed
    churn = [torch.randn_like(t) for _ in range(4) for t in (x, *m.parameters())]
    replay()
    torch.cuda.synchronize()
    x_ref = x.clone().requires_grad_()
    ref = torch.compile(m) if mlp == "compile" else m
    expected = torch.autograd.grad(ref(x_ref), [x_ref] + list(m.parameters()), dy)
    assert len(grads) == len(expected) and len(churn) > 0
    for g, e in zip(grads, expected):
        if mlp == "compile":  # its own compilation of the same module: bf16 tolerances
            torch.testing.assert_close(g, e)
        else:
            assert torch.equal(g, e)


def test_torchao_variant_converts_the_mlp_linears_only(monkeypatch):
    """--mlps=torchao hands torchao's converter a filter that takes the MLPs' two Linears and nothing else; without
    torchao it is one error naming the package."""
    import types

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(bench.errors.RunError, match="--mlps=torchao needs torchao"):
        bench.torchao_float8_mlps(model)
    taken = []

    def convert_to_float8_training(module, module_filter_fn):
        taken.extend(fqn for fqn, m in module.named_modules()
                     if isinstance(m, torch.nn.Linear) and module_filter_fn(m, fqn))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.SimpleNamespace(
        convert_to_float8_training=convert_to_float8_training))
    bench.torchao_float8_mlps(model)
    assert taken == [f"transformer.h.{i}.mlp.{name}" for i in range(2) for name in ("c_fc", "c_proj")]


def test_variants_name_their_kernel_family_and_compile_setting():
    """--mlps entries: "+portable" / "+pointer" select the portable kernels (the fused_ops.env switches bench.py's
    step runs under), and "@mode" a compile setting of the entry's own, beside the others' --compile settings."""
    import bench
    assert bench.kernel_family("fused+cls+portable") == ("fused+cls", {"PINGPONG": False})
    assert bench.kernel_family("fused+pointer") == ("fused", {"PINGPONG": False, "TMA_MODE": "0"})
    assert bench.kernel_family("fp8blocks+cls8") == ("fp8blocks+cls8", {})
    args = bench.parse_args(["configs/gpt2_124m.py", "--device=cpu", "--compile=reduce-overhead,False",
                             "--mlps=eager@True,fused+portable"])
    assert bench.variant_list(args.mlps, args.compile) == [("eager", True), ("fused+portable", "reduce-overhead"),
                                        ("fused+portable", False)]
    from helpers import errors
    with pytest.raises(errors.UsageError, match=r"fused\+portables"):
        bench.parse_args(["configs/gpt2_124m.py", "--device=cpu", "--mlps=fused+portables"])
