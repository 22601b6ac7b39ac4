"""
A sweep's run directories as the tools read them: out_dir/<variant>/seed<s> with its summary.json (a
finished run), scores.json (its whole-split scores, experiments/rescore.py) and log.jsonl (its evaluations, and
the record of a divergence). Every reader is forgiving of a torn or foreign file: an unreadable summary is
an unfinished run, a torn log line is skipped.
"""

import fcntl
import json
import math
import os
import sys
from pathlib import Path

from common import log_records
from tools.diagnose import val_curve


def try_lock(path):
    """An fd holding an exclusive flock on `path` (made if missing) for this process' life, or None while a live
    process holds it: a sweep's claim on a run."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # (a link planted there: refused, not followed)
    except IsADirectoryError:  # (flock needs only an open file)
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def locked(path):
    """Whether a live process holds a flock on `path` (train.py's run directory .lock)."""
    if not Path(path).is_file():
        return False
    fd = try_lock(path)
    if fd is not None:
        os.close(fd)
    return fd is None


def run_dir(spec, variant, seed):
    return Path(spec["out_dir"]) / variant / f"seed{seed}"


def read_json(path):
    """A JSON object from a file, or None: not there, torn, or not an object."""
    try:
        x = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return x if isinstance(x, dict) else None


def read_summary(d):
    """A run directory's summary.json as a dict, or None: not there, or not a JSON object (a torn or
    damaged file is an unfinished run: resumed at its last checkpoint, the run writes it again)."""
    return read_json(Path(d) / "summary.json")


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def finished_run(d):
    """(summary, config) of a finished train.py run directory, each a dict with what every report reads (the
    summary's whole step, the config's train dict with a positive batch_tokens, its model dict), or None: not
    finished, or files that are not train.py's (torn, foreign, odd), which the reports count as unfinished
    rather than read."""
    summary, cfg = read_summary(d), read_json(Path(d) / "config.json")
    if summary is None or cfg is None:
        return None
    train, model, step = cfg.get("train"), cfg.get("model"), summary.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0 and isinstance(train, dict)
            and isinstance(model, dict) and finite(train.get("batch_tokens")) and train["batch_tokens"] > 0):
        return None
    return summary, cfg


def token_unit(dirs):
    """What one token of the runs in `dirs` is, from their config.json's tokenizer: "byte" (the byte
    tokenizer), "token" (any other), or None (no config.json says, or the runs are of both kinds)."""
    kinds = {"byte" if t == "byte" else "token" for d in dirs
             if isinstance(t := (read_json(Path(d) / "config.json") or {}).get("tokenizer"), str)}
    return kinds.pop() if len(kinds) == 1 else None


def nats(unit):
    """The unit of a loss as the reports name it: "nats per byte", "nats per token", or "nats" (unit None)."""
    return f"nats per {unit}" if unit else "nats"


def tabulable(summary):
    return summary is not None and finite(summary.get("val_loss"))


def whole_split_scores(d, step):
    """{"val": loss, "test": loss} of a run's scores.json (experiments/rescore.py) when it scored the whole
    splits of the checkpoint at `step` on the run's own data; {} otherwise (not scored yet, an older
    checkpoint's, or scores of other data: rescore --data_dir)."""
    scores = read_json(Path(d) / "scores.json")
    if scores is None or scores.get("max_tokens") is not None or (step is not None and scores.get("step") != step) \
            or scores.get("own_data") is False:
        return {}
    return {s: scores[s]["loss"] for s in ("val", "test") if isinstance(scores.get(s), dict)
            and finite(scores[s].get("loss"))}


def divergence(d):
    """The "diverged" record train.py left in a run's log.jsonl (its step and error), or None."""
    return next((r for r in reversed(log_records(d)) if r.get("kind") == "diverged"), None)


def collect(spec):
    """The finished runs: each summary.json with its variant, seed, whole-split scores ("whole") and
    validation curve. A summary.json that cannot be read is a run not finished, with a note."""
    runs = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            d = run_dir(spec, variant, seed)
            summary = read_summary(d)
            if summary is None and (d / "summary.json").exists():
                print(f"note: {d / 'summary.json'} is not a readable summary (torn or damaged): {variant} seed {seed} "
                      "counts as unfinished; the sweep resumes it to write it again", file=sys.stderr)
            elif summary is not None and not tabulable(summary):
                print(f"note: {d / 'summary.json'} holds no finite val_loss: {variant} seed {seed} is left out of the "
                      "tables (delete the file to run it again)", file=sys.stderr)
            if tabulable(summary):
                runs.append({"variant": variant, "seed": seed,
                             **{k: v for k, v in summary.items() if k not in ("variant", "seed", "curve", "whole")},
                             "run_dir": f"{variant}/seed{seed}",  # relative to out_dir: no machine's paths
                             "whole": whole_split_scores(d, summary.get("step")),
                             "curve": {str(step): loss for step, loss in val_curve(d)}})
    return runs


def collect_diverged(spec):
    """The runs that diverged: variant, seed, and the step and error of train.py's record."""
    out = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            d = run_dir(spec, variant, seed)
            if read_summary(d) is None and (record := divergence(d)) is not None:
                out.append(dict(variant=variant, seed=seed, step=record.get("step"), error=record.get("error")))
    return out
