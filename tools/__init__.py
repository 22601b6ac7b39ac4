"""The tools around training, each run from the repository root as `python -m tools.<name>`:

    sweep           paired multi-seed runs: every variant x every seed, resumable, shared by processes
    rundirs         a sweep's run directories as the tools read them: summary, whole-split scores, log
    report, stats   what the runs say: the family with gated controls, exploratory tests (stats: the tests)
    plots           the report's forest and gap-over-training plots
    rescore         finished runs scored on whole val and test splits
    diagnose        what the routing learned; validation curves
    robust          does the advantage hold: an lr grid, a second length, the compute multiplier
    robust_design   robust's design file and the runs it asks for
    multiplier      robust's loss-vs-FLOPs fit along the data axis (one size, several lengths), bootstrapped
    ladder          "standard needs X times the compute" from a size ladder of standard, with t-based intervals
    robust_report   robust.md and the loss-vs-FLOPs plot
    bench           speed and memory against standard, in one run
    gpu_check       the one-command check on a CUDA machine (make gpu-check)
    export_ckpt     a sharded FSDP checkpoint as the one file sample.py and diagnose read
"""
