"""GPT.save_pretrained and export.py: folders that transformers' GPT2LMHeadModel loads with no custom code and that
give our logits at every position (fp32, eager and fused MLP); the round trip back through GPT.from_pretrained;
GPT-2's tokenizer files; one clear error for what GPT-2 cannot hold, and no half-written or clobbered folders."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency only: the export itself never imports it

from helpers import data
from helpers import errors
import export
from helpers import hf_gpt2
from helpers import prepare_data
from model import GATED_ACTIVATIONS, GPT, PLAIN_ACTIVATIONS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU the kernels run in the interpreter
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16)
CHARS = {"tokenizer": "char", "vocab_size": 65, "chars": [chr(32 + i) for i in range(65)]}  # a 65-character meta


def random_gpt(vocab_size=128, seed=0, **config):
    """Our GPT with every parameter random (its init leaves biases at 0 and LayerNorm gains at 1, which would hide
    a bias or gain written to the wrong place); 128 rows: a vocabulary padded past CHARS' 65."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, **TINY, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model.eval()


def transformers_model(folder):
    return transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()


def all_logits(model, idx):
    return model(idx, targets=idx)[0]  # with targets our GPT returns every position's logits


# fused_ln: fuse_ln=True, the LayerNorm folded into the fused MLP; it changes how, not what, so it exports.
@pytest.mark.parametrize("activation,mlp", [(a, m) for m in ("eager", "fused") for a in PLAIN_ACTIVATIONS]
                         + [("gelu_tanh", "fused_ln")])
