"""The run directory's promises (docs/reliability.md): kills, signals, full disks, locks, checksums,
resumes that log every record once."""

import argparse
import errno
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from depthres import UserError, checkpoint, files, runlog
from depthres.checkpoint import load_checkpoint
from depthres.run import Stopped
from model import GPTConfig
from model_fast import make_model

from runs import (
    CONFIG,
    ROOT,
    Payload,
    assert_same_run,
    kill_in_step,
    losses,
    poll,
    records,
    replace_in_sharded,
    run,
    sharded_copy,
    steps,
    untimed,
)


def contents(run_dir):
    return {p.name: p.read_bytes() for p in sorted(Path(run_dir).iterdir()) if p.name != ".lock"}


def test_a_fresh_run_never_replaces_a_run(data_dir, tmp_path, straight):
    run(data_dir, tmp_path, "--run_name=a")
    before = contents(tmp_path / "a")
    with pytest.raises(checkpoint.UserError, match=re.escape(
            f"{tmp_path / 'a'} already holds a run (config.json, log.jsonl, ckpt.pt, summary.json): "
            "continue it with --resume=true, or start over with --overwrite=true")):
        run(data_dir, tmp_path, "--run_name=a", "--max_steps=2")
    with pytest.raises(checkpoint.UserError, match="replace it with --overwrite=true, or choose another run_name"):
        run(data_dir, tmp_path, "--run_name=a", f"--resume={straight}")  # another run's checkpoint, into a
    assert contents(tmp_path / "a") == before  # nothing touched

    run(data_dir, tmp_path, "--run_name=a", "--max_steps=2", "--overwrite=true")  # told to: a new run
    assert steps(tmp_path / "a") == [1, 2] and load_checkpoint(tmp_path / "a")["step"] == 2
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["step"] == 2
    with pytest.raises(UserError, match="resume=true continues the run that overwrite=true would delete"):
        run(data_dir, tmp_path, "--run_name=a", "--resume=true", "--overwrite=true")

    (tmp_path / "b").mkdir()  # a run that died before its first checkpoint
    (tmp_path / "b" / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    with pytest.raises(checkpoint.UserError, match=r"already holds a run \(log.jsonl\): replace it with --overwrite"):
        run(data_dir, tmp_path, "--run_name=b")


def test_cli_sigterm_stops_with_a_checkpoint_and_a_second_run_is_refused(data_dir, tmp_path, capsys):
    run_dir = tmp_path / "long"
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=long"]
    first = subprocess.Popen([sys.executable, "train.py", *args, "--max_steps=100000", "--ckpt_interval=0"], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        poll(lambda: (run_dir / "log.jsonl").exists() and records(run_dir))
        assert train.cli(args + ["--resume=true"]) == 2
        assert capsys.readouterr().err == f"error: {run_dir} is in use by another run (pid {first.pid})\n"
        first.send_signal(signal.SIGTERM)
        err = first.communicate(timeout=60)[1]
    finally:
        first.kill()
    assert first.returncode == 143, err  # 128 + SIGTERM
    step = load_checkpoint(run_dir)["step"]
    assert err.splitlines()[-1] == (f"stopped by SIGTERM after step {step}; checkpoint written to "
                                    f"{run_dir / 'ckpt.pt'}; resume with --resume=true")
    assert steps(run_dir)[-1] == step and "Traceback" not in err


def test_the_lock_goes_with_the_process_that_held_it(data_dir, tmp_path):
    run_dir = tmp_path / "test"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from depthres.files import lock_dir; "
                               "lock_dir(sys.argv[1], 'run'); print('locked', flush=True); time.sleep(60)",
                               str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(checkpoint.UserError, match=f"is in use by another run \\(pid {holder.pid}\\)"):
        run(data_dir, tmp_path, "--max_steps=1")
    assert [p.name for p in run_dir.iterdir()] == [".lock"]
    holder.kill()  # kill -9: no chance to clean up
    holder.wait()
    run(data_dir, tmp_path, "--max_steps=1")


def test_a_link_planted_as_the_lock_is_refused_not_followed(data_dir, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("a user's file\n")
    run_dir = tmp_path / "test"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to(outside)
    with pytest.raises(checkpoint.UserError, match="it is a symbolic link"):
        run(data_dir, tmp_path, "--max_steps=1")
    assert outside.read_text() == "a user's file\n"  # neither truncated nor written "PID HOST"


def test_resume_tolerates_a_torn_last_log_line(data_dir, tmp_path, monkeypatch, straight):
    # a kill or a full disk in the middle of an append; blank lines
    foreign = ('{"kind": "note", "step": "two"}\n[1, 2]\n7\n{"kind": "start", "step": 1}\n'  # (round five: tracebacks,
               '{"kind": "note", "step": 2, "tokens_per_s": "fast"}\n')  # one after the last step of every resume)
    for name, tail in (("torn", '{"kind": "train", "step": 5, "lo'), ("blank", "\n\n"), ("foreign", foreign)):
        monkeypatch.setattr(train, "train_step", kill_in_step(5))
        with pytest.raises(KeyboardInterrupt):
            run(data_dir, tmp_path, f"--run_name={name}")
        monkeypatch.undo()
        with open(tmp_path / name / "log.jsonl", "a") as f:
            f.write(tail)
        run(data_dir, tmp_path, f"--run_name={name}", "--resume=true")
        assert_same_run(tmp_path / name, straight)
        assert steps(tmp_path / name) == [1, 2, 3, 4, 5, 6]  # each step once: the records after step 3 were redone


KILLED_IN_THE_SECOND_CHECKPOINT_WRITE = """
import io, os, signal, sys, torch
import train
real, calls = torch.save, []
def save(obj, f, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # the checkpoint of step 6: half of it on disk, then kill -9
        whole = io.BytesIO()
        real(obj, whole)
        f.write(whole.getvalue()[:len(whole.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *args, **kwargs)
torch.save = save
sys.exit(train.cli(sys.argv[1:]))
"""


def test_kill_9_in_a_checkpoint_write_keeps_the_previous_one(data_dir, tmp_path, straight):
    cmd = [sys.executable, "-c", KILLED_IN_THE_SECOND_CHECKPOINT_WRITE, CONFIG, f"--data_dir={data_dir}",
           f"--out_dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    run_dir = tmp_path / "test"
    assert list(run_dir.glob(".ckpt.pt.*.tmp")) and load_checkpoint(run_dir)["step"] == 3  # files.temporary()
    run(data_dir, tmp_path, "--resume=true")
    assert_same_run(run_dir, straight)
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_every_start_records_its_commit_torch_host_and_time(data_dir, tmp_path, monkeypatch):
    """Provenance: a "start" record per start of the run (fresh, then each resume), and the summary's
    UTC span and the commits, torch and hosts of all of them."""
    monkeypatch.setattr(train, "train_step", kill_in_step(4, signal.SIGTERM))
    with pytest.raises(Stopped):
        run(data_dir, tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(runlog, "git_commit", lambda: ("f" * 40, True))  # as if resumed from another, edited checkout
    run(data_dir, tmp_path, "--resume=true")
    starts = records(tmp_path / "test", "start")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    first = starts[0]
    assert [r["step"] for r in starts] == [0, 4] and starts[1]["commit"] == "f" * 40 and starts[1]["dirty"] is True
    if commit.returncode == 0:  # a git checkout (not an exported copy)
        assert first["commit"] == commit.stdout.strip() and isinstance(first["dirty"], bool)
    assert first["torch"] == torch.__version__ and first["host"] == socket.gethostname()
    summary = json.loads((tmp_path / "test" / "summary.json").read_text())
    assert summary["started_utc"] == first["utc"] <= starts[1]["utc"] <= summary["finished_utc"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", summary["finished_utc"])
    assert "f" * 40 + "+dirty" in summary["commits"] and summary["torch"] == [torch.__version__]
    assert summary["hosts"] == [socket.gethostname()]


def test_sigterm_or_ctrl_c_finishes_the_step_and_checkpoints(data_dir, tmp_path, monkeypatch, straight):
    for name, signum in (("term", signal.SIGTERM), ("int", signal.SIGINT)):
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        monkeypatch.setattr(train, "train_step", kill_in_step(4, signum))
        with pytest.raises(Stopped, match=f"stopped by {signal.Signals(signum).name} after step 4") as e:
            run(data_dir, tmp_path, f"--run_name={name}")
        monkeypatch.undo()
        assert e.value.signum == signum and [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
        assert load_checkpoint(tmp_path / name)["step"] == 4 and steps(tmp_path / name) == [1, 2, 3, 4]
        run(data_dir, tmp_path, f"--run_name={name}", "--resume=true")
        assert_same_run(tmp_path / name, straight)

    monkeypatch.setattr(train, "train_step", kill_in_step(4, signal.SIGINT, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: at once
        run(data_dir, tmp_path, "--run_name=twice")
    assert load_checkpoint(tmp_path / "twice")["step"] == 3 and steps(tmp_path / "twice") == [1, 2, 3]


def test_a_full_disk_or_a_read_only_directory_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    run_dir = tmp_path / "test"
    real, calls = train.train_step, []

    def disk_full_from_step_5(*args, **kwargs):  # every write from then on fails with ENOSPC, as on a full disk
        calls.append(1)
        if len(calls) == 5:
            (run_dir / victim).unlink(missing_ok=True)
            (run_dir / victim).symlink_to("/dev/full")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as fixed:  # the temporary's name, known in advance, is the one to fill
        fixed.setattr(files, "temporary", lambda path: path.with_name(f".{path.name}.tmp"))
        for victim, failed in ((".ckpt.pt.tmp", "ckpt.pt"), ("log.jsonl", "log.jsonl")):
            calls.clear()
            monkeypatch.setattr(train, "train_step", disk_full_from_step_5)
            assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--overwrite=true"]) == 2
            monkeypatch.undo()
            err = capsys.readouterr().err
            assert err == (f"error: no space left on device writing {run_dir / failed}; the last checkpoint (step 3) "
                           f"is kept at {run_dir / 'ckpt.pt'}\n")
            assert not list(run_dir.glob(".ckpt.pt*.tmp"))  # the failed write leaves nothing behind
            assert load_checkpoint(run_dir)["step"] == 3
            (run_dir / victim).unlink(missing_ok=True)

    real_open, real_mkdir = os.open, os.mkdir
    read_only = tmp_path / "ro"

    def refuse(fn):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return fn(path, *args, **kwargs)
        return call
    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    monkeypatch.setattr(train, "train_step", None)  # never reached
    assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={read_only}"]) == 2
    assert capsys.readouterr().err == f"error: cannot write {read_only / 'test'}: read-only file system\n"


def flip_a_weight_byte(path):
    raw = bytearray(path.read_bytes())
    weight = torch.load(path, weights_only=True)["model"]["lm_head.weight"].numpy().tobytes()
    at = raw.find(weight) + len(weight) // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_damaged_checkpoint_is_refused_by_its_checksum(data_dir, tmp_path, capsys):
    run(data_dir, tmp_path, "--max_steps=1")
    ckpt = tmp_path / "test" / "ckpt.pt"
    flip_a_weight_byte(ckpt)
    keys = {*checkpoint.CKPT_KEYS, *checkpoint.CKPT_OPTIONAL}
    assert set(torch.load(ckpt, weights_only=True)) == keys  # torch alone does not notice
    message = "ckpt.pt is corrupt: its contents do not match the checksum written with it"
    with pytest.raises(UserError, match=message):
        run(data_dir, tmp_path, "--resume=true", "--max_steps=2")
    import sample
    assert sample.main(["--ckpt", str(ckpt), "--max_new_tokens", "2"]) == 2
    assert message in capsys.readouterr().err
    torch.save({"format": "depthres-ckpt-1", "model": {}}, ckpt)
    with pytest.raises(UserError, match="an older train.py's, without a checksum"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("form", ["file", "sharded"])
@pytest.mark.parametrize("change, message", [
    ({"step": -3}, "its step is -3, not a whole number >= 0"),
    ({"loader": [1, 2]}, "its loader is a list, not a dict"),
], ids=["negative_step", "loader_list"])
def test_other_contents_under_a_recomputed_checksum_are_one_line_for_every_reader(data_dir, tmp_path, capsys, straight,
                                                                                  form, change, message):
    """A checkpoint whose checksum was recomputed over contents train.py never writes: at step -3 it resumed with
    negative learning rates; a loader state that is a list gave a traceback. Every reader refuses it in one line
    (sample.py, given shards, names the export command first)."""
    import sample
    from tools import export_ckpt
    run_dir = tmp_path / "run"
    if form == "sharded":
        sharded_copy(straight, run_dir)
        state = torch.load(run_dir / "ckpt" / "state.pt", weights_only=True)
        replace_in_sharded(run_dir / "ckpt", "state.pt", torch_saved({**state, **change}))
    else:
        shutil.copytree(straight, run_dir, ignore=shutil.ignore_patterns(".lock"))
        checkpoint.save_checkpoint(run_dir / "ckpt.pt", {**load_checkpoint(run_dir / "ckpt.pt"), **change})
    capsys.readouterr()
    statuses = [train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=run",
                           "--resume=true"]), sample.main(["--ckpt", str(run_dir), "--max_new_tokens", "2"])]
    statuses += [export_ckpt.main([str(run_dir)])] if form == "sharded" else []
    err = capsys.readouterr().err.splitlines()
    assert statuses == [2, 2, 2][:len(statuses)] and len(err) == len(statuses), err
    assert all(line.startswith("error: ") for line in err), err
    assert all(message in line for line in err[::2]), err  # train and export (sample names the export, as always)

# ----------------------------------------------------------------------------------------------
# Reliability, round four: no code is ever executed from a sharded checkpoint


def readers(data_dir, run_dir):
    """Each reader of a checkpoint, on run_dir, as its command line runs it: (name, exit status)."""
    import sample
    from tools import diagnose, export_ckpt

    yield "train", train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={run_dir.parent}",
                              f"--run_name={run_dir.name}", "--resume=true"])
    yield "export", export_ckpt.main([str(run_dir)])
    yield "sample", sample.main(["--ckpt", str(run_dir), "--max_new_tokens", "2"])
    yield "diagnose", diagnose.main(["--ckpt", str(run_dir), "--data_dir", str(data_dir)])


@pytest.mark.parametrize("where", ["index", "shard", "foreign"])
def test_a_tampered_sharded_checkpoint_runs_no_code_on_any_reader(data_dir, tmp_path, capsys, straight, where):
    """A payload in DCP's index (.metadata, which torch unpickles with plain pickle) or in a shard's
    non-tensor values (AdamW's hyperparameters, which torch loads with weights_only=False), its manifest
    entry recomputed, never runs: train, export_ckpt, sample and diagnose refuse it with one line. So
    does an index that is not a pickle at all."""
    marker = tmp_path / "payload_ran"

    def in_a_hyperparameter(model, optimizer):
        optimizer.param_groups[0]["foreach"] = Payload(marker)  # saved as bytes by DCP, next to lr and eps
    run_dir = sharded_copy(straight, tmp_path / "run", in_a_hyperparameter if where == "shard" else None)
    if where == "index":
        replace_in_sharded(run_dir / "ckpt", ".metadata", pickle.dumps(Payload(marker)))
    if where == "foreign":
        replace_in_sharded(run_dir / "ckpt", ".metadata", b'{"not": "an index"}')
    capsys.readouterr()
    for name, status in readers(data_dir, run_dir):
        err = capsys.readouterr().err
        assert status == 2 and not marker.exists(), (name, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and "weights_only" not in err, (name, err)
        if name in ("train", "export"):  # the two that read the shards
            assert {"index": "names io.open", "shard": "holds a value that is not plain data",
                    "foreign": "is not the index of a sharded checkpoint"}[where] in err, err


@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_checkpoint_of_one_process_exports_bit_for_bit(data_dir, tmp_path, straight, tied):
    """The safe reader and planner load what DCP wrote: every weight and AdamW value, hyperparameters too.
    With tie_embeddings=true too (export failed on every such checkpoint: 'Missing key in checkpoint
    state_dict: optim.state.lm_head.weight.step', the model it loads into having untied them)."""
    from depthres.checkpoint import export
    if tied:
        run(data_dir, tmp_path, "--run_name=tied", "--tie_embeddings=true", "--max_steps=3")
    source = tmp_path / "tied" if tied else straight
    run_dir = sharded_copy(source, tmp_path / "run")  # ckpt.pt replaced by ckpt/
    out, step = export(run_dir)
    a, b = load_checkpoint(source / "ckpt.pt"), load_checkpoint(out)
    assert step == a["step"] == b["step"] and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for i in a["optimizer"]["state"] for x, y in
               zip(a["optimizer"]["state"][i].values(), b["optimizer"]["state"][i].values(), strict=True))


def test_export_never_writes_inside_its_source_nor_over_another_run(tmp_path, capsys, straight):
    """export_ckpt --out into the checkpoint it reads is refused (it overwrote a shard, exit 0); into another
    run's directory or over a file only with --overwrite; never into a run directory a live run holds."""
    from depthres.files import lock_dir
    from tools import export_ckpt

    run_dir = sharded_copy(straight, tmp_path / "run")
    before = contents(run_dir / "ckpt")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "log.jsonl", "ckpt.pt"):
        (other / name).write_bytes((straight / name).read_bytes())
    stranger = tmp_path / "x.pt"
    stranger.write_text("a user's file")

    def export(*args):
        status = export_ckpt.main([str(run_dir), *args])
        return status, capsys.readouterr().err

    for out in (run_dir / "ckpt" / "__0_0.distcp", run_dir / "ckpt" / "new.pt", run_dir / ".ckpt.tmp" / "x.pt"):
        assert export("--out", str(out), "--overwrite") == (2, f"error: --out {out} is inside the checkpoint being "
                                                               f"exported ({out.parent}): writing it would destroy what "
                                                               f"it reads; write to {run_dir / 'ckpt.pt'} (the default) "
                                                               "or outside the run directory\n")
    assert contents(run_dir / "ckpt") == before and not (run_dir / ".ckpt.tmp").exists()
    assert export("--out", str(other / "ckpt.pt")) == (2, f"error: --out {other / 'ckpt.pt'} exists: pass --overwrite to "
                                                          "replace it, or choose another path\n")
    (other / "ckpt.pt").unlink()
    assert export("--out", str(other / "ckpt.pt")) == (
        2, f"error: --out {other / 'ckpt.pt'} is in another run's directory (config.json, log.jsonl): that run's "
           "--resume=true would continue from this export; pass --overwrite if it should, or choose another path\n")
    assert export("--out", str(stranger))[0] == 2 and stranger.read_text() == "a user's file"
    lock = lock_dir(other, "run")  # a live run in it
    try:
        status, err = export("--out", str(other / "ckpt.pt"), "--overwrite")
        assert status == 2 and err == f"error: {other} is in use by another run (pid {os.getpid()})\n"
    finally:
        lock.release()
    assert not (other / "ckpt.pt").exists()
    assert export("--out", str(other / "ckpt.pt"), "--overwrite") == (0, "")
    assert export() == (0, "") and load_checkpoint(run_dir / "ckpt.pt")["step"] == 6  # its own ckpt.pt, again
    assert export() == (0, "")


def test_sharded_saves_over_a_linked_ckpt_keep_saving_and_never_follow_the_link(tmp_path, straight):
    """A run directory whose ckpt/ is a symbolic link (to a checkpoint kept elsewhere): the first save renamed
    the link to .ckpt.old, which rmtree cannot remove, and every save after it failed ('Not a directory'). The
    link is removed, never followed: what it points to is kept as it was."""
    from depthres.checkpoint import STATE_KEYS, save_sharded
    from depthres.distributed import Dist
    elsewhere = sharded_copy(straight, tmp_path / "elsewhere") / "ckpt"
    before = contents(elsewhere)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ckpt").symlink_to(elsewhere)
    ckpt = load_checkpoint(straight / "ckpt.pt")
    model = make_model(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    optimizer = torch.optim.AdamW(model.param_groups(ckpt["train_config"]["weight_decay"]))
    optimizer.load_state_dict(ckpt["optimizer"])
    for _ in range(3):
        save_sharded(run_dir, model, optimizer, {k: ckpt[k] for k in STATE_KEYS}, Dist(0, 1, torch.device("cpu")))
        assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt"] and not (run_dir / "ckpt").is_symlink()
        assert load_checkpoint(run_dir, sharded=True)["step"] == 6
    assert contents(elsewhere) == before


def test_a_failed_sharded_save_leaves_no_partial_shards_and_says_why(tmp_path, straight):
    """A shard write that fails (here: past a file-size limit; torch says only "[enforce fail at
    inline_container.cc:...] file write failed") is one line; the partial shards go, the previous
    checkpoint stays."""
    import resource

    from depthres.checkpoint import save_sharded
    from depthres.distributed import Dist

    run_dir = sharded_copy(straight, tmp_path / "run")
    before = contents(run_dir / "ckpt")
    ckpt = load_checkpoint(straight / "ckpt.pt")
    model = make_model(GPTConfig(**ckpt["model_config"]))
    optimizer = torch.optim.AdamW(model.param_groups(0.1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # the shard is about 600 kB
    try:
        with pytest.raises(checkpoint.UserError) as e:
            save_sharded(run_dir, model, optimizer, {k: ckpt[k] for k in checkpoint.STATE_KEYS},
                         Dist(0, 1, torch.device("cpu")))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"cannot write {run_dir / '.ckpt.tmp'}: a shard would pass this process' file-size "
                            "limit of 100,000 bytes (ulimit -f); raise it, or give the run more ranks")
    assert not (run_dir / ".ckpt.tmp").exists() and contents(run_dir / "ckpt") == before


def test_a_sharded_resume_records_the_change_of_world_size(data_dir, tmp_path, capsys, straight):
    """As a ckpt.pt resume does: the ranks that wrote a sharded checkpoint are in its manifest."""
    run_dir = sharded_copy(straight, tmp_path / "straight")
    manifest = json.loads((run_dir / "ckpt" / "manifest.json").read_text())
    assert manifest["world_size"] == 1
    manifest["world_size"] = 2  # as if two FSDP ranks wrote it: this resume runs in one process
    (run_dir / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    run(data_dir, tmp_path, "--run_name=straight", "--resume=true")
    out = "".join(capsys.readouterr().out.split())  # the line is wrapped at the terminal's width
    assert f"resumedatstep6from{run_dir};changed:" in out and "world_size2->1" in out  # (and out_dir: a copy)
    [record] = records(run_dir, "resume")
    assert record["changed"]["world_size"] == [2, 1]


# In its deletion of the sharded checkpoint that its new ckpt.pt replaces: half of it deleted, then kill -9.
KILLED_IN_THE_REMOVAL_OF_THE_SHARDED_CHECKPOINT = """
import os, shutil, signal, sys
from pathlib import Path
import train
real = shutil.rmtree
def rmtree(path, *args, **kwargs):
    path = Path(path)
    if (path / "manifest.json").is_file():
        for name in ("manifest.json", "state.pt"):
            (path / name).unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args, **kwargs)
shutil.rmtree = rmtree
sys.exit(train.cli(sys.argv[1:]))
"""


def test_kill_9_while_a_ckpt_pt_replaces_a_sharded_checkpoint_leaves_one_whole_checkpoint(data_dir, tmp_path,
                                                                                           capsys, straight):
    """A one-process (or DDP) run resumed from an FSDP run's ckpt/ writes ckpt.pt, then deletes ckpt/: a kill
    in the deletion left a half-deleted ckpt/ beside the new ckpt.pt, and resume, sample.py and the tools
    refused the run. ckpt/ is now renamed aside before it is deleted: ckpt.pt is the run's one checkpoint,
    and the resume removes what the kill left."""
    run_dir = sharded_copy(straight, tmp_path / "run")  # the straight run at step 6, as ckpt/
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=run", "--resume=true",
            "--max_steps=9"]
    done = subprocess.run([sys.executable, "-c", KILLED_IN_THE_REMOVAL_OF_THE_SHARDED_CHECKPOINT, *args], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert load_checkpoint(run_dir, sharded=True)["step"] == 9 and "sharded" not in load_checkpoint(run_dir, sharded=True)
    import sample
    assert sample.main(["--ckpt", str(run_dir), "--max_new_tokens", "2"]) == 0, capsys.readouterr().err
    run(data_dir, tmp_path, "--run_name=run", "--resume=true", "--max_steps=9")  # its final evaluations redone
    assert steps(run_dir) == list(range(1, 10))
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "ckpt.pt", "config.json", "log.jsonl", "summary.json"]


def torch_saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def edit_manifest(change):
    def edit(ckpt_dir):
        manifest = json.loads((ckpt_dir / "manifest.json").read_text())
        change(manifest)
        (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))
    return edit


@pytest.mark.parametrize("change, message", [
    (edit_manifest(lambda m: m["files"].update({"state.pt": 5})),
     "its manifest.json lists 'state.pt' as 5, not a file name with its bytes and sha256"),
    (edit_manifest(lambda m: m.pop("step")), "its manifest.json has no step (a whole number >= 0), got None"),
    (edit_manifest(lambda m: m.update(files={})),
     "its manifest.json does not list the files it holds (.metadata and state.pt at least), got {}"),
    (edit_manifest(lambda m: m["files"].update({"../../x": m["files"]["state.pt"]})),
     "its manifest.json lists '../../x' as"),
    (lambda d: replace_in_sharded(d, "state.pt", torch_saved(argparse.Namespace(format="depthres-ckpt-2"))),
     "state.pt is not a run state (UnpicklingError reading it): it was not written by train.py, or was altered"),
    (lambda d: replace_in_sharded(d, "state.pt", torch_saved([1, 2])),
     "state.pt is not a run state (a list without the keys of format 'depthres-ckpt-2')"),
], ids=["entry_not_an_object", "no_step", "empty_files", "path_in_files", "non_tensor_state", "list_state"])
def test_a_bad_manifest_or_run_state_is_one_line_for_every_reader(data_dir, tmp_path, capsys, straight, change,
                                                                   message):
    """Beside a ckpt.pt (sample.py reads the manifest's step to pick the newer one) or alone."""
    run_dir = sharded_copy(straight, tmp_path / "run")
    change(run_dir / "ckpt")
    capsys.readouterr()
    for name, status in readers(data_dir, run_dir):
        err = capsys.readouterr().err
        assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, (name, err)
        assert "weights_only" not in err and (name in ("sample", "diagnose") or message in err), (name, err)
    if "manifest.json" in message:  # beside a ckpt.pt, whose step the manifest's is compared with
        (run_dir / "ckpt.pt").write_bytes((straight / "ckpt.pt").read_bytes())
        assert __import__("sample").main(["--ckpt", str(run_dir), "--max_new_tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run_dir / 'ckpt'} is not a whole sharded checkpoint: {message}"), err
        assert err.endswith("; use an intact copy or another checkpoint\n") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------------------------
# Reliability, round two: no record doubled, a huge loss is a divergence, every bad input one line


def record_keys(run_dir):
    return [(r["kind"], r.get("split"), r["step"]) for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def test_an_index_that_points_outside_its_checkpoint_is_refused(data_dir, tmp_path, capsys, straight):
    """DCP's index names the file of each tensor (relative_path): one outside the checkpoint, or not in its
    manifest, was followed (a file no checksum covers loaded and exported, exit 0). Every reader refuses it."""
    import dataclasses
    run_dir = sharded_copy(straight, tmp_path / "run")
    shutil.copy(run_dir / "ckpt" / "__0_0.distcp", run_dir / "outside.distcp")
    index = checkpoint.read_index(run_dir / "ckpt")
    index.storage_data = {k: dataclasses.replace(v, relative_path="../outside.distcp")
                          for k, v in index.storage_data.items()}
    replace_in_sharded(run_dir / "ckpt", ".metadata", pickle.dumps(index))
    capsys.readouterr()
    for name, status in readers(data_dir, run_dir):
        err = capsys.readouterr().err
        assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, (name, err)
        if name in ("train", "export"):
            assert (f"{run_dir / 'ckpt' / '.metadata'} names '../outside.distcp' as a file of the checkpoint, which its "
                    "manifest.json does not list") in err, err


def test_a_sharded_checkpoint_that_does_not_fit_its_model_is_one_line(tmp_path, capsys, straight):
    """DCP's load error (a run state whose model has a layer more than its shards) carried every rank's remote
    traceback inside the `error:` line (26 lines): it is now the error's first line."""
    from tools import export_ckpt
    run_dir = sharded_copy(straight, tmp_path / "run")
    state = torch.load(run_dir / "ckpt" / "state.pt", weights_only=True)
    state["model_config"]["n_layer"] = 3
    replace_in_sharded(run_dir / "ckpt", "state.pt", torch_saved(state))
    capsys.readouterr()
    assert export_ckpt.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'ckpt'} cannot be loaded into this model (RuntimeError: Missing key in "
                          "checkpoint state_dict: model.blocks.2.") and err.count("\n") == 1, err


def test_a_resumed_finished_run_logs_each_record_once(data_dir, tmp_path, straight):
    run_dir = tmp_path / "done"
    run(data_dir, tmp_path, "--run_name=done")
    once = record_keys(run_dir)
    assert len(once) == len(set(once)) and ("eval", "test", 6) in once
    run(data_dir, tmp_path, "--run_name=done", "--resume=true")  # a finished run: its final evaluations redone
    resumed = [k for k in record_keys(run_dir) if k[0] not in ("resume", "start")]
    assert resumed == [k for k in once if k[0] != "start"]  # and the resume, recorded with its start:
    assert record_keys(run_dir).count(("resume", None, 6)) == 1 and record_keys(run_dir).count(("start", None, 6)) == 1
    assert untimed(run_dir) == untimed(straight)
    # killed after the last checkpoint, before summary.json: the same (the resume record of step 6 replaced)
    (run_dir / "summary.json").unlink()
    run(data_dir, tmp_path, "--run_name=done", "--resume=true")
    assert [k for k in record_keys(run_dir) if k[0] not in ("resume", "start")] == [k for k in once if k[0] != "start"]
    assert (run_dir / "summary.json").exists() and record_keys(run_dir).count(("start", None, 6)) == 1
    assert record_keys(run_dir).count(("resume", None, 6)) == 1 and record_keys(run_dir).count(("start", None, 0)) == 1
    speed = statistics.median(r["tokens_per_s"] for r in records(run_dir))  # the run's, kept from its log
    assert json.loads((run_dir / "summary.json").read_text())["tokens_per_s"] == pytest.approx(speed)


def test_a_finite_but_huge_loss_is_a_divergence_and_its_resume_says_so_again(data_dir, tmp_path, capsys):
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--lr=3e3", "--min_lr=0", "--grad_clip=0",
            "--warmup_steps=0", "--max_steps=8"]
    for extra in ([], ["--resume=true"]):
        assert train.cli(args + extra) == 2
        err = capsys.readouterr().err
        assert re.search(r"error: loss \S+ at step \d is above 23.1 nats \(4 ln\(vocab\), far worse than a uniform "
                         r"guess\): training diverged and stopped before this update; (no checkpoint was written|the "
                         r"last good checkpoint \(step \d\) is kept at .*ckpt.pt)\. Try a lower lr", err), err
        assert "Traceback" not in err
        # the run directory tells too (experiments/sweep.py tabulates the run as diverged): one record, the last
        last = json.loads((tmp_path / "test" / "log.jsonl").read_text().splitlines()[-1])
        assert last["kind"] == "diverged" and err.endswith(f"error: {last['error']}\n") and len(records(tmp_path / "test",
                                                                                                 "diverged")) == 1
    assert runlog.perplexity(800.0) == math.inf and runlog.perplexity(2.0) == pytest.approx(math.exp(2.0))


def test_a_huge_val_loss_stops_before_the_checkpoint(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: (800.0, 1024))
    with pytest.raises(UserError, match=r"val loss 800 at step 3 is above 23.1 nats .* stopped before this "
                                            r"checkpoint; no checkpoint was written"):
        run(data_dir, tmp_path)
    assert not (tmp_path / "test" / "ckpt.pt").exists()


def test_sigterm_during_the_final_evaluations_stops_gracefully(data_dir, tmp_path, monkeypatch, straight):
    real, calls = train.evaluate, []

    def evaluate(model, data_dir, split, *args, **kwargs):  # SIGTERM while the last step's val evaluation runs
        calls.append(split)
        out = real(model, data_dir, split, *args, **kwargs)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    monkeypatch.setattr(train, "evaluate", evaluate)
    with pytest.raises(Stopped, match="stopped by SIGTERM after step 6; checkpoint written to"):
        run(data_dir, tmp_path, "--run_name=late")
    monkeypatch.undo()
    assert calls == ["val", "val"]  # the test evaluation did not start
    assert not (tmp_path / "late" / "summary.json").exists() and load_checkpoint(tmp_path / "late")["step"] == 6
    run(data_dir, tmp_path, "--run_name=late", "--resume=true")
    assert untimed(tmp_path / "late") == untimed(straight) and steps(tmp_path / "late") == [1, 2, 3, 4, 5, 6]
    assert len(record_keys(tmp_path / "late")) == len(set(record_keys(tmp_path / "late")))


def test_resume_true_without_a_checkpoint_starts_the_run(data_dir, tmp_path, monkeypatch, capsys, straight):
    monkeypatch.setattr(train, "train_step", kill_in_step(2, signal.SIGTERM))
    with pytest.raises(Stopped):  # a SIGTERM before the first checkpoint writes one at step 2 ...
        run(data_dir, tmp_path, "--run_name=early", "--ckpt_interval=0")
    monkeypatch.setattr(train, "train_step", kill_in_step(2))
    with pytest.raises(KeyboardInterrupt):  # ... a kill does not
        run(data_dir, tmp_path, "--run_name=killed")
    monkeypatch.undo()
    assert not (tmp_path / "killed" / "ckpt.pt").exists() and steps(tmp_path / "killed") == [1]
    capsys.readouterr()
    for name in ("killed", "never_started"):  # a requeue script that always passes --resume=true
        run(data_dir, tmp_path, f"--run_name={name}", "--resume=true")
        assert f"note: {tmp_path / name} holds no checkpoint yet: starting the run from step 0" in capsys.readouterr().err
        assert untimed(tmp_path / name) == untimed(straight) and steps(tmp_path / name) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(UserError, match="no checkpoint at"):  # a checkpoint named that is not there
        run(data_dir, tmp_path, "--run_name=named", f"--resume={tmp_path / 'named' / 'ckpt.pt'}")


def test_a_resume_past_max_steps_is_refused(data_dir, tmp_path, straight):
    message = "checkpoint .*straight is at step 6, past this run's last step 2: resume with max_steps >= 6"
    with pytest.raises(UserError, match=message):
        run(data_dir, straight.parent, "--run_name=straight", "--resume=true", "--max_steps=2")
    with pytest.raises(UserError, match=message):  # from another run's checkpoint too
        run(data_dir, tmp_path, f"--resume={straight}", "--max_steps=2")


def test_a_checkpoint_from_before_newer_keys_still_resumes_and_samples(data_dir, tmp_path, monkeypatch, straight):
    # written by the train.py before mlp_hidden and fsdp existed: its configs lack them
    monkeypatch.setattr(train, "train_step", kill_in_step(5))
    with pytest.raises(KeyboardInterrupt):
        run(data_dir, tmp_path, "--run_name=old")
    monkeypatch.undo()
    path = tmp_path / "old" / "ckpt.pt"
    ckpt = load_checkpoint(path)
    del ckpt["model_config"]["mlp_hidden"], ckpt["train_config"]["fsdp"]
    checkpoint.save_checkpoint(path, ckpt)
    run(data_dir, tmp_path, "--run_name=old", "--resume=true")
    assert losses(tmp_path / "old") == losses(straight)
    import sample
    assert sample.main(["--ckpt", str(path), "--max_new_tokens", "2"]) == 0


# ----------------------------------------------------------------------------------------------
# Reliability, round three: a resume keeps the run's identity and records what it changed; a failed
# compilation and a stray WORLD_SIZE are one line


def test_a_resume_keeps_the_runs_identity_and_names_the_key_that_was_set(data_dir, tmp_path, straight):
    before = contents(straight)
    with pytest.raises(UserError, match=re.escape(
            "holds another model (seq_len: 32 there, 64 here (the model's block_size follows it)); resume with its "
            "config")):
        run(data_dir, straight.parent, "--run_name=straight", "--resume=true", "--seq_len=64")
    for args, message in (
            (["--seed=5"], "was trained with seed=0; a resume cannot change seed (5 here: the initial weights): "
                           "resume with seed=0, or start a fresh run under another run_name"),
            (["--data_seed=5"], "a resume cannot change data_seed (5 here: the order of the batches)"),
            (["--seed=5", "--data_seed=6"], "was trained with seed=0, data_seed=0; a resume cannot change seed (5 here: "
                                            "the initial weights) or data_seed (6 here: the order of the batches)"),
            # round five: max_tokens and batch_tokens changed trained half the asked tokens, while config.json and
            # the summary (steps x batch_tokens, as the tools count) overstated them
            (["--batch_tokens=512", "--max_steps=0", "--max_tokens=4096"],
             "was trained with batch_tokens=256; a resume cannot change batch_tokens (512 here: the tokens of a step: a "
             "run's tokens are its steps x batch_tokens, as its summary and the tools count them): resume with "
             "batch_tokens=256")):
        with pytest.raises(UserError, match=re.escape(message)):
            run(data_dir, straight.parent, "--run_name=straight", "--resume=true", *args)
    with pytest.raises(UserError, match="a resume cannot change seed"):  # from another run's checkpoint too
        run(data_dir, tmp_path, "--run_name=copy", f"--resume={straight}", "--seed=5")
    assert contents(straight) == before


def test_a_resume_records_what_changed_and_at_which_step(data_dir, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "test"
    monkeypatch.setattr(train, "train_step", kill_in_step(5))
    with pytest.raises(KeyboardInterrupt):
        run(data_dir, tmp_path)
    monkeypatch.undo()
    path = run_dir / "ckpt.pt"
    ckpt = load_checkpoint(path)
    assert ckpt["world_size"] == 1
    ckpt["world_size"] = 2  # as if two ranks wrote it (torchrun): this resume runs in one process
    checkpoint.save_checkpoint(path, ckpt)
    capsys.readouterr()
    run(data_dir, tmp_path, "--resume=true", "--depth_impl=reference", "--eval_tokens=512")
    assert (f"resumed at step 3 from {run_dir}; changed: eval_tokens 1024 -> 512, depth_impl 'two_phase' -> 'reference' "
            "(execution only: equal to float rounding), world_size 2 -> 1\n") in capsys.readouterr().out
    changed = {"eval_tokens": [1024, 512], "depth_impl": ["two_phase", "reference"], "world_size": [2, 1]}
    assert records(run_dir, "resume") == [{"kind": "resume", "step": 3, "from": str(run_dir), "changed": changed}]
    run(data_dir, tmp_path, "--resume=true")  # the finished run, back to its keys: a record at step 6
    assert records(run_dir, "resume") == [
        {"kind": "resume", "step": 3, "from": str(run_dir), "changed": changed},
        {"kind": "resume", "step": 6, "from": str(run_dir),
         "changed": {"eval_tokens": [512, 1024], "depth_impl": ["reference", "two_phase"]}}]
    second = records(run_dir, "resume")
    run(data_dir, tmp_path, "--resume=true")  # resumed at the same step again: its record replaced, not doubled
    assert records(run_dir, "resume") == second
    assert len(record_keys(run_dir)) == len(set(record_keys(run_dir)))


@pytest.mark.parametrize("form", ["file", "sharded"])
def test_a_resume_that_changes_adamws_settings_trains_with_them(data_dir, tmp_path, straight, form):
    """weight_decay, beta1, beta2 and eps changed on a resume are AdamW's from the resume's first step (they
    were recorded as changed, but the checkpoint's were kept): bit for bit the run whose checkpoint already
    held them. weight_decay is the decay group's; the other group (gains, routing parameters) keeps 0.0. A
    ckpt.pt (load_state_dict) and a sharded ckpt/ (DCP's set_state_dict) alike."""
    new = {"weight_decay": 0.5, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}
    settings = [(new["weight_decay"], (new["beta1"], new["beta2"]), new["eps"]), (0.0, (new["beta1"], new["beta2"]),
                                                                                  new["eps"])]

    def holding_them(groups):
        for group, (weight_decay, betas, eps) in zip(groups, settings, strict=True):
            group.update(weight_decay=weight_decay, betas=betas, eps=eps)

    def source(name, edit=None):  # a copy of the straight run at step 6, its AdamW groups edited
        if form == "sharded":
            return sharded_copy(straight, tmp_path / name, edit and (lambda model, optimizer: edit(optimizer.param_groups)))
        shutil.copytree(straight, tmp_path / name, ignore=shutil.ignore_patterns(".lock"))
        ckpt = load_checkpoint(tmp_path / name / "ckpt.pt")
        if edit:
            edit(ckpt["optimizer"]["param_groups"])
            checkpoint.save_checkpoint(tmp_path / name / "ckpt.pt", ckpt)
        return tmp_path / name
    flags = [f"--{k}={v}" for k, v in new.items()] + ["--max_steps=9"]
    run(data_dir, tmp_path, "--run_name=changed", f"--resume={source('old')}", *flags)
    run(data_dir, tmp_path, "--run_name=reference", f"--resume={source('new', holding_them)}", *flags)
    assert_same_run(tmp_path / "changed", tmp_path / "reference")
    groups = load_checkpoint(tmp_path / "changed")["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in groups] == settings

def test_a_failed_compilation_is_one_line_and_a_plain_rerun_starts_the_run(data_dir, tmp_path, monkeypatch, capsys):
    from torch._inductor.exc import InductorError, InvalidCxxCompiler

    class Uncompilable(torch.nn.Module):  # what torch.compile gives without a working C++ compiler
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args, **kwargs):
            raise InductorError(InvalidCxxCompiler(), None)  # at the first call; torch's message runs to 108 lines
    monkeypatch.setattr(train, "compile_model", Uncompilable)
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]
    assert train.cli(args + ["--compile=true"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: compile=true, but torch\.compile failed at step 1 \(InductorError: InvalidCxxCompiler: "
                        r"No working C\+\+ compiler found in torch\._inductor\.config\.cpp\.cxx: [^\n]*\); no checkpoint was "
                        r"written: run without compile=true, or fix the compiler \(on CPU torch\.compile needs a working "
                        r"C\+\+ compiler: g\+\+ or clang, or the one \$CXX names\), then run the same command again\n", err)
    assert sorted(p.name for p in (tmp_path / "test").iterdir()) == [".lock", "config.json", "log.jsonl"]
    assert train.cli(args) == 0  # not "already holds a run": it never logged a step
    assert (f"note: {tmp_path / 'test'} holds a run that never logged a step (config.json, log.jsonl): starting it "
            "afresh\n") in capsys.readouterr().err
    assert steps(tmp_path / "test") == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set in the environment, but RANK, MASTER_ADDR, MASTER_PORT are not: start "
                          "the ranks with torchrun (torchrun --nproc_per_node=2 train.py ...), or unset WORLD_SIZE to "
                          "train in one process"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment is not a whole number >= 1: torchrun sets it for each "
                            "rank; unset it to train in one process"),
    ({"RANK": "1"}, "RANK=1 in the environment is not below WORLD_SIZE=1"),
], ids=["world_size", "not_a_number", "rank"])
def test_a_stray_launcher_variable_is_one_line(data_dir, tmp_path, monkeypatch, capsys, env, message):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train, "build", None)  # never reached
    assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("wrote", ["9.9.9", None, "this torch"])
def test_an_index_a_newer_torch_wrote_names_the_versions_not_tampering(tmp_path, capsys, straight, wrote):
    """The index reader admits what this torch's DCP writes (INDEX_CLASSES). An index that names another torch
    class, from a checkpoint another torch wrote (its manifest's "torch"; older manifests have none), is one line
    that names both versions; written by this very torch, the same name is a refusal as before."""
    run_dir = sharded_copy(straight, tmp_path / "run")
    replace_in_sharded(run_dir / "ckpt", ".metadata", b"ctorch.distributed.checkpoint.metadata\nFutureStorageMetadata\n.")
    manifest = json.loads((run_dir / "ckpt" / "manifest.json").read_text())
    manifest["torch"] = torch.__version__ if wrote == "this torch" else wrote
    (run_dir / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as e:
        checkpoint.read_index(run_dir / "ckpt")
    index = run_dir / "ckpt" / ".metadata"
    if wrote == "this torch":
        assert str(e.value).startswith(f"{index} is not the index of a sharded checkpoint (it names "
                                       "torch.distributed.checkpoint.metadata.FutureStorageMetadata, which an index never holds)")
    else:
        assert str(e.value) == (
            f"{index} names torch.distributed.checkpoint.metadata.FutureStorageMetadata, which this reader does not admit "
            f"under torch {torch.__version__}; the checkpoint was written by torch {wrote or '(not recorded)'}, whose DCP "
            "may hold it: read the checkpoint with that torch (requirements.txt states the tested range), or admit the "
            "name in depthres.checkpoint.INDEX_CLASSES once it is known to be plain data")


def test_a_config_that_declares_more_than_its_weights_hold_is_refused_before_a_model_is_built(tmp_path, straight,
                                                                                                monkeypatch):
    """sample.py, diagnose and rescore built the model a checkpoint's config declares, then found its weights did
    not fit (n_layer=10^6: 59 s and 3.6 GB before the refusal). The config's layers and embedding are checked
    against the weights first."""
    ckpt = load_checkpoint(straight)
    ckpt["model_config"]["n_layer"] = 10**6
    del ckpt["checksum"]
    checkpoint.save_checkpoint(tmp_path / "ckpt.pt", ckpt)  # its checksum recomputed, as anyone can
    monkeypatch.setattr(checkpoint, "make_model", None)  # never reached
    with pytest.raises(UserError, match=r"the checkpoint's model does not fit this model.py: its config declares "
                                        r"n_layer=1000000, vocab_size=\d+, n_embd=32; its weights hold 2 layers"):
        checkpoint.load_model(tmp_path / "ckpt.pt")
