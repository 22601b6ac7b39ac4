# Does the advantage hold? (issue 26) The GPU design of experiments/robust.py on configs/rd_s.py's recipe: size S
# (16 layers, width 576, 122M parameters), FineWeb-Edu (prepare the data as configs/rd_s.py says), lr 3e-3
# -> 3e-4 cosine, 2B tokens (3,814 steps of 524,288 tokens). The CPU design's protocol, lengths as
# multiples of that budget: 1x and 3x for every variant, 1x/1.5x/2x/3x for standard's ladder.
#   python -m experiments.robust experiments/configs/robust_gpu.py --launcher "torchrun --standalone --nproc_per_node=8"
#   python -m experiments.robust experiments/configs/robust_gpu.py --table_only
# Cost from model.flops_per_token() (669.3 MFLOP for standard, Block AttnRes, RD-AttnRes and Delta
# AttnRes; 673.5 for MUDDFormer): a 1x run is 1.34e18 FLOP, ~0.94 GPU-hour at 40% MFU on an H100 SXM
# (989 TFLOP/s bf16 dense). tune 30 runs x 1x = 40e18; compare 15 x 1x + 15 x 3x + 3 x 1.5x + 3 x 2x =
# 94.5e18; best up to 15 x 1x = 20e18: 155e18 FLOP in all, ~109 GPU-hours (~14 hours on 8 GPUs); plan
# ~125 for the depth routing's elementwise work, which that count leaves out. Half the budget
# (TOKENS = 1_000_000_000) halves every number.
# Wall-clock ratios come only from a bench file at this size, e.g.
#   python -m tools.bench --device cuda --n_layer 16 --n_embd 576 --n_head 9 --seq_len 1024 --batch_size 8 \
#       --dtype bf16 --compile --variants standard,block_attnres,rd_attnres,muddformer,delta_attnres \
#       --out docs/results/bench_gpu_s.json
# then set bench = "docs/results/bench_gpu_s.json" below.
base = "configs/rd_s.py"
TOKENS = 2_000_000_000  # the recipe's budget (rd_s.py's max_tokens)
N = TOKENS // 524288  # 3814 steps: the recipe's length, the lr grid's
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",  # rd_mode None: decoupled
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer
}
reference = "standard"
contrasts = [("rd_attnres", "block_attnres")]  # the RD-AttnRes paper's comparison, in the report beside the reference's
lrs = [1.5e-3, 3e-3, 6e-3]  # around rd_s's 3e-3; min_lr = lr / 10 each
tuning_seeds = [100, 101]
seeds = [0, 1, 2]
steps = [N, 3 * N]  # 2B and 6B tokens
ladder = [N, 3 * N // 2, 2 * N, 3 * N]  # 2B, 3B, 4B, 6B tokens
fit = "loglinear"
overrides = f"max_tokens={TOKENS}"
bench = None
out_dir = "runs/robust_gpu"
