"""The run directory: never replaced unasked, one process at a time, its files whole, a resume that drops what came
after its checkpoint, and no code run from a checkpoint."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import sample
import train
from common import UserError
from model_fast import load_model
from tools import diagnose

from runs import Payload, ckpt, records, run, steps


@pytest.fixture
def copied(straight, tmp_path):
    """A copy of the straight run to change: tmp_path / "straight"."""
    return shutil.copytree(straight, tmp_path / "straight")


def test_a_fresh_run_never_replaces_a_run(data_dir, tmp_path, copied):
    with pytest.raises(UserError, match="already holds a run .*--resume=true.*--overwrite=true"):
        run(data_dir, tmp_path, "--run_name=straight")
    assert ckpt(copied)["step"] == 6
    with pytest.raises(UserError, match="resume=true continues the run that overwrite=true would delete"):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--overwrite=true")
    run(data_dir, tmp_path, "--run_name=straight", "--overwrite=true", "--max_steps=2")
    assert ckpt(copied)["step"] == 2 and steps(copied) == [1, 2]


def test_a_second_process_on_a_live_run_is_refused(data_dir, tmp_path):
    d = tmp_path / "busy"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR "
                               "| os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                               str(d / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError, match="in use by another run"):
            run(data_dir, tmp_path, "--run_name=busy", "--max_steps=1")
    finally:
        holder.kill()
        holder.wait()
    run(data_dir, tmp_path, "--run_name=busy", "--max_steps=1")  # the lock went with its process


def test_resume_true_without_a_checkpoint_starts_the_run_unless_the_run_had_one(data_dir, tmp_path, copied, capsys):
    """A requeue may always pass --resume=true; a run whose checkpoint is gone (deleted, an older FSDP ckpt/) is refused."""
    run(data_dir, tmp_path, "--run_name=new", "--resume=true", "--max_steps=1")
    assert "holds no checkpoint yet: starting the run from step 0" in capsys.readouterr().err
    assert steps(tmp_path / "new") == [1]
    (copied / "ckpt.pt").unlink()
    before = {p.name: p.read_bytes() for p in copied.iterdir()}
    for more in ([], ["--ckpt_interval=0"]):  # (its own settings count, not this command's)
        with pytest.raises(UserError, match="holds a run's records .* but no ckpt.pt to resume"):
            run(data_dir, tmp_path, "--run_name=straight", "--resume=true", *more)
        (copied / "summary.json").unlink(missing_ok=True)
    (copied / "summary.json").write_bytes(before["summary.json"])
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == before
    killed = tmp_path / "killed"  # in its first checkpoint's save (step 3): its records reach step 3, not past it
    killed.mkdir()
    (killed / "log.jsonl").write_text(json.dumps({"kind": "eval", "split": "val", "step": 3, "loss": 5.0}) + "\n")
    run(data_dir, tmp_path, "--run_name=killed", "--resume=true")
    assert steps(killed) == [1, 2, 3, 4, 5, 6]


def test_the_files_of_a_finished_run_and_its_resumes(data_dir, tmp_path, copied, straight):
    """Its files. A resume of another run or past its end is refused; its own, by another depth_impl (execution only),
    scores again and logs each record once; its summary adds seconds and tokens/s over every segment, keeps the first
    start, and records every segment's commit (+dirty), torch and host. A resume may change AdamW's settings."""
    assert sorted(p.name for p in straight.iterdir()) == [".lock", "ckpt.pt", "config.json", "log.jsonl", "summary.json"]
    state = ckpt(straight)
    assert {"model", "optimizer", "model_config", "train_config", "tokenizer", "step", "loader", "rng"} <= set(state)
    model, _ = load_model(straight)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())
    assert train.TrainConfig(**state["train_config"]).steps == 6
    for arg, message in [("--n_embd=64", "n_embd: 32 there, 64 here"), ("--seed=1", "seed: 0 there, 1 here"),
                         ("--max_steps=4", "at step 6, past this run's last step 4")]:
        with pytest.raises(UserError, match=message):
            run(data_dir, tmp_path, "--run_name=straight", "--resume=true", arg)
    first = json.loads((straight / "summary.json").read_text())
    assert first["commits"] and first["torch"] == [str(torch.__version__)] and len(first["hosts"]) == 1
    assert first["started_utc"] <= first["finished_utc"] and first["tokens_per_s"] > 0
    again = run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--depth_impl=reference")
    assert again["seconds"] > ckpt(straight)["segments"]["seconds"] and again["tokens_per_s"] == first["tokens_per_s"]
    assert again["started_utc"] == first["started_utc"] and again["commits"] == first["commits"]
    logged = [(r["kind"], r.get("split"), r["step"]) for r in records(copied, "eval")]
    assert logged == [(r["kind"], r.get("split"), r["step"]) for r in records(straight, "eval")]
    assert steps(copied) == steps(straight)
    run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8", "--weight_decay=0.5")
    groups = ckpt(copied)["optimizer"]["param_groups"]
    assert {g["weight_decay"] for g in groups} == {0.5, 0.0}  # matrices decay, the rest does not


def test_no_checkpoint_runs_code_in_any_reader(data_dir, tmp_path, capsys):
    """Every torch.load is weights_only=True: a checkpoint holding a pickled payload is refused, never executed."""
    marker = tmp_path / "payload_ran"
    d = tmp_path / "bad"
    d.mkdir()
    torch.save({"step": 1, "model": {}, "x": Payload(marker)}, d / "ckpt.pt")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        run(data_dir, tmp_path, "--run_name=bad", "--resume=true")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_model(d)
    assert sample.main(["--ckpt", str(d)]) == 2 and "not a readable checkpoint" in capsys.readouterr().err
    assert not marker.exists()
    torch.save({"format": "depthres-ckpt-2", "step": 1}, d / "ckpt.pt")  # an older train.py's
    with pytest.raises(UserError, match="not a checkpoint of this train.py"):
        run(data_dir, tmp_path, "--run_name=bad", "--resume=true")


def spoil(state, what):
    """A checkpoint of configs/test.py with one part that does not fit it (a dict: keys replaced, None: removed)."""
    name = next(k for k in state["model"] if k.endswith("c_q.weight"))
    if isinstance(what, dict):
        return {k: v for k, v in {**state, **what}.items() if v is not None}
    if what == "weight":
        state["model"][name] = torch.zeros(3, 5)
    elif what == "moment":
        state["optimizer"]["state"][name]["exp_avg"] = torch.zeros(7)
    elif what == "no AdamW state":
        state["optimizer"]["state"] = {}
    elif what == "rng":
        state["rng"]["torch"] = torch.zeros(10, dtype=torch.uint8)
    elif what == "no loader":
        del state["loader"]
    elif what == "nan":
        state["model"]["wte.weight"][-1, 0] = float("nan")  # a padded row: no byte id reads it
    else:
        state["loader"]["pos"] = what
    return state


ONLY_A_RESUME_READS = "damaged|another run|does not fit"


@pytest.mark.parametrize("what, named", [
    ("weight", "weight blocks.0.attn.c_q.weight: .3, 5. there"), ("moment", "exp_avg of blocks.0.attn.c_q.weight"),
    ("rng", "RNG state"), ("no loader", "KeyError"), (-5, "position -5"), ("x", "position 'x'"),
    (dict(val_loss="bad"), ONLY_A_RESUME_READS), (dict(val_loss=float("nan")), ONLY_A_RESUME_READS),
    (dict(segments="x"), ONLY_A_RESUME_READS), (dict(segments={"speeds": 5}), ONLY_A_RESUME_READS),
    (dict(model_config={}), ONLY_A_RESUME_READS), ("no AdamW state", ONLY_A_RESUME_READS),
    (dict(tokenizer="gpt2"), "was trained on gpt2 tokens, but .* holds byte tokens")])
def test_a_checkpoint_that_does_not_fit_is_one_line_before_any_step(data_dir, tmp_path, copied, straight, what, named):
    torch.save(spoil(ckpt(copied), what), copied / "ckpt.pt")
    with pytest.raises(UserError, match=named):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8")
    assert steps(copied) == steps(straight)


@pytest.mark.parametrize("damage, named", [(dict(step=-2), "step is -2"), (dict(step=3.0), "step is 3.0"),
                                           (dict(tokenizer=None), "lacks tokenizer"), ("nan", "is not finite")])
def test_a_damaged_checkpoint_is_one_line_in_every_reader(data_dir, tmp_path, copied, capsys, damage, named):
    """A bad step, a missing key, a NaN weight (in a row no token reads, too): refused by the resume, sample.py and
    tools.diagnose, never carried into a new checkpoint."""
    torch.save(spoil(ckpt(copied), damage), copied / "ckpt.pt")
    with pytest.raises(UserError, match=named):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8")
    capsys.readouterr()
    for main, argv in ((sample.main, ["--ckpt", str(copied), "--max_new_tokens", "2"]),
                       (diagnose.main, ["--ckpt", str(copied), "--data_dir", str(data_dir)])):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err


def test_diagnose_writes_over_no_file_it_did_not_make(copied, tmp_path, capsys):
    for name in ("ckpt.pt", "log.jsonl", "summary.json"):
        before = (copied / name).read_bytes()
        assert diagnose.main(["--curves", str(copied), "--out", str(copied / name)]) == 2
        assert "not one diagnose wrote" in capsys.readouterr().err and (copied / name).read_bytes() == before
    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's own figure")
    assert diagnose.main(["--curves", str(copied), "--out", str(tmp_path / "mine.png")]) == 2  # a PNG, not a tool's
    assert diagnose.main(["--curves", str(copied), "--out", str(tmp_path / "c.png")]) == 0
    assert diagnose.main(["--curves", str(copied), "--out", str(tmp_path / "c.png")]) == 0  # its own PNG: replaced


def test_final_eval_tokens_scores_the_whole_split_once_at_the_end(data_dir, tmp_path):
    summary = run(data_dir, tmp_path, "--run_name=whole", "--final_eval_tokens=0")
    val = [r for r in records(tmp_path / "whole", "eval") if r["split"] == "val"]
    whole, _ = train.evaluate(load_model(tmp_path / "whole")[0], train.TokenData(data_dir), "val", 4, 32)
    assert val[-1]["tokens"] > val[-2]["tokens"] and val[-1]["step"] == val[-2]["step"] == summary["step"]
    assert summary["val_loss"] == val[-1]["loss"] and abs(whole - summary["val_loss"]) < 1e-6
    assert summary["final_eval_tokens"] == 0