def test_transformers_gives_our_logits(tmp_path, activation, mlp):
    model = random_gpt(activation=activation, mlp=mlp.removesuffix("_ln"), fuse_ln=mlp == "fused_ln")
    model.save_pretrained(tmp_path / "hf", meta=CHARS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == {"gelu": "gelu", "gelu_tanh": "gelu_new"}.get(activation, activation)
    assert config["vocab_size"] == 65  # cut back from 128 padded rows
    hf = transformers_model(tmp_path / "hf")
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = all_logits(model.to(DEVICE), idx.to(DEVICE)).cpu()
        theirs = hf(idx).logits
    assert theirs.shape == (2, 16, 65)
    torch.testing.assert_close(ours[..., :65], theirs, rtol=1e-5, atol=1e-5)  # the real tokens' logits, unchanged


@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_gives_back_the_same_weights(tmp_path, bias):
    model = random_gpt(activation="relu2", bias=bias)
    model.save_pretrained(tmp_path / "hf", meta=CHARS)
    back = GPT.from_pretrained(str(tmp_path / "hf"), mlp="eager")
    assert dataclasses.replace(back.config, bias=bias, vocab_size=128) == model.config
    theirs, ours = back.state_dict(), model.state_dict()
    for name, tensor in theirs.items():
        want = ours.get(name, torch.zeros_like(tensor))  # bias=False: GPT-2's biases are exported as zeros
        if name in ("transformer.wte.weight", "lm_head.weight"):
            want = want[:65]  # the padding rows are not exported
        torch.testing.assert_close(tensor, want, rtol=0, atol=0, msg=name)
    assert set(ours) <= set(theirs)


def test_without_meta_every_row_is_kept_and_no_tokenizer_written(tmp_path):
    random_gpt(vocab_size=70).save_pretrained(tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["README.md", "config.json", "model.safetensors"]
    assert transformers_model(tmp_path / "hf").config.vocab_size == 70
    assert "The tokenizer was not given" in (tmp_path / "hf" / "README.md").read_text()


@pytest.mark.parametrize("activation", list(GATED_ACTIVATIONS))
def test_gated_mlp_is_one_clear_error(tmp_path, activation):
    with pytest.raises(errors.UsageError, match=rf"activation='{activation}' is a gated MLP .*GPT-2 in transformers "
                                                r"does not have: only models with gelu, gelu_tanh, relu, relu2 export"):
        random_gpt(activation=activation).save_pretrained(tmp_path / "hf", meta=CHARS)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary folder


def test_replaces_an_earlier_export_never_another_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(errors.UsageError, match="mine exists and is not an earlier export .*choose another folder"):
        random_gpt().save_pretrained(tmp_path / "mine", meta=CHARS)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    random_gpt().save_pretrained(tmp_path / "empty", meta=CHARS)  # an empty folder is filled
    random_gpt(activation="relu").save_pretrained(tmp_path / "nested" / "hf", meta=CHARS)
    random_gpt(activation="gelu").save_pretrained(tmp_path / "nested" / "hf")  # replaces the export, whole
    assert transformers_model(tmp_path / "nested" / "hf").config.activation_function == "gelu"
    assert not (tmp_path / "nested" / "hf" / "char_vocab.json").exists()  # nothing left from the first one
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine", "nested"] and os.listdir(tmp_path / "nested") == ["hf"]
    with pytest.raises(errors.UsageError, match=r"tokenizer's vocabulary \(65 tokens\) does not fit the model's 60"):
        random_gpt(vocab_size=60).save_pretrained(tmp_path / "small", meta=CHARS)


def test_gpt2_tokenizer_files_encode_as_ours(tmp_path):
    meta = {"tokenizer": "gpt2", "vocab_size": 50257}
    random_gpt(vocab_size=50304).save_pretrained(tmp_path / "hf", meta=meta)  # GPT-2's vocabulary, padded to 50304
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (50257, 50256)
    encode, decode = data.get_tokenizer(meta)
    text = "Hello, world!  It's 2024.\n\n\tindented <|endoftext|> Ünïcödé 日本語 🙂 don't"
    for cls in (transformers.AutoTokenizer, transformers.GPT2TokenizerFast, transformers.GPT2Tokenizer):
        tok = cls.from_pretrained(str(tmp_path / "hf"))
        assert tok.encode(text) == encode(text), cls.__name__
        assert tok.decode(encode(text)) == decode(encode(text)) == text
        assert tok.eos_token_id == 50256 and tok.model_max_length == 16
    with torch.no_grad():
        assert transformers_model(tmp_path / "hf")(torch.tensor([encode("Hello")])).logits.shape == (1, 1, 50257)


def test_char_vocabulary_says_how_to_decode(tmp_path):
    random_gpt().save_pretrained(tmp_path / "hf", meta=CHARS)
    assert json.loads((tmp_path / "hf" / "char_vocab.json").read_text()) == {"chars": CHARS["chars"]}
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert "token id i is `chars[i]` of char_vocab.json" in readme and "65 tokens (the 63 padding rows" in readme
    assert hf_gpt2.tokenizer_meta(str(tmp_path / "hf"), 65) == CHARS  # what sample.py decodes an export with
    assert hf_gpt2.tokenizer_meta(str(tmp_path), 50257) == {"tokenizer": "gpt2", "vocab_size": 50257}


# -----------------------------------------------------------------------------------------------------------
# export.py


def write_run(out_dir, model, meta):
    """A checkpoint as train.py writes it (the keys export.py reads, and the rest)."""
    os.makedirs(out_dir)
    torch.save({"model": model.state_dict(), "optimizer": {}, "model_args": dataclasses.asdict(model.config),
                "config": {}, "meta": meta, "iter_num": 7, "best_val_loss": 1.5, "rng": []},
               os.path.join(out_dir, "ckpt.pt"))
    return str(out_dir)


def test_export_py_after_training(tmp_path, capsys):
    """train.py on a tiny character corpus, vocabulary padded to 128, then export.py: transformers' logits are ours."""
    import train  # here: the other tests need it not

    (tmp_path / "corpus.txt").write_text("ROMEO:\nwherefore art thou, Romeo?\n\nJULIET:\ngood night.\n" * 200)
    prepare_data.prepare(str(tmp_path / "tiny"), source=str(tmp_path / "corpus.txt"), tokenizer="char")
    out, to = str(tmp_path / "out"), str(tmp_path / "exported")
    train.main(["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--max_iters=3",
                "--eval_interval=3", "--eval_iters=1", "--vocab_size=128", "--dropout=0.1", "--bias=False",
                "--activation=relu", "--progress=False", "--plot=False", "--device=cpu", "--dtype=float32",
                "--mlp=eager", f"--dataset={tmp_path / 'tiny'}", f"--out_dir={out}"])
    capsys.readouterr()
    assert export.main([f"--out_dir={out}", f"--to={to}"]) == to
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {to}: README.md, char_vocab.json, config.json, model.safetensors\n"), printed
    model, ckpt = export.checkpoint.load_model(out)
    n = ckpt["meta"]["vocab_size"]
    assert f"vocabulary: {n} tokens, cut from the model's 128 padded rows; tokenizer: characters" in printed
    hf = transformers_model(to)
    assert (hf.config.activation_function, hf.config.resid_pdrop, hf.config.vocab_size) == ("relu", 0.1, n)
    idx = torch.randint(0, n, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(all_logits(model, idx)[..., :n], hf(idx).logits, rtol=1e-5, atol=1e-5)
    # sample.py reads the export back with its characters: the same greedy text as from the checkpoint
    import sample
    greedy = ["--start=ROMEO:", "--num_samples=1", "--max_new_tokens=20", "--top_k=1", "--device=cpu", "--mlp=eager"]
    assert sample.main([f"--init_from={to}", *greedy]) == sample.main([f"--out_dir={out}", *greedy])
    # without --to: beside the checkpoint, in the run's folder (which git ignores), never a new folder in the checkout
    capsys.readouterr()
    assert export.main([f"--out_dir={out}"]) == os.path.join(out, "hf")
    assert capsys.readouterr().out.startswith(f"wrote {os.path.join(out, 'hf')}: README.md, char_vocab.json, ")
    assert transformers_model(os.path.join(out, "hf")).config.vocab_size == n


def test_export_py_errors_are_one_line(tmp_path, capsys):
    run = write_run(tmp_path / "gated", random_gpt(activation="swiglu"), CHARS)
    argv = [f"--out_dir={run}", f"--to={tmp_path / 'hf'}"]
    assert errors.run_main("export.py", export.main, argv) == 2
    assert capsys.readouterr().err == ("export.py: error: activation='swiglu' is a gated MLP (c_fc makes a gate and an "
                                       "up projection), which GPT-2 in transformers does not have: only models with "
                                       "gelu, gelu_tanh, relu, relu2 export to its format\n")
    assert not (tmp_path / "hf").exists()
    # the script itself, from a shell: no checkpoint
    proc = subprocess.run([sys.executable, "export.py", f"--out_dir={tmp_path / 'none'}", f"--to={tmp_path / 'hf'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"export.py: error: no checkpoint at {tmp_path / 'none' / 'ckpt.pt'}; train one first, " \
                          f"e.g. python train.py configs/shakespeare_char_cpu.py --out_dir={tmp_path / 'none'}\n"
