# nanoGPT's fine-tuning recipe: OpenAI's GPT-2 (124M) fine-tuned on Shakespeare, tokenized with GPT-2's BPE.
#   python train.py configs/finetune_shakespeare.py
#   python sample.py --out_dir=out-shakespeare-gpt2 --start="ROMEO:"
# init_from also takes gpt2-medium, gpt2-large, gpt2-xl (bigger: lower batch_size, raise
# gradient_accumulation_steps) or a folder with a Hugging Face GPT-2 checkpoint. The checkpoint fixes the
# architecture (layers, heads, width, biases, GELU); the "shakespeare" dataset (prepare.py makes it on first
# use) has GPT-2's 50257-token vocabulary, as the checkpoint needs.

out_dir = "out-shakespeare-gpt2"
init_from = "gpt2"
dataset = "shakespeare"

# A pretrained model learns the style within a few steps and then overfits: evaluate often and keep only
# the checkpoint with the best val loss.
eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False

# 32 sequences of 1024 tokens per iteration, through gradient accumulation (as nanoGPT's recipe).
batch_size = 8
gradient_accumulation_steps = 4
block_size = 1024  # GPT-2's whole context; a smaller value crops the position table

mlp = "auto"  # the fused MLP on a GPU: GPT-2 runs through our kernels
dropout = 0.0

# A small constant learning rate: the weights are already good, a large step would undo them.
learning_rate = 3e-5
decay_lr = False
max_iters = 20

sample_after = True
