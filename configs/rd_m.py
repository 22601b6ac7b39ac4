# RD-AttnRes, size M of the paper: 24 layers, width 832 (13 heads of 64), on FineWeb-Edu, 2B tokens.
#
# Data: as in configs/rd_s.py (one preparation serves both sizes):
#   python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT --streaming \
#       --val_fraction 0.001 --test_fraction 0.001 --num_proc 16
# Train:
#   torchrun --standalone --nproc_per_node=8 train.py configs/rd_m.py
# Paired baselines: --residual=standard or block_attnres (and a --run_name), as for S.
#
# Cost: 283M parameters (199M in the blocks, 42M each in the embedding and the untied head);
# model.flops_per_token() = 1693 MFLOP, so 2B tokens are 3.4e18 FLOP. Assuming 40% MFU on an H100
# SXM (989 TFLOP/s bf16 dense): ~234k tokens/s per GPU, ~2.4 GPU-hours, about 18 minutes on 8 GPUs
# (AttnRes variants somewhat slower: their depth attention is not in the FLOP count).

data_dir = "data/fineweb-edu-sample-10BT"

residual = "rd_attnres"  # rd_mode None = "decoupled"
attnres_block_size = 4  # two transformer layers per block: 12 blocks over 48 sublayers
n_layer = 24
n_embd = 832
n_head = 13  # head dim 64
seq_len = 1024

batch_tokens = 524288  # 2**19 tokens per step
batch_size = 16  # per GPU; 16 x 1024 x 8 GPUs = 131072, so 4 micro-steps per step
max_tokens = 2_000_000_000  # 3814 steps

# AdamW, warmup then cosine to 10%. The peak lr is S's 3e-3 scaled by about width_S / width_M
# (our choice, not the paper's); lr_schedule = "wsd" with decay_frac = 0.2 is the alternative.
lr = 2e-3
min_lr = 2e-4
lr_schedule = "cosine"
warmup_steps = 200
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 250
eval_tokens = 10_485_760
log_interval = 10
ckpt_interval = 500
compile = True
