"""train.py: DDP equals one process, exact resume, checkpoint checks, config checks, divergence; and the
README's reliability promises (kills, signals, full disk, locks, checksums, data checked before step 1)."""

import errno
import gzip
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import train
import checkpoint
import config
import distributed
import runlog
from checkpoint import CheckpointError, load_checkpoint
from config import ConfigError
from model import GPTConfig
from prepare_data import DEFAULT_CORPUS, prepare
from shards import DataError, load_meta
from train import DivergedError

ROOT = Path(__file__).resolve().parent
CONFIG = str(ROOT / "configs" / "test.py")  # 2 layers of width 32, 6 steps of 256 byte tokens


@pytest.fixture(autouse=True)
def one_thread():
    """The test model is tiny: a second thread only adds synchronisation (and contention on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """40 short documents of the embedded corpus as byte tokens (2 of them val, 2 test)."""
    tmp = tmp_path_factory.mktemp("data")
    with gzip.open(DEFAULT_CORPUS, "rt") as f:
        texts = [json.loads(line)["text"][:3000] for line in f][:40]
    source = tmp / "tiny.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(data_files=[str(source)], tokenizer="byte", out_dir=tmp / "byte")
    return tmp / "byte"


def run(data_dir, out_dir, *overrides):
    return train.main([CONFIG, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *overrides])


def records(run_dir, kind="train"):
    lines = (Path(run_dir) / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def untimed(run_dir, kind="eval"):
    """The records without their clock readings, which no two runs share."""
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "eta_s")} for r in records(run_dir, kind)]


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir)]


@pytest.mark.parametrize("ranks_args", [[], ["--activation_checkpointing=true"]], ids=["plain", "checkpointing"])
def test_two_ddp_ranks_reach_the_parameters_of_one_process(data_dir, tmp_path, ranks_args):
    # one process accumulates 2 micro-batches of 4 sequences; two ranks take one each (recomputing
    # their sublayers in backward, in the second case: the same numbers)
    run(data_dir, tmp_path, "--run_name=one", "--max_steps=3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=two", "--max_steps=3", *ranks_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    assert two["train_config"]["batch_tokens"] == one["train_config"]["batch_tokens"]
    for name, p in one["model"].items():
        torch.testing.assert_close(two["model"][name], p, atol=1e-5, rtol=0, msg=name)
    for (s1, l1), (s2, l2) in zip(losses(tmp_path / "one"), losses(tmp_path / "two"), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-5)
    assert records(tmp_path / "two", "eval")[-1]["tokens"] == records(tmp_path / "one", "eval")[-1]["tokens"]
    assert load_checkpoint(tmp_path / "two")["model_config"]["activation_checkpointing"] == bool(ranks_args)


def test_resume_after_a_kill_repeats_the_uninterrupted_losses(data_dir, tmp_path, monkeypatch):
    run(data_dir, tmp_path, "--run_name=straight")  # 6 steps, checkpoints at 3 and 6

    real_step, calls = train.train_step, []

    def killed_in_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", killed_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        run(data_dir, tmp_path, "--run_name=killed")
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "killed")["step"] == 3
    assert [s for s, _ in losses(tmp_path / "killed")] == [1, 2, 3, 4]  # step 4 was not checkpointed
    assert not (tmp_path / "killed" / "summary.json").exists()  # written by finished runs only

    run(data_dir, tmp_path, "--run_name=killed", "--resume=true")
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")  # bit for bit
    assert untimed(tmp_path / "killed") == untimed(tmp_path / "straight")
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "killed")
    assert a["step"] == b["step"] == 6
    final_val = [r for r in records(tmp_path / "straight", "eval") if r["split"] == "val"][-1]
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["val_loss"] == final_val["loss"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_bad_checkpoints_are_refused(data_dir, tmp_path):
    run(data_dir, tmp_path, "--run_name=good", "--max_steps=1")
    good = tmp_path / "good" / "ckpt.pt"
    assert set(load_checkpoint(tmp_path / "good")) == set(checkpoint.CKPT_KEYS)
    assert set(torch.load(good, weights_only=True)) == set(checkpoint.CKPT_KEYS)  # plain torch.load reads it too
    raw = good.read_bytes()
    bad = tmp_path / "bad.pt"
    for content in (raw[:len(raw) // 2], random.Random(0).randbytes(4096), b"step 6, loss 2.3\n"):
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match="not a readable checkpoint"):
            load_checkpoint(bad)
    torch.save({"weights": torch.zeros(3)}, bad)
    with pytest.raises(CheckpointError, match="not a train.py checkpoint"):
        load_checkpoint(bad)
    torch.save({"format": "depthres-ckpt-0"}, bad)
    with pytest.raises(CheckpointError, match="has format 'depthres-ckpt-0'"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")

    bad.write_bytes(raw[:1000])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        run(data_dir, tmp_path, "--run_name=good", f"--resume={bad}")
    with pytest.raises(CheckpointError, match="residual: 'block_attnres' there, 'standard' here"):
        run(data_dir, tmp_path, "--run_name=good", "--resume=true", "--residual=standard")
    with pytest.raises(CheckpointError, match=r"another model \(n_embd: 32 there, 64 here\); resume with its config"):
        run(data_dir, tmp_path, "--run_name=good", "--resume=true", "--n_embd=64")


def test_overrides_are_typed_and_checked(data_dir, tmp_path):
    tc, model = config.parse_config([CONFIG, "--max_steps=1e5", "--lr=2e-3", "--compile=true", "--rd_mode=none",
                                    "--residual=rd_attnres", "--n_embd=64"])
    assert (tc.max_steps, tc.lr, tc.compile, tc.run_name) == (100000, 2e-3, True, "test")
    assert type(tc.max_steps) is int and model == {"residual": "rd_attnres", "rd_mode": None, "n_layer": 2,
                                                   "n_head": 2, "n_embd": 64}
    for text, value in [("true", True), ("False", False), ("1", True), ("0", False)]:
        assert config.parse_config([CONFIG, f"--compile={text}"])[0].compile is value
    for arg, message in [("--lr=fast", "lr expects float, got 'fast'"),
                         ("--max_steps=1.5", "max_steps expects int, got '1.5'"),
                         ("--compile=yes", "compile expects true/false/1/0"),
                         ("--batchsize=8", "unknown key 'batchsize' in the command line; did you mean batch_size"),
                         ("--n_layers=3", "did you mean n_layer"),
                         ("--lr", "expected --key=value"),
                         ("--lr_schedule=linear", "lr_schedule must be cosine or wsd")]:
        with pytest.raises(ConfigError, match=message):
            config.parse_config([CONFIG, arg])
    typo = tmp_path / "typo.py"
    typo.write_text("import math\nlr = math.pi / 1000\nn_embed = 64\n")
    with pytest.raises(ConfigError, match=f"unknown key 'n_embed' in {typo}; did you mean n_embd"):
        config.parse_config([str(typo)])
    with pytest.raises(ConfigError, match=re.escape("world_size = 4 * 32 * 1 = 128 (e.g. batch_tokens=256)")):
        run(data_dir, tmp_path, "--batch_tokens=300")
    tc, _ = config.parse_config([CONFIG])
    with pytest.raises(ConfigError, match="= 4 \\* 32 \\* 3 = 384"):
        config.grad_accum_steps(tc, world_size=3)
    with pytest.raises(ConfigError, match="model config: n_embd=33 is not divisible by n_head=2"):
        run(data_dir, tmp_path, "--n_embd=33")


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(data_dir, tmp_path):
    args = ["--lr=1e12", "--min_lr=1e12", "--warmup_steps=0", "--grad_clip=0", "--max_steps=30", "--ckpt_interval=1"]
    with pytest.raises(DivergedError, match="non-finite") as failure:
        run(data_dir, tmp_path, *args)
    ckpt = load_checkpoint(tmp_path / "test")
    assert f"last good checkpoint (step {ckpt['step']})" in str(failure.value)
    assert 1 <= ckpt["step"] < 30 and all(torch.isfinite(p).all() for p in ckpt["model"].values())
    assert losses(tmp_path / "test")[-1][0] == ckpt["step"] and math.isfinite(losses(tmp_path / "test")[-1][1])

    # from the command line: a one-line message and a non-zero exit status, no traceback
    cmd = [sys.executable, "train.py", CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=cli",
           *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: non-finite loss") and "Traceback" not in done.stderr


def test_runs_that_differ_only_in_residual_are_paired(data_dir):
    cpu, built = distributed.Dist(rank=0, world_size=1, device=torch.device("cpu")), []
    for residual in ("standard", "block_attnres"):
        tc, model_settings = config.parse_config([CONFIG, f"--data_dir={data_dir}", f"--residual={residual}"])
        mc = config.build_model_config(model_settings, tc, load_meta(data_dir))
        model, _, loader, _ = train.build(tc, mc, cpu, ckpt=None)
        built.append((model.state_dict(), [loader.next_batch() for _ in range(3)]))
    (standard, batches_s), (attnres, batches_a) = built
    assert set(standard) < set(attnres)  # block_attnres adds its pseudo-queries
    assert all(torch.equal(standard[k], attnres[k]) for k in standard)
    assert all(torch.equal(u, v) for s, a in zip(batches_s, batches_a) for u, v in zip(s, a))


def test_lr_schedules():
    cosine = config.TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [train.lr_at(i, cosine, 100) for i in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[9:], lrs[10:]))
    wsd = config.TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="wsd", decay_frac=0.2)
    lrs = [train.lr_at(i, wsd, 100) for i in range(100)]
    assert lrs[:10] == [(i + 1) / 10 for i in range(10)] and set(lrs[9:80]) == {1.0} and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[79:], lrs[80:]))


# ----------------------------------------------------------------------------------------------
# Reliability: runs and run directories


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """An uninterrupted run of configs/test.py: 6 steps, checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("straight")
    run(data_dir, out, "--run_name=straight")
    return out / "straight"


