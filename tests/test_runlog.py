"""What a run reports: progress and ETA, log lines, execution-only keys on resume, Weights & Biases."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

import train
from depthres import UserError, checkpoint, runlog
from depthres.checkpoint import load_checkpoint
from model import GPTConfig

from runs import CONFIG, assert_same_run, kill_in_step, poll, run

# ----------------------------------------------------------------------------------------------
# Progress, execution-only keys, Weights & Biases


def test_eta_is_the_mean_step_time_after_the_first_step():
    now = [100.0]
    progress = runlog.Progress(10, 110, clock=lambda: now[0])  # resumed at step 10 of 110
    now[0] = 130.0  # step 11 took 30 s: compilation, warm-up
    progress.stepped(11)
    assert progress.elapsed() == 30 and progress.eta(11) == 30 * 99  # nothing better known yet
    now[0] = 136.0  # steps 12 to 13: 3 s each
    progress.stepped(13)
    assert progress.elapsed() == 36 and progress.eta(13) == 3 * 97
    assert progress.at(13) == "step  13/110" and runlog.hms(3 * 97) == "0:04:51"


def test_log_lines_say_how_far_the_run_is(data_dir, tmp_path, capsys):
    run(data_dir, tmp_path, "--max_steps=4", "--eval_interval=2")
    out = capsys.readouterr().out
    clock = r"\d+:\d\d:\d\d"
    assert re.search(rf"^step 2/4 \(50\.0%\) \| loss [\d.]+ \| .* ms/step \| {clock} elapsed, ETA {clock}$", out, re.M)
    assert re.search(rf"^step 4/4 \| val loss [\d.]+ \| ppl [\d.]+ \| 1,024 tokens \| {clock} elapsed$", out, re.M)
    lines = [json.loads(line) for line in (tmp_path / "test" / "log.jsonl").read_text().splitlines()]
    assert set(lines.pop(0)) == {"kind", "step", "utc", "commit", "dirty", "torch", "host"}  # the start record
    train_keys = {"kind", "step", "loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step", "elapsed_s", "eta_s"}
    eval_keys = {"kind", "split", "step", "loss", "ppl", "tokens", "elapsed_s"}
    assert [set(r) for r in lines] == [train_keys] * 2 + [eval_keys] + [train_keys] * 2 + [eval_keys] * 2
    assert [r["eta_s"] for r in lines if r["kind"] == "train"][-1] == 0
    elapsed = [r["elapsed_s"] for r in lines]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


def test_a_resume_may_change_execution_only_keys(data_dir, tmp_path, monkeypatch, capsys, straight):
    with monkeypatch.context() as patched:
        patched.setattr(train, "train_step", kill_in_step(5))
        with pytest.raises(KeyboardInterrupt):
            run(data_dir, tmp_path)
    capsys.readouterr()
    run(data_dir, tmp_path, "--resume=true", "--activation_checkpointing=true")
    assert "; changed: activation_checkpointing False -> True (execution only: bit for bit)\n" in capsys.readouterr().out
    assert_same_run(tmp_path / "test", straight)  # recomputing the sublayers changes no bit of the training
    ckpt = load_checkpoint(tmp_path / "test")
    assert ckpt["model_config"]["activation_checkpointing"] is True

    def config(**changes):
        return GPTConfig(**{**ckpt["model_config"], **changes})

    checkpoint.check_resumable(ckpt, "ckpt.pt", config(depth_impl="reference", depth_chunk=2), "byte")
    del ckpt["model_config"]["activation_checkpointing"]  # a checkpoint from before the key existed
    checkpoint.check_resumable(ckpt, "ckpt.pt", config(), "byte")
    with pytest.raises(UserError, match=r"another model \(attnres_block_size: 4 there, 2 here\)"):
        checkpoint.check_resumable(ckpt, "ckpt.pt", config(attnres_block_size=2, depth_chunk=2), "byte")


def test_wandb_log_without_wandb_is_one_line_before_compute(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with monkeypatch.context() as patched:
        patched.setattr(train, "build", None)  # never reached
        assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--wandb_log=true"]) == 2
    assert capsys.readouterr().err == ("error: wandb_log=true needs the wandb package, which is not installed: "
                                       "pip install wandb (or drop wandb_log)\n")
    assert not (tmp_path / "test").exists()
    run(data_dir, tmp_path, "--max_steps=1")  # without wandb_log, wandb is never imported


def wandb_records(path):
    """The records of a W&B run's transaction log, run-<id>.wandb: wandb's protobuf Records in
    LevelDB's log format (a 7-byte header, then blocks of 32 KiB; each record a 7-byte header of
    checksum, length and type, 1: whole, 2: first, 3: middle, 4: last piece; a block's tail shorter
    than a header is padding). A record still being written ends them."""
    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", f"{path} is not a W&B transaction log of the version this test reads"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            return
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def read_wandb_run(offline_run_dir):
    """What an offline W&B run holds: its identity, config, and history {step: {metric: value}}.
    wandb's service may still be writing the log when finish() returns: wait for its exit record."""
    (path,) = Path(offline_run_dir).glob("run-*.wandb")
    poll(lambda: any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)))
    run = {"config": {}, "history": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, project=r.project, name=r.display_name, group=r.run_group, tags=list(r.tags))
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            run["history"].setdefault(record.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})  # _step, _runtime, _timestamp
    return run


