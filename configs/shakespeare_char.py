# nanoGPT's "baby GPT" on character-level Shakespeare: about 10.7M parameters, a few minutes on one
# A100-class GPU, val loss about 1.47. On CPU use configs/shakespeare_char_cpu.py instead.
#   python train.py configs/shakespeare_char.py

out_dir = "out-shakespeare-char"
eval_interval = 250  # it overfits quickly on this small corpus, so keep an eye on val loss
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep only the best-val-loss checkpoint

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # 256 characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
bias = False

learning_rate = 1e-3  # a small model can take a high learning rate
max_iters = 5000
lr_decay_iters = 5000  # usually equal to max_iters
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # a bit larger than GPT-2's 0.95: few tokens per iteration
warmup_iters = 100

sample_after = True
# CUDA graphs: this small model is bound by kernel launches without them (H100: 2 min 2 s for the 5000
# iterations, against 2 min 58 s uncompiled). Under torchrun too (results/several_gpus_h100.txt).
compile = "reduce-overhead"
