#!/usr/bin/env bash
# Issue 41's measurements on one host of several GPUs (results/several_gpus_h100.txt). Run from the repository root
# with data/shakespeare_char prepared; writes to ${OUT:-/tmp/several_gpus}. Part 1: the baby GPT's benchmark on 1 and
# 2 GPUs; part 2: GPT-2 124M's on 1, 2 and 4; part 3: the baby GPT's loss curves (500 steps) on 1 and 2 GPUs, bf16
# and FP8, GPT-2 on 4 GPUs with 100 MB buckets, and the DDP overlap trace; part 4: 100 MB buckets for eager and fused;
# part 5: everything at 100 MB buckets on one machine, and the 4-GPU fp8 rate at 16x1024 per micro-step (the moonshot).
# part 6: the moonshot's batch under plain compile (the FP8 operators' own graphs) on 1 and 4 GPUs, and reduce-overhead.
# Each part fits one 10-minute call.
set -u
OUT=${OUT:-/tmp/several_gpus}; mkdir -p "$OUT" /tmp/sg /tmp/runs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-1}
show() {  # the log's errors and its last table
  grep -E "Error|error:" "$1" | grep -v "^\[rank" | head -5; grep -A12 "tokens/s per GPU\|ms/step" "$1" | tail -14
}
if [ "$part" = 1 ]; then
  for mode in reduce-overhead False; do
    timeout 280 python3 bench.py configs/shakespeare_char.py --gpus=1,2 --mlps=eager,fused,fp8 --compile=$mode \
        --rounds=2 --steps=30 --out="/tmp/sg/char_$mode" > "$OUT/char_$mode.log" 2>&1; show "$OUT/char_$mode.log"
    cp /tmp/sg/char_$mode.json "$OUT/"
  done
elif [ "$part" = 2 ]; then
  timeout 580 python3 bench.py configs/gpt2_124m.py --gpus=1,2,4 --mlps=eager,fused,fp8 --compile=reduce-overhead \
      --grad_accum=2 --rounds=2 --steps=6 --warmup=3 --out=/tmp/sg/gpt2 > "$OUT/gpt2.log" 2>&1; show "$OUT/gpt2.log"
  cp /tmp/sg/gpt2.json "$OUT/"
elif [ "$part" = 3 ]; then
  run() {  # run NAME GPUS ARGS...: train.py on the baby GPT, 500 steps of 2 micro-steps (over all GPUs)
    local name=$1 n=$2; shift 2
    timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node="$n" train.py configs/shakespeare_char.py \
        --max_iters=500 --lr_decay_iters=500 --eval_interval=100 --eval_iters=50 --log_interval=1 --progress=False \
        --sample_after=False --gradient_accumulation_steps=2 --out_dir="/tmp/runs/$name" "$@" > "/tmp/runs/$name.log" 2>&1 \
        || tail -5 "/tmp/runs/$name.log"
  }
  run one_bf16 1
  run one_bf16_seed7 1 --seed=7
  run two_bf16 2
  run one_fp8 1 --mlp=fused --fp8=True
  run two_fp8 2 --mlp=fused --fp8=True
  python3 lab/compare_runs.py /tmp/runs/one_bf16 /tmp/runs/one_bf16_seed7 /tmp/runs/two_bf16 /tmp/runs/one_fp8 \
      /tmp/runs/two_fp8 | tee "$OUT/loss_curves.txt"
  timeout 150 python3 bench.py configs/gpt2_124m.py --gpus=4 --mlps=fp8 --compile=reduce-overhead --grad_accum=2 \
      --rounds=2 --steps=6 --warmup=3 --bucket_mb=100 --out=/tmp/sg/gpt2_b100 > "$OUT/gpt2_b100.log" 2>&1
  show "$OUT/gpt2_b100.log"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 lab/ddp_overlap.py configs/gpt2_124m.py \
      --mlps=fused --compile=True --grad_accum=2 --steps=5 --warmup=3 --buckets=25,100 > "$OUT/overlap.log" 2>&1
  tail -6 "$OUT/overlap.log"
elif [ "$part" = 4 ]; then  # after the runs above: 100 MB buckets for eager and fused, the baby GPT's step in train.py
  timeout 210 python3 bench.py configs/gpt2_124m.py --gpus=2,4 --mlps=eager,fused --compile=reduce-overhead \
      --grad_accum=2 --rounds=2 --steps=6 --warmup=3 --out=/tmp/sg/gpt2_b100_bf16 > "$OUT/gpt2_b100_bf16.log" 2>&1
  show "$OUT/gpt2_b100_bf16.log"
  for n in 1 2; do
    timeout 40 python3 -m torch.distributed.run --standalone --nproc_per_node=$n train.py configs/shakespeare_char.py \
        --max_iters=300 --eval_interval=1000 --log_interval=1 --progress=False --sample_after=False \
        --gradient_accumulation_steps=$n --out_dir=/tmp/runs/char_$n > /tmp/runs/char_$n.log 2>&1 || tail -3 /tmp/runs/char_$n.log
  done
  python3 lab/compare_runs.py /tmp/runs/char_1 /tmp/runs/char_2 | tail -3
elif [ "$part" = 5 ]; then  # the second session, one machine: 100 MB buckets everywhere, then the moonshot's batch
  timeout 170 python3 bench.py configs/shakespeare_char.py --gpus=1,2 --mlps=eager,fused,fp8 --compile=reduce-overhead \
      --rounds=2 --steps=30 --out=/tmp/sg/char_b100 > "$OUT/char_b100.log" 2>&1; show "$OUT/char_b100.log"
  timeout 330 python3 bench.py configs/gpt2_124m.py --gpus=1,2,4 --mlps=eager,fused,fp8 --compile=reduce-overhead \
      --grad_accum=2 --rounds=2 --steps=5 --warmup=3 --out=/tmp/sg/gpt2_b100_all > "$OUT/gpt2_b100_all.log" 2>&1
  show "$OUT/gpt2_b100_all.log"
  timeout 80 python3 bench.py configs/gpt2_124m.py --gpus=4 --mlps=fp8 --compile=reduce-overhead --batch_size=16 \
      --grad_accum=2 --rounds=2 --steps=5 --warmup=3 --out=/tmp/sg/gpt2_moonshot > "$OUT/gpt2_moonshot.log" 2>&1
  show "$OUT/gpt2_moonshot.log"
elif [ "$part" = 6 ]; then  # the third session: plain compile, where the FP8 operators replay graphs of their own
  timeout 300 python3 bench.py configs/gpt2_124m.py --gpus=1,4 --mlps=fused,fp8 --compile=True --batch_size=16 \
      --grad_accum=2 --rounds=2 --steps=5 --warmup=3 --out=/tmp/sg/gpt2_plain16 > "$OUT/gpt2_plain16.log" 2>&1
  show "$OUT/gpt2_plain16.log"
  timeout 150 python3 bench.py configs/gpt2_124m.py --gpus=4 --mlps=fp8 --compile=reduce-overhead --batch_size=16 \
      --grad_accum=2 --rounds=2 --steps=5 --warmup=3 --out=/tmp/sg/gpt2_ro16 > "$OUT/gpt2_ro16.log" 2>&1
  show "$OUT/gpt2_ro16.log"
fi
