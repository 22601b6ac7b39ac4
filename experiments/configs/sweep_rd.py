# The RD-AttnRes paper's comparison: RD-AttnRes against Block AttnRes, 5 paired seeds, 2B FineWeb-Edu
# tokens (prepare the data as configs/rd_s.py says). Size S; for M add --base configs/rd_m.py.
#   python -m experiments.sweep experiments/configs/sweep_rd.py --launcher "torchrun --standalone --nproc_per_node=8"
#   python -m experiments.sweep experiments/configs/sweep_rd.py --base configs/rd_m.py --out_dir runs/sweep_rd_m --launcher "..."
# Compute (40% MFU on H100, see configs/rd_s.py): S ~1 GPU-hour a run, 10 runs ~10 GPU-hours;
# M ~2.4 GPU-hours a run, ~24 GPU-hours. The paper: delta -0.0301 (S) / -0.0247 (M), 10 of 10 wins.
base = "configs/rd_s.py"
variants = {
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres rd_mode=decoupled",
}
seeds = [0, 1, 2, 3, 4]
reference = "block_attnres"
primary = [("rd_attnres", "block_attnres")]  # the paper's one claim (experiments/report.py)
out_dir = "runs/sweep_rd_s"
