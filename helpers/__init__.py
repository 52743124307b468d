"""
What the scripts at the top (train.py, sample.py, prepare.py, export.py, bench.py) are built from. Each module,
and who uses it; imports point one way: scripts -> helpers -> model.py -> fused_ops/ (hf_gpt2 is handed the model's
classes; nothing here imports a script).

    config.py        train.py's settings: DEFAULTS, config files and --key=value, their checks   train.py
    runtime.py       device, precision (autocast), can the fused MLP / FP8 run here, to_host      train, sample, bench
    errors.py        one-line failures and exit statuses (UsageError, RunError, Stopped)          every script
    data.py          a prepared dataset: tokenizers, meta.json, token files, random batches       train, sample
    prepare_data.py  tokenizing a corpus into a dataset; ensure_dataset (prepare on first use)     prepare, train
    corpus.py        the text sources prepare_data reads (Shakespeare, files, folders, hf:)       prepare_data
    checkpoint.py    ckpt.pt: writing it atomically, reading it back, resuming, load_model        train, sample, export
    hf_gpt2.py       Hugging Face GPT-2 checkpoints in and out (GPT.from_pretrained / save_pretrained)  model, export
    runlog.py        out_dir/log.jsonl, loss.png, wandb                                           train.py
    stopping.py      how a run ends early: Ctrl-C/SIGTERM (save, say how to resume), NaN, OOM    train.py
    timing.py        RunTimer: where a run's time goes (start-up, steps, evals, checkpoints)      train.py
"""
