"""Helpers the sweep and report tests share: run directories as a finished, scored train.py run leaves
them, a run_child that plays train.py, and sweep specs and files."""

import json
import os
from pathlib import Path


def finished_run(d, loss, params=1000, whole=True):
    """A run directory as a finished train.py run leaves it, scored on whole splits as the sweep scores it
    (scores.json; whole=False: not yet): what the sweep and its report read of it. The prefix scores are
    `loss`, the whole validation split loss + 0.001, the whole test split loss + 0.002."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "log.jsonl").write_text("".join(json.dumps({"kind": "eval", "split": "val", "step": s, "loss": loss + 1 / s})
                                         + "\n" for s in (2, 4)))
    (d / "summary.json").write_text(json.dumps({"run_dir": str(d), "step": 4, "val_loss": loss, "test_loss": loss,
                                                "params": params, "tokens_per_s": 100.0, "peak_memory_bytes": 10}))
    if whole:
        (d / "scores.json").write_text(json.dumps({"step": 4, "max_tokens": None, "val": {"loss": loss + 0.001, "tokens": 99},
                                                   "test": {"loss": loss + 0.002, "tokens": 99}}))


def fake_train(diverging=(), ran=None):
    """A run_child that does what train.py does to its run directory: it holds the directory's lock (a
    second one is 'in use by another run', status 2), and finishes it or, for `diverging` variants,
    leaves its log.jsonl ending on a diverged record (status 2)."""
    from experiments.rundirs import try_lock

    def run(cmd):
        arg = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cmd if a.startswith("--")}
        d = Path(arg["--out_dir"]) / arg["--run_name"]
        variant, seed = d.parent.name, int(arg["--seed"])
        d.mkdir(parents=True, exist_ok=True)
        lock = try_lock(d / ".lock")
        if lock is None:
            return 1
        try:
            if ran is not None:
                ran.append((variant, seed))
            if variant in diverging:
                (d / "log.jsonl").write_text(json.dumps({"kind": "diverged", "step": 3, "error": "loss nan"}) + "\n")
                return 1
            finished_run(d, 3.0 + 0.01 * len(variant) + 0.001 * seed)
            return 0
        finally:
            os.close(lock)
    return run


def sweep_spec(tmp_path, variants=("a", "b"), seeds=(0, 1), **kw):
    """A checked sweep's spec (as load_sweep returns it), with its runs in tmp_path/runs."""
    spec = dict(base="configs/test.py", variants={v: "" for v in variants}, seeds=list(seeds), overrides="",
                reference=variants[0], controls={}, primary=[], twins={}, score="val", alpha=0.05)
    spec.update(kw)
    if "out_dir" not in spec:
        spec["out_dir"] = str(tmp_path / "runs")
    return spec


def sweep_file(tmp_path, variants=("a", "b"), seeds=(0, 1), out_dir=None, extra=""):
    path = tmp_path / "sweep_x.py"
    path.write_text(f'base = "configs/test.py"\nvariants = {json.dumps({v: "" for v in variants})}\n'
                    f'seeds = {list(seeds)}\nreference = "{variants[0]}"\nout_dir = {str(out_dir or tmp_path / "runs")!r}\n'
                    + extra)
    return path


def strict_json(path):
    """A JSON file's object, refusing NaN and Infinity (not JSON)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(Path(path).read_text(), parse_constant=refuse)
