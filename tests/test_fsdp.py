"""FSDP2: the same run sharded, equal to one process, started without a whole model on any rank; its
sharded checkpoints survive kills, resume on any number of ranks, and export to one file that samples."""

import json
import pickle
import shutil
import signal

import pytest
import torch

import sample
import train
from depthres.checkpoint import load_checkpoint
from depthres.run import Stopped
from tools import export_ckpt

from runs import (
    CONFIG,
    RANK1_SIGTERM_IN_STEP_2,
    Payload,
    assert_same_run,
    kill_in_step,
    losses,
    replace_in_sharded,
    run,
    sharded_copy,
    signal_in_step_2,
    steps,
    two_ranks,
    whole,
)

# ----------------------------------------------------------------------------------------------
# FSDP2: the same run sharded; its checkpoints load anywhere

KILL_9_IN_STEP_2 = signal_in_step_2("SIGKILL")

# Two ranks build every residual family's model sharded from the meta device and compare each
# parameter (gathered) and buffer with the one process model of the same seed; sys.exit(1) with the
# names that differ. Odd sizes (vocab 67, 3 layers: 7 sites) leave uneven and empty shards.
INITIAL_WEIGHTS = """
import sys, torch
import torch.distributed as torch_dist
from depthres.distributed import setup_distributed, sharded_model
from model import GPTConfig, RESIDUALS
from model_fast import make_model
dist = setup_distributed("cpu")
configs = [dict(residual=r) for r in RESIDUALS] + [dict(residual="dar", dar_routing="sep_v"),
           dict(residual="rd_attnres", rd_mode="frozen_v"), dict(residual="standard", tie_embeddings=True)]
differ, families = [], set()
for extra in configs:
    cfg = GPTConfig(vocab_size=67, block_size=16, n_layer=3, n_head=2, n_embd=16, **extra)
    sharded, one = sharded_model(cfg, 5, dist), make_model(cfg, seed=5)
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


@pytest.mark.slow
def test_fsdp_initial_weights_equal_one_process_for_every_family():
    """The paired-init promise under FSDP's meta-device start: no rank builds the whole model, and
    the shards gathered are bit for bit the weights one process initialises, for every variant."""
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: [], (INITIAL_WEIGHTS, INITIAL_WEIGHTS))
    assert (rc0, rc1) == (0, 0), err0 + err1


def assert_close_runs(a, b, atol=1e-5):
    """Two runs that differ only in how ranks sum their gradients: float32 rounding apart (a sum in another order,
    2 u = 1.2e-7 relative a step, which AdamW turns into weight drifts near lr x that: 1e-5 holds 6 steps with room
    and stays far below one step's change)."""
    ca, cb = whole(a), whole(b)
    assert ca["step"] == cb["step"]
    for name, p in ca["model"].items():
        torch.testing.assert_close(cb["model"][name], p, atol=atol, rtol=0, msg=name)
    for (s1, l1), (s2, l2) in zip(losses(a), losses(b), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=atol)


@pytest.mark.slow
def test_fsdp_equals_one_process_for_dar(data_dir, tmp_path):
    # 9 evaluation windows: rank 0 gets 5 (2 batches of up to 4), rank 1 gets 4 (1 batch); under FSDP
    # every forward is collective, so both ranks must run 2 forwards or the evaluation hangs
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--residual=dar", "--eval_tokens=288"]
    run(data_dir, tmp_path, "--run_name=one", "--residual=dar", "--eval_tokens=288")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args + ["--run_name=fsdp", "--fsdp=true"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_close_runs(tmp_path / "one", tmp_path / "fsdp")
    one, sharded = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "fsdp"))
    # the mechanism of FSDP's memory rule: each rank holds its shards (dim 0 split over 2 ranks: half of every
    # tensor, the odd row of an odd one on rank 0), not the whole model and AdamW state; the resident-set figure
    # it makes, which the allocator and the build set too, is python -m tools.bench --memory's (docs/performance.md)
    assert 0.45 < sharded["state_bytes_per_rank"] / one["state_bytes_per_rank"] < 0.55
    # the peak is the largest of every rank's, not rank 0's alone
    assert len(sharded["peak_memory_bytes_per_rank"]) == 2 and len(one["peak_memory_bytes_per_rank"]) == 1
    assert sharded["peak_memory_bytes"] == max(sharded["peak_memory_bytes_per_rank"]) > 0


