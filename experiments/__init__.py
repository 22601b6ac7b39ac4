"""The experiments wing: the studies this project runs on its own variants, each run from the repository
root as `python -m experiments.<name>`, with their design files in experiments/configs/ and their tests in
experiments/tests/. It imports the core (model.py, train.py, common.py, the users' tools); nothing in the core imports it.

    sweep           paired multi-seed runs: every variant x every seed, resumable, shared by processes
    rundirs         a sweep's run directories as the reports read them: summary, whole-split scores
    report, stats   what the runs say: the family with gated controls, exploratory tests (stats: the tests)
    plots           the report's forest and gap-over-training plots
    rescore         finished runs scored on whole val and test splits
    robust          does the advantage hold: an lr grid, a second length, the compute multiplier
    robust_design   robust's design file and the runs it asks for
    multiplier      robust's loss-vs-FLOPs fit along the data axis (one size, several lengths), bootstrapped
    ladder          "standard needs X times the compute" from a size ladder of standard, with t-based intervals
    robust_report   robust.md and the loss-vs-FLOPs plot

A design file committed before its runs keeps the commands it was written with (tools.sweep, configs/...):
editing it would read as a change of the design. Run it as python -m experiments.sweep experiments/configs/<file>.
"""
