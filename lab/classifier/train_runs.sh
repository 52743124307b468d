#!/usr/bin/env bash
# Issue 47's learning runs (one H200; data/shakespeare and data/shakespeare_char carried, made by prepare.py):
# GPT-2-small-shaped, 2000 iterations, against results/fp8_train's bf16 run (same seed and data): the fused
# classifier (cls) and bf16 with another seed (the noise); then the baby GPT, 5000 iterations, with the fused classifier.
# The FP8 classifier's runs: RUNS=cls8,fp8_cls8 BABY=0 (the earlier logs copied in, so that the table has them all).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/train && cp results/fp8_train/bf16.jsonl results/fp8_train/bf16.txt results/classifier_train/*.jsonl $OUT/train/
python3 lab/fp8/train_compare.py --out $OUT/train --runs ${RUNS:-cls,bf16_seed} 2>&1 | grep -v -i warn | tail -20
[ "${BABY:-1}" = 1 ] || exit 0
python3 train.py configs/shakespeare_char.py --classifier=fused --out_dir=/tmp/baby_cls --sample_after=False \
  > $OUT/baby_cls.txt 2>&1; tail -5 $OUT/baby_cls.txt
