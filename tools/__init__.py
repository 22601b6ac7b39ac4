"""The users' tools, each run from the repository root as `python -m tools.<name>`:

    diagnose        what the routing learned; validation curves
    bench           speed and memory against standard, in one run (--memory: what a process holds)
    gpu_check       the one-command check on a CUDA machine (make gpu-check)
    export_ckpt     a sharded FSDP checkpoint as the one file sample.py and diagnose read

The project's own studies (sweeps, their statistics, the robustness study, the size ladder) are the
experiments wing, experiments/, which imports these and the core; nothing here imports it.
"""