def contents(run_dir):
    return {p.name: p.read_bytes() for p in sorted(Path(run_dir).iterdir()) if p.name != ".lock"}


def steps(run_dir, kind="train"):
    return [r["step"] for r in records(run_dir, kind)]


def test_a_fresh_run_never_replaces_a_run(data_dir, tmp_path, straight):
    run(data_dir, tmp_path, "--run_name=a")
    before = contents(tmp_path / "a")
    with pytest.raises(checkpoint.RunDirError, match=re.escape(
            f"{tmp_path / 'a'} already holds a run (config.json, log.jsonl, ckpt.pt, summary.json): "
            "continue it with --resume=true, or start over with --overwrite=true")):
        run(data_dir, tmp_path, "--run_name=a", "--max_steps=2")
    with pytest.raises(checkpoint.RunDirError, match="replace it with --overwrite=true, or choose another run_name"):
        run(data_dir, tmp_path, "--run_name=a", f"--resume={straight}")  # another run's checkpoint, into a
    assert contents(tmp_path / "a") == before  # nothing touched

    run(data_dir, tmp_path, "--run_name=a", "--max_steps=2", "--overwrite=true")  # told to: a new run
    assert steps(tmp_path / "a") == [1, 2] and load_checkpoint(tmp_path / "a")["step"] == 2
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["step"] == 2
    with pytest.raises(ConfigError, match="resume=true continues the run that overwrite=true would delete"):
        run(data_dir, tmp_path, "--run_name=a", "--resume=true", "--overwrite=true")

    (tmp_path / "b").mkdir()  # a run that died before its first checkpoint
    (tmp_path / "b" / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    with pytest.raises(checkpoint.RunDirError, match=r"already holds a run \(log.jsonl\): replace it with --overwrite"):
        run(data_dir, tmp_path, "--run_name=b")


def poll(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_cli_sigterm_stops_with_a_checkpoint_and_a_second_run_is_refused(data_dir, tmp_path, capsys):
    run_dir = tmp_path / "long"
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=long"]
    first = subprocess.Popen([sys.executable, "train.py", *args, "--max_steps=100000", "--ckpt_interval=0"], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        poll(lambda: (run_dir / "log.jsonl").exists() and records(run_dir))
        assert train.cli(args + ["--resume=true"]) == 1
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
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from files import DirLock; "
                               "DirLock(sys.argv[1], 'run'); print('locked', flush=True); time.sleep(60)",
                               str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(checkpoint.RunDirError, match=f"is in use by another run \\(pid {holder.pid}\\)"):
        run(data_dir, tmp_path, "--max_steps=1")
    assert [p.name for p in run_dir.iterdir()] == [".lock"]
    holder.kill()  # kill -9: no chance to clean up
    holder.wait()
    run(data_dir, tmp_path, "--max_steps=1")


def kill_in_step(n, *signals):
    """A train_step that sends itself `signals` (KeyboardInterrupt if none) before its n-th step."""
    real, calls = train.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            if not signals:
                raise KeyboardInterrupt
            for s in signals:
                os.kill(os.getpid(), s)
        return real(*args, **kwargs)
    return step


def assert_same_run(run_dir, reference):
    assert losses(run_dir) == losses(reference)  # bit for bit
    assert untimed(run_dir) == untimed(reference)
    a, b = load_checkpoint(reference), load_checkpoint(run_dir)
    assert a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] == \
        json.loads((reference / "summary.json").read_text())["val_loss"]


def test_resume_tolerates_a_torn_last_log_line(data_dir, tmp_path, monkeypatch, straight):
    # a kill or a full disk in the middle of an append; blank lines
    for name, tail in (("torn", '{"kind": "train", "step": 5, "lo'), ("blank", "\n\n")):
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
    assert (run_dir / ".ckpt.pt.tmp").exists() and load_checkpoint(run_dir)["step"] == 3
    run(data_dir, tmp_path, "--resume=true")
    assert_same_run(run_dir, straight)
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_sigterm_or_ctrl_c_finishes_the_step_and_checkpoints(data_dir, tmp_path, monkeypatch, straight):
    for name, signum in (("term", signal.SIGTERM), ("int", signal.SIGINT)):
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        monkeypatch.setattr(train, "train_step", kill_in_step(4, signum))
        with pytest.raises(train.Stopped, match=f"stopped by {signal.Signals(signum).name} after step 4") as e:
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

    for victim, failed in ((".ckpt.pt.tmp", "ckpt.pt"), ("log.jsonl", "log.jsonl")):
        calls.clear()
        monkeypatch.setattr(train, "train_step", disk_full_from_step_5)
        assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--overwrite=true"]) == 1
        monkeypatch.undo()
        err = capsys.readouterr().err
        assert err == (f"error: no space left on device writing {run_dir / failed}; the last checkpoint (step 3) "
                       f"is kept at {run_dir / 'ckpt.pt'}\n")
        assert not (run_dir / ".ckpt.pt.tmp").exists()  # the failed write leaves nothing behind
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
    assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={read_only}"]) == 1
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
    assert set(torch.load(ckpt, weights_only=True)) == set(checkpoint.CKPT_KEYS)  # torch alone does not notice
    message = "ckpt.pt is corrupt: its contents do not match the checksum written with it"
    with pytest.raises(CheckpointError, match=message):
        run(data_dir, tmp_path, "--resume=true", "--max_steps=2")
    import sample
    assert sample.main(["--ckpt", str(ckpt), "--max_new_tokens", "2"]) == 2
    assert message in capsys.readouterr().err
    torch.save({"format": "depthres-ckpt-1", "model": {}}, ckpt)
    with pytest.raises(CheckpointError, match="an older train.py's, without a checksum"):
        load_checkpoint(ckpt)


# ----------------------------------------------------------------------------------------------
# Reliability: data and configs are checked before step 1


def broken_copy(data_dir, tmp_path, name, change):
    """A copy of data_dir with `change(copy)` applied."""
    out = tmp_path / name
    out.mkdir()
    for f in data_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    change(out)
    return out


def truncate(name):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:-3])


