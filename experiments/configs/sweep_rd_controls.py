# The RD-AttnRes paper's early-budget controls: same size S, 0.5B tokens (a full cosine schedule over
# 954 steps), 5 paired seeds: is it role separation (decoupled) or just a second route (average),
# a second parameter (tied is Block AttnRes), or a uniform value route (frozen_v)?
#   python -m experiments.sweep experiments/configs/sweep_rd_controls.py --launcher "torchrun --standalone --nproc_per_node=8"
# Compute: ~0.25 GPU-hour a run at 40% MFU on H100; 25 runs ~6 GPU-hours.
base = "configs/rd_s.py"
variants = {
    "block_attnres": "residual=block_attnres",
    "rd_decoupled": "residual=rd_attnres rd_mode=decoupled",
    "rd_tied": "residual=rd_attnres rd_mode=tied",
    "rd_average": "residual=rd_attnres rd_mode=average",
    "rd_frozen_v": "residual=rd_attnres rd_mode=frozen_v",
}
seeds = [0, 1, 2, 3, 4]
reference = "block_attnres"
overrides = "max_tokens=500000000 warmup_steps=100"
primary = [("rd_decoupled", "block_attnres")]  # the claim; average and frozen_v are exploratory
out_dir = "runs/sweep_rd_controls"
