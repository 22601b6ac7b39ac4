"""
Score finished runs on whole splits: each run's final checkpoint on every token of its validation and
test splits, not the fixed prefix (eval_tokens) the run itself evaluates.

    python -m tools.rescore runs/sweep_cpu/rd_attnres/seed0          # one run (or several)
    python -m tools.rescore --sweep configs/sweep_cpu.py             # every finished run of a sweep
    python -m tools.rescore --sweep configs/sweep_cpu.py --out_dir DIR   # ... whose runs are in DIR
    python -m tools.rescore RUN_DIR --tokens 65536 --splits val      # as the run scored it (a check)

Writes scores.json into each run directory (atomically): {"step", "val": {"loss", "tokens"}, "test":
{...}, "max_tokens", "device", "autocast"}; train.py drops it when the run starts over or continues.
A run whose scores.json is of its checkpoint's step is skipped unless --force.
The numbers are those train.py's evaluation computes (the same function, depthres.run.evaluate: the
same windows of seq_len, the same batches, float64 sums), so with --tokens set to the run's eval_tokens
they equal its logged losses bit for bit. On a CUDA machine the model runs there, under bfloat16
autocast as train.py evaluates; elsewhere on the CPU in float32. A sweep scores each run it finishes
this way (tools/sweep.py); tools/report.py reads the scores.
Exit status: 0 done; 2 with one `error:` line (no checkpoint, a corrupt one, missing data, a run
directory that cannot be written).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from depthres.checkpoint import CheckpointError, load_model
from depthres.distributed import Dist
from depthres.files import write_file
from depthres.run import evaluate
from depthres.token_data import DataError
from tools.report import run_dir
from tools.sweep import load_sweep


class RescoreError(RuntimeError):
    """A run directory that cannot be scored or written."""


def rescore(path, splits=("val", "test"), max_tokens=None, force=False, data_dir=None):
    """Score one run directory's checkpoint; returns its scores (and writes scores.json), or None when
    an up-to-date scores.json is there already."""
    path = Path(path)
    model, ckpt = load_model(path)
    out = path / "scores.json"
    if out.exists() and not force:
        try:
            old = json.loads(out.read_text())
            if old.get("step") == ckpt["step"] and old.get("max_tokens") == max_tokens and \
                    all(s in old for s in splits):
                return None
        except ValueError:
            pass  # a torn file: score again
    tc = ckpt["train_config"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None  # as train.py
    scores = {"step": ckpt["step"], "max_tokens": max_tokens, "device": device.type,
              "autocast": "bfloat16" if autocast else None}
    for split in splits:  # train.py's evaluation, on one process
        loss, tokens = evaluate(model, data_dir or tc["data_dir"], split, tc["batch_size"], tc["seq_len"], max_tokens,
                                Dist(rank=0, world_size=1, device=device), autocast)
        scores[split] = {"loss": loss, "tokens": tokens}
    write_file(out, (json.dumps(scores, indent=2) + "\n").encode(), RescoreError)
    return scores


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (each with ckpt.pt)")
    p.add_argument("--sweep", help="a sweep file: every finished run (summary.json) of it")
    p.add_argument("--out_dir", help="with --sweep: where its runs are, if not the sweep file's out_dir")
    p.add_argument("--splits", default="val,test", help="comma-separated splits to score (default: val,test)")
    p.add_argument("--tokens", type=int, default=None, help="score only the first TOKENS targets (default: all)")
    p.add_argument("--data_dir", default=None, help="the prepared data (default: each run's own data_dir)")
    p.add_argument("--force", action="store_true", help="score again runs whose scores.json is up to date")
    args = p.parse_args(argv)
    splits = tuple(s for s in args.splits.split(",") if s)
    try:
        if not args.runs and not args.sweep:
            raise RescoreError("give run directories or --sweep SWEEP_FILE")
        if args.tokens is not None and args.tokens < 1:
            raise RescoreError(f"--tokens must be at least 1, got {args.tokens}")
        if not splits or not set(splits) <= {"train", "val", "test"}:
            raise RescoreError(f"--splits takes train, val and test, got {args.splits!r}")
        runs = [Path(r) for r in args.runs]
        if args.sweep:
            spec = load_sweep(args.sweep)
            if args.out_dir:
                spec["out_dir"] = str(Path(args.out_dir).absolute())
            runs += [d for v in spec["variants"] for s in spec["seeds"]
                     if (d := run_dir(spec, v, s)).joinpath("summary.json").exists()]
        for r in runs:
            t0 = time.perf_counter()
            scores = rescore(r, splits, args.tokens, args.force, args.data_dir)
            if scores is None:
                print(f"{r}: up to date")
            else:
                print(f"{r}: step {scores['step']}, " + ", ".join(
                    f"{s} {scores[s]['loss']:.5f} ({scores[s]['tokens']:,} tokens)" for s in splits)
                    + f" in {time.perf_counter() - t0:.0f}s", flush=True)
    except (CheckpointError, DataError, RescoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
