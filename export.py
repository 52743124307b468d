"""
Export a model trained with train.py to Hugging Face's GPT-2 format, for transformers and the tools built on it:

    python export.py --out_dir=out-shakespeare-char-cpu          # writes out-shakespeare-char-cpu/hf
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('out-shakespeare-char-cpu/hf')"

The folder holds config.json, model.safetensors and the tokenizer: GPT-2's BPE files (vocab.json, merges.txt)
when the run used them, else char_vocab.json, which README.md there explains. The vocabulary is cut back to the
dataset's (training pads it, e.g. 50257 -> 50304; those rows are never a target). Gated MLPs (swiglu, ...) have
no GPT-2 equivalent and do not export. docs/export.md has the activation table.
"""

import dataclasses
import os
import sys

from helpers import checkpoint, errors, hf_gpt2


def parse_args(argv):
    p = errors.ArgumentParser("export.py", description=__doc__)
    p.add_argument("--out_dir", default="out", help="the run's folder, holding ckpt.pt")
    p.add_argument("--to", help="the folder to write; an earlier export there is replaced whole (default: "
                   "<out_dir>/hf, beside the checkpoint: no new folder in the checkout)")
    args = p.parse_args(argv)
    args.to = args.to or os.path.join(args.out_dir, "hf")
    return args


def main(argv=None):
    """Write the export and return its folder."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model, ckpt = checkpoint.load_model(args.out_dir, device="cpu", mlp="eager")  # same weights, no kernels needed
    # The run's dropout goes into config.json, for fine-tuning in transformers (this copy was built without it).
    model.config = dataclasses.replace(model.config, dropout=ckpt["model_args"]["dropout"])
    meta = ckpt["meta"]
    model.save_pretrained(args.to, meta=meta)
    cfg, kept = model.config, meta["vocab_size"]
    tokenizer = "GPT-2 BPE (vocab.json, merges.txt)" if meta["tokenizer"] == "gpt2" else "characters (char_vocab.json)"
    cut = f", cut from the model's {cfg.vocab_size} padded rows" if kept < cfg.vocab_size else ""
    print(f"wrote {args.to}: {', '.join(sorted(os.listdir(args.to)))}\n"
          f"GPT-2 with {cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.block_size} positions, "
          f"activation_function={hf_gpt2.ACTIVATIONS_OUT[cfg.activation]!r} (ours: {cfg.activation}), from iteration "
          f"{ckpt.get('iter_num', '?')}\nvocabulary: {kept} tokens{cut}; tokenizer: {tokenizer}")
    return args.to


def cli():
    return errors.run_main("export.py", main)


if __name__ == "__main__":
    sys.exit(cli())
