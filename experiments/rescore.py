"""
Score finished runs on whole splits: each run's final checkpoint on every token of its validation and
test splits, not the fixed prefix (eval_tokens) the run itself evaluates.

    python -m experiments.rescore runs/sweep_cpu/rd_attnres/seed0          # one run (or several)
    python -m experiments.rescore --sweep experiments/configs/sweep_cpu.py             # every finished run of a sweep
    python -m experiments.rescore --sweep experiments/configs/sweep_cpu.py --out_dir DIR   # ... whose runs are in DIR
    python -m experiments.rescore RUN_DIR --tokens 65536 --splits val      # as the run scored it (a check)

Writes scores.json into each run directory (atomically): {"step", "val": {"loss", "tokens"}, "test":
{...}, "max_tokens", "data_dir", "own_data", "device", "autocast"}; train.py drops it when the run starts
over or continues. data_dir is the prepared data it scored (resolved), own_data whether that is the
run's own data_dir (experiments/rundirs.py reads only scores of the run's own data). A run whose scores.json is
of its checkpoint's step, its --tokens and the data asked for is skipped unless --force.
Before any compute: the data must hold the tokens the run's model reads (its tokenizer's name and
fingerprint, and no id beyond the model's vocabulary: as tools/diagnose.py checks), and the run
directory must take a file; one that does not is an `error:` line, and its scores are printed, not saved.
The numbers are those train.py's evaluation computes (the same function, train.evaluate: the
same windows of seq_len, the same batches, float64 sums), so with --tokens set to the run's eval_tokens
they equal its logged losses bit for bit. On a CUDA machine the model runs there, under bfloat16
autocast as train.py evaluates; elsewhere on the CPU in float32. A sweep scores each run it finishes
this way (experiments/sweep.py); the reports read the scores (experiments/rundirs.py).
Exit status: 0 done; 2 with one `error:` line per run that could not be scored or saved (no checkpoint, a
corrupt one, missing data or data of another tokenizer, a run directory that cannot be written: the scores
are then printed, not saved), the other runs scored.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common import UserError, cli, os_error_message, write_atomic
from data import get_tokenizer, load_meta
from experiments.rundirs import run_dir
from experiments.sweep import load_sweep
from model_fast import load_model
from tools import check_writable
from tools.diagnose import find_data_dir
from train import evaluate


def run_data(ckpt, data_dir=None):
    """(the prepared data to score, whether it is the run's own data_dir), checked against the run's
    model before any compute: the tokenizer it was trained on (name and fingerprint) and ids within
    its vocabulary; UserError otherwise. data_dir: --data_dir (it must hold prepared data), else the
    run's own (tools.diagnose.find_data_dir: from here, then from the project root)."""
    recorded = ckpt["train_config"]["data_dir"]
    try:
        own = Path(find_data_dir(recorded)[0]).resolve()
    except UserError:
        if data_dir is None:
            raise
        own = None
    data = own if data_dir is None else Path(find_data_dir(recorded, data_dir)[0]).resolve()
    meta, name, vocab = load_meta(data), ckpt["tokenizer"], ckpt["model_config"]["vocab_size"]
    if meta["tokenizer"] != name or meta["vocab_size"] > vocab:
        raise UserError(f"{data} holds {meta['tokenizer']} tokens ({meta['vocab_size']} ids), but the run's model reads "
                        f"{name} tokens ({vocab} ids): pass --data_dir with data prepared with --tokenizer {name}, or "
                        "leave it out (the run's own data_dir)")
    if meta["tokenizer_fingerprint"] != get_tokenizer(name).fingerprint:
        raise UserError(f"{data} was prepared with another version of the {name} tokenizer than this one: re-run "
                        "prepare_data.py with --overwrite")
    return data, data == own


def up_to_date(out, ckpt, splits, max_tokens, data):
    """Whether the run's scores.json holds these scores: its checkpoint's step, these splits and
    max_tokens, on this data (a scores.json that names no data_dir is of unknown data: not)."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):  # none, or a torn file: score again
        return False
    return isinstance(old, dict) and old.get("step") == ckpt["step"] and old.get("max_tokens") == max_tokens \
        and old.get("data_dir") == str(data) and all(s in old for s in splits)


def rescore(path, splits=("val", "test"), max_tokens=None, force=False, data_dir=None):
    """Score one run directory's checkpoint; returns its scores (and writes scores.json), or None when
    an up-to-date scores.json is there already. Everything is checked before any compute (run_data, and
    that the run directory takes a file: if not, its `error:` line is printed then, the run is scored,
    and a UserError with an empty message, said already, carries the scores as its result)."""
    path = Path(path)
    model, ckpt = load_model(path)
    data, own = run_data(ckpt, data_dir)
    out = path / "scores.json"
    if not force and up_to_date(out, ckpt, splits, max_tokens, data):
        return None
    try:
        check_writable(path)
        unwritable = None
    except OSError as e:
        unwritable = f"{os_error_message(e, out)}: the scores below are printed, not saved"
        print(f"error: {unwritable}", file=sys.stderr, flush=True)
    tc = ckpt["train_config"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None  # as train.py
    scores = {"step": ckpt["step"], "max_tokens": max_tokens, "data_dir": str(data), "own_data": own,
              "device": device.type, "autocast": "bfloat16" if autocast else None}
    for split in splits:  # train.py's evaluation, on one process
        loss, tokens = evaluate(model, data, split, tc["batch_size"], tc["seq_len"], max_tokens, device, autocast)
        scores[split] = {"loss": loss, "tokens": tokens}
    if unwritable:
        raise unsaved("", scores)
    try:
        write_atomic(out, json.dumps(scores, indent=2) + "\n")
    except OSError as e:
        raise unsaved(f"{os_error_message(e, out)}: the scores above are printed, not saved", scores) from None
    return scores


def unsaved(message, scores):
    """A UserError that carries the scores computed before it (printed, so that nothing computed is lost)."""
    e = UserError(message)
    e.result = scores
    return e


def line(r, scores, splits, seconds):
    return f"{r}: step {scores['step']}, " + ", ".join(
        f"{s} {scores[s]['loss']:.5f} ({scores[s]['tokens']:,} tokens)" for s in splits) + f" in {seconds:.0f}s"


def main(argv=None):
    """The command line; its exit status (common.cli)."""
    return cli(run, argv)


def run(argv):
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
    if not args.runs and not args.sweep:
        raise UserError("give run directories or --sweep SWEEP_FILE")
    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {args.tokens}")
    if not splits or not set(splits) <= {"train", "val", "test"}:
        raise UserError(f"--splits takes train, val and test, got {args.splits!r}")
    runs = [Path(r) for r in args.runs]
    if args.sweep:
        spec = load_sweep(args.sweep)
        if args.out_dir:
            spec["out_dir"] = str(Path(args.out_dir).absolute())
        runs += [d for v in spec["variants"] for s in spec["seeds"]
                 if (d := run_dir(spec, v, s)).joinpath("summary.json").exists()]
    status = 0
    for r in runs:
        t0 = time.perf_counter()
        try:
            scores = rescore(r, splits, args.tokens, args.force, args.data_dir)
        except (UserError, OSError) as e:  # this run's line (and its scores, if computed); the others are scored
            if getattr(e, "result", None) is not None:
                print(line(r, e.result, splits, time.perf_counter() - t0), flush=True)
            if str(e):  # (empty: said before the scoring)
                print(f"error: {e if isinstance(e, UserError) else os_error_message(e)}", file=sys.stderr, flush=True)
            status = 2
            continue
        if scores is None:
            print(f"{r}: up to date")
        else:
            print(line(r, scores, splits, time.perf_counter() - t0), flush=True)
    return status

if __name__ == "__main__":
    sys.exit(main())
