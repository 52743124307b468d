# A baby GPT (0.8M parameters) that trains on 2 CPU cores in about 4 minutes and already writes recognisable
# Shakespeare: val loss ~1.72 (configs/shakespeare_char.py, on a GPU, goes further). Measured on 2-core machines:
# 4m05s (val loss 1.7231, a new user's), and faster ones 1m57s at 74-84 ms per iteration and 3m03s at a median 134 ms.
#   python train.py configs/shakespeare_char_cpu.py
#   python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:"

out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 10

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 16
block_size = 128  # 2,048 tokens per iteration

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0  # too few steps to overfit
bias = False
mlp = "auto"  # eager on CPU

learning_rate = 5e-3  # high for a short run; measured: 2e-3 -> 1.82, 3e-3 -> 1.73, 5e-3 -> 1.72 val loss
max_iters = 1300
lr_decay_iters = 1300
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 50

device = "cpu"
dtype = "float32"
compile = False
sample_after = True
