"""The experiments wing: quick paired experiments on the variants, run from the repository root as
`python -m experiments.sweep SWEEP_FILE`, with sweep files in experiments/configs/ and tests in experiments/tests/.
It imports the core (train.py, model.py, common.py, the tools); nothing in the core imports it.

    sweep    every variant x every seed, resumable, shared by processes, through a launcher; then the report
    report   what the finished runs say: the declared family with gated controls and TOST, exploratory tests, tables,
             results.md/.json/.csv, forest.png and curves.png
    stats    the paired t-test, Holm, the gated family, TOST (scipy.stats)

The finished studies (robust, ladder, seed_claims and the replications) are records in docs/results/, each
directory's README.md naming the commit whose code ran it.
"""
