"""train.py: DDP equals one process, exact resume after a kill, the one checkpoint file, divergence, pairing, the
config, the schedules, one synchronisation per step."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

import train
from common import ROOT, Stopped, UserError, cli
from data import TokenLoader, load_meta
from model_fast import make_model

from runs import argv, assert_close_runs, assert_same_run, ckpt, interrupt_step, records, run, signal_in_step, steps, two_ranks

# a train.py killed (kill -9) in the middle of writing its checkpoint at step 6: after the temporary file's first bytes
KILLED_IN_THE_LAST_SAVE = """
import os, signal, sys, torch
import train
real = torch.save
def save(obj, f, *args, **kwargs):
    if obj["step"] == 6:
        f.write(b"PK" * 1000)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *args, **kwargs)
torch.save = save
train.command(sys.argv[1:])
"""


def one_process(code, *args):
    """Run train.py (or `code` playing it) in a process of its own: (exit status, stderr)."""
    p = subprocess.run([sys.executable, *(["-c", code] if code else ["train.py"]), *map(str, args)], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


def built(data_dir, tmp_path, *overrides):
    """configs/test.py's config, model and first training loader, as train.py builds them."""
    tc, settings = train.parse_config(argv(data_dir, tmp_path, *overrides))
    model = make_model(train.build_model_config(settings, tc, load_meta(data_dir)), seed=tc.seed)
    return tc, model, TokenLoader(tc.data_dir, "train", tc.batch_size, tc.seq_len, seed=tc.data_seed)


@pytest.mark.parametrize("ranks_args", [[], pytest.param(["--activation_checkpointing=true"], marks=pytest.mark.slow)],
                         ids=["plain", "checkpointing"])
def test_two_ddp_ranks_reach_the_parameters_of_one_process(data_dir, tmp_path, ranks_args):
    # one process accumulates 2 micro-batches of 4 sequences; two ranks take one each (checkpointing: the same numbers)
    run(data_dir, tmp_path, "--run_name=one", "--max_steps=3")
    two_ranks(argv(data_dir, tmp_path, "--run_name=two", "--max_steps=3", *ranks_args))
    assert_close_runs(tmp_path / "one", tmp_path / "two")
    assert records(tmp_path / "two", "eval")[-1]["tokens"] == records(tmp_path / "one", "eval")[-1]["tokens"]
    assert ckpt(tmp_path / "two")["model_config"]["activation_checkpointing"] == bool(ranks_args)


def test_resume_after_a_kill_repeats_the_uninterrupted_run(data_dir, tmp_path, monkeypatch, straight):
    interrupt_step(monkeypatch, 5)  # killed in step 5
    with pytest.raises(KeyboardInterrupt):
        run(data_dir, tmp_path, "--run_name=killed")
    monkeypatch.undo()
    assert ckpt(tmp_path / "killed")["step"] == 3 and steps(tmp_path / "killed") == [1, 2, 3, 4]
    assert not (tmp_path / "killed" / "summary.json").exists()  # written by finished runs only
    run(data_dir, tmp_path, "--run_name=killed", "--resume=true")  # step 4's record, past the checkpoint, is dropped
    assert_same_run(tmp_path / "killed", straight)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["val_loss"] == [r for r in records(straight, "eval") if r["split"] == "val"][-1]["loss"]


def test_kill_9_in_a_checkpoint_write_keeps_the_previous_one_and_resumes_bit_for_bit(data_dir, tmp_path, straight):
    args = argv(data_dir, tmp_path, "--run_name=k")
    assert one_process(KILLED_IN_THE_LAST_SAVE, *args)[0] == -signal.SIGKILL
    assert ckpt(tmp_path / "k")["step"] == 3  # the half-written step 6 is a hidden temporary file, never read
    assert [p.name for p in (tmp_path / "k").iterdir() if p.name.startswith(".ckpt.pt.")]
    assert one_process(signal_in_step(2, "SIGKILL"), *args, "--resume=true")[0] == -signal.SIGKILL  # in step 5
    rc, err = one_process(None, *args, "--resume=true")
    assert rc == 0, err
    assert_same_run(tmp_path / "k", straight)
    assert not list((tmp_path / "k").glob(".*.tmp"))  # the killed save's temporary: removed when the run started again


