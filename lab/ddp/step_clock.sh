#!/usr/bin/env bash
# Does train.py's reported step time under torchrun equal the GPU's? On one host of 2 GPUs: the stop-agreement GPU
# test, then train.py's reported step time against the GPU's (lab/ddp/train_timing.py), GPT-2 124M at 12x1024,
# reduce-overhead, 2 micro-steps per process, on random GPT-2 tokens: 1 process, 2 processes with the fix, 2 processes
# with the stop agreement of before it. Output: results/ddp_step_time_h200x2.txt.
set -u
export PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_ddp_steps.py -k "stop_agreement" 2>&1 | tail -3
python3 - <<'PY'
import json, os, numpy as np
os.makedirs("/tmp/random_gpt2", exist_ok=True)
rng = np.random.default_rng(0)
for split, n in (("train", 20_000_000), ("val", 1_000_000)):
    rng.integers(0, 50257, n, dtype=np.uint16).tofile(f"/tmp/random_gpt2/{split}.bin")
json.dump({"tokenizer": "gpt2", "vocab_size": 50257, "dtype": "uint16"}, open("/tmp/random_gpt2/meta.json", "w"))
PY
args="configs/gpt2_124m.py --dataset=/tmp/random_gpt2 --compile=reduce-overhead --max_iters=60 --eval_iters=1
      --eval_interval=1000 --progress=False --plot=False --out_dir=/tmp/out_step_clock --always_save_checkpoint=False"
run() { timeout 170 torchrun --standalone --nproc_per_node=$1 lab/ddp/train_timing.py $2 $args \
          --gradient_accumulation_steps=$3 2>&1 | grep -E "RESULT|rror" ; }
run 1 "" 2
run 2 "" 4
run 2 --old_stop 4
