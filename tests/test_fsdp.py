"""FSDP2: the same run sharded, equal to one process, started without a whole model on any rank; its one checkpoint
file survives kills, resumes on 1 and on 2 ranks, and loads in sample.py and tools.diagnose."""

import json
import shutil
import signal

import pytest

import sample
import train
from common import Stopped
from tools import diagnose

from runs import CONFIG, assert_close_runs, assert_same_run, ckpt, run, signal_in_step, steps, two_ranks

# Two ranks build every residual family's model sharded from the meta device and compare each parameter (gathered)
# and buffer with the one-process model of the same seed. Odd sizes (vocab 67, 3 layers) leave uneven shards.
INITIAL_WEIGHTS = """
import os, sys, torch
import torch.distributed as dist
from train import sharded_model
from model import GPTConfig, RESIDUALS
from model_fast import make_model
dist.init_process_group("gloo")
configs = [dict(residual=r) for r in RESIDUALS] + [dict(residual="dar", dar_routing="sep_v"),
           dict(residual="rd_attnres", rd_mode="frozen_v"), dict(residual="standard", tie_embeddings=True)]
differ = []
for extra in configs:
    cfg = GPTConfig(vocab_size=67, block_size=16, n_layer=3, n_head=2, n_embd=16, **extra)
    sharded, one = sharded_model(cfg, 5, 2, torch.device("cpu")), make_model(cfg, seed=5)
    local = sum(p.to_local().numel() for p in sharded.parameters())
    differ += [f"{extra}: {n}" for n, p in sharded.named_parameters() if not torch.equal(p.full_tensor(), one.get_parameter(n))]
    differ += [f"{extra}: buffer {n}" for n, b in sharded.named_buffers() if not torch.equal(b, one.get_buffer(n))]
    if not local < 0.6 * one.num_params():  # this rank holds about half of the weights
        differ.append(f"{extra}: {local} of {one.num_params()} parameters")
dist.destroy_process_group()
print("\\n".join(differ), file=sys.stderr, flush=True)
os._exit(1 if differ else 0)  # as train.command() leaves a rank: the interpreter's teardown can abort in gloo
"""


@pytest.mark.slow
def test_fsdp_initial_weights_equal_one_process_for_every_family():
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: [], (INITIAL_WEIGHTS, INITIAL_WEIGHTS))
    assert (rc0, rc1) == (0, 0), err0 + err1


@pytest.mark.slow
def test_fsdp_equals_one_process_for_dar(data_dir, tmp_path):
    # 9 evaluation windows: rank 0 gets 5 (2 batches of up to 4), rank 1 gets 4 (1 batch); under FSDP every forward
    # is collective, so both ranks must run 2 forwards or the evaluation hangs
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--residual=dar", "--eval_tokens=288"]
    run(data_dir, tmp_path, "--run_name=one", "--residual=dar", "--eval_tokens=288")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args + ["--run_name=fsdp", "--fsdp=true"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_close_runs(tmp_path / "one", tmp_path / "fsdp")
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["peak_memory_bytes"] == max(summary["peak_memory_bytes_per_rank"]) > 0
    assert len(summary["peak_memory_bytes_per_rank"]) == 2


# RD-AttnRes with activation checkpointing and 2 micro-steps per rank (no reduce-scatter on the first)
MODEL = ["--residual=rd_attnres", "--activation_checkpointing=true", "--batch_tokens=512"]


def fsdp_args(data_dir, out_dir, name, *more):
    return [CONFIG, f"--data_dir={data_dir}", f"--out_dir={out_dir}", f"--run_name={name}", *MODEL, "--fsdp=true", *more]


@pytest.fixture(scope="module")
def fsdp_straight(data_dir, tmp_path_factory):
    """An uninterrupted 2-rank FSDP run: 6 steps, checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("fsdp")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp_args(data_dir, out, "straight"))
    assert (rc0, rc1) == (0, 0), err0 + err1
    return out / "straight"


@pytest.fixture(scope="module")
def fsdp_stopped(data_dir, tmp_path_factory):
    """The same run stopped by a SIGTERM that reaches rank 1 only, in step 2: both ranks stop after step 2."""
    out = tmp_path_factory.mktemp("fsdp_stopped")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp_args(data_dir, out, "stopped"),
                                         (None, signal_in_step(2, "SIGTERM")))
    assert (rc0, rc1) == (143, 143) and "stopped by SIGTERM after step 2" in err0, err0 + err1
    return out / "stopped"


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_runs")
def test_fsdp_runs_stop_and_resume_bit_exact_after_kill_9(data_dir, tmp_path, fsdp_straight, fsdp_stopped):
    """Stopped by SIGTERM, resumed, killed by kill -9 (both ranks, in step 5) and resumed again: the uninterrupted
    FSDP run bit for bit, from one checkpoint file."""
    d = shutil.copytree(fsdp_stopped, tmp_path / "killed")
    args = fsdp_args(data_dir, tmp_path, "killed", "--resume=true")
    kill = signal_in_step(3, "SIGKILL")  # resumed at 2: its third step is step 5, after the checkpoint of step 3
    assert [rc for rc, _ in two_ranks(lambda rank: args, (kill, kill))] == [-signal.SIGKILL] * 2
    assert ckpt(d)["step"] == 3 and not (d / "ckpt").exists()
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_same_run(d, fsdp_straight)
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["ckpt.pt", "config.json", "log.jsonl",
                                                                                 "summary.json"]


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_runs")
def test_a_2_rank_checkpoint_resumes_on_1_rank_and_loads_in_sample_and_diagnose(data_dir, tmp_path, monkeypatch,
                                                                                capsys, fsdp_straight, fsdp_stopped):
    d = shutil.copytree(fsdp_stopped, tmp_path / "moved")
    real, calls = train.train_step, []

    def sigterm_in_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "train_step", sigterm_in_step_2)
    with pytest.raises(Stopped):  # on one process: resumed at 2, stopped after step 4
        train.main(fsdp_args(data_dir, tmp_path, "moved", "--resume=true"))
    monkeypatch.undo()
    assert ckpt(d)["step"] == 4 and ckpt(d)["world_size"] == 1
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp_args(data_dir, tmp_path, "moved", "--resume=true"))
    assert (rc0, rc1) == (0, 0), err0 + err1  # and on 2 ranks again
    assert steps(d) == [1, 2, 3, 4, 5, 6]
    assert_close_runs(d, fsdp_straight)  # the steps on 1 process sum the gradients in another order

    assert sample.main(["--ckpt", str(fsdp_straight), "--max_new_tokens", "4"]) == 0
    assert diagnose.main(["--ckpt", str(fsdp_straight), "--tokens", "64", "--out", str(tmp_path / "diag")]) == 0
    assert "rd_attnres at step 6" in capsys.readouterr().out
