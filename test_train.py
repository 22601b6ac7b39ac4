"""train.py: DDP equals one process, exact resume, checkpoint checks, config checks, divergence."""

import gzip
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from prepare_data import DEFAULT_CORPUS, load_meta, prepare
from train import CheckpointError, ConfigError, DivergedError, load_checkpoint

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


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir)]


def test_two_ddp_ranks_reach_the_parameters_of_one_process(data_dir, tmp_path):
    # one process accumulates 2 micro-batches of 4 sequences; two ranks take one each
    run(data_dir, tmp_path, "--run_name=one", "--max_steps=3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--run_name=two", "--max_steps=3"]
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
    assert records(tmp_path / "killed", "eval") == records(tmp_path / "straight", "eval")
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "killed")
    assert a["step"] == b["step"] == 6
    final_val = [r for r in records(tmp_path / "straight", "eval") if r["split"] == "val"][-1]
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["val_loss"] == final_val["loss"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_bad_checkpoints_are_refused(data_dir, tmp_path):
    run(data_dir, tmp_path, "--run_name=good", "--max_steps=1")
    good = tmp_path / "good" / "ckpt.pt"
    assert set(load_checkpoint(tmp_path / "good")) == set(train.CKPT_KEYS)
    assert set(torch.load(good, weights_only=True)) == set(train.CKPT_KEYS)  # plain torch.load reads it too
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
    tc, model = train.parse_config([CONFIG, "--max_steps=1e5", "--lr=2e-3", "--compile=true", "--rd_mode=none",
                                    "--residual=rd_attnres", "--n_embd=64"])
    assert (tc.max_steps, tc.lr, tc.compile, tc.run_name) == (100000, 2e-3, True, "test")
    assert type(tc.max_steps) is int and model == {"residual": "rd_attnres", "rd_mode": None, "n_layer": 2,
                                                   "n_head": 2, "n_embd": 64}
    for text, value in [("true", True), ("False", False), ("1", True), ("0", False)]:
        assert train.parse_config([CONFIG, f"--compile={text}"])[0].compile is value
    for arg, message in [("--lr=fast", "lr expects float, got 'fast'"),
                         ("--max_steps=1.5", "max_steps expects int, got '1.5'"),
                         ("--compile=yes", "compile expects true/false/1/0"),
                         ("--batchsize=8", "unknown key 'batchsize' in the command line; did you mean batch_size"),
                         ("--n_layers=3", "did you mean n_layer"),
                         ("--lr", "expected --key=value"),
                         ("--lr_schedule=linear", "lr_schedule must be cosine or wsd")]:
        with pytest.raises(ConfigError, match=message):
            train.parse_config([CONFIG, arg])
    typo = tmp_path / "typo.py"
    typo.write_text("import math\nlr = math.pi / 1000\nn_embed = 64\n")
    with pytest.raises(ConfigError, match=f"unknown key 'n_embed' in {typo}; did you mean n_embd"):
        train.parse_config([str(typo)])
    with pytest.raises(ConfigError, match=re.escape("world_size = 4 * 32 * 1 = 128 (e.g. batch_tokens=256)")):
        run(data_dir, tmp_path, "--batch_tokens=300")
    tc, _ = train.parse_config([CONFIG])
    with pytest.raises(ConfigError, match="= 4 \\* 32 \\* 3 = 384"):
        train.grad_accum_steps(tc, world_size=3)
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
    cmd = [sys.executable, "train.py", CONFIG, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: non-finite loss") and "Traceback" not in done.stderr


def test_runs_that_differ_only_in_residual_are_paired(data_dir):
    cpu, built = train.Dist(rank=0, world_size=1, device=torch.device("cpu")), []
    for residual in ("standard", "block_attnres"):
        tc, model_settings = train.parse_config([CONFIG, f"--data_dir={data_dir}", f"--residual={residual}"])
        mc = train.build_model_config(model_settings, tc, load_meta(data_dir))
        model, _, loader, _ = train.build(tc, mc, cpu, ckpt=None)
        built.append((model.state_dict(), [loader.next_batch() for _ in range(3)]))
    (standard, batches_s), (attnres, batches_a) = built
    assert set(standard) < set(attnres)  # block_attnres adds its pseudo-queries
    assert all(torch.equal(standard[k], attnres[k]) for k in standard)
    assert all(torch.equal(u, v) for s, a in zip(batches_s, batches_a) for u, v in zip(s, a))


def test_lr_schedules():
    cosine = train.TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [train.lr_at(i, cosine, 100) for i in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[9:], lrs[10:]))
    wsd = train.TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="wsd", decay_frac=0.2)
    lrs = [train.lr_at(i, wsd, 100) for i in range(100)]
    assert lrs[:10] == [(i + 1) / 10 for i in range(10)] and set(lrs[9:80]) == {1.0} and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[79:], lrs[80:]))
