# The README's CPU experiment: every variant x 5 paired seeds on configs/exp_cpu.py, plus a
# parameter-matched standard control for each variant with more than 1% extra parameters.
#   python prepare_data.py --tokenizer byte && python -m experiments.sweep experiments/configs/sweep_cpu.py
# 80 runs, about 3 hours as two processes of one thread each (they share the runs):
#   OMP_NUM_THREADS=1 python -m experiments.sweep experiments/configs/sweep_cpu.py &
#   OMP_NUM_THREADS=1 python -m experiments.sweep experiments/configs/sweep_cpu.py
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "full_attnres": "residual=full_attnres",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",
    "rd_average": "residual=rd_attnres rd_mode=average",
    "rd_frozen_v": "residual=rd_attnres rd_mode=frozen_v",
    "dar": "residual=dar dar_block_size=2",  # Block DAR: one history entry per 2 layers (exp_cpu's value)
    "dar_self_kv": "residual=dar dar_routing=self_kv dar_block_size=2",
    "dar_full": "residual=dar dar_block_size=1",  # Full DAR: one history entry per transformer layer
    "mhc": "residual=mhc",
    "denseformer": "residual=denseformer",  # 1x1: a DWA after every layer over every layer output
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer (delta_block_size=1)
    "delta_block": "residual=delta_attnres delta_block_size=4",  # blocks of 2 layers, as Block AttnRes here
    # parameter-matched controls: standard with a wider MLP (hidden 512 -> H), within 0.05% of the variant's count
    "standard_mlp549": "residual=standard mlp_hidden=549",  # 1,730,560 vs muddformer's 1,730,005 (+4.5%)
    "standard_mlp608": "residual=standard mlp_hidden=608",  # 1,851,392 vs mhc's 1,851,824 (+11.9%)
}
# The comparison, declared before the runs (experiments/report.py). The primary family: each paper's claim
# against its own baseline, paired t-tests on the whole validation split, Holm within the family.
primary = [
    ("full_attnres", "standard"),  # Kimi's Attention Residuals
    ("block_attnres", "standard"),
    ("rd_attnres", "block_attnres"),  # RD-AttnRes is proposed over Block AttnRes
    ("dar", "block_attnres"),  # DAR (Block) as an extension of Block AttnRes
    ("mhc", "standard"),
    ("denseformer", "standard"),
    ("muddformer", "standard"),
    ("delta_attnres", "standard"),
]
# a control is a gate: "variant - control" is tested once the variant's primary test rejects
controls = {"muddformer": "standard_mlp549", "mhc": "standard_mlp608"}  # variant -> its parameter-matched control
score = "val"  # the whole validation split (each run's final evaluation); the whole test split is reported beside it
# everything else (the RD and DAR ablations, dar_full, delta_block, each variant against both references) is exploratory
seeds = [0, 1, 2, 3, 4]
reference = "standard"
second_reference = "block_attnres"
out_dir = "runs/sweep_cpu"
