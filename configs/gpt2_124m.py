# GPT-2 small (124M) shapes, used for throughput measurements of the fused vs eager MLP:
#   python train.py configs/gpt2_124m.py --mlp=fused --max_iters=50
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
# The offline "shakespeare" dataset (GPT-2 BPE) is far too small to pretrain on (it overfits within a
# few hundred steps); the shapes, token counts and timings are what matter here.

out_dir = "out-gpt2-124m"
eval_interval = 1000
eval_iters = 200
log_interval = 10
always_save_checkpoint = False

dataset = "shakespeare"  # GPT-2 BPE tokens
# 12 sequences * 1024 tokens * 40 micro-steps = 491,520 tokens per iteration (nanoGPT's ~0.5M), whatever
# the number of GPUs: with torchrun the 40 micro-steps are divided between processes.
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304  # 50257 padded up to a multiple of 64: faster matmuls; the extra rows are never targets
dropout = 0.0
bias = False
mlp = "auto"
activation = "gelu"

learning_rate = 6e-4
max_iters = 5000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 200
lr_decay_iters = 5000
min_lr = 6e-5

device = "auto"
dtype = "auto"  # bfloat16 on H100/A100
compile = True  # torch.compile's default mode; the README's results table gives each setting's speed; --compile=False: eager
# with --fp8=True --classifier=fp8, --compile=reduce-overhead is faster: plain compile is host-bound there
# (results/step_idle_h200.txt)
