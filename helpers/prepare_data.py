"""
Preparing a dataset: tokenize a source (helpers/corpus.py reads it) into train.bin, val.bin and meta.json, the
folder helpers/data.py loads. prepare.py is its command line; train.py prepares a known dataset (data.DATASETS)
on first use through ensure_dataset. Training a prepared dataset never runs this code.

A seeded fraction of the documents goes to val; with GPT-2 BPE each document ends with <|endoftext|>, as in
nanoGPT's OpenWebText preparation. A single text (one file, the built-in corpus) is split as it always was:
its last val_fraction is val. Documents stream through a pool of processes and their ids are appended to the
.bin files as they come, so memory stays bounded whatever the corpus size. A crash or a stop leaves a previous
dataset in out_dir whole (_replacing).
"""
import collections.abc
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time

import numpy as np
from tqdm import tqdm

from helpers import corpus, data, errors

# fork where there is one: workers start at once, with nothing sent to them that Ctrl-C could cut off
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"

# -----------------------------------------------------------------------------
# items: (split, text, ends_document), split 0 for train and 1 for val

def _text_items(pieces, split_at):
    """(split, text, True) items of a single text: the chars before split_at are train (0), the rest val (1)."""
    pos = 0
    for piece in pieces:
        if pos < split_at < pos + len(piece):
            yield 0, piece[:split_at - pos], True
            yield 1, piece[split_at - pos:], True
        else:
            yield int(pos >= split_at), piece, True
        pos += len(piece)

def _val_flags(count, val_fraction, seed):
    """Which documents are val, in order. With a known count exactly max(1, round(count * val_fraction))
    of them, drawn with the seed; in a stream of unknown length each one with probability val_fraction.
    Drawn here in the main process, so the split does not depend on --num_proc."""
    rng = np.random.default_rng(seed)
    if count is not None:
        is_val = np.zeros(count, dtype=bool)
        is_val[rng.choice(count, min(count - 1, max(1, round(count * val_fraction))), replace=False)] = True
        yield from is_val.tolist()
        return
    while True:
        yield from (rng.random(4096) < val_fraction).tolist()

def _document_items(docs, flags, separator, counts):
    """(split, text, ends_document) per piece of each non-empty document (a document is a str, or an
    iterator of pieces: see corpus.document_pieces); `separator` joins the documents of a split (char
    vocabulary: they are joined as one text, as they always were). The last document is held back: if no
    document went to one of the splits, it goes there, so any two documents can be split. Counts documents
    per split, and the empty ones."""
    def items(pieces, split):
        counts[split] += 1
        text = next(pieces)
        if counts[split] > 1:
            text = separator + text
        for following in pieces:  # one piece ahead: the last one ends the document
            yield split, text, False
            text = following
        yield split, text, True
    held = None
    for doc, is_val in zip(docs, flags):
        pieces = iter(corpus.document_pieces(doc))
        blank = ""  # leading blank pieces (at most one: only the last piece of a file can be blank)
        for piece in pieces:
            if piece and not piece.isspace():
                pieces = itertools.chain([blank + piece], pieces)
                break
            blank += piece
        else:
            counts["empty"] += 1
            continue
        if held:
            yield from items(*held)
        held = pieces, int(is_val)
    if held:
        pieces, split = held
        yield from items(pieces, 1 - split if counts[split] and not counts[1 - split] else split)

def _batches(items):
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= corpus.BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

# -----------------------------------------------------------------------------
# the tokenizing processes

_worker = {}  # what a tokenizing process needs: set once by _init_worker

