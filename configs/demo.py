# The CPU demo: a small Block AttnRes model on the embedded Shakespeare corpus, GPT-2 tokens.
# About 5 minutes on 2 CPU cores; it ends well below the unigram baseline printed at the start
# (measured: 312 s, val loss 5.04 against the baseline's 6.59 nats/token).
#   python prepare_data.py                 # once: data/shakespeare (GPT-2 BPE)
#   python train.py configs/demo.py
#   python sample.py --ckpt runs/demo      # text from the trained model
# Another variant: --residual=standard | full_attnres | block_attnres | rd_attnres, with a
# --run_name per variant; seed and data_seed are fixed, so the runs are paired (same initial
# weights, same batches) and their logs compare step by step.
#
# Sizes chosen by measuring on 2 cores: the 50k-token softmax and LM head cost most of each step,
# so the model is narrow with tied embeddings, and small batches (many steps) learn fastest here.

data_dir = "data/shakespeare"
residual = "block_attnres"  # blocks of attnres_block_size = 4 sublayers: 3 blocks over 6 layers

n_layer = 6
n_embd = 192
n_head = 6  # head dim 32
tie_embeddings = True
seq_len = 128

batch_size = 4
batch_tokens = 512  # one micro-step of 4 x 128 tokens
max_steps = 480  # ~250k tokens, a sixth of the training split

lr = 3e-3
min_lr = 3e-4
warmup_steps = 50
lr_schedule = "cosine"

log_interval = 20
eval_interval = 80
eval_tokens = 8192
ckpt_interval = 240