def test_bad_data_is_found_before_step_1(data_dir, tmp_path, monkeypatch):
    from shards import get_tokenizer, open_shard, write_shard

    def id_300_in_val(d):
        tokens = open_shard(d / "val_000000.bin").copy()
        tokens[5] = 300  # inside the padded vocabulary of 320: it would train silently
        write_shard(d / "val_000000.bin", tokens, get_tokenizer("byte"))

    def no_vocab_size(d):
        meta = json.loads((d / "meta.json").read_text())
        del meta["vocab_size"]
        (d / "meta.json").write_text(json.dumps(meta))

    val_tokens = load_meta(data_dir)["splits"]["val"]["tokens"]
    cases = [(broken_copy(data_dir, tmp_path, "val", truncate("val_000000.bin")), [],
              "val_000000.bin is truncated or corrupt"),
             (broken_copy(data_dir, tmp_path, "test", truncate("test_000000.bin")), [],
              "test_000000.bin is truncated or corrupt"),
             (broken_copy(data_dir, tmp_path, "ids", id_300_in_val), [],
              "val_000000.bin holds token id 300, outside the byte tokenizer's ids 0..256"),
             (broken_copy(data_dir, tmp_path, "meta", no_vocab_size), [], "meta.json lacks vocab_size"),
             (data_dir, [f"--seq_len={val_tokens}", f"--eval_tokens={val_tokens}", "--batch_size=1",
                         f"--batch_tokens={val_tokens}"],
              f"split 'val' of {data_dir} has {val_tokens} tokens, too few for one evaluation sequence of "
              f"seq_len \\+ 1 = {val_tokens + 1}: use seq_len <= {val_tokens - 1}, or prepare the data with a "
              "larger --val_fraction")]
    monkeypatch.setattr(train, "train_step", None)  # never reached
    for data, args, message in cases:
        with pytest.raises(DataError, match=message):
            run(data, tmp_path / "runs", *args)
        assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="eval_tokens=16 is less than one sequence of seq_len=32 tokens: "
                                          "set eval_tokens >= 32"):
        run(data_dir, tmp_path / "runs", "--eval_tokens=16")


