"""FSDP2: the same run sharded, equal to one process; its checkpoints load anywhere."""

import json
import signal

import pytest
import torch

from depthres.checkpoint import load_checkpoint

from runs import CONFIG, RANK1_SIGTERM_IN_STEP_2, losses, run, signal_in_step_2, two_ranks

# ----------------------------------------------------------------------------------------------
# FSDP2: the same run sharded; its checkpoints load anywhere

KILL_9_IN_STEP_2 = signal_in_step_2("SIGKILL")

# Two ranks build every residual family's model sharded from the meta device and compare each
# parameter (gathered) and buffer with the one process model of the same seed; sys.exit(1) with the
# names that differ. Odd sizes (vocab 67, 3 layers: 7 sites) leave uneven and empty shards.
INITIAL_WEIGHTS = """
import sys, torch
import torch.distributed as torch_dist
from depthres.distributed import setup_distributed
from depthres.sharded import sharded_model
from model import GPT, GPTConfig, RESIDUALS
dist = setup_distributed("cpu")
configs = [dict(residual=r) for r in RESIDUALS] + [dict(residual="dar", dar_routing="sep_v"),
           dict(residual="rd_attnres", rd_mode="frozen_v"), dict(residual="standard", tie_embeddings=True)]
differ, families = [], set()
for extra in configs:
    cfg = GPTConfig(vocab_size=67, block_size=16, n_layer=3, n_head=2, n_embd=16, **extra)
    sharded, one = sharded_model(cfg, 5, dist), GPT(cfg, seed=5)
    local = 0
    for name, p in sharded.named_parameters():
        local += p.to_local().numel()
        if not torch.equal(p.full_tensor(), one.get_parameter(name)):
            differ.append(f"{extra}: {name}")
    for name, b in sharded.named_buffers():
        if not torch.equal(b, one.get_buffer(name)):
            differ.append(f"{extra}: buffer {name}")
    if not local < 0.6 * one.num_params():  # this rank holds about half of the weights
        differ.append(f"{extra}: {local} of {one.num_params()} parameters on rank {dist.rank}")
    families.add(extra["residual"])
assert families == set(RESIDUALS)
torch_dist.destroy_process_group()
print("\\n".join(differ), file=sys.stderr)
sys.exit(1 if differ else 0)
"""


def test_fsdp_initial_weights_equal_one_process_for_every_family():
    """The paired-init promise under FSDP's meta-device start: no rank builds the whole model, and
    the shards gathered are bit for bit the weights one process initialises, for every variant."""
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: [], (INITIAL_WEIGHTS, INITIAL_WEIGHTS))
    assert (rc0, rc1) == (0, 0), err0 + err1


def assert_close_runs(a, b, atol=1e-5):
    """Two runs that differ only in how ranks sum their gradients: float32 rounding apart."""
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca["step"] == cb["step"]
    for name, p in ca["model"].items():
        torch.testing.assert_close(cb["model"][name], p, atol=atol, rtol=0, msg=name)
    for (s1, l1), (s2, l2) in zip(losses(a), losses(b), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=atol)


def test_fsdp_equals_one_process_for_dar(data_dir, tmp_path):
    # 9 evaluation windows: rank 0 gets 5 (2 batches of up to 4), rank 1 gets 4 (1 batch); under FSDP
    # every forward is collective, so both ranks must run 2 forwards or the evaluation hangs
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--residual=dar", "--eval_tokens=288"]
    run(data_dir, tmp_path, "--run_name=one", "--residual=dar", "--eval_tokens=288")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args + ["--run_name=fsdp", "--fsdp=true"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_close_runs(tmp_path / "one", tmp_path / "fsdp")
    one, sharded = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "fsdp"))
    assert 0.45 < sharded["state_bytes_per_rank"] / one["state_bytes_per_rank"] < 0.55  # half the weights and AdamW
    # the peak is the largest of every rank's, not rank 0's alone
    assert len(sharded["peak_memory_bytes_per_rank"]) == 2 and len(one["peak_memory_bytes_per_rank"]) == 1
    assert sharded["peak_memory_bytes"] == max(sharded["peak_memory_bytes_per_rank"]) > 0


def test_fsdp_runs_stop_and_resume_bit_exact_and_their_checkpoints_load_anywhere(data_dir, tmp_path, capsys):
    """RD-AttnRes with activation checkpointing and 2 micro-steps per rank (no reduce-scatter on the
    first). FSDP equals one process to float32 rounding (it sums gradients in another order); an FSDP
    run stopped by SIGTERM, resumed, killed by kill -9 and resumed again repeats the uninterrupted FSDP
    run bit for bit; an FSDP checkpoint samples, and resumes in one process and under DDP; a DDP
    checkpoint resumes under FSDP."""
    model = ["--residual=rd_attnres", "--activation_checkpointing=true", "--batch_tokens=512"]
    base = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *model]
    fsdp = base + ["--fsdp=true"]
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp + ["--run_name=straight"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    run(data_dir, tmp_path, "--run_name=one", *model)
    assert_close_runs(tmp_path / "one", tmp_path / "straight")

    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp + ["--run_name=broken"], (None, RANK1_SIGTERM_IN_STEP_2))
    assert (rc0, rc1) == (143, 143) and load_checkpoint(tmp_path / "broken")["step"] == 2, err0 + err1
    (rc0, _), (rc1, _) = two_ranks(lambda rank: fsdp + ["--run_name=broken", "--resume=true"],
                                   (KILL_9_IN_STEP_2, KILL_9_IN_STEP_2))  # step 4 dies; the checkpoint of 3 stays
    assert (rc0, rc1) == (-signal.SIGKILL, -signal.SIGKILL) and load_checkpoint(tmp_path / "broken")["step"] == 3
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp + ["--run_name=broken", "--resume=true"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "broken")
    assert losses(tmp_path / "broken") == losses(tmp_path / "straight")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for i in a["optimizer"]["state"] for x, y in
               zip(a["optimizer"]["state"][i].values(), b["optimizer"]["state"][i].values()))

    straight = tmp_path / "straight" / "ckpt.pt"
    import sample
    assert sample.main(["--ckpt", str(straight), "--max_new_tokens", "4"]) == 0
    run(data_dir, tmp_path, "--run_name=one_more", f"--resume={straight}", "--max_steps=8", *model)
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: base + ["--run_name=ddp_more", f"--resume={straight}",
                                                              "--max_steps=8"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_close_runs(tmp_path / "one_more", tmp_path / "ddp_more")
    ddp_ckpt = tmp_path / "ddp_more" / "ckpt.pt"
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp + ["--run_name=fsdp_more", f"--resume={ddp_ckpt}",
                                                              "--max_steps=10"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    run(data_dir, tmp_path, "--run_name=one_10", f"--resume={ddp_ckpt}", "--max_steps=10", *model)
    assert_close_runs(tmp_path / "one_10", tmp_path / "fsdp_more")
