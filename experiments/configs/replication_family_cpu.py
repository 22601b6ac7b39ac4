# The family replication (issue 45): the parent claims, each paper's method against the standard residual
# it is proposed over, on configs/exp_cpu.py unchanged, with 16 fresh seeds that no earlier study used.
# This file is the declaration: it was committed before the first of its runs, every run is trained from
# one checkout frozen at that commit, and the report names the commit and the runs' recorded start times
# (each run's log.jsonl "start" records; summary.json's started_utc). Nothing in it may change once a
# run has started.
#   python prepare_data.py --tokenizer byte
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/replication_family_cpu.py &    # two processes share the runs
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/replication_family_cpu.py
# 96 runs, about 6-7 CPU-hours with their whole-split scoring.
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",  # blocks of 4 sublayers (exp_cpu's attnres_block_size)
    "full_attnres": "residual=full_attnres",
    "dar": "residual=dar dar_block_size=2",  # Block DAR, as in configs/replication_cpu.py
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer (delta_block_size=1)
}
# Five primary tests, each a paper's claim against the baseline it is proposed over: paired t-tests on the
# whole validation split (each run's scores.json), Holm at alpha 0.05 within the five. The test split is
# secondary (reported beside, no claim).
primary = [
    ("block_attnres", "standard"),  # Kimi Team, Attention Residuals (Block)
    ("full_attnres", "standard"),  # Kimi Team, Attention Residuals (Full)
    ("dar", "standard"),  # X. Yu et al., Dual Attention Residuals (Block)
    ("muddformer", "standard"),  # D. Xiao et al., MUDDFormer
    ("delta_attnres", "standard"),  # Delta AttnRes
]
score = "val"
alpha = 0.05
# The equivalence margin of configs/replication_cpu.py, 0.006 nats per byte, with the same TOST: each primary
# test shows a difference (the two-sided test rejects), equivalence (TOST rejects: |delta| < margin), or
# neither. How large, declared here with the tests: a difference whose 95% interval lies wholly beyond the
# margin (|delta| > 0.006 at every point of it) is reported as one "beyond the margin"; one whose interval
# reaches inside the margin as "a difference, not shown as large as the margin".
# Planned with the paired sds of the 16-seed replication (0.0071 and 0.0097 for its two tests): with 16 pairs,
# Holm's first step (alpha/5, two-sided) has power 0.92 and 0.64 for a difference of 0.008 (simulated).
equivalence_margin = 0.006
seeds = list(range(1100, 1116))  # 16 fresh seeds: the studies before used 0-4, 100-101, 1000-1015
reference = "standard"
out_dir = "runs/replication_family_cpu"
