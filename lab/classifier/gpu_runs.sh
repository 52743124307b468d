#!/usr/bin/env bash
# Issue 47's first GPU runs (one H200): the classifier's GPU tests, then bench_classifier.py against compile,
# Liger-Kernel 0.8.5 and Cut Cross-Entropy 25.1.1 (wheels carried in .whl/, installed to /tmp/site).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pytest -q -p no:cacheprovider tests/test_classifier.py -m gpu 2>&1 | tail -15
python3 bench_classifier.py --out=${OUT:-/tmp}/classifier_h200.json 2>&1 | grep -v Warning
