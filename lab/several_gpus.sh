#!/usr/bin/env bash
# Issue 41's measurements on one host of several GPUs (results/several_gpus_h100.txt). Run from the repository root
# with data/shakespeare_char prepared; writes to ${OUT:-/tmp/several_gpus}. Part 1: the GPT-2 124M benchmark on 1, 2
# and 4 GPUs and the baby GPT's benchmark on 1 and 2; part 2: one GPU's compile modes, the baby GPT's step and loss
# curves (500 steps) on 1 and 2 GPUs, bf16 and FP8, and the DDP overlap trace.
set -u
OUT=${OUT:-/tmp/several_gpus}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-1}
if [ "$part" = 1 ]; then
  timeout 280 python3 bench.py configs/shakespeare_char.py --gpus=1,2 --mlps=eager,fused,fp8 \
      --compile=False,reduce-overhead --rounds=2 --steps=30 --out="$OUT/char" 2>&1 | grep -v "it/s\]" | tail -30
  timeout 540 python3 bench.py configs/gpt2_124m.py --gpus=1,2,4 --mlps=eager,fused,fp8 --compile=reduce-overhead \
      --grad_accum=2 --rounds=2 --steps=6 --warmup=3 --out="$OUT/gpt2" 2>&1 | grep -v "it/s\]" | tail -30
else
  timeout 200 python3 bench.py configs/gpt2_124m.py --mlps=fused,fp8 --compile=False,True --rounds=2 --steps=8 \
      --out="$OUT/gpt2_modes" 2>&1 | grep -v "it/s\]" | tail -8
  run() {  # run NAME GPUS ARGS...: train.py on the baby GPT, 500 steps
    local name=$1 n=$2; shift 2
    timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node="$n" train.py configs/shakespeare_char.py \
        --max_iters=500 --lr_decay_iters=500 --eval_interval=100 --eval_iters=50 --log_interval=1 --progress=False \
        --sample_after=False --out_dir="/tmp/runs/$name" "$@" > "/tmp/runs/$name.log" 2>&1 || tail -5 "/tmp/runs/$name.log"
  }
  mkdir -p /tmp/runs
  run one_accum1 1 --gradient_accumulation_steps=1
  run two_accum2 2 --gradient_accumulation_steps=2
  run one_bf16 1 --gradient_accumulation_steps=2
  run one_bf16_seed7 1 --gradient_accumulation_steps=2 --seed=7
  run two_bf16 2 --gradient_accumulation_steps=2
  run one_fp8 1 --gradient_accumulation_steps=2 --mlp=fused --fp8=True
  run one_fp8_seed7 1 --gradient_accumulation_steps=2 --mlp=fused --fp8=True --seed=7
  run two_fp8 2 --gradient_accumulation_steps=2 --mlp=fused --fp8=True
  python3 lab/compare_runs.py /tmp/runs/one_accum1 /tmp/runs/two_accum2 /tmp/runs/one_bf16 /tmp/runs/one_bf16_seed7 \
      /tmp/runs/two_bf16 /tmp/runs/one_fp8 /tmp/runs/one_fp8_seed7 /tmp/runs/two_fp8 | tee "$OUT/loss_curves.txt"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 lab/ddp_overlap.py configs/gpt2_124m.py \
      --mlps=fused --compile=True --grad_accum=2 --steps=5 --warmup=3 --buckets=25,100 2>&1 | tail -6
fi