def test_config_values_out_of_range_are_config_errors(data_dir, tmp_path, capsys, monkeypatch):
    for arg, message in [("--seed=-1", r"seed must be in \[0, 2\*\*32\), got -1"),
                         ("--seed=5e9", r"seed must be in \[0, 2\*\*32\), got 5000000000"),
                         ("--data_seed=-1", r"data_seed must be in \[0, 2\*\*32\)"),
                         ("--lr=inf", "lr must be a finite number, got inf"),
                         ("--lr=nan", "lr must be a finite number, got nan"),
                         ("--grad_clip=inf", "grad_clip must be a finite number"),
                         ("--lr=0", "lr > 0"),
                         ("--eps=-1", "eps must be >= 0"),
                         ("--wandb_project=me/runs", "wandb_project must be a non-empty name without /"),
                         ("--wandb_tags=seed0," + "x" * 65, "wandb_tags: a W&B tag is at most 64 characters")]:
        with pytest.raises(ConfigError, match=message):
            config.parse_config([CONFIG, arg])
    run(data_dir, tmp_path, "--warmup_steps=10", "--max_steps=2")
    assert ("warning: warmup_steps=10 is more than the run's 2 steps: the learning rate ends its warmup at 0.002, "
            "never reaching lr=0.01") in capsys.readouterr().err

    monkeypatch.setattr(train, "train_step", lambda *args, **kwargs: (4178201.5, math.inf, 0))
    with pytest.raises(DivergedError, match=re.escape("non-finite gradient norm at step 1 (loss 4178201.5, gradient "
                                                      "norm inf)")):
        run(data_dir, tmp_path, "--run_name=diverged")


