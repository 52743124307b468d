#!/usr/bin/env bash
# Issue 47, fp8_reach="blocks", second command on 2 H200s (after blocks_round.sh): the DDP step check on both GPUs
# (tests/test_ddp_steps.py, its new case the fastest setting: every linear in FP8, reduce-overhead, 2 micro-steps);
# then GPU 0 measures the step's memory (bench.py, one round: its memory columns) while GPU 1 profiles the two fastest
# variants' kernels (lab/profile_step.py) and runs the GPT-2-shaped learning run again for its log (the first run's
# log did not come back).
set -u
export PYTHONUNBUFFERED=1
timeout 290 python3 -m pytest -q -m gpu tests/test_ddp_steps.py -k two_gpus > $OUT/ddp_tests.txt 2>&1
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 lab/profile_step.py configs/gpt2_124m.py \
    --variants=fp8+cls8+reduce-overhead,fp8blocks+cls8+reduce-overhead > $OUT/profile.txt 2>&1
  mkdir -p /tmp/train && timeout 130 python3 lab/fp8/train_compare.py --out /tmp/train --runs fp8blocks_cls8 > /dev/null 2>&1
  cp /tmp/train/fp8blocks_cls8.jsonl $OUT/ ) &
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 bench.py configs/gpt2_124m.py --mlps=eager,fp8+cls8,fp8blocks+cls8 \
  --compile=True,reduce-overhead --rounds=1 --steps=10 --out=$OUT/bench_memory > $OUT/bench_memory.txt 2>&1
wait
tail -3 $OUT/ddp_tests.txt; tail -40 $OUT/profile.txt; tail -9 $OUT/bench_memory.txt
