#!/usr/bin/env bash
# Issue 47, fourth round (one H200): the classifiers' GPU tests (16-bit and FP8), bench_classifier.py with the FP8
# form, then the GPT-2 step with every classifier, rounds alternated.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pytest -q -p no:cacheprovider tests/test_classifier.py tests/test_fp8_classifier.py -m gpu 2>&1 | tail -4
PYTHONPATH=/tmp/site python3 bench_classifier.py --out=$OUT/classifier_h200.json 2>&1 | grep -v -i -E "warn|online softmax|split the red|important use|softmax\.$|^$"
python3 bench.py configs/gpt2_124m.py --mlps=${MLPS:-eager,fused+cls,fused+cls8,fp8+cls,fp8+cls8} --compile=True \
  --rounds=4 --steps=10 --out=$OUT/bench_gpt2_124m_step 2>&1 | grep -v -i warn | tail -9
