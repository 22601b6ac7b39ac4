# RD-AttnRes, size S of the paper: 16 layers, width 576 (9 heads of 64), on FineWeb-Edu, 2B tokens.
#
# Data (GPT-2 BPE, ~10B tokens, 0.1% of the documents each for val and test):
#   python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT --streaming \
#       --val_fraction 0.001 --test_fraction 0.001 --num_proc 16
# Train (one node of 8 GPUs; one GPU works too, with 8x the gradient accumulation):
#   torchrun --standalone --nproc_per_node=8 train.py configs/rd_s.py
# Paired baselines: add --residual=standard (or block_attnres, or --rd_mode=tied|average|frozen_v)
# and a --run_name; seed and data_seed stay fixed, so every run starts from the same shared weights
# and sees the same batches.
#
# Cost: 122M parameters (64M in the blocks, 29M each in the embedding and the untied head);
# model.flops_per_token() = 669 MFLOP (6N + attention), so 2B tokens are 1.3e18 FLOP. Assuming 40%
# MFU on an H100 SXM (989 TFLOP/s bf16 dense), that is ~590k tokens/s per GPU: ~1 GPU-hour, about
# 8 minutes on 8 GPUs. The depth attention is elementwise work outside that FLOP count, so expect
# AttnRes variants to reach a lower MFU than `standard`; the MFU in the log tells.

data_dir = "data/fineweb-edu-sample-10BT"

residual = "rd_attnres"  # rd_mode None = "decoupled"
attnres_block_size = 4  # sublayers per block: two transformer layers, 8 blocks over 32 sublayers
n_layer = 16
n_embd = 576
n_head = 9  # head dim 64
seq_len = 1024  # block_size follows

batch_tokens = 524288  # 2**19 tokens per step (~0.5M)
batch_size = 32  # per GPU; 32 x 1024 x 8 GPUs = 262144, so 2 micro-steps per step
max_tokens = 2_000_000_000  # max_steps = 0: 2e9 // 524288 = 3814 steps

# AdamW, warmup then cosine to 10% (our choice; lr_schedule = "wsd" with decay_frac = 0.2 is the
# alternative, and its constant phase lets a longer run branch off a checkpoint).
lr = 3e-3
min_lr = 3e-4
lr_schedule = "cosine"
warmup_steps = 200  # ~100M tokens
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 250
eval_tokens = 10_485_760  # 20 batches' worth of val tokens per evaluation
log_interval = 10
ckpt_interval = 500
compile = True
