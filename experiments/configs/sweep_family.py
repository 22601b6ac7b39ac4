# The family at a paper size: the standard residual, Block AttnRes, RD-AttnRes, DAR, DenseFormer,
# MUDDFormer and Delta AttnRes, size S (configs/rd_s.py: 16 layers, width 576, 122M parameters), 2B
# FineWeb-Edu tokens (prepare the data as configs/rd_s.py says), 3 paired seeds.
#   python -m experiments.sweep experiments/configs/sweep_family.py --launcher "torchrun --standalone --nproc_per_node=8"
#   python -m experiments.sweep experiments/configs/sweep_family.py --table_only --reference block_attnres
# Compute: model.flops_per_token() is 669 MFLOP for every variant but MUDDFormer (674: its 0.7M
# generator weights), so 2B tokens are 1.34e18 FLOP, ~0.94 GPU-hour a run at 40% MFU on an H100 SXM
# (989 TFLOP/s bf16 dense); 21 runs ~20 GPU-hours. The depth routing and the dense mixes are
# elementwise work outside that count: plan for ~25 (DAR ~20% slower, as in sweep_dar.py).
# Papers: DenseFormer 1.767 vs 1.766 for the baseline in the AttnRes paper's 436M ablation; MUDDFormer
# matches Transformers trained with ~1.8-2.4x compute; Delta AttnRes 36.83 vs 38.71 val PPL at 220M.
base = "configs/rd_s.py"
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres rd_mode=decoupled",
    "dar": "residual=dar",  # Block DAR, dar_block_size = 2 layers: the same 4-sublayer blocks as Block AttnRes
    "denseformer": "residual=denseformer",  # 1x1
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer, delta_block_size = 1
}
seeds = [0, 1, 2]
reference = "standard"
# the declared family (experiments/report.py): each paper's claim against the baseline it is proposed over, Holm
# within it, on the whole validation split; each variant against both references otherwise is exploratory
primary = [
    ("block_attnres", "standard"),
    ("rd_attnres", "block_attnres"),
    ("dar", "block_attnres"),
    ("denseformer", "standard"),
    ("muddformer", "standard"),
    ("delta_attnres", "standard"),
]
second_reference = "block_attnres"
out_dir = "runs/sweep_family_s"
