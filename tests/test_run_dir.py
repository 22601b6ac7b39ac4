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
from common import UserError, write_atomic
from model_fast import load_model
from tools import diagnose

from runs import Payload, ckpt, records, run, steps


def test_a_fresh_run_never_replaces_a_run(data_dir, tmp_path, straight):
    d = tmp_path / "straight"
    shutil.copytree(straight, d)
    with pytest.raises(UserError, match="already holds a run .*--resume=true.*--overwrite=true"):
        run(data_dir, tmp_path, "--run_name=straight")
    assert ckpt(d)["step"] == 6
    with pytest.raises(UserError, match="resume=true continues the run that overwrite=true would delete"):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--overwrite=true")
    run(data_dir, tmp_path, "--run_name=straight", "--overwrite=true", "--max_steps=2")
    assert ckpt(d)["step"] == 2 and steps(d) == [1, 2]


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


def test_resume_true_without_a_checkpoint_starts_the_run_unless_the_run_had_one(data_dir, tmp_path, straight, capsys):
    """A requeue may always pass --resume=true; a run whose checkpoint is gone (deleted, an older FSDP ckpt/) is refused
    and nothing in it changes."""
    run(data_dir, tmp_path, "--run_name=new", "--resume=true", "--max_steps=1")
    assert "holds no checkpoint yet: starting the run from step 0" in capsys.readouterr().err
    assert steps(tmp_path / "new") == [1]
    d = shutil.copytree(straight, tmp_path / "straight")
    (d / "ckpt.pt").unlink()
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for more in ([], ["--ckpt_interval=0"]):  # (its own settings count, not this command's)
        with pytest.raises(UserError, match="holds a run's records .* but no ckpt.pt to resume"):
            run(data_dir, tmp_path, "--run_name=straight", "--resume=true", *more)
        (d / "summary.json").unlink(missing_ok=True)
    (d / "summary.json").write_bytes(before["summary.json"])
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    killed = tmp_path / "killed"  # in its first checkpoint's save (step 3): its records reach step 3, not past it
    killed.mkdir()
    (killed / "log.jsonl").write_text(json.dumps({"kind": "eval", "split": "val", "step": 3, "loss": 5.0}) + "\n")
    run(data_dir, tmp_path, "--run_name=killed", "--resume=true")
    assert steps(killed) == [1, 2, 3, 4, 5, 6]


def test_a_resume_of_another_run_or_past_its_end_is_refused(data_dir, tmp_path, straight):
    shutil.copytree(straight, tmp_path / "straight")
    for arg, message in [("--n_embd=64", "n_embd: 32 there, 64 here"), ("--seed=1", "seed: 0 there, 1 here"),
                         ("--max_steps=4", "at step 6, past this run's last step 4")]:
        with pytest.raises(UserError, match=message):
            run(data_dir, tmp_path, "--run_name=straight", "--resume=true", arg)
    run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--depth_impl=reference")  # execution only


def test_a_resumed_finished_run_logs_each_record_once(data_dir, tmp_path, straight):
    shutil.copytree(straight, tmp_path / "straight")
    run(data_dir, tmp_path, "--run_name=straight", "--resume=true")
    again = [(r["kind"], r.get("split"), r["step"]) for r in records(tmp_path / "straight", "eval")]
    assert again == [(r["kind"], r.get("split"), r["step"]) for r in records(straight, "eval")]
    assert steps(tmp_path / "straight") == steps(straight)


def test_a_resume_that_changes_adamws_settings_trains_with_them(data_dir, tmp_path, straight):
    shutil.copytree(straight, tmp_path / "straight")
    run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8", "--weight_decay=0.5")
    groups = ckpt(tmp_path / "straight")["optimizer"]["param_groups"]
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
    """A checkpoint of configs/test.py with one part that does not fit it."""
    name = next(k for k in state["model"] if k.endswith("c_q.weight"))
    if what == "weight":
        state["model"][name] = torch.zeros(3, 5)
    elif what == "moment":
        state["optimizer"]["state"][name]["exp_avg"] = torch.zeros(7)
    elif what == "rng":
        state["rng"]["torch"] = torch.zeros(10, dtype=torch.uint8)
    elif what == "no loader":
        del state["loader"]
    else:
        state["loader"]["pos"] = what
    return state


@pytest.mark.parametrize("what, named", [("weight", "weight blocks.0.attn.c_q.weight: .3, 5. there"),
                                         ("moment", "exp_avg of blocks.0.attn.c_q.weight"), ("rng", "RNG state"),
                                         ("no loader", "KeyError"), (-5, "position -5"), ("x", "position 'x'")])
def test_a_checkpoint_that_does_not_fit_is_one_line_before_any_step(data_dir, tmp_path, straight, what, named):
    d = tmp_path / "straight"
    shutil.copytree(straight, d)
    torch.save(spoil(ckpt(d), what), d / "ckpt.pt")
    with pytest.raises(UserError, match=named):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8")
    assert steps(d) == steps(straight)


