# The multi-stream family next to standard and Block AttnRes: 200 steps of configs/exp_cpu.py, one
# seed, every DAR routing, HC and mHC (about 10 minutes on 2 cores).
#   python -m experiments.sweep experiments/configs/sweep_multistream.py
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "dar_cross": "residual=dar dar_routing=cross",
    "dar_self_kv": "residual=dar dar_routing=self_kv",
    "dar_cross_v": "residual=dar dar_routing=cross_v",
    "dar_fixed_kv": "residual=dar dar_routing=fixed_kv",
    "dar_sep_v": "residual=dar dar_routing=sep_v",
    "hc": "residual=hc",
    "mhc": "residual=mhc",
}
seeds = [0]
reference = "standard"
overrides = "max_steps=200 warmup_steps=20 eval_interval=50 log_interval=50"
out_dir = "runs/sweep_multistream"
