#!/usr/bin/env bash
# The README's results table: one run of these commands on one GPU, at one commit, writing results/h200/ (or $1).
#   bash lab/readme_table.sh [OUT_DIR]
# Each step variant runs in a process of its own (bench.py with one --mlps entry): building a reduce-overhead fused
# variant after another compiled model in the same process failed its CUDA-graph capture on the H200 (2026-12-01,
# see results/h200/README.md). The classifier alone: bench_classifier.py (Liger-Kernel and Cut Cross-Entropy where
# installed). The MLP alone: python bench_mlp.py (results/portable/ holds its run).
set -uo pipefail
out=${1:-results/h200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD 2>/dev/null; date -u +%F; } \
  > "$out/machine.txt"
for v in eager@True fused+cls@reduce-overhead fp8blocks+cls8@reduce-overhead fused+cls+portable@reduce-overhead; do
  timeout 75 python bench.py configs/gpt2_124m.py --rounds=2 --steps=20 --compile=reduce-overhead --mlps=$v \
    --out "$out/gpt2_${v//[@+]/_}" > "$out/gpt2_${v//[@+]/_}.txt" 2>&1; echo "gpt2 $v rc=$?"
done
for v in eager fused fused+portable; do
  timeout 40 python bench.py configs/shakespeare_char.py --rounds=2 --steps=50 --compile=reduce-overhead --mlps=$v \
    --out "$out/baby_${v//[@+]/_}" > "$out/baby_${v//[@+]/_}.txt" 2>&1; echo "baby $v rc=$?"
done