@pytest.mark.parametrize("damage, named", [(dict(step=-2), "step is -2"), (dict(step=3.0), "step is 3.0"),
                                           (dict(tokenizer=None), "lacks tokenizer"), ("nan", "is not finite")])
def test_a_damaged_checkpoint_is_one_line_in_every_reader(data_dir, tmp_path, straight, capsys, damage, named):
    """A bad step, a missing key, a NaN weight (in a row no token reads, too): refused by the resume, sample.py and
    tools.diagnose, never carried into a new checkpoint."""
    d = shutil.copytree(straight, tmp_path / "straight")
    state = ckpt(d)
    if damage == "nan":
        state["model"]["wte.weight"][-1, 0] = float("nan")  # a padded row: no byte id reads it
    else:
        state = {k: v for k, v in {**state, **damage}.items() if v is not None}
    torch.save(state, d / "ckpt.pt")
    with pytest.raises(UserError, match=named):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8")
    capsys.readouterr()
    for main, argv in ((sample.main, ["--ckpt", str(d), "--max_new_tokens", "2"]),
                       (diagnose.main, ["--ckpt", str(d), "--data_dir", str(data_dir)])):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize("damage", [dict(val_loss="bad"), dict(val_loss=float("nan")), dict(segments="x"),
                                    dict(segments={"speeds": 5}), dict(model_config={}), "no AdamW state"])
def test_a_checkpoint_damaged_in_what_only_a_resume_reads_is_one_line(data_dir, tmp_path, straight, damage):
    d = shutil.copytree(straight, tmp_path / "straight")
    state = ckpt(d)
    if damage == "no AdamW state":
        state["optimizer"]["state"] = {}
    else:
        state.update(damage)
    torch.save(state, d / "ckpt.pt")
    with pytest.raises(UserError, match="damaged|another run|does not fit"):
        run(data_dir, tmp_path, "--run_name=straight", "--resume=true", "--max_steps=8")
    assert steps(d) == steps(straight)


def test_diagnose_writes_over_no_file_it_did_not_make(straight, tmp_path, capsys):
    d = shutil.copytree(straight, tmp_path / "straight")
    for name in ("ckpt.pt", "log.jsonl", "summary.json"):
        before = (d / name).read_bytes()
        assert diagnose.main(["--curves", str(d), "--out", str(d / name)]) == 2
        assert "not one diagnose wrote" in capsys.readouterr().err and (d / name).read_bytes() == before
    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's own figure")
    assert diagnose.main(["--curves", str(d), "--out", str(tmp_path / "mine.png")]) == 2  # a PNG, not a tool's
    assert diagnose.main(["--curves", str(d), "--out", str(tmp_path / "c.png")]) == 0
    assert diagnose.main(["--curves", str(d), "--out", str(tmp_path / "c.png")]) == 0  # its own PNG: replaced


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old\n")

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomic(path, fails)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_the_files_of_a_finished_run(straight):
    assert sorted(p.name for p in straight.iterdir()) == [".lock", "ckpt.pt", "config.json", "log.jsonl", "summary.json"]
    state = ckpt(straight)
    assert {"model", "optimizer", "model_config", "train_config", "tokenizer", "step", "loader", "rng"} <= set(state)
    model, _ = load_model(straight)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())
    assert train.TrainConfig(**state["train_config"]).steps == 6


def test_a_resumed_run_s_summary_adds_up_its_segments_and_records_where_it_ran(data_dir, tmp_path, straight):
    """seconds and tokens/s over every segment (a resume of a finished run keeps them); the first start, the last
    finish, every segment's commit (+dirty), torch and host."""
    first = json.loads((straight / "summary.json").read_text())
    assert first["commits"] and first["torch"] == [str(torch.__version__)] and len(first["hosts"]) == 1
    assert first["started_utc"] <= first["finished_utc"] and first["tokens_per_s"] > 0
    d = tmp_path / "straight"
    shutil.copytree(straight, d)
    again = run(data_dir, tmp_path, "--run_name=straight", "--resume=true")  # finished: the final scores only
    assert again["seconds"] > ckpt(straight)["segments"]["seconds"] and again["tokens_per_s"] == first["tokens_per_s"]
    assert again["started_utc"] == first["started_utc"] and again["commits"] == first["commits"]


def test_final_eval_tokens_scores_the_whole_split_once_at_the_end(data_dir, tmp_path):
    summary = run(data_dir, tmp_path, "--run_name=whole", "--final_eval_tokens=0")
    val = [r for r in records(tmp_path / "whole", "eval") if r["split"] == "val"]
    whole, _ = train.evaluate(load_model(tmp_path / "whole")[0], train.TokenData(data_dir), "val", 4, 32)
    assert val[-1]["tokens"] > val[-2]["tokens"] and val[-1]["step"] == val[-2]["step"] == summary["step"]
    assert summary["val_loss"] == val[-1]["loss"] and abs(whole - summary["val_loss"]) < 1e-6
    assert summary["final_eval_tokens"] == 0
