"""Helpers the training tests share: run train.py in-process or as ranks, read its log and checkpoint."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

import train
from common import ROOT, log_records

CONFIG = str(ROOT / "configs" / "test.py")  # 2 layers of width 32, 6 steps of 256 byte tokens, checkpoints at 3 and 6


def argv(data_dir, out_dir, *overrides):
    """train.py's command line for configs/test.py."""
    return [CONFIG, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *overrides]


def run(data_dir, out_dir, *overrides):
    return train.main(argv(data_dir, out_dir, *overrides))


def records(run_dir, kind="train"):
    return [r for r in log_records(run_dir) if r["kind"] == kind]


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir)]


def steps(run_dir, kind="train"):
    return [r["step"] for r in records(run_dir, kind)]


def ckpt(run_dir):
    return torch.load(Path(run_dir) / "ckpt.pt", weights_only=True)


def assert_same_run(run_dir, reference):
    """Bit for bit: the losses, the evaluations at the reference's steps, the weights and AdamW state."""
    assert losses(run_dir) == losses(reference)
    at = {(r["split"], r["step"]) for r in records(reference, "eval")}
    mine, theirs = ([{k: v for k, v in r.items() if k not in ("elapsed_s", "eta_s")} for r in records(d, "eval")]
                    for d in (run_dir, reference))  # without the clock readings, which no two runs share
    assert [r for r in mine if (r["split"], r["step"]) in at] == theirs
    a, b = ckpt(reference), ckpt(run_dir)
    assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    flat = [(x, y) for k in a["optimizer"]["state"] for x, y in
            zip(a["optimizer"]["state"][k].values(), b["optimizer"]["state"][k].values(), strict=True)]
    assert flat and all(torch.equal(x, y) for x, y in flat)


def assert_close_runs(a, b, atol=1e-5):
    """Two runs that differ only in how the ranks sum their gradients: float32 rounding apart (2 u = 1.2e-7 relative
    a step, which AdamW turns into weight drifts near lr x that: 1e-5 holds 6 steps with room, far below a step's
    change at lr = 1e-2)."""
    ca, cb = ckpt(a), ckpt(b)
    assert ca["step"] == cb["step"]
    for name, p in ca["model"].items():
        torch.testing.assert_close(cb["model"][name], p, atol=atol, rtol=0, msg=name)
    for (s1, l1), (s2, l2) in zip(losses(a), losses(b), strict=True):
        assert s1 == s2 and abs(l1 - l2) <= atol


def interrupt_step(monkeypatch, n, signum=None):
    """train.train_step sends this process `signum` before its n-th step (None: raises KeyboardInterrupt, as a crash)."""
    real, calls = train.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            if signum is None:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "train_step", step)


def signal_in_step(n, name):
    """The code of a train.py that sends itself signal `name` (SIGKILL: killed) before its n-th step."""
    return f"""
import os, signal, sys
import train
real, calls = train.train_step, []
def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == {n}:
        os.kill(os.getpid(), signal.{name})
    return real(*args, **kwargs)
train.train_step = step
train.command(sys.argv[1:])
"""


def two_ranks(args, code_of_rank=(None, None), expect=0):
    """train.py (or code playing it) with `args` as torchrun's ranks 0 and 1 of a gloo group, both exiting `expect`: stderrs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        code = code_of_rank[rank]
        cmd = [sys.executable, *(["-c", code] if code else ["train.py"]), *map(str, args)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    try:
        done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [rc for rc, _ in done] == [expect] * 2, "".join(err[-3000:] for _, err in done)
    return [err for _, err in done]


class Payload:
    """Unpickled, it creates its marker file: a stand-in for a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")
