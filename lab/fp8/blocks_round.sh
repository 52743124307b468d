#!/usr/bin/env bash
# Issue 47, every linear of the blocks in FP8 (fp8_reach="blocks"), on 2 H200s of one host (nvidia-h200-x2), in one
# command: GPU 0 runs bench.py alone (the step, six variants, rounds alternated); GPU 1 meanwhile runs the FP8
# linear's GPU tests, then the learning runs (GPT-2-shaped 2000 iterations against results/fp8_train's bf16, and the
# baby GPT, 5000 iterations). data/ carried (prepare.py's shakespeare and shakespeare_char).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/train
cp results/fp8_train/bf16.jsonl results/fp8_train/bf16.txt results/classifier_train/*.jsonl $OUT/train/
( export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 -m pytest -q -m gpu tests/test_fp8_linear.py > $OUT/gpu_tests.txt 2>&1
  timeout 170 python3 lab/fp8/train_compare.py --out $OUT/train --runs fp8blocks_cls8 > $OUT/train_compare.txt 2>&1
  timeout 150 python3 train.py configs/shakespeare_char.py --mlp=fused --fp8=True --fp8_reach=blocks --out_dir=/tmp/baby \
    --sample_after=False --progress=False > $OUT/baby_fp8blocks.txt 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench.py configs/gpt2_124m.py --mlps=eager,fp8+cls8,fp8blocks+cls8 \
  --compile=True,reduce-overhead --rounds=3 --steps=10 --out=$OUT/bench_blocks > $OUT/bench.txt 2>&1
wait
tail -3 $OUT/gpu_tests.txt; tail -16 $OUT/train_compare.txt; tail -2 $OUT/baby_fp8blocks.txt; tail -30 $OUT/bench.txt
