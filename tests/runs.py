"""Helpers the training tests share: run train.py in-process, read its log, compare runs."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import train
from depthres.checkpoint import MANIFEST, STATE_KEYS, file_digest, load_checkpoint, save_sharded, whole_checkpoint
from depthres.distributed import Dist
from model import GPTConfig
from model_fast import make_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "test.py")  # 2 layers of width 32, 6 steps of 256 byte tokens


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


def steps(run_dir, kind="train"):
    return [r["step"] for r in records(run_dir, kind)]


def poll(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


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


def whole(run_dir):
    """A run's checkpoint as one dict (weights, optimizer), a sharded one gathered (an FSDP run's)."""
    ckpt = load_checkpoint(run_dir, sharded=True)
    return whole_checkpoint(ckpt["sharded"]) if "sharded" in ckpt else ckpt


def assert_same_run(run_dir, reference):
    assert losses(run_dir) == losses(reference)  # bit for bit
    assert untimed(run_dir) == untimed(reference)
    a, b = whole(reference), whole(run_dir)
    assert a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for i in a["optimizer"]["state"] for x, y in
               zip(a["optimizer"]["state"][i].values(), b["optimizer"]["state"][i].values(), strict=True))
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] == \
        json.loads((reference / "summary.json").read_text())["val_loss"]


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
        return [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def sharded_copy(run_dir, to, tamper=None):
    """A copy of a run directory whose ckpt.pt is written as a sharded checkpoint (ckpt/), as one process
    writes one (DCP without a process group: one shard file) in place of ckpt.pt; tamper(model, optimizer)
    first, if given."""
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(".lock"))
    ckpt = load_checkpoint(to / "ckpt.pt")
    model = make_model(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    optimizer = torch.optim.AdamW(model.param_groups(ckpt["train_config"]["weight_decay"]))
    optimizer.load_state_dict(ckpt["optimizer"])
    if tamper is not None:
        tamper(model, optimizer)
    save_sharded(to, model, optimizer, {k: ckpt[k] for k in STATE_KEYS}, Dist(0, 1, torch.device("cpu")))
    return to


def replace_in_sharded(ckpt_dir, name, data):
    """Replace a file of a sharded checkpoint, its manifest entry recomputed as anyone who can write it can."""
    (ckpt_dir / name).write_bytes(data)
    manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    manifest["files"][name] = file_digest(ckpt_dir / name)
    (ckpt_dir / MANIFEST).write_text(json.dumps(manifest))


class Payload:
    """Unpickled, it creates its marker file: a stand-in for a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")