# RD-AttnRes with activation checkpointing and 2 micro-steps per rank (no reduce-scatter on the first)
MODEL = ["--residual=rd_attnres", "--activation_checkpointing=true", "--batch_tokens=512"]


def fsdp_args(data_dir, out_dir, *more):
    return [CONFIG, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *MODEL, "--fsdp=true", *more]


# The three tests that share the runs of these fixtures are one xdist_group: one process runs them all
# (make test: --dist loadgroup), so that it starts each run once.

@pytest.fixture(scope="module")
def fsdp_straight(data_dir, tmp_path_factory):
    """An uninterrupted 2-rank FSDP run: 6 steps, sharded checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("fsdp")
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp_args(data_dir, out, "--run_name=straight"))
    assert (rc0, rc1) == (0, 0), err0 + err1
    return out / "straight"


@pytest.fixture(scope="module")
def fsdp_stopped(data_dir, tmp_path_factory):
    """The same run, stopped by a SIGTERM that reaches rank 1 only, in step 2: both ranks stop after
    step 2 with a sharded checkpoint. Returns the run directory (tests resume copies of it) and each
    rank's (exit status, stderr)."""
    out = tmp_path_factory.mktemp("fsdp_stopped")
    ranks = two_ranks(lambda rank: fsdp_args(data_dir, out, "--run_name=stopped"), (None, RANK1_SIGTERM_IN_STEP_2))
    assert [rc for rc, _ in ranks] == [143, 143], ranks[0][1] + ranks[1][1]
    return out / "stopped", ranks


def resumable_copy(run_dir, to):
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(".lock"))
    return to


