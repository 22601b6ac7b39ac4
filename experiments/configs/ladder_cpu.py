# The size ladder (issue 37): the compute multiplier the papers' way. `standard` at five widths on
# configs/exp_cpu.py's recipe unchanged (8 layers, 4 heads, 400 steps of 1,024 byte tokens, lr 3e-3 -> 3e-4
# cosine), 3 seeds each. This file is the declaration: it was committed before the first of its runs, and
# the report names that commit. Nothing in it may change once a run has started.
#   python prepare_data.py --tokenizer byte
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/ladder_cpu.py &    # two processes share the runs
#   OMP_NUM_THREADS=1 python -m tools.sweep configs/ladder_cpu.py
#   python -m tools.ladder configs/ladder_cpu.py                      # the read-off: ladder.md, ladder.json
# 15 runs, 6.0x the FLOPs of one seed of exp_cpu's 400-step run per seed (18x in all): about 1-1.5 CPU-hours
# with their whole-split scoring.
#
# The read-off, declared with the runs (tools/ladder.py):
# - compute C = GPT.flops_per_token() x the 409,600 training tokens (the same tokens at every size, so C
#   moves with the model size only); the ladder's fit: log L = a - alpha log C by least squares on the five
#   widths' mean log loss (the whole validation split, scores.json), alpha's standard error from its
#   residuals (3 degrees of freedom);
# - each variant in `pairs` runs at exp_cpu's size (the rung d128) on the ladder's seeds 1000-1002, so it
#   pairs with d128 seed by seed (the same initial weights and batches): r_s = log L_variant(s) - log
#   L_d128(s). "standard needs X times the compute" at this size: X = exp(-mean r / alpha) (the horizontal
#   offset of a curve parallel to the ladder's, through the variant's point), step-matched; FLOP-matched
#   divides by the variant's FLOPs per token over standard's;
# - its 95% interval includes the slope's uncertainty: the 97.5% t-interval of mean r (2 degrees of
#   freedom) and the 97.5% t-interval of alpha (3), and X's range over both (Bonferroni: it covers at
#   least 95% when each covers; tests/test_ladder.py checks the coverage by simulation). No bootstrap.
# What it is not: the lr is exp_cpu's at every width (not retuned per size), and every size sees the same
# 0.4M tokens, so the wider models are further from their own best; the papers' ladders are at 0.1B+
# parameters. This is the size-axis multiplier; tools/robust.py's is along the data axis (one size).
base = "configs/exp_cpu.py"
variants = {  # n_head 4 at every width, as exp_cpu (head dim 24, 28, 32, 40, 48); 0.95M-3.66M parameters (3.9x)
    "d96": "n_embd=96",
    "d112": "n_embd=112",
    "d128": "",  # exp_cpu's size: the rung the variants pair with
    "d160": "n_embd=160",
    "d192": "n_embd=192",
}
seeds = [1000, 1001, 1002]  # the replication's first three seeds (configs/replication_cpu.py): paired with its runs
reference = "d128"
out_dir = "runs/ladder_cpu"
rung = "d128"
pairs = {"runs/replication_cpu": ["block_attnres", "rd_attnres", "dar"]}  # {a sweep's out_dir: its variants to read off}
level = 0.95
