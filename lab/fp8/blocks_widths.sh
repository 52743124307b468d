#!/usr/bin/env bash
# Issue 47: where fp8_reach="blocks" pays. At GPT-2 small's width (768) the attention's FP8 GEMMs save about what
# their casts cost; the GEMMs' saving grows as C², the casts' traffic as C. One H200: the step (bench.py, rounds
# alternated) with the MLP and classifier in FP8, with and without the attention's projections, at widths 1536 and
# 2048 (12 layers, 12x1024 tokens: lab/fp8/gpt2_width*.py), reduce-overhead. Its first run found Inductor's race
# (helpers/inductor_fix.py, results/fp8_blocks/README.md); these are the runs with the fix.
set -u
for c in ${WIDTHS:-1536 2048}; do
  timeout 280 python3 bench.py lab/fp8/gpt2_width$c.py --mlps=fp8+cls8,fp8blocks+cls8 --compile=reduce-overhead \
    --rounds=4 --steps=10 --out=$OUT/bench_width$c > $OUT/bench_width$c.txt 2>&1
  tail -4 $OUT/bench_width$c.txt
done