# ----------------------------------------------------------------------------------------------
# Reliability, round two: no record doubled, a huge loss is a divergence, every bad input one line


def record_keys(run_dir):
    return [(r["kind"], r.get("split"), r["step"]) for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def test_a_resumed_finished_run_logs_each_record_once(data_dir, tmp_path, straight):
    run_dir = tmp_path / "done"
    run(data_dir, tmp_path, "--run_name=done")
    once = record_keys(run_dir)
    assert len(once) == len(set(once)) and ("eval", "test", 6) in once
    run(data_dir, tmp_path, "--run_name=done", "--resume=true")  # a finished run: its final evaluations redone
    assert record_keys(run_dir) == once
    assert untimed(run_dir) == untimed(straight)
    # killed after the last checkpoint, before summary.json: the same
    (run_dir / "summary.json").unlink()
    run(data_dir, tmp_path, "--run_name=done", "--resume=true")
    assert record_keys(run_dir) == once and (run_dir / "summary.json").exists()
    speed = statistics.median(r["tokens_per_s"] for r in records(run_dir))  # the run's, kept from its log
    assert json.loads((run_dir / "summary.json").read_text())["tokens_per_s"] == pytest.approx(speed)


def test_a_finite_but_huge_loss_is_a_divergence_and_its_resume_says_so_again(data_dir, tmp_path, capsys):
    args = [CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--lr=3e3", "--min_lr=0", "--grad_clip=0",
            "--warmup_steps=0", "--max_steps=8"]
    for extra in ([], ["--resume=true"]):
        assert train.cli(args + extra) == 1
        err = capsys.readouterr().err
        assert re.search(r"error: loss \S+ at step \d is above 23.1 nats \(4 ln\(vocab\), far worse than a uniform "
                         r"guess\): training diverged and stopped before this update; (no checkpoint was written|the "
                         r"last good checkpoint \(step \d\) is kept at .*ckpt.pt)\. Try a lower lr", err), err
        assert "Traceback" not in err
    assert runlog.perplexity(800.0) == math.inf and runlog.perplexity(2.0) == pytest.approx(math.exp(2.0))


def test_a_huge_val_loss_stops_before_the_checkpoint(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "evaluate", lambda *args: (800.0, 1024))
    with pytest.raises(DivergedError, match=r"val loss 800 at step 3 is above 23.1 nats .* stopped before this "
                                            r"checkpoint; no checkpoint was written"):
        run(data_dir, tmp_path)
    assert not (tmp_path / "test" / "ckpt.pt").exists()


def test_sigterm_during_the_final_evaluations_stops_gracefully(data_dir, tmp_path, monkeypatch, straight):
    real, calls = train.evaluate, []

    def evaluate(model, split, tc, dist, autocast):  # SIGTERM while the last step's val evaluation runs
        calls.append(split)
        out = real(model, split, tc, dist, autocast)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    monkeypatch.setattr(train, "evaluate", evaluate)
    with pytest.raises(train.Stopped, match="stopped by SIGTERM after step 6; checkpoint written to"):
        run(data_dir, tmp_path, "--run_name=late")
    monkeypatch.undo()
    assert calls == ["val", "val"]  # the test evaluation did not start
    assert not (tmp_path / "late" / "summary.json").exists() and load_checkpoint(tmp_path / "late")["step"] == 6
    run(data_dir, tmp_path, "--run_name=late", "--resume=true")
    assert untimed(tmp_path / "late") == untimed(straight) and steps(tmp_path / "late") == [1, 2, 3, 4, 5, 6]
    assert len(record_keys(tmp_path / "late")) == len(set(record_keys(tmp_path / "late")))


def test_resume_true_without_a_checkpoint_starts_the_run(data_dir, tmp_path, monkeypatch, capsys, straight):
    monkeypatch.setattr(train, "train_step", kill_in_step(2, signal.SIGTERM))
    with pytest.raises(train.Stopped):  # a SIGTERM before the first checkpoint writes one at step 2 ...
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
    with pytest.raises(CheckpointError, match="no checkpoint at"):  # a checkpoint named that is not there
        run(data_dir, tmp_path, "--run_name=named", f"--resume={tmp_path / 'named' / 'ckpt.pt'}")


def test_a_resume_past_max_steps_is_refused(data_dir, tmp_path, straight):
    message = "checkpoint .*straight is at step 6, past this run's last step 2: resume with max_steps >= 6"
    with pytest.raises(CheckpointError, match=message):
        run(data_dir, straight.parent, "--run_name=straight", "--resume=true", "--max_steps=2")
    with pytest.raises(CheckpointError, match=message):  # from another run's checkpoint too
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


def test_a_random_bytes_checkpoint_never_quotes_unsafe_advice(tmp_path):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(random.Random(1).randbytes(100_000))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert str(e.value).startswith(f"{bad} is not a readable checkpoint") and "weights_only" not in str(e.value)


BAD_CONFIG_FILES = [
    ("residual = 'standard'\nn_layer = 2 +\n", "line 2: syntax error"),
    ("import math\nn_layer = 2\nlr = math.sqrt(-1)\n", "line 3: ValueError: math domain error"),
    ("n_layer = undefined_name\n", "line 1: NameError"),
]


@pytest.mark.parametrize("text, message", BAD_CONFIG_FILES, ids=["syntax", "raises", "name"])
def test_a_config_file_that_fails_names_its_line(tmp_path, text, message):
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path}, {message}")):
        config.parse_config([str(path)])


