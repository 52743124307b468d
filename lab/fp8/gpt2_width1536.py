# bench.py's model for lab/fp8/blocks_widths.sh: GPT-2 small's depth and batch at width 1536 (heads of 128)
batch_size = 12
block_size = 1024
n_layer = 12
n_head = 12
n_embd = 1536
bias = False