def _die_with_parent():
    """Linux: have the kernel kill this process when its parent dies, even by SIGKILL, so that no worker
    is left running on its own. A no-op elsewhere (there the parent's shutdown is all there is). The kernel
    ties this to the parent's thread that started the worker: the pool starts them from the main thread."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no libc / no prctl: nothing more to do
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)

def _init_worker(vocab, dtype, eot, in_pool=True):
    if in_pool:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the main process, which stops the pool
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not main()'s handler (fork copies it): the pool's
        _die_with_parent()                              # own terminate() must end a worker
    _worker.update(vocab=vocab, dtype=dtype, eot=eot)

def _encode(text, ends_document=True):
    vocab, dtype = _worker["vocab"], _worker["dtype"]
    if isinstance(vocab, np.ndarray):  # char: vocab holds the sorted code points, so an id is a rank
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        return np.searchsorted(vocab, codes).astype(dtype)
    eot = _worker["eot"] if ends_document else []  # <|endoftext|> once, after a document's last piece
    return np.array(vocab.encode(text, allowed_special={"<|endoftext|>"}) + eot, dtype=dtype)

def _encode_batch(batch):
    """[(split, text, ends_document)] -> (train ids, val ids), number of documents ended, of chars, of
    UTF-8 bytes."""
    ids = ([], [])
    for split, text, ends in batch:
        ids[split].append(_encode(text, ends))
    ids = [np.concatenate(part) if part else np.empty(0, _worker["dtype"]) for part in ids]
    n_bytes = sum(len(item[1].encode("utf-8", "surrogatepass")) for item in batch)
    return ids, sum(item[2] for item in batch), sum(len(item[1]) for item in batch), n_bytes

def _chars_of(batch):
    return set().union(*(item[1] for item in batch))

def _ordered_map(fn, batches, num_proc, initargs):
    """fn over batches on num_proc processes, results in order (so the output never depends on num_proc).
    Not Pool.imap: it reads its whole input ahead into a queue. Here at most two batches per process are
    in flight, which keeps memory bounded however fast the source reads."""
    batches = iter(batches)
    head = list(itertools.islice(batches, 2))
    if num_proc == 1 or len(head) < 2:  # a single batch is not worth starting processes for
        _init_worker(*initargs, in_pool=False)
        yield from map(fn, itertools.chain(head, batches))
        return
    pool = concurrent.futures.ProcessPoolExecutor(num_proc, multiprocessing.get_context(START_METHOD),
                                                  _init_worker, initargs)
    try:
        pending = collections.deque()
        for batch in itertools.chain(head, batches):
            pending.append(pool.submit(fn, batch))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also after an error or Ctrl-C: queued batches are dropped, running ones end, workers exit
        pool.shutdown(wait=True, cancel_futures=True)

def _tokenize(items, paths, num_proc, initargs, bar):
    """Write the ids of (split, text) items to the train and val files -> ([train, val] tokens, UTF-8 bytes)."""
    tokens, n_bytes = [0, 0], 0
    with open(paths[0], "wb") as train, open(paths[1], "wb") as val:
        for ids, n_texts, n_chars, nb in _ordered_map(_encode_batch, _batches(items), num_proc, initargs):
            for split, f in enumerate((train, val)):
                ids[split].tofile(f)
                tokens[split] += len(ids[split])
            n_bytes += nb
            bar.update(n_chars if bar.unit == "char" else n_texts)
            bar.set_postfix_str(f"{sum(tokens):,} tokens", refresh=False)
        for f in (train, val):
            f.flush()
            os.fsync(f.fileno())  # on disk before it is renamed into place
    return tokens, n_bytes

def _cpu_count():
    """The CPUs this process may run on (its affinity mask, where the OS has one), not all of the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

# -----------------------------------------------------------------------------
# the steps of prepare()

def ensure_dataset(name_or_dir, data_root="data"):
    """Directory of a prepared dataset, preparing a known one (data.DATASETS) on first use."""
    target = os.path.join(data_root, name_or_dir)
    for d in (name_or_dir, target):
        if data.is_prepared(d):
            return d
    if name_or_dir in data.DATASETS:
        print(f"dataset {name_or_dir!r} not prepared yet, preparing it in {target}")
        prepare(target, **data.DATASETS[name_or_dir])
        return target
    raise FileNotFoundError(
        f"dataset {name_or_dir!r} not found: no train.bin/val.bin/meta.json in {name_or_dir!r} "
        f"or {target!r}, and it is not a known dataset ({', '.join(sorted(data.DATASETS))}). "
        f"Prepare custom data with: python prepare.py --source=PATH_OR_hf:NAME "
        f"--tokenizer=char|gpt2 --out_dir={target}")


