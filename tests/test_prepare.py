"""Tests for prepare.py, helpers/prepare_data.py and the sources it reads (helpers/corpus.py): all offline, CPU only."""
import hashlib
import itertools
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import corpus as corpus_py
from helpers import data
from helpers import errors
import prepare
from helpers import prepare_data
from test_data import ROOT, SAMPLE, corpus, offline_gpt2  # noqa: F401 (corpus, offline_gpt2: fixtures)


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


def run_prepare_py(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


# --- the built-in corpus (helpers/corpus.py) ----------------------------------------------------

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
    assert corpus == corpus_py.shakespeare_text()  # deterministic


def test_play_to_text_drops_markup():
    md = ("# A Play\n\n## ACT I\n\n### SCENE I. A wood.\nwrapped heading\n\n"
          "_Enter ROMEO and\nJULIET_\n\n**ROMEO**  \nHello there,  \n_\\[Aside]_  \nfair one.\n\n"
          "_Exit_\n\nstill Romeo\n\nBISHOP\n\n**OF ELY**  \nAmen.\n\n**DROMIO**  \nOpen!\nOF EPHESUS\n\n"
          "**LUCE**  \nNo.\n\n### SCENE II. A street\n\nnear the gate.\n")
    assert corpus_py.play_to_text(md) == ("ROMEO:\nHello there,\nfair one.\nstill Romeo\n\nBISHOP OF ELY:\nAmen.\n\n"
                                     "DROMIO OF EPHESUS:\nOpen!\n\nLUCE:\nNo.\n\n")


# --- preparation ------------------------------------------------------------------------

def test_prepare_shakespeare_char(tmp_path, corpus):
    meta = prepare_data.prepare(str(tmp_path), **data.DATASETS["shakespeare_char"])
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


def test_prepare_local_file_gpt2(tmp_path, monkeypatch, offline_gpt2):
    src = tmp_path / "sample.txt"
    src.write_text(SAMPLE * 40, encoding="utf-8")
    monkeypatch.setattr(corpus_py, "CHUNK_CHARS", 1)  # cut at every allowed newline
    out = tmp_path / "out"
    meta = prepare_data.prepare(str(out), source=str(src), tokenizer="gpt2", val_fraction=0.25)
    assert offline_gpt2 == []  # the shipped files: no download tried
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
    meta = prepare_data.prepare(str(tmp_path), **data.DATASETS["shakespeare"])
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
    m1 = prepare_data.prepare(str(tmp_path / "d1"), source=str(tmp_path / "docs"))
    m2 = prepare_data.prepare(str(tmp_path / "d2"), source=str(tmp_path / "docs" / "*.txt"))
    assert m1["chars"] == m2["chars"] == list("\n ab")
    assert read_bins(str(tmp_path / "d1")) == read_bins(str(tmp_path / "d2"))
    # each file is a document: one of the two is val (at least one always is), the other train
    assert (m1["train_documents"], m1["val_documents"]) == (1, 1)
    _, decode = data.get_tokenizer(m1)
    train, val = read_bins(str(tmp_path / "d1"))
    assert sorted([decode(train), decode(val)]) == ["aaaa aaaa\n" * 20, "bbbb bbbb\n" * 20]
    with pytest.raises(errors.UsageError, match="nothing_here"):
        prepare_data.prepare(str(tmp_path / "d3"), source=str(tmp_path / "nothing_here"))


def test_prepare_validates_arguments(tmp_path, monkeypatch, capsys):
    src = tmp_path / "t.txt"
    src.write_text("hello world\n" * 10)
    with pytest.raises(errors.UsageError, match="--val_fraction=1.0"):
        prepare_data.prepare(str(tmp_path / "o"), source=str(src), val_fraction=1.0)
    with pytest.raises(errors.UsageError, match="--tokenizer=bytes"):
        prepare_data.prepare(str(tmp_path / "o"), source=str(src), tokenizer="bytes")
    with pytest.raises(errors.UsageError, match="--num_proc=-1"):
        prepare_data.prepare(str(tmp_path / "o"), source=str(src), num_proc=-1)
    # 0 is not "all cores": one line naming --num_proc, exit status 2, before any work
    argv = [f"--source={src}", f"--out_dir={tmp_path / 'o'}", "--num_proc=0"]
    assert errors.run_main("prepare.py", prepare.main, argv) == 2
    assert "prepare.py: error: --num_proc=0: must be at least 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
    # the default: the CPUs this process may run on, not all of the machine's
    if hasattr(os, "sched_getaffinity"):
        assert prepare_data._cpu_count() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(prepare_data, "_cpu_count", lambda: 1)
    prepare_data.prepare(str(tmp_path / "o"), source=str(src))
    assert "--num_proc=1)" in capsys.readouterr().out


def test_large_char_vocab_uses_uint32(tmp_path):
    text = "".join(chr(0x20000 + i) for i in range(70_000))  # 70k distinct chars
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    meta = prepare_data.prepare(str(tmp_path / "o"), source=str(tmp_path / "big.txt"))
    assert meta["vocab_size"] == 70_000 and meta["dtype"] == "uint32"
    train, val = read_bins(str(tmp_path / "o"))
    assert train + val == list(range(70_000))  # ids above 65535 survive


# --- Hugging Face source ----------------------------------------------------------------

def test_hf_failure_is_clear(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    def fail(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")
    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(errors.RunError, match=r"--source=hf:someone/stories could not be loaded \(offline\?.*reach the Hub"):
        prepare_data.prepare(str(tmp_path), source="hf:someone/stories")
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
        meta = prepare_data.prepare(out, source="hf:me/tiny", tokenizer="gpt2", text_column="story", hf_config="small",
                            hf_split="validation", streaming=streaming, val_fraction=0.25, num_proc=1)
        assert seen[-1] == ("me/tiny", "small", "validation", streaming)
        train, val = (split_docs(ids) for ids in read_bins(out))
        assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val))
        assert len(train) + len(val) == 40  # the empty and the None row are skipped
        texts = [enc.decode(d) for d in train + val]
        assert sorted(texts) == sorted(stories)
        assert [enc.decode(d) for d in train] == [s for s in stories if s in texts[:len(train)]]  # in order
        flags = list(itertools.islice(prepare_data._val_flags(None if streaming else 42, 0.25, 2357), 42))
        assert [s for s, f in zip(rows["story"], flags) if f and s] == texts[len(train):]
        if not streaming:
            assert sum(flags) == round(42 * 0.25)  # exactly, when the length is known up front
        splits[streaming] = texts[len(train):]
    assert 3 <= len(splits[True]) <= 20 and splits[True] != splits[False]  # a draw per streamed document
    # a char vocabulary reads the stream twice (alphabet, then ids); the same documents are val
    meta = prepare_data.prepare(str(tmp_path / "char"), source="hf:me/tiny", text_column="story", streaming=True,
                        val_fraction=0.25, num_proc=1)
    _, decode = data.get_tokenizer(meta)
    train, val = read_bins(str(tmp_path / "char"))
    assert decode(val) == "\n\n".join(splits[True])
    assert decode(train) == "\n\n".join(s for s in stories if s not in splits[True])
    # another seed draws other val documents; the same seed the same ones
    prepare_data.prepare(str(tmp_path / "seed"), source="hf:me/tiny", tokenizer="gpt2", text_column="story",
                 val_fraction=0.25, num_proc=1, seed=1)
    assert read_bins(str(tmp_path / "seed")) != read_bins(str(tmp_path / "streaming_False"))
    prepare_data.prepare(str(tmp_path / "again"), source="hf:me/tiny", tokenizer="gpt2", text_column="story",
                 val_fraction=0.25, num_proc=1, hf_config="small", hf_split="validation")
    assert sha256s(str(tmp_path / "again")) == sha256s(str(tmp_path / "streaming_False"))
    with pytest.raises(errors.UsageError, match="no column 'text'; its columns are 'story', 'id'"):
        prepare_data.prepare(str(tmp_path / "x"), source="hf:me/tiny")


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

    real_tokenize, real_replace = prepare_data._tokenize, os.replace
    for crash in ("val.bin", 0, 1, 2):  # after writing the temp .bin files, or at the n-th rename
        d = os.path.join("data", f"crash_{crash}")
        prepare_data.prepare(d, source=str(old_src))
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
            m.setattr(prepare_data, "_tokenize", write_then_crash)
            m.setattr(prepare_data.os, "replace", replace_then_crash)
            with pytest.raises((KeyboardInterrupt, OSError)):
                prepare_data.prepare(d, source=str(new_src))
        if crash == "val.bin":
            assert data.is_prepared(d) and consistent(d) == str(old_src)  # the old set, untouched
        elif data.is_prepared(d):
            assert consistent(d) == str(old_src)
        else:  # detected as incomplete: prepared again on the next use
            monkeypatch.setitem(data.DATASETS, f"crash_{crash}", dict(source=str(new_src), tokenizer="char"))
            assert prepare_data.ensure_dataset(f"crash_{crash}", data_root="data") == d
            assert consistent(d) == str(new_src)
        assert calls or crash == "val.bin"  # every crash point was reached


def test_cli(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("hello world\n" * 100)
    meta = prepare.main([f"--source={src}", "--tokenizer=char", f"--out_dir={tmp_path / 'o'}", "--val_fraction=0.2"])
    assert meta == data.load_meta(str(tmp_path / "o"))
    assert (meta["train_tokens"], meta["val_tokens"]) == (960, 240)
    with pytest.raises(SystemExit):
        prepare.main(["--tokenizer=char"])  # neither --dataset nor --source
    r = run_prepare_py(f"--source={src}", "--hf_config=x", "--streaming", f"--out_dir={tmp_path / 'p'}")
    assert r.returncode == 2 and "--hf_config, --streaming only apply to hf: sources" in r.stderr, r.stderr


# --- corpora of documents ---------------------------------------------------------------

def write_docs(folder, n, seed=0, words=30):
    """n small .txt documents of random words (and some non-ASCII), plus an empty and a blank file."""
    rng = np.random.default_rng(seed)
    vocab = ["the", "cat", "sat", "on", "mat", "naïve", "café", "中文", "😀", "It's", "42", "!", "\n", "  "]
    os.makedirs(folder, exist_ok=True)
    texts = []
    for i in range(n):
        text = " ".join(rng.choice(vocab, size=words)) + "\n"
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    (folder / "empty.txt").write_text("")
    (folder / "blank.txt").write_text(" \n\n ")
    return texts


@pytest.mark.parametrize("tokenizer,start_method", [("gpt2", None), ("char", None), ("gpt2", "spawn")])
def test_documents_same_files_whatever_num_proc(tmp_path, monkeypatch, offline_gpt2, tokenizer, start_method):
    """Documents in many small batches, tokenized by 1 or 2 processes: the same bytes. Each non-empty file
    is a document (GPT-2: ending with <|endoftext|>; char: documents of a split joined by a blank line),
    in sorted order; empty and blank files are skipped."""
    texts = write_docs(tmp_path / "docs", 60)
    monkeypatch.setattr(corpus_py, "BATCH_CHARS", 200)  # ~1-2 documents a batch: many batches in flight
    if start_method:  # spawn is what macOS and Windows get
        monkeypatch.setattr(prepare_data, "START_METHOD", start_method)
    outs = [str(tmp_path / f"out{n}") for n in (1, 2)]
    metas = [prepare_data.prepare(out, source=str(tmp_path / "docs"), tokenizer=tokenizer, num_proc=n)
             for out, n in zip(outs, (1, 2))]
    assert sha256s(outs[0]) == sha256s(outs[1])
    meta = metas[0]
    assert (meta["train_documents"], meta["val_documents"]) == (54, 6)  # round(60 * 0.1); blank ones skipped
    flags = list(itertools.islice(prepare_data._val_flags(62, 0.1, 2357), 62))  # 62 files, sorted: blank, doc000...
    names = sorted(["blank.txt", "empty.txt"] + [f"doc{i:03d}.txt" for i in range(60)])
    by_name = dict(zip([f"doc{i:03d}.txt" for i in range(60)], texts))
    want = ([by_name[n] for n, f in zip(names, flags) if n in by_name and not f],
            [by_name[n] for n, f in zip(names, flags) if n in by_name and f])
    train, val = read_bins(outs[0])
    _, decode = data.get_tokenizer(meta)
    if tokenizer == "gpt2":
        assert [decode(d) for d in split_docs(train)] == want[0]
        assert [decode(d) for d in split_docs(val)] == want[1]
    else:
        assert meta["chars"] == sorted(set("".join(texts)) | {"\n"})
        assert (decode(train), decode(val)) == ("\n\n".join(want[0]), "\n\n".join(want[1]))


def test_large_txt_documents_stream_in_pieces(tmp_path, monkeypatch, offline_gpt2):
    """A .txt file of a directory larger than a batch streams through in pieces (never read whole, never
    tokenized whole), and is still one document: its ids are those of the whole text, then one
    <|endoftext|>; a char vocabulary joins it to the others with a blank line, as a small file."""
    docs = tmp_path / "docs"
    docs.mkdir()
    big = "".join(f"line {i}:  naïve café 中文 😀 It's 42!\n" for i in range(150))
    texts = {"a.txt": "small one\n", "b.txt": big, "c.txt": big.replace("\n", "\r\n"), "d.txt": "small two"}
    for name, text in texts.items():
        (docs / name).write_text(text, encoding="utf-8", newline="")
    (docs / "e.txt").write_text(" \n" * 300)  # blank, and larger than a batch: skipped
    monkeypatch.setattr(corpus_py, "BATCH_CHARS", 256)
    read_whole, longest = [], [0]
    real_read_text, real_encode = corpus_py._read_text, prepare_data._encode
    monkeypatch.setattr(corpus_py, "_read_text", lambda path: read_whole.append(os.path.basename(path))
                        or real_read_text(path))
    def encode(text, ends_document=True):  # num_proc=1: runs in this process
        longest[0] = max(longest[0], len(text))
        return real_encode(text, ends_document)
    monkeypatch.setattr(prepare_data, "_encode", encode)
    enc = data.gpt2_encoding()
    meta = prepare_data.prepare(str(tmp_path / "gpt2"), source=str(docs), tokenizer="gpt2", val_fraction=0.25, num_proc=1)
    assert sorted(read_whole) == ["a.txt", "d.txt"] and longest[0] < 2 * 256
    assert (meta["train_documents"], meta["val_documents"]) == (3, 1)
    train, val = (split_docs(ids) for ids in read_bins(str(tmp_path / "gpt2")))
    in_val = {n: enc.encode(texts[n]) in val for n in sorted(texts)}
    assert train == [enc.encode(texts[n]) for n in sorted(texts) if not in_val[n]]  # in order, each whole
    assert val == [enc.encode(texts[n]) for n in sorted(texts) if in_val[n]]
    meta = prepare_data.prepare(str(tmp_path / "char"), source=str(docs), val_fraction=0.25, num_proc=1)
    _, decode = data.get_tokenizer(meta)  # the same seed: the same documents are val
    train, val = read_bins(str(tmp_path / "char"))
    assert [decode(ids) for ids in (train, val)] == [
        "\n\n".join(texts[n] for n in sorted(texts) if in_val[n] == split) for split in (0, 1)]
    assert meta["chars"] == sorted(set("".join(texts.values())) | {"\n", " "})


def test_val_flags():
    exact = list(prepare_data._val_flags(1000, 0.05, 7))
    assert len(exact) == 1000 and sum(exact) == 50 and exact == list(prepare_data._val_flags(1000, 0.05, 7))
    assert exact != list(prepare_data._val_flags(1000, 0.05, 8))
    assert sum(prepare_data._val_flags(3, 0.9, 7)) == 2  # never all of them: train keeps one
    stream = list(itertools.islice(prepare_data._val_flags(None, 0.05, 7), 20_000))
    assert 800 < sum(stream) < 1200 and stream == list(itertools.islice(prepare_data._val_flags(None, 0.05, 7), 20_000))


def test_ordered_map_bounds_read_ahead():
    """However fast the source, at most two batches per process are read ahead of the results."""
    read = []
    def batches():
        for i in range(1000):
            read.append(i)
            yield [(0, f"doc {i}")]
    results = prepare_data._ordered_map(prepare_data._chars_of, batches(), 2, (None, None, None))
    assert next(results) == set("doc 0")
    assert len(read) <= 4
    assert [sorted(r) for r in itertools.islice(results, 3)] == [sorted(set(f"doc {i}")) for i in (1, 2, 3)]
    assert len(read) <= 8
    results.close()  # stops the pool


def test_file_pieces(tmp_path, offline_gpt2):
    """A text file streams in pieces cut only at a newline after a non-space char, the UTF-8 decoder
    carrying chars split between reads; a bad byte is reported with its offset in the file."""
    text = ("naïve 中文 😀 line\n  \n\n\tword \nend" * 50)
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    for size in (1, 3, 7, 1000):
        pieces = list(corpus_py._file_pieces(str(path), size))
        assert "".join(pieces) == text
        assert all(p.startswith("\n") and not q[-1].isspace() for q, p in zip(pieces, pieces[1:]))
    assert len(list(corpus_py._file_pieces(str(path), 7))) > 40
    raw = text.encode("utf-8")
    crlf = tmp_path / "crlf.txt"  # Windows line endings: cut before the \r of a \r\n, not never
    crlf.write_bytes(raw.replace(b"\n", b"\r\n"))
    crlf_text = text.replace("\n", "\r\n")
    enc = data.gpt2_encoding()
    for size in (1, 7, 1000):
        pieces = list(corpus_py._file_pieces(str(crlf), size))
        assert "".join(pieces) == crlf_text and len(pieces) > (40 if size < 10 else 1)  # not one piece
        assert all(p.startswith("\r\n") and not q[-1].isspace() for q, p in zip(pieces, pieces[1:]))
        assert [t for p in pieces for t in enc.encode(p)] == enc.encode(crlf_text)  # the ids of the whole
    at = raw.index(b"word", 777)
    path.write_bytes(raw[:at] + b"\xff" + raw[at:])
    with pytest.raises(errors.UsageError, match=rf"t\.txt: not UTF-8 text \(byte 0xff at offset {at}\)"):
        list(corpus_py._file_pieces(str(path), 5))
    emoji = raw.index("😀".encode(), 700)
    path.write_bytes(raw[:emoji + 2])  # ends inside a 4-byte char
    with pytest.raises(errors.UsageError, match=rf"byte 0xf0 at offset {emoji}\)"):
        list(corpus_py._file_pieces(str(path), 5))


def test_data_files_through_datasets(tmp_path, offline_gpt2):
    """.jsonl, .csv and .parquet files give the same dataset from the same rows; a missing --text_column
    names the columns there are."""
    datasets = pytest.importorskip("datasets")
    rows = {"id": list(range(30)), "body": [f"Row {i}, a short document with a comma." for i in range(30)]}
    rows["body"][3] = ""  # skipped
    ds = datasets.Dataset.from_dict(rows)
    for i, part in enumerate((ds.select(range(15)), ds.select(range(15, 30)))):  # two files each
        part.to_json(str(tmp_path / f"rows{i}.jsonl"))
        part.to_csv(str(tmp_path / f"rows{i}.csv"), index=False)
        part.to_parquet(str(tmp_path / f"rows{i}.parquet"))
    results = []
    for ext in ("jsonl", "csv", "parquet"):
        out = str(tmp_path / f"out_{ext}")
        meta = prepare_data.prepare(out, source=str(tmp_path / f"rows*.{ext}"), tokenizer="gpt2", text_column="body",
                            val_fraction=0.2, num_proc=1)
        results.append(read_bins(out))  # meta.json differs: it names the source
        train, val = (split_docs(ids) for ids in read_bins(out))
        assert len(train) + len(val) == 29 and len(val) == meta["val_documents"] > 0
    assert results[0] == results[1] == results[2]
    with pytest.raises(errors.UsageError, match="no column 'text'; its columns are 'id', 'body'"):
        prepare_data.prepare(str(tmp_path / "x"), source=str(tmp_path / "rows*.parquet"), num_proc=1)
    with pytest.raises(errors.UsageError, match="mixes kinds of files"):
        prepare_data.prepare(str(tmp_path / "x"), source=str(tmp_path / "rows0.*"), num_proc=1)
    (tmp_path / "bad.jsonl").write_bytes(b'{"body": "ok"}\n{"body": "caf\xe9"}\n')  # latin-1
    with pytest.raises(errors.UsageError, match=r"bad\.jsonl: not UTF-8 text \(byte 0xe9 at offset 28\)"):
        prepare_data.prepare(str(tmp_path / "x"), source=str(tmp_path / "bad.jsonl"), text_column="body", num_proc=1)


# --- prepare.py as a command: expected failures are one line and an exit status ---------

@pytest.mark.parametrize("case", ["empty", "tiny", "binary", "no_dir", "hf_offline", "column", "one_doc"])
def test_cli_errors(tmp_path, case):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("x")
    (tmp_path / "bin.txt").write_bytes(b"abc\xad\x00\xff")
    (tmp_path / "rows.jsonl").write_text('{"body": "x y z"}\n{"body": "a b c"}\n')
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("just one document")
    (tmp_path / "one" / "b.txt").write_text("\n")
    args, status, message = {
        "empty": ("--source=empty.txt", 2, "prepare.py: error: --source=empty.txt is empty"),
        "tiny": ("--source=tiny.txt", 2, "prepare.py: error: --source=tiny.txt is too small (1 chars) to split into "
                                         "train and val"),
        "binary": ("--source=bin.txt", 2, "prepare.py: error: bin.txt: not UTF-8 text (byte 0xad at offset 3)"),
        "no_dir": ("--source=no/such/dir", 2, "prepare.py: error: --source=no/such/dir: no such file or directory"),
        "hf_offline": ("--source=hf:no/such", 1, "prepare.py: error: --source=hf:no/such could not be loaded "
                                                 "(offline?"),
        "column": ("--source=rows.jsonl", 2, "prepare.py: error: --source=rows.jsonl has no column 'text'; its "
                                            "columns are 'body' (pass --text_column=...)"),
        "one_doc": ("--source=one", 2, "prepare.py: error: --source=one has 1 non-empty document(s) (1 empty): at "
                                       "least 2 are needed, one for train and one for val"),
    }[case]
    # USE_TORCH=0: `datasets` would otherwise import torch (seconds), which reading text never needs
    r = run_prepare_py(args, "--out_dir=out", env={"HF_HUB_OFFLINE": "1", "USE_TORCH": "0"}, cwd=tmp_path)
    assert r.returncode == status, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_cli_failure_mid_run_keeps_previous_dataset(tmp_path):
    """A source that fails after some documents were tokenized (a file that is not UTF-8, read late), on
    two processes: the previous dataset in --out_dir is untouched and no temp file is left."""
    write_docs(tmp_path / "docs", 40)
    r = run_prepare_py("--source=docs", "--out_dir=out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"tokenized at [\d.]+ MB/s \([\d.]+ s, --num_proc=\d+\)", r.stdout), r.stdout
    assert re.search(r"tokenizing: 100%.* 42.0/42.0 .*doc/s, [\d,]+ tokens\]", r.stderr), r.stderr  # 40 + 2 empty
    before = sha256s(str(tmp_path / "out"))
    (tmp_path / "docs" / "zz_latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    r = run_prepare_py("--source=docs", "--out_dir=out", "--num_proc=2", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "prepare.py: error: docs/zz_latin1.txt: not UTF-8 text (byte 0xe9 at offset 3)" in r.stderr
    assert sha256s(str(tmp_path / "out")) == before
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]


@pytest.fixture(scope="module")
def big_docs(tmp_path_factory):
    """~10 MB of documents: seconds of GPT-2 work on any CPU, so a run is still going when a signal comes."""
    folder = tmp_path_factory.mktemp("big") / "docs"
    write_docs(folder, 2000, words=1000)
    return str(folder)


def default_sigint():
    """In the child, before exec: SIGINT's default action, as a terminal gives it. A test run started in the
    background of a non-interactive shell (nohup cmd &) inherits SIGINT ignored, and a Python started so never
    raises KeyboardInterrupt: the Ctrl-C test would then watch a run that cannot be interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_mid_run(tmp_path, big_docs):
    """A prepared dataset in tmp_path/out (its checksums returned), then prepare.py re-preparing it from big_docs
    on two processes, returned once its workers write tokens."""
    write_docs(tmp_path / "docs", 2)
    assert run_prepare_py("--source=docs", "--out_dir=out", cwd=tmp_path).returncode == 0
    before = sha256s(str(tmp_path / "out"))
    with open(tmp_path / "stderr.txt", "w") as stderr:  # a file, not a pipe: a worker left behind keeps
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "prepare.py"), f"--source={big_docs}",  # that open
                              "--out_dir=out", "--tokenizer=gpt2", "--num_proc=2"], cwd=tmp_path, stderr=stderr,
                             start_new_session=True, preexec_fn=default_sigint)
    deadline = time.time() + 60
    def tokens_written():  # a temp .bin has grown: workers are tokenizing
        sizes = [os.stat(e).st_size for e in os.scandir(tmp_path / "out") if ".tmp" in e.name]
        return any(sizes)
    while not tokens_written():
        assert p.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.01)
    return p, before


def children(pid):
    """Pids of the live processes whose parent is pid (Linux /proc)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(os.path.join(entry.path, "stat")).read()
            except OSError:  # gone meanwhile
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry.name))
    return found


def alive(pid):
    """Running (not gone, not a zombie waiting for a parent that does not reap it)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(prepare_data.START_METHOD != "fork", reason="spawned workers import prepare_data.py before "
                    "their initializer ignores SIGINT: a Ctrl-C that early kills them with a traceback")
def test_cli_ctrl_c_keeps_previous_dataset(tmp_path, big_docs):
    """Ctrl-C (SIGINT to the process group) while two processes tokenize: prepare.py stops with one line and
    status 130, the previous dataset is untouched, and no temp file is left."""
    p, before = start_mid_run(tmp_path, big_docs)
    os.killpg(p.pid, signal.SIGINT)  # as Ctrl-C in a terminal: to the workers too
    p.wait(timeout=60)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert p.returncode == 130 and stderr.rstrip().endswith("prepare.py: interrupted"), stderr
    assert "Traceback" not in stderr, stderr
    assert sha256s(str(tmp_path / "out")) == before
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the worker processes through Linux's /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_cli_killed_main_process_leaves_no_worker(tmp_path, big_docs, signum):
    """SIGTERM (as `kill`, systemd or a batch scheduler send) to prepare.py's main process only, while two
    processes tokenize: it stops as on Ctrl-C (status 143 = 128 + SIGTERM, one line), its workers exit, the
    previous dataset is untouched and no temp file is left. SIGKILL, which nothing can catch: the workers
    die with it (Linux), and the previous dataset is untouched (the temp files stay: nothing could remove them)."""
    p, before = start_mid_run(tmp_path, big_docs)
    workers = children(p.pid)
    assert len(workers) >= 2, workers
    os.kill(p.pid, signum)  # the main process only: nothing is sent to the workers
    try:
        p.wait(timeout=60)
        deadline = time.time() + 20
        while any(map(alive, workers)) and time.time() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if alive(w)], "workers left running after the main process ended"
    finally:  # never leave processes behind, even when the test fails
        for pid in [p.pid] * (p.poll() is None) + [w for w in workers if alive(w)]:
            os.kill(pid, signal.SIGKILL)
    stderr = (tmp_path / "stderr.txt").read_text()
    if signum == signal.SIGTERM:
        assert p.returncode == 143, stderr
        assert stderr.rstrip().splitlines()[-1].startswith("prepare.py: terminated before out was complete: its "
                                                           "temporary files are removed")
        assert "Traceback" not in stderr, stderr
        assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]
    else:
        assert p.returncode == -signal.SIGKILL
    assert sha256s(str(tmp_path / "out")) == before


def test_fineweb_config_data_command(monkeypatch):
    """The data command in configs/gpt2_124m_fineweb.py's header is valid for prepare.py and writes the dataset
    the config trains on; a step is 524,288 tokens and the run one pass over ~10B tokens."""
    path = os.path.join(ROOT, "configs", "gpt2_124m_fineweb.py")
    lines = [line.lstrip("# ").rstrip() for line in open(path) if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("python prepare.py"))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
    command = shlex.split(" ".join(line.rstrip("\\") for line in lines[start:end + 1]))
    seen = {}
    monkeypatch.setattr(prepare_data, "prepare", lambda out_dir, **kwargs: seen.update(out_dir=out_dir, **kwargs))
    prepare.main(command[2:])
    cfg = runpy.run_path(path)
    assert seen["out_dir"] == os.path.join(cfg.get("data_root", "data"), cfg["dataset"])
    assert (seen["source"], seen["hf_config"], seen["streaming"], seen["tokenizer"]) == (
        "hf:HuggingFaceFW/fineweb-edu", "sample-10BT", True, "gpt2")
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * cfg["gradient_accumulation_steps"]
    assert tokens_per_step == 524_288 and cfg["gradient_accumulation_steps"] % 8 == 0
    assert 9.9e9 < tokens_per_step * cfg["max_iters"] < 1.01e10


@pytest.mark.skipif(prepare_data.START_METHOD != "fork", reason="the workers get the monkeypatched _chars_of only by fork")
def test_a_killed_worker_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """A tokenizing process killed mid-run (as by the out-of-memory killer): one line naming --num_proc,
    and the previous dataset stays. Through prepare() too (train.py prepares known datasets through
    ensure_dataset): a RunError with the same message, not a traceback."""
    write_docs(tmp_path / "docs", 30)
    prepare.main([f"--source={tmp_path / 'docs'}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"])
    before = sha256s(str(tmp_path / "out"))
    monkeypatch.setattr(corpus_py, "BATCH_CHARS", 200)
    monkeypatch.setattr(prepare_data, "_chars_of", _killed)
    argv = [f"--source={tmp_path / 'docs'}", f"--out_dir={tmp_path / 'out'}", "--num_proc=2"]
    status = errors.run_main("prepare.py", prepare.main, argv)
    err = capsys.readouterr().err
    assert status == 1 and "prepare.py: error: preparing" in err
    assert "died (out of memory?); try a smaller --num_proc" in err
    assert sha256s(str(tmp_path / "out")) == before
    monkeypatch.setitem(data.DATASETS, "killed", dict(source=str(tmp_path / "docs"), tokenizer="char", num_proc=2))
    with pytest.raises(errors.RunError, match=r"preparing .*killed failed: a tokenizing process died \(out of "
                                              r"memory\?\); try a smaller --num_proc"):
        prepare_data.ensure_dataset("killed", data_root=str(tmp_path))
    assert not os.path.exists(tmp_path / "killed")  # killed in the first pass (the alphabet): nothing written


def _killed(batch):  # runs in a worker process
    os.kill(os.getpid(), signal.SIGKILL)


def test_data_files_without_datasets_say_what_to_install(tmp_path, monkeypatch):
    """Only data files and hf: need `datasets`: without it they say what to install, and .txt works."""
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    write_docs(tmp_path / "docs", 10)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: importing it fails
    with pytest.raises(errors.UsageError, match=r"rows\.jsonl is read through the `datasets` package, which is "
                                                r"not installed: pip install datasets"):
        prepare_data.prepare(str(tmp_path / "o"), source=str(tmp_path / "rows.jsonl"))
    meta = prepare_data.prepare(str(tmp_path / "o"), source=str(tmp_path / "docs"), num_proc=1)
    assert meta["train_documents"] + meta["val_documents"] == 10
