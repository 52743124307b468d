# Issue 41's one-GPU question: is fp8 at least bf16 fused's speed in every compile mode? GPT-2 124M, 12x1024, each mode
# in its own process (mixing uncompiled and CUDA-graph variants in one process crashed on an H100), then
# lab/fp8/step_gaps.py for the compiled pair (host and GPU time per step), then the compiled pair's memory (variants one
# after another: each its own peak) with the operators' CUDA graphs (fused_ops/fp8/graphs.py) on and off. Writes to $OUT.
export PYTHONUNBUFFERED=1
for mode in True False reduce-overhead; do
  timeout 170 python3 bench.py configs/gpt2_124m.py --mlps=fused,fp8 --compile=$mode --rounds=4 --steps=10 > $OUT/bench_$mode.txt 2>&1
  grep -E "Error|error:" $OUT/bench_$mode.txt | head -3; grep -A3 "^variant" $OUT/bench_$mode.txt
done
timeout 150 python3 lab/fp8/step_gaps.py configs/gpt2_124m.py --variants=fused+compile,fp8+compile > $OUT/gaps.txt 2>&1
tail -3 $OUT/gaps.txt
for g in 1 0; do
  FUSED_OPS_GRAPHS=$g timeout 150 python3 bench.py configs/gpt2_124m.py --mlps=fused,fp8 --compile=True --steps=10 --out=/tmp/mem$g > $OUT/memory_graphs$g.txt 2>&1
  echo "FUSED_OPS_GRAPHS=$g"; grep -A2 "^variant" $OUT/memory_graphs$g.txt
done
