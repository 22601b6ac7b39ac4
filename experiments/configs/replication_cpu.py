# The replication (issue 37): the seed papers' own claims, RD-AttnRes and DAR each against Block
# AttnRes, on configs/exp_cpu.py unchanged, with 16 fresh seeds that no earlier study used.
# This file is the declaration: it was committed before the first of its runs, and the report names
# that commit. Nothing in it may change once a run has started.
#   python prepare_data.py --tokenizer byte
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/replication_cpu.py &    # two processes share the runs
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/replication_cpu.py
# 48 runs, about 3 CPU-hours with their whole-split scoring.
base = "configs/exp_cpu.py"
variants = {
    "block_attnres": "residual=block_attnres",  # blocks of 4 sublayers (exp_cpu's attnres_block_size)
    "rd_attnres": "residual=rd_attnres",  # rd_mode decoupled, the paper's method
    "dar": "residual=dar dar_block_size=2",  # Block DAR: one history entry per 2 layers, as Block AttnRes's blocks
}
# Two primary tests, each a paper's claim against the baseline it is proposed over: paired t-tests on the
# whole validation split (each run's scores.json), Holm at alpha 0.05 within the two. The test split is
# secondary (reported beside, no claim).
primary = [
    ("rd_attnres", "block_attnres"),  # K. Wang, Role-Decoupled Attention Residuals
    ("dar", "block_attnres"),  # X. Yu et al., Dual Attention Residuals (Block)
]
score = "val"
alpha = 0.05
# The equivalence margin, declared with the tests, so that a null result can be concluded: for each primary
# test, two one-sided paired t-tests (TOST) against -margin and +margin, Holm-adjusted within the two tests
# as the difference tests are. Each test then shows one of three things: a difference (the two-sided test
# rejects), equivalence (TOST rejects: |delta| < margin), or neither.
# 0.006 nats per byte is about 0.020-0.027 nats per GPT-2 token at 3.3-4.5 bytes a token: the size of the
# RD-AttnRes paper's own gains (-0.0301 and -0.0247 nats per token), so "equivalent" means "smaller than
# what the paper reports". Planned with the paired sd of the 5-seed study (0.0078): the two-sided test has
# power 0.93 for a difference of 0.008 at alpha/2; TOST at alpha/2 has power about 0.65 when the truth is 0.
equivalence_margin = 0.006
seeds = list(range(1000, 1016))  # 16 fresh seeds: the studies before used 0-4 (the robustness study 0-2 and tuning seeds 100-101)
reference = "block_attnres"
out_dir = "runs/replication_cpu"