# Each rank, in its second checkpoint (step 6): its shards written, then cut to half, then kill -9.
KILLED_IN_THE_SECOND_SHARDED_SAVE = """
import os, signal, sys
from pathlib import Path
import torch.distributed.checkpoint as dcp
import train
real, calls = dcp.FileSystemWriter.write_data, []
def write_data(self, plan, planner):
    calls.append(1)
    written = real(self, plan, planner)
    if len(calls) == 2:
        written.wait()
        for f in Path(self.path).glob(f"__{os.environ['RANK']}_*"):
            os.truncate(f, f.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return written
dcp.FileSystemWriter.write_data = write_data
sys.exit(train.cli(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def fsdp_killed(data_dir, tmp_path_factory, fsdp_stopped):
    """The stopped run (a copy) resumed at step 2 and killed (kill -9, both ranks) in the middle of its
    sharded checkpoint write of step 6; resumed at 3 and killed in its second step (step 5); resumed at
    3 to the end. Returns the run directory and what each kill left: exit statuses, the checkpoint's
    step, whether a half-written .ckpt.tmp/ is there."""
    run_dir = resumable_copy(fsdp_stopped[0], tmp_path_factory.mktemp("fsdp_killed") / "killed")
    args = fsdp_args(data_dir, run_dir.parent, "--run_name=killed", "--resume=true")
    left = {}
    for kill, code in (("in_a_checkpoint_write", KILLED_IN_THE_SECOND_SHARDED_SAVE), ("in_a_step", KILL_9_IN_STEP_2)):
        (rc0, _), (rc1, _) = two_ranks(lambda rank: args, (code, code))
        left[kill] = dict(exit=(rc0, rc1), step=load_checkpoint(run_dir, sharded=True)["step"],
                          tmp=(run_dir / ".ckpt.tmp").is_dir())
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args)
    assert (rc0, rc1) == (0, 0), err0 + err1
    return run_dir, left


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_runs")
def test_fsdp_runs_stop_and_resume_bit_exact_and_their_checkpoints_load_anywhere(data_dir, tmp_path, fsdp_straight,
                                                                                 fsdp_stopped, fsdp_killed):
    """FSDP equals one process to float32 rounding (it sums gradients in another order); an FSDP run
    stopped by SIGTERM, resumed, killed by kill -9 and resumed again repeats the uninterrupted FSDP
    run bit for bit; its sharded checkpoint resumes in one process and under DDP (DCP reshards it); a
    DDP checkpoint (one file) resumes under FSDP."""
    base = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *MODEL]
    fsdp = base + ["--fsdp=true"]
    run(data_dir, tmp_path, "--run_name=one", *MODEL)
    assert_close_runs(tmp_path / "one", fsdp_straight)
    assert sorted(p.name for p in fsdp_straight.iterdir()) == [".lock", "ckpt", "config.json", "log.jsonl",
                                                               "summary.json"]  # no ckpt.pt, nothing left over

    stopped, ((rc0, err0), (rc1, err1)) = fsdp_stopped
    assert (rc0, rc1) == (143, 143) and load_checkpoint(stopped, sharded=True)["step"] == 2, err0 + err1
    assert "checkpoint written to " + str(stopped / "ckpt") in err0
    killed, left = fsdp_killed  # resumed, killed twice, resumed each time at the checkpoint of step 3
    assert left["in_a_step"]["exit"] == (-signal.SIGKILL, -signal.SIGKILL) and left["in_a_step"]["step"] == 3
    assert_same_run(killed, fsdp_straight)

    run(data_dir, tmp_path, "--run_name=one_more", f"--resume={fsdp_straight}", "--max_steps=8", *MODEL)
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: base + ["--run_name=ddp_more", f"--resume={fsdp_straight}",
                                                              "--max_steps=8"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert_close_runs(tmp_path / "one_more", tmp_path / "ddp_more")
    ddp_ckpt = tmp_path / "ddp_more" / "ckpt.pt"
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: fsdp + ["--run_name=fsdp_more", f"--resume={ddp_ckpt}",
                                                              "--max_steps=10"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    run(data_dir, tmp_path, "--run_name=one_10", f"--resume={ddp_ckpt}", "--max_steps=10", *MODEL)
    assert_close_runs(tmp_path / "one_10", tmp_path / "fsdp_more")


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_runs")
def test_kill_9_in_a_sharded_checkpoint_write_keeps_the_previous_one(tmp_path, fsdp_straight, fsdp_killed):
    run_dir, left = fsdp_killed
    assert left["in_a_checkpoint_write"] == dict(exit=(-signal.SIGKILL, -signal.SIGKILL), step=3, tmp=True)
    assert_same_run(run_dir, fsdp_straight)  # bit for bit: losses, evaluations, weights, AdamW state
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6] and not (run_dir / ".ckpt.tmp").exists()

    # a kill between a save's two renames leaves the previous checkpoint as .ckpt.old/: it is the checkpoint
    moved = resumable_copy(run_dir, tmp_path / "moved")
    (moved / "ckpt").rename(moved / ".ckpt.old")
    assert load_checkpoint(moved, sharded=True)["sharded"] == moved / ".ckpt.old"


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_runs")
def test_a_2_rank_checkpoint_resumes_on_1_and_on_2_ranks_and_exports_to_a_file_that_samples(
        data_dir, tmp_path, monkeypatch, capsys, fsdp_straight, fsdp_stopped):
    """2 ranks -> 1 -> 2: the state is resumed exactly; the steps on 1 process sum the gradients in another
    order (float32 rounding apart: the data is the same). A sharded checkpoint is read by sample.py once
    exported to one file, bit for bit the state the shards hold; a damaged shard is refused."""
    run_dir = resumable_copy(fsdp_stopped[0], tmp_path / "moved")
    assert load_checkpoint(run_dir, sharded=True)["step"] == 2  # 2 ranks stopped after step 2, sharded
    args = fsdp_args(data_dir, tmp_path, "--run_name=moved")
    monkeypatch.setattr(train, "train_step", kill_in_step(2, signal.SIGTERM))
    with pytest.raises(Stopped):  # on one process: resumed at 2, stopped after step 4, one file
        train.main(args + ["--resume=true"])
    monkeypatch.undo()
    out = "".join(capsys.readouterr().out.split())  # (the line is wrapped at the terminal's width)
    assert "resumedatstep2from" in out and "world_size2->1" in out  # the manifest's ranks, as a ckpt.pt's
    one = load_checkpoint(run_dir)
    assert one["step"] == 4 and not (run_dir / "ckpt").exists()
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: args + ["--resume=true"])  # on 2 ranks again, sharded
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6] and not (run_dir / "ckpt.pt").exists()
    assert_close_runs(run_dir, fsdp_straight)

    # export: one file, the shards' state bit for bit, that samples; sample.py names the command before it
    assert sample.main(["--ckpt", str(fsdp_straight), "--max_new_tokens", "4"]) == 2
    assert "python -m tools.export_ckpt" in capsys.readouterr().err
    exported = tmp_path / "exported"
    shutil.copytree(fsdp_straight, exported)
    assert export_ckpt.main([str(exported)]) == 0
    file, shards = load_checkpoint(exported), whole(exported)
    assert file["step"] == shards["step"] == 6
    assert all(torch.equal(file["model"][k], v) for k, v in shards["model"].items())
    assert sample.main(["--ckpt", str(exported), "--max_new_tokens", "4"]) == 0
    assert load_checkpoint(exported, sharded=True)["sharded"] == exported / "ckpt"  # a resume keeps the shards

    shard = exported / "ckpt" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert export_ckpt.main([str(exported), "--out", str(tmp_path / "x.pt")]) == 2
    assert "__1_0.distcp is missing or corrupt" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tampered_sharded_checkpoint_runs_no_code_on_2_ranks(data_dir, tmp_path, straight):
    """Resumed under FSDP on 2 ranks, a payload in the index or in a shard's values never runs: both ranks
    exit with the same one line (tests/test_run_dir.py tries every reader in one process)."""
    marker = tmp_path / "payload_ran"

    def in_a_hyperparameter(model, optimizer):
        optimizer.param_groups[0]["foreach"] = Payload(marker)
    sharded_copy(straight, tmp_path / "shard", in_a_hyperparameter)
    sharded_copy(straight, tmp_path / "index")
    replace_in_sharded(tmp_path / "index" / "ckpt", ".metadata", pickle.dumps(Payload(marker)))
    for name, line in (("shard", "holds a value that is not plain data"), ("index", "names io.open")):
        ranks = two_ranks(lambda rank: [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--fsdp=true",
                                        f"--run_name={name}", "--resume=true", "--max_steps=8"])
        assert not marker.exists()
        for rc, err in ranks:
            assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and line in err, err
    # the error leaves nothing of the sharded model for interpreter teardown, where gloo's threads,
    # destroyed unjoined, abort the process (seen once in CI as exit -6 after the right line)
    ranks = two_ranks(lambda rank: [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--fsdp=true",
                                    "--run_name=shard", "--resume=true", "--max_steps=8"], (LEFT_AT_EXIT,) * 2)
    for rc, err in ranks:
        assert rc == 2 and err.endswith("left at exit: []\n"), err


# train.py's command line, then the names of the FSDP objects still alive (none should be)
LEFT_AT_EXIT = """
import gc, sys
import train
rc = train.cli(sys.argv[1:])
print("left at exit:", sorted({type(o).__name__ for o in gc.get_objects() if type(o).__name__.startswith("FSDP")}),
      file=sys.stderr)
sys.exit(rc)
"""
