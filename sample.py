"""
Sample from a model trained with train.py:

    python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:" --num_samples=2
    python sample.py --out_dir=out --start=FILE:prompt.txt --top_k=1          # greedy
    python sample.py --init_from=gpt2 --start="The meaning of life is"          # OpenAI's GPT-2 (124M)
    python sample.py --init_from=path/to/folder   # a Hugging Face GPT-2 checkpoint (config.json + model.safetensors)

The tokenizer comes from the dataset metadata stored in the checkpoint, so the data folder is not needed;
GPT-2 checkpoints use GPT-2's BPE.
A checkpoint trained with any mlp setting loads into any other (--mlp); the parameters are the same.
"""

import sys

import torch

from helpers import checkpoint, data, errors, hf_gpt2, runtime
from model import GPT


def load_pretrained(init_from, device="cpu", mlp=None):
    """GPT-2 (a name or a Hugging Face checkpoint folder) in eval mode on device, and the metadata of its
    tokenizer: GPT-2's BPE, or the characters of a char-level model exported by export.py."""
    model = GPT.from_pretrained(init_from, mlp=mlp or "auto", dropout=0.0)
    return model.eval().to(device), hf_gpt2.tokenizer_meta(init_from, model.config.vocab_size)


def parse_args(argv):
    p = errors.ArgumentParser("sample.py", description=__doc__)
    p.add_argument("--init_from", default="resume", help="resume (out_dir/ckpt.pt), a GPT-2 name (gpt2, "
                   "gpt2-medium, gpt2-large, gpt2-xl: from the Hugging Face cache, downloaded when online) or a "
                   "folder with a Hugging Face GPT-2 checkpoint")
    p.add_argument("--out_dir", default="out", help="folder holding ckpt.pt (with --init_from=resume)")
    p.add_argument("--start", default=None, help="prompt text, or FILE:path to read it from a file (default: a "
                   "newline, or the first token of a vocabulary without one)")
    p.add_argument("--num_samples", type=int, default=3, help="samples to print")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="< 1 is more conservative, > 1 more random")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0 for all, 1 is greedy")
    p.add_argument("--seed", type=int, default=1337, help="of the sampling")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPUs that have it, else float32")
    p.add_argument("--mlp", default=None, choices=["eager", "fused", "auto"], help="override the checkpoint's MLP kind")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole context every step (slower)")
    return p.parse_args(argv)


def main(argv=None):
    """Print and return num_samples continuations of the prompt."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = runtime.resolve_device(args.device)  # one line naming --device if this machine has no such device
    runtime.check_mlp(args.mlp, device)  # one line naming --mlp if the kernels cannot run here
    device_type = device.split(":")[0]
    dtype, autocast = runtime.precision(args.dtype, device_type, auto_fp16=False)
    runtime.check_interpreter_dtype(args.mlp, device, dtype)

    if args.init_from == "resume":
        model, ckpt = checkpoint.load_model(args.out_dir, device, args.mlp)
        meta = ckpt["meta"]
    else:
        model, meta = load_pretrained(args.init_from, device, args.mlp)
    encode, decode = data.get_tokenizer(meta)
    start = args.start
    if start is not None and start.startswith("FILE:"):
        start = read_prompt(start[5:])
    try:
        ids = data.start_ids(meta, encode, start)
    except ValueError as e:  # characters a char vocabulary lacks (named in the message)
        raise errors.UsageError(f"--start: {e}") from None
    if not ids:
        raise errors.UsageError("the prompt is empty after encoding; give --start some text")
    x = torch.tensor([ids], dtype=torch.long, device=device)

    torch.manual_seed(args.seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(args.seed)
    samples = []
    with torch.no_grad(), autocast:
        for _ in range(args.num_samples):
            y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                               use_kv_cache=not args.no_kv_cache)
            # A padded vocabulary (50304 for GPT-2's 50257) has rows with no text; an undertrained model may pick them.
            samples.append(decode([i for i in y[0].tolist() if i < meta["vocab_size"]]))
            print(samples[-1])
            print("---------------")
    return samples


def read_prompt(path):
    """The text of --start=FILE:path; a file that is missing, unreadable or not UTF-8 is one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise errors.UsageError(f"--start=FILE:{path}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                                f"at offset {e.start}); save the prompt as UTF-8") from None
    except OSError as e:
        raise errors.UsageError(f"--start=FILE:{path}: cannot read {path} ({e.strerror})") from None


def cli():
    return errors.run_main("sample.py", main)


if __name__ == "__main__":
    sys.exit(cli())
