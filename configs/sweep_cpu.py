# The README's CPU experiment: every variant x 3 paired seeds on configs/exp_cpu.py (about 50 minutes
# on 2 cores).   python prepare_data.py --tokenizer byte && python sweep.py configs/sweep_cpu.py
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "full_attnres": "residual=full_attnres",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",
    "rd_tied": "residual=rd_attnres rd_mode=tied",
    "rd_average": "residual=rd_attnres rd_mode=average",
    "rd_frozen_v": "residual=rd_attnres rd_mode=frozen_v",
    "dar": "residual=dar",
    "dar_self_kv": "residual=dar dar_routing=self_kv",
    "mhc": "residual=mhc",
}
seeds = [0, 1, 2]
reference = "standard"
out_dir = "runs/sweep_cpu"
