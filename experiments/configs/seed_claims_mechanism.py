# The seed-claims study (issue 55), part 3 of 3: what each mechanism learns, declared before the runs of
# seed_claims_rd.py and seed_claims_dar.py (see seed_claims_rd.py's header). Computed after the runs, from each
# run's final checkpoint, by the project's own diagnostics (tools/diagnose.py), on a fixed prefix of the
# validation split: its first 65,536 bytes, the runs' own evaluation prefix (exp_cpu's eval_tokens). A per-run
# figure is one number; seeds pair across variants (same seed, same init and data order).
#   python -m tools.diagnose --ckpt runs/seed_claims_rd/rd_attnres/seed1200 --tokens 65536   # one run's measures
tokens = 65536
runs = {  # name: (sweep out_dir, variant)
    "rd_attnres": ("runs/seed_claims_rd", "rd_attnres"),
    "dar": ("runs/seed_claims_dar", "dar"),
    "dar_self_kv": ("runs/seed_claims_dar", "dar_self_kv"),
    "mhc2": ("runs/seed_claims_dar", "mhc2"),
}
seeds = list(range(1200, 1220))
# The per-run figures:
#   js        rd_attnres: the mean over the 8 layers of the per-layer mean Jensen-Shannon divergence (natural log)
#             between the QK and V depth distributions of each attention sublayer (diagnose's QK||V)
#   imbalance dar, dar_self_kv: the mean over the 8 layers of |gain_0 - gain_1|, the rescue gains of keeping stream
#             0 or stream 1 intact when both streams' retrievals at that layer are replaced by their token means
#   cka_off   dar, dar_self_kv, mhc2: linear CKA between stream 0's state after layer i and stream 1's after layer
#             j, averaged over the 56 pairs i != j (mismatched depths); cka_diag the same over i = j (reported, no test)
# The tests, one family, Holm at alpha 0.05 within the five; t-tests over the 20 seeds (one-sample or paired), each
# with its 95% interval. The signs the papers predict:
#   M1  js > 0                             RD-AttnRes: the two routes differ (one-sample, against 0)
#   M2  js - 0.22 (two-sided)              against the paper's mean JS at 120M (0.22; 0.215 at 343M): a rejection
#                                          says this scale's routes differ from the paper's by more than chance
#   M3  imbalance(dar_self_kv) - imbalance(dar) > 0   DAR keeps both streams useful; self_kv goes lopsided (paired)
#   M4  cka_off(dar_self_kv) - cka_off(dar) > 0       DAR's streams stay dissimilar at mismatched depths, self_kv's
#   M5  cka_off(mhc2) - cka_off(dar) > 0              and mHC-2's show broad high-similarity regions (paired)
# Reported beside, no claim: each figure's mean per layer (the gains of each stream, cka_diag) over seeds, the figure
# of CKA matrices of dar, dar_self_kv and mhc2 side by side (means over seeds), and rescue gains per layer.
family = ["M1", "M2", "M3", "M4", "M5"]
alpha = 0.05
paper_js = 0.22
# Planning: no earlier multi-seed measure of these figures exists (one seed of dar: CKA 0.68-0.82 per layer; one of
# rd_attnres: JS 0.28); 20 seeds are set by seed_claims_rd.py and seed_claims_dar.py, and the report gives each
# test's interval and the effect it detects with 80% power at the sd it observed.