def prepare(out_dir, source="shakespeare", tokenizer="char", text_column="text", val_fraction=0.1,
            hf_split="train", hf_config=None, streaming=False, num_proc=None, seed=2357):
    """Tokenize a source into out_dir/{train,val}.bin + meta.json; returns meta. num_proc=None: every CPU
    this process may use. A tokenizing process that dies (killed for memory) is a RunError."""
    num_proc = _check_arguments(tokenizer=tokenizer, val_fraction=val_fraction, num_proc=num_proc)
    kind, read, count = corpus.open_source(source, text_column, hf_config, hf_split, streaming)
    try:
        if kind == "text":
            split = _split_text(read, source=source, val_fraction=val_fraction, char=tokenizer == "char")
        else:
            split = _split_documents(read, count=count, val_fraction=val_fraction, seed=seed,
                                     char=tokenizer == "char", num_proc=num_proc)
        meta, vocab = _vocabulary(tokenizer, split.chars, source=source)
        eot = [vocab.eot_token] if tokenizer == "gpt2" and kind == "documents" else []
        tokens, n_bytes, seconds = _write(out_dir, split, meta, source=source, num_proc=num_proc,
                                          initargs=(vocab, meta["dtype"], eot))
    except concurrent.futures.BrokenExecutor:  # a worker process was killed, most likely for memory
        raise errors.RunError(f"preparing {out_dir} failed: a tokenizing process died (out of memory?); "
                              f"try a smaller --num_proc") from None
    what, counts = f"{n_bytes / 1e6:,.1f} MB", split.counts
    if kind == "documents":
        what += f" in {counts[0] + counts[1]:,} documents ({counts['empty']:,} empty ones skipped)"
    print(f"{source}: {what}, {tokenizer} vocab {meta['vocab_size']:,}, "
          f"train {tokens[0]:,} / val {tokens[1]:,} tokens -> {out_dir}")
    mb_per_s = n_bytes / 1e6 / max(seconds, 1e-9)
    print(f"tokenized at {mb_per_s:,.1f} MB/s ({seconds:.1f} s, --num_proc={num_proc})")
    return meta

def _check_arguments(tokenizer, val_fraction, num_proc):
    """-> num_proc (None: every CPU this process may use); a UsageError before any work for a bad one."""
    if tokenizer not in ("char", "gpt2"):
        raise errors.UsageError(f"--tokenizer={tokenizer}: expected 'char' or 'gpt2'")
    if not 0 < val_fraction < 1:
        raise errors.UsageError(f"--val_fraction={val_fraction}: must be between 0 and 1")
    if num_proc is None:
        num_proc = _cpu_count()
    if num_proc < 1:  # 0 is not "all cores": leave --num_proc out for that
        raise errors.UsageError(f"--num_proc={num_proc}: must be at least 1 (leave it out to use every CPU "
                                f"this process may run on: {_cpu_count()})")
    return num_proc

@dataclasses.dataclass
class _Split:
    """The items of a source, each in its split, and what the later steps need to know of them."""
    items: collections.abc.Iterator  # of (split, text, ends_document), read once
    total: int | None  # for the progress bar: chars of a single text, documents of a corpus (None: unknown)
    unit: str  # of total: "char" or "doc"
    chars: set  # the alphabet, collected only for a char vocabulary
    counts: collections.Counter  # documents per split, and the empty ones: filled as the items are read

