#!/usr/bin/env bash
# The README's results table: these commands on one GPU, at one commit, writing out-table/ (or $2; the table's
# files are in results/h100/).
#   bash lab/readme_table.sh [steps|kernels|learning|all] [OUT_DIR]
# steps: the GPT-2 124M and baby GPT steps (bench.py); kernels: the MLP alone (bench_mlp.py) and the classifier alone
# (bench_classifier.py, with Liger-Kernel and Cut Cross-Entropy where installed: pip install --no-deps their wheels);
# learning: 2000 GPT-2-shaped iterations with fused_ops.FusedAdamW and with PyTorch's AdamW (lab/fp8/train_compare.py,
# on data/shakespeare: python prepare.py --dataset=shakespeare). A lent machine runs a command for at most 10 minutes:
# each part fits in one.
# Each step variant runs in a process of its own (bench.py with one --mlps entry): building a reduce-overhead fused
# variant after another compiled model in the same process failed its CUDA-graph capture on the H200 (2026-12-01,
# see results/h200/README.md).
set -uo pipefail
part=${1:-all}
out=${2:-out-table}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } > "$out/machine_$part.txt"
if [ "$part" = steps ] || [ "$part" = all ]; then
  for v in eager@True fused@True fused+cls@reduce-overhead fp8blocks+cls8@reduce-overhead \
           fused+cls+portable@reduce-overhead; do
    timeout 80 python bench.py configs/gpt2_124m.py --rounds=2 --steps=20 --compile=reduce-overhead --mlps=$v \
      --out "$out/gpt2_${v//[@+]/_}" > "$out/gpt2_${v//[@+]/_}.txt" 2>&1; echo "gpt2 $v rc=$?"
  done
  for v in eager fused fused+portable; do
    timeout 45 python bench.py configs/shakespeare_char.py --rounds=2 --steps=50 --compile=reduce-overhead --mlps=$v \
      --out "$out/baby_${v//[@+]/_}" > "$out/baby_${v//[@+]/_}.txt" 2>&1; echo "baby $v rc=$?"
  done
fi
if [ "$part" = kernels ] || [ "$part" = all ]; then
  timeout 400 python bench_mlp.py --out "$out/mlp.json" > "$out/mlp.txt" 2>&1; echo "mlp rc=$?"
  timeout 100 python bench_classifier.py --shapes=12288x768x50304 --rounds=3 --out "$out/classifier.json" \
    > "$out/classifier.txt" 2>&1; echo "classifier rc=$?"
fi
if [ "$part" = learning ] || [ "$part" = all ]; then
  [ -f data/shakespeare/train.bin ] || python prepare.py --dataset=shakespeare > /dev/null
  timeout 250 python lab/fp8/train_compare.py --out "$out/train" --runs bf16,bf16_torch_adamw > "$out/train.txt" 2>&1
  echo "learning rc=$?"
fi
