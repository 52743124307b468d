#!/usr/bin/env bash
# Issue 47, third round (one H200): the classifier's GPU tests, bench_classifier.py (GPU time alone) against compile,
# Liger-Kernel 0.8.5 and Cut Cross-Entropy 25.1.1 (wheels carried in .whl/), then the GPT-2 step, rounds alternated.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pytest -q -p no:cacheprovider tests/test_classifier.py -m gpu 2>&1 | tail -3
PYTHONPATH=/tmp/site python3 bench_classifier.py --out=$OUT/classifier_h200.json 2>&1 | grep -v -i warn
python3 bench.py configs/gpt2_124m.py --mlps=${MLPS:-eager,fused+cls,fp8,fp8+cls} --compile=True --rounds=4 --steps=10 \
  --out=$OUT/bench_gpt2_124m_step 2>&1 | grep -v -i warn | tail -12
