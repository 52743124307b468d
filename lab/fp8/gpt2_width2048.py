# bench.py's model for lab/fp8/blocks_widths.sh: GPT-2 small's depth and batch at width 2048 (heads of 128)
batch_size = 12
block_size = 1024
n_layer = 12
n_head = 16
n_embd = 2048
bias = False
