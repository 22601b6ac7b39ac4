# The size ladder at a paper size: experiments/configs/ladder_cpu.py's read-off on configs/rd_s.py's recipe (FineWeb-Edu,
# 2B tokens, lr 3e-3 -> 3e-4 cosine; prepare the data as configs/rd_s.py says). `standard` at five widths of 16
# layers, head dim 64 at each (52M-304M parameters, 5.9x), 3 seeds; the rung w576 is size S, the same run as
# experiments/configs/sweep_family.py's `standard` (same base, overrides and seeds), so the family's six variants pair with
# it seed by seed and get "standard needs X times the compute" read off this ladder.
#   python -m experiments.sweep experiments/configs/sweep_family.py --launcher "torchrun --standalone --nproc_per_node=8"
#   python -m experiments.sweep experiments/configs/ladder_gpu.py --launcher "torchrun --standalone --nproc_per_node=8"
#   python -m experiments.ladder experiments/configs/ladder_gpu.py        # ladder.md, ladder.json, ladder.png in runs/ladder_s
# Cost from model.flops_per_token() (MFLOP: w320 277, w448 455, w576 669, w768 1062, w1024 1718) x 2B tokens
# x 3 seeds = 2.5e19 FLOP, ~17.6 GPU-hours at 40% MFU on an H100 SXM (989 TFLOP/s bf16 dense): w1024 alone is
# 7.2 of them, the rung 2.8 (it runs again here, in its own out_dir: a sweep writes its report into its
# out_dir, so two designs cannot share one). Plan ~20.
# Declared choices, as on the CPU: every width sees the same 2B tokens (compute moves with size only: about
# 2x Chinchilla's 20 tokens a parameter at w320, 0.33x at w1024) and the recipe's lr 3e-3 (not retuned per
# size), so the widest are further from their own best; the read-off is experiments/ladder.py's (the fit over the
# widths' mean log NLL on the whole validation split, X from the paired log gaps to the rung, its 95% interval
# over the 97.5% t-intervals of the gap and of the slope; no bootstrap).
base = "configs/rd_s.py"
variants = {
    "w320": "residual=standard n_embd=320 n_head=5",
    "w448": "residual=standard n_embd=448 n_head=7",
    "w576": "residual=standard",  # size S: experiments/configs/sweep_family.py's `standard`, the rung
    "w768": "residual=standard n_embd=768 n_head=12",
    "w1024": "residual=standard n_embd=1024 n_head=16",
}
seeds = [0, 1, 2]  # experiments/configs/sweep_family.py's
reference = "w576"
out_dir = "runs/ladder_s"
rung = "w576"
pairs = {"runs/sweep_family_s": ["block_attnres", "rd_attnres", "dar", "denseformer", "muddformer", "delta_attnres"]}
level = 0.95
