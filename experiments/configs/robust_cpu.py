# Does the advantage hold? (issue 26) The CPU design of tools/robust.py on configs/exp_cpu.py's recipe
# (lr 3e-3 -> 3e-4 cosine, 400 steps of 1,024 byte tokens), scored on the whole validation split (the default
# score; docs/results/robust_cpu holds the report, from runs at commit 41cdbfb, and the runs' records in runs.tar.gz):
#   python prepare_data.py --tokenizer byte        # once: data/shakespeare_byte
#   OMP_NUM_THREADS=1 python -m tools.robust configs/robust_cpu.py &    # two processes share the runs,
#   OMP_NUM_THREADS=1 python -m tools.robust configs/robust_cpu.py      # as two sweep processes do
#   python -m tools.robust configs/robust_cpu.py --table_only     # the report from the finished runs
# Runs: tune 5 variants x 3 lrs x 2 seeds (30 x 400 steps); compare 5 variants x 3 seeds at 400 and 1200
# steps plus standard at 600 and 800 (15 x 400, 3 x 600, 3 x 800, 15 x 1200); best: up to 5 x 3 x 400
# more. ~2.8 CPU-minutes a 400-step run: about 6-7 CPU-hours in all (3-4 hours as two processes).
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer
}
reference = "standard"
# the RD-AttnRes paper's comparison, in the report beside the reference's (report only: added before the
# whole-split rerun's results were read; it changes no run)
contrasts = [("rd_attnres", "block_attnres")]
lrs = [1.5e-3, 3e-3, 6e-3]  # min_lr = lr / 10 each (min_lr_ratio)
tuning_seeds = [100, 101]  # the lr is chosen here; never a comparison seed
seeds = [0, 1, 2]  # the comparison
steps = [400, 1200]  # every variant, each length its own warmup + cosine to its end
ladder = [400, 600, 800, 1200]  # standard's lengths for loss against FLOPs
fit = "loglinear"  # 4 points over 3x compute: see tools/robust.py fit_ladder
overrides = "ckpt_interval=200"
bench = "docs/results/bench_cpu_exp_size.json"  # tools.bench at this size: the wall-clock ratios
out_dir = "runs/robust_cpu"
