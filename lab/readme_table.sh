#!/usr/bin/env bash
# The README's results table: one run of these commands on one GPU, at one commit, writing results/h200/ (or $1).
#   bash lab/readme_table.sh [OUT_DIR]
# Liger-Kernel and Cut Cross-Entropy are the classifier's peers where installed (pip install liger-kernel
# cut-cross-entropy). The MLP alone: python bench_mlp.py --out OUT_DIR/mlp.json (results/portable/ holds its run).
set -uo pipefail
out=${1:-results/h200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD 2>/dev/null; date -u +%F; } \
  > "$out/machine.txt"
# GPT-2 124M, train.py's step: eager + compile, and the fused settings under reduce-overhead, the portable one too
timeout 330 python bench.py configs/gpt2_124m.py --rounds=4 --steps=20 --compile=reduce-overhead \
  --mlps=eager@True,fused,fused+cls,fp8blocks+cls8,fused+cls+portable --out "$out/gpt2_step" > "$out/gpt2_step.txt" 2>&1
echo "gpt2 rc=$?"
# the baby GPT (configs/shakespeare_char.py's model and batch), CUDA graphs
timeout 150 python bench.py configs/shakespeare_char.py --rounds=4 --steps=50 --compile=reduce-overhead \
  --mlps=eager,fused,fused+cls,fused+portable --out "$out/baby_step" > "$out/baby_step.txt" 2>&1
echo "baby rc=$?"
# the classifier alone against Liger-Kernel and Cut Cross-Entropy
timeout 100 python bench_classifier.py --shapes=12288x768x50304 --rounds=3 --out "$out/classifier.json" \
  > "$out/classifier.txt" 2>&1
echo "classifier rc=$?"
