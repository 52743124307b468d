#!/usr/bin/env bash
# Issue 47, fifth round (one H200): the classifiers' GPU tests, the FP8 form's profile, bench_classifier.py at GPT-2's
# shape, the GPT-2 step with memory (one round), and the baby GPT's 5000 iterations with the eager classifier (the
# fused one's run is results/classifier_train/baby_cls.txt).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pytest -q -p no:cacheprovider tests/test_classifier.py tests/test_fp8_classifier.py -m gpu --tb=line 2>&1 | tail -4
PYTHONPATH=. python3 lab/classifier/fp8_profile.py 2>&1 | grep -v -i warn
PYTHONPATH=/tmp/site python3 bench_classifier.py --shapes=12288x768x50304 --out=$OUT/classifier_h200.json 2>&1 \
  | grep -v -i -E "warn|online softmax|split the red|important use|softmax\.$|^$"
python3 bench.py configs/gpt2_124m.py --mlps=eager,fused+cls,fp8+cls,fp8+cls8 --compile=True --rounds=1 --steps=20 \
  --out=$OUT/bench_gpt2_124m_step 2>&1 | grep -v -i warn | tail -8
python3 train.py configs/shakespeare_char.py --classifier=eager --out_dir=/tmp/baby_eager --sample_after=False \
  > $OUT/baby_eager.txt 2>&1; grep -o "iter 5000: train loss [0-9.]*, val loss [0-9.]*" $OUT/baby_eager.txt
