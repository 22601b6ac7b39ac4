"""The tools around training, each run from the repository root as `python -m tools.<name>`:
sweep (paired comparisons, with stats), bench (speed and memory), diagnose (what a trained model
routes) and gpu_check (the one-command GPU check)."""
