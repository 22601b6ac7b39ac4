# The seed-claims study (issue 55), part 1 of 3: RD-AttnRes's controls, declared before its runs.
# This file, seed_claims_dar.py and seed_claims_mechanism.py are the declaration: committed before the first
# of their runs, every run trained from one checkout frozen at that commit (the report names the commit and the
# runs' recorded start times). Nothing in them may change once a run has started.
#   python prepare_data.py --tokenizer byte
#   OMP_NUM_THREADS=1 python -m experiments.sweep experiments/configs/seed_claims_rd.py &   # two processes share the runs
#   OMP_NUM_THREADS=1 python -m experiments.sweep experiments/configs/seed_claims_rd.py
# 80 runs (4 variants x 20 seeds), about 6.5 CPU-hours with their whole-split scoring.
base = "configs/exp_cpu.py"
variants = {
    "rd_attnres": "residual=rd_attnres",  # rd_mode decoupled: the method
    "rd_average": "residual=rd_attnres rd_mode=average",  # both routes run, their mean used for Q, K and V
    "rd_frozen_v": "residual=rd_attnres rd_mode=frozen_v",  # the value route's query frozen at 0: uniform over sources
    "block_attnres": "residual=block_attnres",  # blocks of 4 sublayers (exp_cpu's attnres_block_size)
}
# The paper's claims (K. Wang, Role-Decoupled Attention Residuals, its controls at 0.5B tokens), one family,
# paired t-tests on the whole validation split, Holm at alpha 0.05 within the three. Written as
# (variant, baseline), delta = variant - baseline, so the signs the paper predicts are:
#   H1  rd_average - rd_attnres > 0    running two routes and averaging them is not the gain: the decoupled
#                                      method has the lower loss (a difference, positive)
#   H2  rd_frozen_v - rd_attnres > 0   the value route must be learned: a uniform one is worse (a difference, positive)
#   H3  block_attnres - rd_average, |delta| < 0.006   averaging performs like Block AttnRes: an equivalence test
#                                      (TOST against the margin below); for H3 the claim is equivalence, and a
#                                      difference there counts against the paper
# The test split is secondary (reported beside, no claim). rd_tied is not run: it trains bit for bit as Block
# AttnRes (tested in test_equivalence.py).
primary = [
    ("rd_average", "rd_attnres"),  # H1
    ("rd_frozen_v", "rd_attnres"),  # H2
    ("block_attnres", "rd_average"),  # H3 (equivalence)
]
score = "val"
alpha = 0.05
# The margin of the two replications (configs replication_cpu.py, replication_family_cpu.py): 0.006 nats per
# byte, about 0.019 nats per GPT-2 token on this corpus (3.23 bytes a token). Each test ends as one of the family
# replication's verdicts: a difference beyond the margin (its 95% interval wholly beyond +-0.006), a difference not
# shown as large as the margin (it rejects, its interval reaches inside), equivalence (TOST rejects), or neither.
# Seeds from a power calculation on the paired sds the 5-seed family measured for these very pairs (seeds 0-4,
# docs/results/cpu_results.json, whole val): rd_attnres vs rd_average 0.0117, vs rd_frozen_v 0.0144, rd_average vs
# block_attnres 0.0049. With 20 pairs, at Holm's first step (alpha/3, two-sided, noncentral t): H1 has power 0.87
# for a difference of 0.010 (the replication's rd - block -0.0134 less the family's average - block -0.0031) and
# detects 0.0092 with 80% power; H2 has power 0.68 for 0.010 (the expected 0.018 is detected with power > 0.99); H3's
# TOST has power 0.67 if the truth is -0.003 and 0.997 if it is 0 (simulated). 16 seeds would give 0.76 / 0.55 / 0.55.
equivalence_margin = 0.006
seeds = list(range(1200, 1220))  # 20 fresh seeds: the studies before used 0-4, 100-101, 1000-1015, 1100-1115
reference = "rd_attnres"
out_dir = "runs/seed_claims_rd"
