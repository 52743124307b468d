"""
Prepare a dataset: tokenize a source (helpers/corpus.py reads it) into train.bin, val.bin and meta.json, the folder
train.py loads. The command line only: the work is helpers/prepare_data.py's (the sources: helpers/corpus.py).

    python prepare.py --dataset=shakespeare_char          # built-in, works offline
    python prepare.py --source=my_texts/ --tokenizer=gpt2 --out_dir=data/mine
    python prepare.py --source='shards/*.parquet' --text_column=text --tokenizer=gpt2 --out_dir=data/mine
    python prepare.py --source=hf:roneneldan/TinyStories --tokenizer=gpt2 --out_dir=data/tiny

A seeded fraction of the documents goes to val; with GPT-2 BPE each document ends with <|endoftext|>, as in
nanoGPT's OpenWebText preparation. A single text (one file, the built-in corpus) is split as it always was:
its last val_fraction is val. Documents stream through a pool of processes and their ids are appended to the
.bin files as they come, so memory stays bounded whatever the corpus size.

Ctrl-C (status 130) or SIGTERM (status 143) stops it cleanly: the temporary files go, a previous dataset in
--out_dir is left as it was, and the worker processes exit (on Linux they die with the main process even when
it is killed outright). A stopped or failed run cannot resume: the next one starts over.
"""
import contextlib
import os
import signal
import sys
import threading

from helpers import data, errors
from helpers import prepare_data

# -----------------------------------------------------------------------------
# the command

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
    p = errors.ArgumentParser("prepare.py", description=__doc__)
    p.add_argument("--dataset", choices=sorted(data.DATASETS), help="a known, offline dataset")
    p.add_argument("--source", help="a text file; a directory or glob of .txt (a file is a document) or of "
                                    ".jsonl/.json/.parquet/.csv files; or hf:<dataset name>")
    p.add_argument("--tokenizer", choices=("char", "gpt2"), default="char", help="of --source")
    p.add_argument("--out_dir", help="default: <data_root>/<dataset>")
    p.add_argument("--data_root", default="data", help="where --dataset is written")
    p.add_argument("--text_column", default="text", help="the text of .jsonl/.json/.parquet/.csv and hf: rows")
    p.add_argument("--hf_config", default=None, help="configuration (subset) of an hf: dataset")
    p.add_argument("--hf_split", default="train", help="split of an hf: dataset")
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
        kwargs = data.DATASETS[args.dataset]
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
            return prepare_data.prepare(out_dir, val_fraction=args.val_fraction, num_proc=args.num_proc,
                                        seed=args.seed, **kwargs)
    except Terminated:
        raise errors.Stopped(signal.SIGTERM, f"terminated before {out_dir} was complete: its temporary files "
                                             f"are removed and a previous dataset there is left as it was; run "
                                             f"the command again to prepare it (from the start: it cannot "
                                             f"resume)") from None
    except OSError as e:  # disk full, permissions...: the previous dataset in out_dir is left whole
        raise errors.RunError(f"preparing {out_dir} failed: {e}") from None

if __name__ == "__main__":
    sys.exit(errors.run_main("prepare.py", main))