def as_logged(record):
    """What runlog.track sends W&B of a record: its numbers, not its flags (a resume or start record has none)."""
    kind = record.get("split", record["kind"])
    return {f"{kind}/{k}": v for k, v in record.items()
            if k not in ("kind", "split", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_wandb_logs_every_record_and_a_resume_continues_its_run(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)), ("WANDB_SILENT", "true"),
                        ("WANDB_CONSOLE", "off")):
        monkeypatch.setenv(name, value)
    args = ["--wandb_log=true", "--wandb_project=tests", "--wandb_group=sweep", "--wandb_tags=block, seed0"]
    with monkeypatch.context() as patched:
        patched.setattr(train, "train_step", kill_in_step(5))  # steps 1 to 4 logged; the checkpoint of step 3
        with pytest.raises(KeyboardInterrupt):
            run(data_dir, tmp_path, *args)
    run_dir = tmp_path / "test"
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    time.sleep(1.01 - time.time() % 1)  # W&B names an offline run's folder by the second: two in one second share it
    run(data_dir, tmp_path, "--resume=true", *args)
    first, resumed = map(read_wandb_run, sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}")))
    for wb in (first, resumed):
        assert (wb["id"], wb["project"], wb["name"], wb["group"], wb["tags"]) == (run_id, "tests", "test", "sweep",
                                                                                 ["block", "seed0"])
    assert resumed["config"] == json.loads((run_dir / "config.json").read_text())  # the resolved config
    assert first["config"]["train"]["resume"] == "" and first["config"]["model"] == resumed["config"]["model"]
    logged = {}  # the finished run's log.jsonl as W&B metrics, by step
    for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()):
        logged.setdefault(r["step"], {}).update(as_logged(r))
    assert sorted(first["history"]) == [1, 2, 3, 4] and sorted(resumed["history"]) == [4, 5, 6]
    assert {s: first["history"][s] for s in (1, 2, 3)} == {s: logged[s] for s in (1, 2, 3)}
    assert first["history"][4]["train/loss"] == logged[4]["train/loss"]  # step 4, trained twice, bit for bit
    assert resumed["history"] == {s: logged[s] for s in (4, 5, 6)}
    assert {"val/loss", "test/loss", "train/eta_s"} <= set(resumed["history"][6])

    # a run without an id file (it did not log to W&B before) starts a W&B run that holds its history
    (run_dir / "wandb_id.txt").unlink()
    run(data_dir, tmp_path, "--resume=true", "--max_steps=7", *args)
    new_id = (run_dir / "wandb_id.txt").read_text().strip()
    (new,) = map(read_wandb_run, (tmp_path / "wandb").glob(f"offline-run-*-{new_id}"))
    assert new_id != run_id and sorted(new["history"]) == [1, 2, 3, 4, 5, 6, 7]
    assert {s: new["history"][s] for s in range(1, 7)} == {s: logged[s] for s in range(1, 7)}


def test_wandb_that_cannot_start_is_one_line_before_step_1(data_dir, tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")

    def not_logged_in(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", not_logged_in)
    monkeypatch.setattr(train, "train_step", None)  # never reached
    assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--wandb_log=true"]) == 2
    assert capsys.readouterr().err == ("error: wandb_log=true, but W&B did not start: api_key not configured "
                                       "(no-tty). call wandb.login(key=[your_api_key]) (wandb login, or "
                                       "WANDB_MODE=offline to log locally)\n")
