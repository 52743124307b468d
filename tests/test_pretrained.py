"""GPT.from_pretrained on Hugging Face GPT-2 checkpoints (helpers/hf_gpt2.py): tiny random ones that transformers saves (it is a
test dependency only), compared with transformers' own logits; the hub cache offline; clear errors.
A GPU test does the same at GPT-2 124M's shapes under bf16 autocast."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency only (.ci/run installs it): the loader itself never imports it
from safetensors.torch import load_file, save_file

from helpers import config
from helpers import data
from helpers import errors
import sample
import train
from model import GPT
from numerics import assert_no_worse_than_eager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the fused kernels run: a GPU if there is one (without one, conftest sets Triton's CPU interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)  # vocab_size: GPT-2's 50257


def random_gpt2(seed=0, vocab_size=50257, **config):
    """A transformers GPT2LMHeadModel with every parameter random (its own init leaves biases at 0 and
    LayerNorm gains at 1, which would hide a bias or gain that failed to load)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:  # LayerNorm gains (the only 1-D weights) around 1, biases around 0
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return hf


def openai_style_state_dict(hf):
    """The layout of OpenAI's original files on the hub: no "transformer." prefix, the attention-mask
    buffers saved alongside the weights, no lm_head."""
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    n = hf.config.n_positions
    for i in range(hf.config.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return sd


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, safetensors folder, pytorch_model.bin folder, sharded-safetensors folder)."""
    root = tmp_path_factory.mktemp("gpt2")
    hf = random_gpt2(**TINY)
    hf.save_pretrained(root / "safetensors")
    hf.save_pretrained(root / "sharded", max_shard_size="1MB")
    hf.config.save_pretrained(root / "bin")
    torch.save(openai_style_state_dict(hf), root / "bin" / "pytorch_model.bin")
    return hf, root / "safetensors", root / "bin", root / "sharded"


def all_logits(model, idx):
    logits, _ = model(idx, targets=idx)  # with targets our GPT returns the logits of every position
    return logits


def test_saved_layouts_are_the_ones_meant(tiny):
    _, st, bin_, sharded = tiny
    assert "transformer.h.0.attn.c_attn.weight" in load_file(st / "model.safetensors")
    assert "h.0.attn.masked_bias" in torch.load(bin_ / "pytorch_model.bin", weights_only=True)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()


@pytest.mark.parametrize("layout", ["safetensors", "bin", "sharded"])
@pytest.mark.parametrize("mlp", ["eager", "fused"])  # fused: our Triton kernels (the CPU interpreter without a GPU)
def test_same_logits_as_transformers(tiny, layout, mlp):
    hf, folders = tiny[0], dict(zip(["safetensors", "bin", "sharded"], tiny[1:]))
    model = GPT.from_pretrained(str(folders[layout]), mlp=mlp).eval()
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (2, 2, 32, 64)
    assert (cfg.vocab_size, cfg.bias, cfg.activation, cfg.mlp) == (50257, True, "gelu_tanh", mlp)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    device = DEVICE if mlp == "fused" else "cpu"  # the kernels take CUDA tensors where there is a GPU
    model, idx = model.to(device), torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = all_logits(model, idx.to(device)).cpu()
        theirs = hf(idx).logits
        reference = hf.double()(idx).logits
        hf.float()
    assert ours.shape == theirs.shape == (2, 64, 50257)
    # Ours must be as close to the float64 answer as transformers' own fp32 logits are (the repo's 2x rule).
    assert_no_worse_than_eager(ours, theirs, reference, f"{layout} {mlp} logits")


@pytest.mark.parametrize("activation_function,ours", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"),
                                                      ("relu", "relu"), ("relu2", "relu2")])
def test_other_activations_and_vocabularies_load(tmp_path, activation_function, ours):
    """GPT-2's network with another activation transformers and our GPT share, and another vocabulary (as
    GPT.save_pretrained writes for a character model)."""
    hf = random_gpt2(vocab_size=100, activation_function=activation_function, **TINY)
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), mlp="eager").eval()
    assert (model.config.activation, model.config.vocab_size) == (ours, 100)
    idx = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(all_logits(model, idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_block_size_crops_the_position_table(tiny):
    hf, folder = tiny[0], str(tiny[1])
    model = GPT.from_pretrained(folder, block_size=16, mlp="eager").eval()
    wpe = model.transformer.wpe.weight
    assert model.config.block_size == 16 and wpe.shape == (16, 32)
    assert wpe.untyped_storage().nbytes() == 16 * 32 * 4  # a copy: the 64-row table is not kept (nor saved)
    torch.testing.assert_close(wpe, hf.transformer.wpe.weight[:16], rtol=0, atol=0)
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_no_worse_than_eager(all_logits(model, idx), hf(idx).logits, hf.double()(idx).logits, "cropped")
        hf.float()
        with pytest.raises(ValueError, match="exceeds block_size 16"):
            model(torch.zeros(1, 17, dtype=torch.long))
    assert GPT.from_pretrained(folder, block_size=64).config.block_size == 64  # the whole table: nothing to crop
    with pytest.raises(errors.UsageError, match=r"block_size=65: .* has 64 positions .*1\.\.64"):
        GPT.from_pretrained(folder, block_size=65)
    with pytest.raises(ValueError, match=r"block_size must be an integer in 1\.\.16"):
        model.crop_block_size(0)


def test_half_precision_file_loads_as_fp32(tiny, tmp_path):
    tensors = {k: v.half() for k, v in load_file(tiny[1] / "model.safetensors").items()}
    model = GPT.from_pretrained(write_checkpoint(tmp_path / "fp16", tensors, source=tiny[1]))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(model.transformer.h[1].mlp.c_fc.weight,
                               tensors["transformer.h.1.mlp.c_fc.weight"].float().t(), rtol=0, atol=0)


def test_dropout_and_mlp_overrides(tiny):
    model = GPT.from_pretrained(str(tiny[1]), mlp="auto", dropout=0.1)
    assert (model.config.mlp, model.config.dropout, model.config.fuse_ln) == ("auto", 0.1, False)
    model = GPT.from_pretrained(str(tiny[1]), mlp="fused", fuse_ln=True)  # how to run it, not its architecture
    assert model.config.fuse_ln is True and all(block.mlp.fuse_ln for block in model.transformer.h)
    with pytest.raises(errors.UsageError, match="'fuse_ln' folds the LayerNorm into the fused MLP"):
        GPT.from_pretrained(str(tiny[1]), mlp="eager", fuse_ln=True)
    with pytest.raises(errors.UsageError, match="config key 'mlp' must be one of"):
        GPT.from_pretrained(str(tiny[1]), mlp="fast")


def greedy_ids(hf, ids, n):
    ids = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def test_sample_py_from_a_folder(tiny, capsys):
    hf, folder = tiny[0], str(tiny[1])
    out = sample.main([f"--init_from={folder}", "--device=cpu", "--start=Hello, world", "--num_samples=1",
                       "--max_new_tokens=6", "--top_k=1", "--mlp=eager"])
    encode, decode = data.get_tokenizer({"tokenizer": "gpt2"})
    assert out == [decode(greedy_ids(hf, encode("Hello, world"), 6))]  # greedy: transformers' own tokens
    assert out[0] in capsys.readouterr().out
    # sampling, with the default MLP choice ("auto": the interpreted kernels here) and the default newline prompt
    out = sample.main([f"--init_from={folder}", "--device=cpu", "--num_samples=2", "--max_new_tokens=4",
                       "--temperature=1.0"])
    assert out[0].startswith("\n") and out[0] != out[1]


def write_checkpoint(folder, tensors, config_changes=None, source=None):
    """A checkpoint folder: config.json (the tiny one, changed) and model.safetensors holding tensors."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def test_clear_errors(tiny, tmp_path):
    good = tiny[1]
    tensors = load_file(good / "model.safetensors")

    def error(match, folder, exc=errors.UsageError, **overrides):
        with pytest.raises(exc, match=match):
            GPT.from_pretrained(str(folder), **overrides)

    error(r"init_from='no/such/folder' is neither a GPT-2 name \(gpt2, gpt2-medium, gpt2-large, gpt2-xl\) nor an "
          "existing folder", "no/such/folder")
    (tmp_path / "empty").mkdir()
    error("empty has no config.json: init_from needs a Hugging Face GPT-2 checkpoint folder", tmp_path / "empty")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(good / "config.json", tmp_path / "no_weights")
    error("no_weights has config.json but no weights: expected model.safetensors or", tmp_path / "no_weights")
    error("override 'n_layer' is not allowed: .* only mlp, dropout, block_size, fuse_ln", good, n_layer=3)

    wrong = {**tensors, "transformer.h.1.mlp.c_fc.weight": torch.zeros(32, 100)}
    error(r"model.safetensors: tensor 'transformer.h.1.mlp.c_fc.weight' has shape \(32, 100\), but its config.json "
          r"implies \(32, 128\)", write_checkpoint(tmp_path / "shape", wrong, source=good))
    missing = {k: v for k, v in tensors.items() if k != "transformer.ln_f.bias"}
    error("has no tensor 'ln_f.bias' \\(1 missing\\)", write_checkpoint(tmp_path / "missing", missing, source=good))
    extra = {**tensors, "transformer.h.0.mlp.c_gate.weight": torch.zeros(4)}
    error("has a tensor 'transformer.h.0.mlp.c_gate.weight' that GPT-2 does not",
          write_checkpoint(tmp_path / "extra", extra, source=good))
    # A config.json our GPT would load but compute differently from.
    error("activation_function='silu', but GPT-2 \\(and our GPT\\) needs 'gelu' or 'gelu_new' or 'relu' or 'relu2' or",
          write_checkpoint(tmp_path / "silu", tensors, {"activation_function": "silu"}, source=good))
    error(r"tensor 'transformer.wte.weight' has shape \(50257, 32\), but its config.json implies \(50304, 32\)",
          write_checkpoint(tmp_path / "vocab", tensors, {"vocab_size": 50304}, source=good))
    error("n_inner=64, but", write_checkpoint(tmp_path / "inner", tensors, {"n_inner": 64}, source=good))
    # A damaged weights file is a failed run (exit 1) naming the file, not a traceback.
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    (damaged / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    error("damaged/model.safetensors: cannot read its tensors .*download or save it again", damaged, errors.RunError)


def run_loader(code, env_changes, timeout=120):
    """Run code in a fresh interpreter (huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when imported)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")
           and not k.lower().endswith("_proxy")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **env_changes}, capture_output=True,
                          text=True, timeout=timeout)


FROM_NAME = ("import sys, model\nfrom helpers import errors, hf_gpt2\n"
             "hf_gpt2.HUB_TIMEOUT = 2\n"
             "sys.exit(errors.run_main('sample.py', lambda argv: print(model.GPT.from_pretrained('gpt2').config)))")


def test_name_offline_and_not_cached_names_the_folder_option(tmp_path):
    proc = run_loader(FROM_NAME, {"HF_HOME": str(tmp_path / "empty_home"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("sample.py: error: init_from='gpt2' is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE is set: pass --init_from=<folder> with a local checkpoint" in proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback


def test_name_with_an_unresponsive_hub_fails_instead_of_hanging(tmp_path):
    # A server that accepts the connection and never answers, as a firewall that drops packets would.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = {"HF_HOME": str(tmp_path / "empty_home"), "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        proc = run_loader(FROM_NAME, env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "init_from='gpt2' is not in the Hugging Face cache and downloading openai-community/gpt2 failed" in proc.stderr
    assert proc.stderr.rstrip().endswith("pass --init_from=<folder> with a local checkpoint (config.json + model.safetensors)")


@pytest.mark.parametrize("repo_dir", ["models--openai-community--gpt2", "models--gpt2"])
def test_name_reads_the_hub_cache_offline(tiny, tmp_path, repo_dir):
    """A checkpoint in the cache layout huggingface_hub writes (refs/main -> snapshots/<commit>/files), under the
    hub's current repository name or the short one older transformers used, loads with no network at all."""
    repo = tmp_path / "home" / "hub" / repo_dir
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny[1], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = ("import sys, torch, model\n"
            "a, b = model.GPT.from_pretrained('gpt2'), model.GPT.from_pretrained(sys.argv[1])\n"
            "assert a.config == b.config, (a.config, b.config)\n"
            "assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())\n"
            "print('same')\n")
    proc = run_loader(code.replace("sys.argv[1]", repr(str(tiny[1]))), {"HF_HOME": str(tmp_path / "home"),
                                                                       "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "same", proc.stderr


def test_finetune_config_uses_real_train_keys():
    cfg = config.parse_config(config.DEFAULTS, [os.path.join(ROOT, "configs", "finetune_shakespeare.py")],
                                    config.KEY_TYPES)
    assert cfg["init_from"] == "gpt2" and cfg["dataset"] == "shakespeare"
    assert data.DATASETS["shakespeare"]["tokenizer"] == "gpt2"  # GPT-2's BPE: the checkpoint's 50257 tokens
    assert cfg["always_save_checkpoint"] is False and cfg["decay_lr"] is False
    assert cfg["learning_rate"] <= 1e-4 and cfg["max_iters"] <= 100


# -----------------------------------------------------------------------------------------------------------
# GPU: GPT-2 124M's shapes, bf16 autocast


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpt2_124m_shaped_checkpoint_bf16(tmp_path):
    hf = random_gpt2(n_layer=12, n_head=12, n_embd=768, n_positions=1024)
    hf.save_pretrained(tmp_path / "gpt2-124m")
    hf = hf.cuda()
    idx = torch.randint(0, 50257, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        reference = hf.double()(idx).logits
        hf.float()
        hf32 = hf(idx).logits
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hf16 = hf(idx).logits
        ours = {}
        for mlp in ("eager", "fused"):
            model = GPT.from_pretrained(str(tmp_path / "gpt2-124m"), mlp=mlp).cuda().eval()
            ours[mlp, "fp32"] = all_logits(model, idx)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ours[mlp, "bf16"] = all_logits(model, idx)
            del model
    for mlp in ("eager", "fused"):
        assert_no_worse_than_eager(ours[mlp, "fp32"], hf32, reference, f"{mlp} fp32 vs transformers fp32")
        assert_no_worse_than_eager(ours[mlp, "bf16"], hf16, reference, f"{mlp} bf16 vs transformers bf16",
                                   compute_dtype=torch.bfloat16)
    assert_no_worse_than_eager(ours["fused", "bf16"], ours["eager", "bf16"], reference, "fused bf16 vs eager bf16",
                               compute_dtype=torch.bfloat16)
