# Pretrain GPT-2 small (124M) on 10B tokens of FineWeb-Edu (sample-10BT), on 8 GPUs: one pass over the data.
#
# 1. The data (once; streamed from the Hugging Face hub, so nothing but the .bin files lands on disk:
#    ~10B tokens * 2 bytes (uint16) = ~20 GB in data/fineweb_edu; needs `pip install datasets` and the network):
#      python prepare.py --source=hf:HuggingFaceFW/fineweb-edu --hf_config=sample-10BT --streaming \
#          --tokenizer=gpt2 --val_fraction=0.0005 --out_dir=data/fineweb_edu
#    Each document ends with <|endoftext|>; 0.05% of the documents (seeded draw) are val, as nanoGPT's
#    OpenWebText. It tokenizes on every core and prints MB/s at the end.
#    Time: tokenizing ran at 77.1 MB/s with --num_proc=16 on an H100 machine's 16 cores (6.1 MB/s with
#    --num_proc=1), measured on a 330 MB synthetic corpus (results/data_tokenize_h100.txt). sample-10BT is
#    ~10B tokens, about 45 GB of text at ~4.5 bytes a token (an estimate, not measured), so about 10 minutes
#    of tokenizing at that rate (about 2 hours on one core), plus the download from the hub, which is not
#    measured.
#    It cannot resume part-way: if it fails or is stopped (Ctrl-C, SIGTERM), a previous dataset in
#    data/fineweb_edu is left as it was, but the next run starts over from the first document.
# 2. Training:
#      torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py
#
# The recipe is the one of Karpathy's "Let's reproduce GPT-2 (124M)" (github.com/karpathy/build-nanogpt):
# 524,288 tokens a step, 19,073 steps (~1 epoch of 10B tokens), lr 6e-4 with 715 warmup steps and a
# cosine decay to 6e-5, AdamW betas (0.9, 0.95), weight decay 0.1, gradient clipping at 1.0. Its notebook
# (play.ipynb) compares runs with the OpenAI GPT-2 124M checkpoint: val loss 3.2924 on FineWeb-Edu and
# HellaSwag 0.2945. Our val split is another sample of the same data, so losses compare but are not identical.

out_dir = "out-gpt2-124m-fineweb"
eval_interval = 500
eval_iters = 50  # batches per process: 50 * 16 * 1024 * 8 GPUs = ~6.6M tokens, about the whole val split
log_interval = 10
always_save_checkpoint = True  # a checkpoint every eval: a long run can resume (--init_from=resume)

dataset = "fineweb_edu"  # data/fineweb_edu, written by the data command above
# 16 sequences * 1024 tokens * 32 micro-steps = 524,288 tokens per step; under torchrun the 32 micro-steps
# are divided between the processes (4 each on 8 GPUs).
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 32

n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304  # 50257 padded up to a multiple of 64: faster matmuls; the extra rows are never targets
dropout = 0.0
bias = False
mlp = "auto"  # the fused MLP on GPUs; --mlp=eager for plain PyTorch
activation = "gelu"

learning_rate = 6e-4
max_iters = 19073
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 715
lr_decay_iters = 19073
min_lr = 6e-5

device = "auto"
dtype = "auto"  # bfloat16 on H100/A100
compile = True
