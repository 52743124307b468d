"""
What the scripts at the top (train.py, sample.py, prepare.py, export.py, bench.py) are built from: one line a
module, and who imports it. Imports point one way: scripts -> helpers -> model.py -> fused_ops/; nothing here
imports a script (tests/test_layout.py checks both).

    config.py        train.py's settings: DEFAULTS, config files and --key=value, their checks    train
    runtime.py       device, precision (autocast), whether the fused MLP / FP8 can run;           train, sample, bench
                     DDP + torch.compile (wrap_model), gradients under CUDA graphs; to_host
    inductor_fix.py  a barrier Inductor's row kernels lack (a race above width 1024), for compile  runtime.py
    errors.py        one-line failures and exit statuses (UsageError, RunError, Stopped)          every script
    data.py          a prepared dataset: DATASETS, tokenizers, meta.json, token files, batches    train, sample
    prepare_data.py  tokenizing a corpus into a dataset; ensure_dataset (prepare on first use)    prepare, train
    corpus.py        the text sources prepare_data.py reads (Shakespeare, files, folders, hf:)    prepare_data.py
    checkpoint.py    ckpt.pt: written atomically, read back, resumed; load_model                  train, sample, export
    hf_gpt2.py       GPT-2 checkpoints in Hugging Face's format, read and written (GPT's classes  model, sample, export
                     handed over: it never imports model.py)
    runlog.py        out_dir/log.jsonl, loss.png and wandb                                        train
    stopping.py      how a run ends early: Ctrl-C / SIGTERM (save, say how to resume), NaN, OOM   train
    timing.py        RunTimer: where a run's time goes (start-up, steps, evals, checkpoints)      train
    variants.py      a benchmark variant's name: MLP, classifier, kernel family, compile setting  bench, bench_mlp
"""