@pytest.mark.parametrize("arg, message", [
    ("--rope_base=0", "rope_base must be a finite number > 0"),
    ("--rope_base=-5", "rope_base must be a finite number > 0"),
    ("--rope_base=inf", "rope_base must be a finite number > 0"),
    ("--rope_base=nan", "rope_base must be a finite number > 0"),
    ("--logit_softcap=inf", "logit_softcap must be a finite number >= 0"),
    ("--run_name=a/b", "run_name must be a plain directory name inside out_dir"),
    ("--run_name=..", "run_name must be a plain directory name inside out_dir"),
    ("--run_name=/tmp/elsewhere", "run_name must be a plain directory name inside out_dir"),
])
def test_bad_keys_are_refused_before_step_1(data_dir, tmp_path, monkeypatch, arg, message):
    monkeypatch.setattr(train, "train_step", None)  # never reached
    with pytest.raises(ConfigError, match=message):
        run(data_dir, tmp_path, arg)
    assert not any(tmp_path.iterdir())


def edit_meta(change):
    def edit(d):
        meta = json.loads((d / "meta.json").read_text())
        change(meta)
        (d / "meta.json").write_text(json.dumps(meta))
    return edit


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(vocab_size="257"), "vocab_size '257' is not the byte tokenizer's 257"),
    (lambda m: m.update(vocab_size=-1), "vocab_size -1 is not the byte tokenizer's 257"),
    (lambda m: m.update(splits=[]), "splits is a JSON list, not an object"),
    (lambda m: m["splits"]["train"].update(files="train_000000.bin"), "split 'train': files 'train_000000.bin' is not "
                                                                     "a list of file names"),
    (lambda m: m["splits"]["val"].update(files=["../../secret.bin"]), "is not a list of file names"),
    (lambda m: m.update(tokenizer="sentencepiece"), "tokenizer 'sentencepiece' is not one of gpt2, byte"),
    (lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 5),
     "split 'train' of .* holds [0-9,]+ tokens in its shards, but its meta.json says [0-9,]+"),
], ids=["vocab_str", "vocab_negative", "splits_list", "files_str", "files_path", "tokenizer", "tokens"])
def test_a_bad_meta_json_is_refused_before_step_1(data_dir, tmp_path, monkeypatch, change, message):
    data = broken_copy(data_dir, tmp_path, "data", edit_meta(change))
    monkeypatch.setattr(train, "train_step", None)  # never reached
    with pytest.raises(DataError, match=message):
        run(data, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------
# Multi-node resume, one synchronisation per step, prefetch, DDP buffers, TF32


def test_batches_read_ahead_checkpoint_the_state_of_the_batches_used(data_dir):
    from shards import TokenLoader
    plain, ahead = (TokenLoader(data_dir, "train", 4, 32, seed=3) for _ in range(2))
    batches = train.DeviceBatches(ahead, torch.device("cpu"))
    for _ in range(5):
        state = plain.state_dict()
        assert batches.state_dict() == state  # not the loader's own: it is one batch ahead
        assert all(torch.equal(a, b) for a, b in zip(batches.next_batch(), plain.next_batch()))
    assert ahead.state_dict() != plain.state_dict()


def test_a_training_step_synchronises_with_the_device_once(data_dir, monkeypatch):
    cpu = distributed.Dist(rank=0, world_size=1, device=torch.device("cpu"))
    tc, model_settings = config.parse_config([CONFIG, f"--data_dir={data_dir}"])
    model, optimizer, loader, _ = train.build(tc, config.build_model_config(model_settings, tc, load_meta(data_dir)),
                                              cpu, ckpt=None)
    syncs, counting = [], [True]
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        def counted(self, *args, _real=getattr(torch.Tensor, name), _name=name):
            if counting[0]:
                syncs.append(_name)
            return _real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    real_step = optimizer.step

    def uncounted_step():  # CPU AdamW reads its step counters with .item(); CUDA's fused AdamW does not
        counting[0] = False
        real_step()
        counting[0] = True
    monkeypatch.setattr(optimizer, "step", uncounted_step)
    train.train_step(model, optimizer, loader, 1e-3, 2, 1.0, cpu, nullcontext())
    assert syncs == ["tolist"]


def test_ddp_does_not_broadcast_the_constant_buffers(data_dir, tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tc, model_settings = config.parse_config([CONFIG, f"--data_dir={data_dir}"])
        model = train.GPT(config.build_model_config(model_settings, tc, load_meta(data_dir)))
        assert {name for name, _ in model.named_buffers()} == {"cos", "sin"}  # constants, the same on every rank
        _, ddp = train.wrap(model, tc, distributed.Dist(rank=0, world_size=2, device=torch.device("cpu")))
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.broadcast_buffers is False
        del ddp
    finally:
        torch.distributed.destroy_process_group()


def test_float32_matmuls_stay_float32_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    precision = torch.get_float32_matmul_precision()
    try:
        assert distributed.setup_distributed("cuda").device == torch.device("cuda", 0)
        assert torch.get_float32_matmul_precision() == "highest"  # no TF32 for the routing and the loss
    finally:
        torch.set_float32_matmul_precision(precision)


def signal_in_step_2(name):
    """The code of a train.py that sends itself signal `name` before its second step (two_ranks runs it)."""
    return f"""
import os, signal, sys
import train
real, calls = train.train_step, []
def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.{name})
    return real(*args, **kwargs)
train.train_step = step
sys.exit(train.cli(sys.argv[1:]))
"""


RANK1_SIGTERM_IN_STEP_2 = signal_in_step_2("SIGTERM")


def two_ranks(args_of_rank, code_of_rank=(None, None)):
    """Run train.py as ranks 0 and 1 of a gloo group (as torchrun would, without its agent);
    returns each rank's (exit status, stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        code = code_of_rank[rank]
        cmd = [sys.executable, *(["-c", code] if code else ["train.py"]), *args_of_rank(rank)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    try:
        return [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_ddp_ranks_stop_together_and_resume_from_rank_0s_checkpoint(data_dir, tmp_path):
    run(data_dir, tmp_path, "--run_name=one")  # one process, 6 steps
    base = [CONFIG, f"--data_dir={data_dir}", "--run_name=two"]
    mine = [f"--out_dir={tmp_path}"]

    # SIGTERM reaches rank 1 only; both ranks stop after the same step, rank 0 writes the checkpoint
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: base + mine, (None, RANK1_SIGTERM_IN_STEP_2))
    assert (rc0, rc1) == (143, 143), err0 + err1
    assert err0.splitlines()[-1].startswith("stopped by SIGTERM after step 2; checkpoint written to")
    assert "Traceback" not in err0 + err1
    assert load_checkpoint(tmp_path / "two")["step"] == 2 and steps(tmp_path / "two") == [1, 2]

    # resume: rank 1's out_dir holds nothing (a node-local disk); it receives rank 0's checkpoint
    elsewhere = [f"--out_dir={tmp_path / 'node1'}"]
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: base + (mine if rank == 0 else elsewhere) + ["--resume=true"])
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert not (tmp_path / "node1").exists()
    one, two = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    assert two["step"] == 6 and steps(tmp_path / "two") == [1, 2, 3, 4, 5, 6]
    for name, p in one["model"].items():
        torch.testing.assert_close(two["model"][name], p, atol=1e-5, rtol=0, msg=name)
    for (s1, l1), (s2, l2) in zip(losses(tmp_path / "one"), losses(tmp_path / "two"), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-5)

    # a checkpoint rank 0 cannot read: the same error on both ranks, no hang
    ckpt = tmp_path / "two" / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    (rc0, err0), (rc1, err1) = two_ranks(lambda rank: base + (mine if rank == 0 else elsewhere) + ["--resume=true"])
    assert (rc0, rc1) == (1, 1)
    assert err0 == err1 and err0.startswith(f"error: {ckpt} is not a readable checkpoint") and err0.count("\n") == 1


# ----------------------------------------------------------------------------------------------
# FSDP2: the same run sharded; its checkpoints load anywhere

KILL_9_IN_STEP_2 = signal_in_step_2("SIGKILL")


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
    one, sharded = (json.loads((tmp_path / n / "summary.json").read_text())["state_bytes_per_rank"] for n in ("one", "fsdp"))
    assert 0.45 < sharded / one < 0.55  # each of the 2 ranks holds half the weights and AdamW state


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
    assert "; changed: activation_checkpointing False -> True (execution only)\n" in capsys.readouterr().out
    assert_same_run(tmp_path / "test", straight)  # recomputing the sublayers changes no bit of the training
    ckpt = load_checkpoint(tmp_path / "test")
    assert ckpt["model_config"]["activation_checkpointing"] is True

    def config(**changes):
        return GPTConfig(**{**ckpt["model_config"], **changes})

    checkpoint.check_resumable(ckpt, "ckpt.pt", config(depth_impl="reference", depth_chunk=2), "byte")
    del ckpt["model_config"]["activation_checkpointing"]  # a checkpoint from before the key existed
    checkpoint.check_resumable(ckpt, "ckpt.pt", config(), "byte")
    with pytest.raises(CheckpointError, match=r"another model \(attnres_block_size: 4 there, 2 here\)"):
        checkpoint.check_resumable(ckpt, "ckpt.pt", config(attnres_block_size=2, depth_chunk=2), "byte")


def test_wandb_log_without_wandb_is_one_line_before_compute(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with monkeypatch.context() as patched:
        patched.setattr(train, "build", None)  # never reached
        assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--wandb_log=true"]) == 1
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
    kind = record.get("split", record["kind"])
    return {f"{kind}/{k}": v for k, v in record.items() if k not in ("kind", "split", "step")}


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
    assert train.cli([CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--wandb_log=true"]) == 1
    assert capsys.readouterr().err == ("error: wandb_log=true, but W&B did not start: api_key not configured "
                                       "(no-tty). call wandb.login(key=[your_api_key]) (wandb login, or "
                                       "WANDB_MODE=offline to log locally)\n")
