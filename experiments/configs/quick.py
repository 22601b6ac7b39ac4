# A quick paired experiment, about 5 minutes on 2 cores: Block AttnRes against the standard residual on 2 seeds,
# 100 steps of configs/exp_cpu.py, each run scored on the whole validation and test splits at its end.
#   python prepare_data.py --tokenizer byte        # once: data/shakespeare_byte
#   python -m experiments.sweep experiments/configs/quick.py
base = "configs/exp_cpu.py"
variants = {"standard": "residual=standard", "block_attnres": "residual=block_attnres"}
seeds = [0, 1]
reference = "standard"
primary = [("block_attnres", "standard")]  # the declared test: paired t, Holm (one test), TOST at the margin
equivalence_margin = 0.006
overrides = "max_steps=100 eval_interval=50 warmup_steps=10"
