# The DAR paper's comparison at the small dense scale (its 0.1B-0.5B models; size S here, 122M):
# DAR and its routing ablations against the standard residual, Block AttnRes and mHC-2, 3 seeds, 2B
# FineWeb-Edu tokens.
#   python -m experiments.sweep experiments/configs/sweep_dar.py --launcher "torchrun --standalone --nproc_per_node=8"
# Compute: ~1 GPU-hour a run at 40% MFU on H100 (DAR ~20% slower); 24 runs ~28 GPU-hours.
# The paper: DAR 2.03% to 5.12% lower val loss than the standard residual.
base = "configs/rd_s.py"
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "dar": "residual=dar dar_routing=cross",
    "dar_self_kv": "residual=dar dar_routing=self_kv",
    "dar_cross_v": "residual=dar dar_routing=cross_v",
    "dar_fixed_kv": "residual=dar dar_routing=fixed_kv",
    "dar_sep_v": "residual=dar dar_routing=sep_v",
    "mhc2": "residual=mhc hc_streams=2",
}
seeds = [0, 1, 2]
reference = "standard"
# the paper's headline, against the standard residual (experiments/report.py); the routings, Block AttnRes and
# mHC-2 against it are exploratory
primary = [("dar", "standard")]
out_dir = "runs/sweep_dar_s"
