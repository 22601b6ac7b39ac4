# The README's CPU experiment: every variant x 3 paired seeds on configs/exp_cpu.py (the first ten rows
# took 56 minutes on 2 cores; with the DAR-granularity and section-7 rows, about 1.5 hours).
#   python prepare_data.py --tokenizer byte && python sweep.py configs/sweep_cpu.py
base = "configs/exp_cpu.py"
variants = {
    "standard": "residual=standard",
    "full_attnres": "residual=full_attnres",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",
    "rd_tied": "residual=rd_attnres rd_mode=tied",
    "rd_average": "residual=rd_attnres rd_mode=average",
    "rd_frozen_v": "residual=rd_attnres rd_mode=frozen_v",
    "dar": "residual=dar dar_block_size=2",  # Block DAR: one history entry per 2 layers (exp_cpu's value)
    "dar_self_kv": "residual=dar dar_routing=self_kv dar_block_size=2",
    "dar_full": "residual=dar dar_block_size=1",  # Full DAR: one history entry per transformer layer
    "mhc": "residual=mhc",
    "denseformer": "residual=denseformer",  # 1x1: a DWA after every layer over every layer output
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",  # per sublayer (delta_block_size=1)
    "delta_block": "residual=delta_attnres delta_block_size=4",  # blocks of 2 layers, as Block AttnRes here
}
seeds = [0, 1, 2]
reference = "standard"
out_dir = "runs/sweep_cpu"
