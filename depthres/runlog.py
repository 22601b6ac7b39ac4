"""
What a run reports: log lines on stdout, one JSON record per logged step and per evaluation in
log.jsonl, the same records in Weights & Biases when asked (optional: imported only with
wandb_log=true), how far the run is (Progress: elapsed time and ETA), and where it ran (provenance:
each start of a run, fresh or resumed, is a "start" record of the commit, torch, host and UTC time).
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path

import torch

from depthres import UserError
from depthres.files import write_file, writing


class RunLog:
    """Log lines on stdout and JSON objects appended to log.jsonl, on rank 0 only; with a tracker (a
    W&B run), every record goes there too."""

    def __init__(self, path, enabled):
        self.path, self.enabled, self.tracker = path, enabled, None

    def __call__(self, line, record=None):
        """Print `line` (unless None) and append `record` (unless None)."""
        if not self.enabled:
            return
        if line is not None:
            try:
                print(line, flush=True)
            except OSError as e:  # stdout failed (a full disk, a closed pipe: `| head`): the run goes on, unprinted
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                with suppress(OSError):
                    print(f"note: stdout failed ({e.strerror or e}); the run goes on without printing, and "
                          f"{self.path} keeps every record", file=sys.stderr, flush=True)
        if record is not None:
            with writing(self.path, UserError), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            track(self.tracker, record)

    def finish(self, clean):
        if self.tracker is not None:
            self.tracker.finish(exit_code=0 if clean else 1)
            self.tracker = None


ROOT = Path(__file__).resolve().parents[1]


def utc_now():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit(root=ROOT):
    """(the checkout's commit, whether its tracked files differ from it), or (None, None) outside a git
    checkout (an exported copy, no git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        diff = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0 or diff.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(diff.stdout.strip())


def provenance(step):
    """The "start" record of a run's start (fresh, or resumed at `step`): what code, torch and host
    trained from here, and when (UTC)."""
    commit, dirty = git_commit()
    return {"kind": "start", "step": step, "utc": utc_now(), "commit": commit, "dirty": dirty,
            "torch": torch.__version__, "host": socket.gethostname()}


def log_records(d):
    """The JSON records of a run's log.jsonl (a torn or foreign line skipped; none without the file)."""
    try:
        lines = (Path(d) / "log.jsonl").read_bytes().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def run_provenance(starts):
    """A finished run's provenance for summary.json, from its "start" records (log.jsonl): when it started
    and finished (UTC), and every commit (with "+dirty" where the tree was), torch and host it ran on."""
    def distinct(values):
        return sorted({v for v in values if isinstance(v, str)})
    starts = [r for r in starts if isinstance(r.get("utc"), str)]  # train.py's (a foreign line is skipped)
    return {"started_utc": starts[0]["utc"] if starts else None, "finished_utc": utc_now(),
            "commits": distinct(r.get("commit") + ("+dirty" if r.get("dirty") else "") for r in starts
                                if isinstance(r.get("commit"), str)),
            "torch": distinct(r.get("torch") for r in starts), "hosts": distinct(r.get("host") for r in starts)}


def require_wandb():
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("wandb_log=true needs the wandb package, which is not installed: pip install wandb "
                        "(or drop wandb_log)") from None


def start_wandb(tc, run_dir, resolved, claim):
    """This run's W&B run, with the resolved config. A resumed run continues the W&B run of its run
    directory, whose id is kept in wandb_id.txt; a fresh one starts a new W&B run and writes its id."""
    import wandb
    id_file = run_dir / "wandb_id.txt"
    run_id = (id_file.read_text().strip() or None) if claim.continuing and id_file.exists() else None
    try:
        run = wandb.init(project=tc.wandb_project, name=tc.wandb_run_name or tc.run_name, id=run_id,
                         resume="allow" if run_id else None, group=tc.wandb_group or None, tags=tc.tags() or None)
        run.config.update(resolved, allow_val_change=True)  # a resume may change keys
    except Exception as e:  # not logged in, no network, a bad setting: wandb's first line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"wandb_log=true, but W&B did not start: {reason} (wandb login, or WANDB_MODE=offline "
                        "to log locally)") from None
    if run_id is None:
        write_file(id_file, (run.id + "\n").encode(), UserError)
        for line in claim.kept_log:  # a run that starts logging to W&B on resume: what it logged before, too
            track(run, json.loads(line))
    return run


def track(run, record):
    """A log.jsonl record into W&B at its step, keys under its kind: train/loss, val/loss, test/ppl, .."""
    if run is None:
        return
    kind = record.get("split", record["kind"])
    metrics = {f"{kind}/{k}": v for k, v in record.items()
               if k not in ("kind", "split", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if metrics:
        run.log(metrics, step=record["step"])


def hms(seconds):
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """How far a run is: its step out of max_steps, the seconds since this process started training,
    and an ETA: the mean wall time per step since the end of the first step (which holds compilation
    and warm-up; evaluations and checkpoints are averaged in), times the steps left."""

    def __init__(self, step, max_steps, clock=time.perf_counter, batch_tokens=None, mfu_per_token_s=None, speeds=()):
        self.max_steps, self.clock, self.start = max_steps, clock, clock()
        self.marks = [(step, self.start)]  # (step, time): at the start, then after the first step
        self.batch_tokens, self.mfu_per_token_s = batch_tokens, mfu_per_token_s  # for log_train's tokens/s and MFU
        self.seconds, self.steps = 0.0, 0  # the steps' own time since the last log line (no evaluations)
        self.speeds = list(speeds)  # tokens/s of every log interval

    def stepped(self, step, seconds=0.0):
        """Step `step` is done; it took `seconds` of training (evaluations and checkpoints not counted)."""
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1
        if len(self.marks) == 1:
            self.marks.append((step, self.clock()))

    def elapsed(self):
        return self.clock() - self.start

    def eta(self, step):
        first, t = self.marks[-1] if self.marks[-1][0] < step else self.marks[0]
        return (self.clock() - t) / (step - first) * (self.max_steps - step)

    def at(self, step):
        return f"step {step:>{len(str(self.max_steps))}}/{self.max_steps}"


def perplexity(loss):
    """exp(loss), inf where it overflows (a loss above 709.78 nats)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def log_eval(log, split, step, loss, tokens, progress):
    elapsed, ppl = progress.elapsed(), perplexity(loss)
    log(f"{progress.at(step)} | {split} loss {loss:.4f} | ppl {ppl:.1f} | {tokens:,} tokens | {hms(elapsed)} elapsed",
        {"kind": "eval", "split": split, "step": step, "loss": loss, "ppl": ppl, "tokens": tokens,
         "elapsed_s": elapsed})


def log_train(log, progress, step, loss, lr, norm):
    """One line and record for the steps since the previous one (progress holds their time); returns tokens/s."""
    seconds, steps = progress.seconds, progress.steps
    tok_s, ms = progress.batch_tokens * steps / seconds, 1000 * seconds / steps
    elapsed, eta = progress.elapsed(), progress.eta(step)
    record = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": norm,
              "tokens_per_s": tok_s, "ms_per_step": ms, "elapsed_s": elapsed, "eta_s": eta}
    line = (f"{progress.at(step)} ({100 * step / progress.max_steps:.1f}%) | loss {loss:.4f} | lr {lr:.2e} | "
            f"norm {norm:.2f} | {tok_s:,.0f} tok/s | {ms:.0f} ms/step")
    if progress.mfu_per_token_s is not None:
        record["mfu"] = progress.mfu_per_token_s * tok_s
        line += f" | MFU {100 * record['mfu']:.1f}%"
    log(line + f" | {hms(elapsed)} elapsed, ETA {hms(eta)}", record)
    progress.seconds, progress.steps = 0.0, 0
    progress.speeds.append(tok_s)
    return tok_s


# Dense bf16 tensor-core peak per GPU, matched against the words of torch.cuda.get_device_name();
# the first entry whose words all appear wins.
PEAK_BF16_FLOPS = (
    ({"H100", "PCIe"}, 756e12), ({"H100", "NVL"}, 835e12), ({"H100"}, 989e12),
    ({"H200", "NVL"}, 835e12), ({"H200"}, 989e12), ({"GH200"}, 989e12), ({"B200"}, 2250e12),
    ({"A100"}, 312e12), ({"L40S"}, 362e12), ({"L4"}, 121e12), ({"A10"}, 125e12),
)


def peak_flops(device):
    """The device's bf16 peak in FLOP/s, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    words = set(re.split(r"[\s\-_]+", torch.cuda.get_device_name(device)))
    return next((peak for need, peak in PEAK_BF16_FLOPS if need <= words), None)
