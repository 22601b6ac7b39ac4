# A tiny run for the tests and for trying train.py out in seconds: byte tokens, 2 layers of width 32.
#   python prepare_data.py --tokenizer byte && python train.py configs/test.py
data_dir = "data/shakespeare_byte"
residual = "block_attnres"
n_layer = 2
n_head = 2
n_embd = 32
seq_len = 32
batch_size = 4
batch_tokens = 256  # 2 micro-steps on one process, 1 on each of two ranks
max_steps = 6
warmup_steps = 2
lr = 1e-2
min_lr = 1e-3
eval_interval = 3
eval_tokens = 1024
log_interval = 1
ckpt_interval = 3
