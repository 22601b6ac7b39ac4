"""The experiments wing: the studies this project runs on its own variants, each run from the repository
root as `python -m experiments.<name>`, with their design files in experiments/configs/ and their tests in
experiments/tests/. It imports the core (model.py, train.py, common.py, the users' tools); nothing in the core imports it.

    sweep           paired multi-seed runs: every variant x every seed, resumable, shared by processes
    rundirs         a sweep's run directories as the reports read them: summary, whole-split scores
    report, stats   what the runs say: the family with gated controls, exploratory tests (stats: the tests)
    plots           the report's forest and gap-over-training plots
    rescore         finished runs scored on whole val and test splits

The finished studies (robust, ladder, seed_claims and the replications) are records in docs/results/, each
directory's README.md naming the commit whose code ran it.
"""
