# The CPU experiment of the README: an 8-layer byte-level model on the embedded Shakespeare corpus,
# deep enough (16 sublayers) for depth routing to matter, small enough for 85 paired runs on 2 cores.
#   python prepare_data.py --tokenizer byte        # once: data/shakespeare_byte
#   python -m experiments.sweep experiments/configs/sweep_cpu.py           # every variant and control x 5 seeds, then the table
data_dir = "data/shakespeare_byte"
residual = "standard"

n_layer = 8
n_embd = 128
n_head = 4  # head dim 32
seq_len = 128
attnres_block_size = 4  # 4 blocks of 2 layers
dar_block_size = 2  # transformer layers per history entry: the same 4-sublayer blocks

batch_size = 8
batch_tokens = 1024
max_steps = 400  # 410k tokens, 9% of the training split

lr = 3e-3
min_lr = 3e-4
warmup_steps = 30
lr_schedule = "cosine"

log_interval = 25
eval_interval = 100
eval_tokens = 65536  # a fixed 64k-token prefix of val: every run is scored on the same bytes
ckpt_interval = 0  # only at the end