def _split_text(read, source, val_fraction, char):
    """A single text: the last val_fraction of its chars is val."""
    n_chars, chars = 0, set()
    for piece in read():  # first pass: the length (for the split point) and the alphabet
        n_chars += len(piece)
        if char:
            chars.update(piece)
    split_at = int(n_chars * (1 - val_fraction))
    if split_at == 0 or split_at == n_chars:
        size = "empty" if not n_chars else f"too small ({n_chars} chars) to split into train and val"
        raise errors.UsageError(f"--source={source} is {size}")
    return _Split(_text_items(read(), split_at), n_chars, "char", chars, collections.Counter())

def _split_documents(read, count, val_fraction, seed, char, num_proc):
    """Documents: a seeded draw of them is val (_val_flags)."""
    chars, counts = set(), collections.Counter()
    if char:  # first pass: the alphabet, plus the newline that joins documents
        batches = _batches((0, piece, True) for doc in read() for piece in corpus.document_pieces(doc) if piece)
        chars = set().union("\n", *_ordered_map(_chars_of, batches, num_proc, (None, None, None)))
    separator = "\n\n" if char else ""  # GPT-2 BPE ends each with <|endoftext|> instead
    items = _document_items(read(), _val_flags(count, val_fraction, seed), separator, counts)
    return _Split(items, count, "doc", chars, counts)

def _vocabulary(tokenizer, chars, source):
    """-> (meta without the counts, what the workers encode with: the sorted code points of a char
    vocabulary, or GPT-2's tiktoken encoding)."""
    if tokenizer == "char":
        chars = sorted(chars)
        meta = {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}
        vocab = np.array([ord(c) for c in chars], dtype=np.uint32)
    else:
        vocab = data.gpt2_encoding()
        meta = {"tokenizer": "gpt2", "vocab_size": vocab.n_vocab}
    meta.update(dtype=np.dtype(data.token_dtype(meta["vocab_size"])).name, source=source)
    return meta, vocab

def _write(out_dir, split, meta, source, num_proc, initargs):
    """Tokenize the items into out_dir, completing meta with the counts; a previous dataset there is
    replaced only once all is written. -> ([train, val] tokens, UTF-8 bytes read, seconds)."""
    with _replacing(out_dir) as tmp:
        t0 = time.time()
        with tqdm(total=split.total, unit=split.unit, unit_scale=True, desc="tokenizing") as bar:
            tokens, n_bytes = _tokenize(split.items, (tmp["train.bin"], tmp["val.bin"]), num_proc, initargs, bar)
            bar.update(split.counts["empty"])  # skipped documents were read too
        seconds = time.time() - t0
        counts = split.counts
        if split.unit == "doc":
            if not counts[0] or not counts[1]:
                raise errors.UsageError(f"--source={source} has {counts[0] + counts[1]} non-empty document(s) "
                                        f"({counts['empty']} empty): at least 2 are needed, one for train "
                                        f"and one for val")
            meta.update(train_documents=counts[0], val_documents=counts[1])
        meta.update(train_tokens=tokens[0], val_tokens=tokens[1])
        with open(tmp["meta.json"], "w", encoding="utf-8") as f:
            json.dump(meta, f, ensure_ascii=False)
    return tokens, n_bytes, seconds

@contextlib.contextmanager
def _replacing(out_dir):
    """Temp paths for train.bin, val.bin and meta.json in out_dir, renamed into place when the block ends
    without an error, and removed otherwise: a crash while tokenizing leaves a previous dataset whole.
    Its meta.json goes first (the folder now reads as unprepared), the new files are renamed in, the new
    meta.json last: its presence marks a complete dataset, so old meta never sits beside new tokens."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise errors.UsageError(f"--out_dir={out_dir}: cannot create it ({e.strerror})") from None
    names = ("train.bin", "val.bin", "meta.json")
    tmp = {n: os.path.join(out_dir, f"{n}.tmp{os.getpid()}") for n in names}
    try:
        yield tmp
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, "meta.json"))
        for n in names:
            os.replace(tmp[n], os.path.join(out_dir, n))
    finally:
        for path in tmp.values():  # left over only after a failure
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