def test_sigterm_or_ctrl_c_finishes_the_step_and_checkpoints(data_dir, tmp_path, monkeypatch, straight, capfd):
    for name, signum in (("term", signal.SIGTERM), ("int", signal.SIGINT)):
        interrupt_step(monkeypatch, 2, signum)
        with pytest.raises(Stopped) as stopped:
            run(data_dir, tmp_path, f"--run_name={name}")
        monkeypatch.undo()
        assert stopped.value.signum == signum and "resume with --resume=true" in str(stopped.value)
        assert ckpt(tmp_path / name)["step"] == 2 and steps(tmp_path / name, "stop") == [2]
        run(data_dir, tmp_path, f"--run_name={name}", "--resume=true")
        assert_same_run(tmp_path / name, straight)
    assert "SIGTERM: stopping after this step" in capfd.readouterr().err


def test_overrides_are_typed_and_checked_and_help_gives_every_key_a_meaning(data_dir, tmp_path, capsys):
    tc, model = train.parse_config(argv(data_dir, tmp_path, "--max_steps=1e5", "--lr=2e-3", "--compile=true", "--rd_mode=none",
                                        "--residual=rd_attnres", "--n_embd=64"))
    assert (tc.max_steps, tc.lr, tc.compile, tc.run_name) == (100000, 2e-3, True, "test") and type(tc.max_steps) is int
    assert model == {"residual": "rd_attnres", "rd_mode": None, "n_layer": 2, "n_head": 2, "n_embd": 64}
    assert train.parse_config(argv(data_dir, tmp_path, "--max_steps", "50", "--lr=2e-3"))[0].max_steps == 50  # --key value
    for text, value in [("true", True), ("False", False), ("1", True), ("0", False)]:
        assert train.parse_config(argv(data_dir, tmp_path, f"--compile={text}"))[0].compile is value
    typo = tmp_path / "typo.py"
    typo.write_text("import math\nlr = math.pi / 1000\nn_embed = 64\n")  # what it imports is no key
    with pytest.raises(UserError, match="unknown key 'n_embed'.*did you mean n_embd"):
        train.parse_config([str(typo)])
    assert cli(train.main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert "dar_block_size" in out and "K, in transformer layers" in out and "one of standard, full_attnres" in out


def test_a_checkpoint_far_worse_than_the_last_or_diverged_never_replaces_it(data_dir, tmp_path):
    """After a checkpoint, one step at lr 1: a finite val loss above a uniform guess's (ln V) stops the run, the good
    checkpoint kept. At lr=1e10, a checkpoint every step: one replaces the last only after a finite evaluation at its
    step, the divergence line names the step it kept and the one it did not save, and the run goes on at a sane lr."""
    run(data_dir, tmp_path, "--max_steps=3")
    good = ckpt(tmp_path / "test")
    with pytest.raises(UserError, match="at step 4 is more than ln 2 above the last checkpoint.*checkpoint of step 3"):
        run(data_dir, tmp_path, "--resume=true", "--max_steps=4", "--ckpt_interval=1", "--lr=1", "--min_lr=1")
    assert ckpt(tmp_path / "test")["step"] == 3 and torch.equal(ckpt(tmp_path / "test")["model"]["wte.weight"],
                                                                 good["model"]["wte.weight"])
    with pytest.raises(UserError, match="training diverged") as failure:
        run(data_dir, tmp_path, "--resume=true", "--lr=1e10", "--min_lr=1e10", "--max_steps=30", "--ckpt_interval=1")
    kept = ckpt(tmp_path / "test")
    assert kept["step"] == 3 and "without saving step 4" in str(failure.value)
    assert f"checkpoint of step {kept['step']} (val loss" in str(failure.value) and "evaluated finite" in str(failure.value)
    assert math.isfinite(kept["val_loss"]) and kept["val_loss"] <= 4 * math.log(kept["model_config"]["vocab_size"])
    assert all(torch.isfinite(p).all() for p in kept["model"].values())
    assert records(tmp_path / "test", "diverged")
    run(data_dir, tmp_path, "--resume=true", "--lr=1e-3", "--min_lr=1e-4", "--max_steps=30", "--ckpt_interval=1")
    assert steps(tmp_path / "test")[-1] == 30


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last(data_dir, tmp_path, full_disk, capsys, straight):
    full_disk(tmp_path / "test", (straight / "ckpt.pt").stat().st_size + 20000)  # room for the first checkpoint only
    assert cli(train.main, argv(data_dir, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write") and "no space left" in err[0], err
    assert ckpt(tmp_path / "test")["step"] == 3 and not list((tmp_path / "test").glob(".*.tmp"))


def test_runs_that_differ_only_in_residual_are_paired(data_dir, tmp_path):
    pair = [built(data_dir, tmp_path, f"--residual={r}")[1:] for r in ("standard", "block_attnres")]
    (standard, batches_s), (attnres, batches_a) = [(m.state_dict(), [data.next_batch() for _ in range(3)]) for m, data in pair]
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


def test_a_training_step_synchronises_with_the_device_once(data_dir, tmp_path, monkeypatch):
    tc, model, loader = built(data_dir, tmp_path)
    optimizer = torch.optim.AdamW(model.param_groups(0.1))
    syncs, counting = [], [True]
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        def counted(self, *args, _real=getattr(torch.Tensor, name), _name=name):  # noqa: B008 (bound per name)
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
    train.train_step(model, optimizer, loader, 2, 1e-3, tc, torch.device("cpu"), train.nullcontext, 100.0)
    assert syncs == ["tolist"]


@pytest.mark.slow
def test_ddp_ranks_stop_together_and_resume_bit_for_bit_after_kill_9(data_dir, tmp_path, straight):
    two_ranks(argv(data_dir, tmp_path, "--run_name=straight"))
    # SIGTERM reaches rank 1 only; both ranks stop after the same step, rank 0 writes the checkpoint
    err0, err1 = two_ranks(argv(data_dir, tmp_path, "--run_name=two"), (None, signal_in_step(2, "SIGTERM")), expect=143)
    assert "stopped by SIGTERM after step 2" in err0 and "Traceback" not in err0 + err1
    resume, kill = argv(data_dir, tmp_path, "--run_name=two", "--resume=true"), signal_in_step(3, "SIGKILL")
    two_ranks(resume, (kill, kill), expect=-signal.SIGKILL)  # resumed at 2: its third step is step 5, after ckpt 3
    assert ckpt(tmp_path / "two")["step"] == 3
    two_ranks(resume)
    assert_same_run(tmp_path / "two", tmp_path / "straight")  # bit for bit
    assert_close_runs(straight, tmp_path / "two")  # one process: float32 rounding apart
    # a checkpoint rank 0 cannot read: the same one line on both ranks, no hang
    path = tmp_path / "two" / "ckpt.pt"
    path.write_bytes(path.read_bytes()[:1000])
    err0, err1 = two_ranks(resume, expect=2)
    assert err0 == err1 and "not a readable checkpoint" in err0 and err0.count("\n") == 1


@pytest.mark.slow
def test_many_short_ddp_runs_all_exit_on_a_loaded_machine(data_dir, tmp_path):
    """No hang at exit (a gloo teardown deadlock hung about 1 run in 50 under load): 16 two-rank runs, each must end
    within two_ranks' bound, beside two busy processes."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(16):
            two_ranks(argv(data_dir, tmp_path, f"--run_name=r{i}", "--max_steps=2"))
            assert ckpt(tmp_path / f"r{i}")["step"] == 2
    finally:
        for p in busy:
            p.kill()
            p.wait()
