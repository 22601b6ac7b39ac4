"""
Paired comparisons: every variant with every seed, resumable, shared by processes, then the report.

    python -m experiments.sweep experiments/configs/quick.py                 # one run after another, then the table
    OMP_NUM_THREADS=1 python -m experiments.sweep FILE & OMP_NUM_THREADS=1 python -m experiments.sweep FILE
                                                                             # two processes share the runs
    python -m experiments.sweep FILE --launcher "torchrun --standalone --nproc_per_node=8"
    python -m experiments.sweep FILE --table_only                            # the report of the finished runs

A sweep file is Python that sets `base` (a train.py config), `variants` ({name: "key=value ..."}), `seeds` and
`reference`, and optionally `overrides` (for every run), `out_dir` (default runs/<file name>), `second_reference`,
`wandb`, and the declared comparison: `primary` [(variant, baseline)], `controls` {variant: control},
`equivalence_margin`, `score` ("val" or "test") and `alpha` (experiments/report.py). Run s of every variant uses
seed=s and data_seed=s, so partners share their initial weights and batches; the sweep owns those keys, run_name,
out_dir, resume, overwrite and final_eval_tokens (0: every run scores the whole splits at its end). Paths in a sweep
file are relative to the project root; on the command line, to the working directory. docs/experiments.md has the
protocol. Exit status: 0; 2 after one `error:` line (before any run where the input is bad); 3 done, with runs
that diverged (final, tabulated as such; delete a run's directory to run it again).
"""

import argparse
import ctypes
import fcntl
import functools
import importlib.util
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python experiments/sweep.py` as `python -m ...`

from common import ROOT, Stopped, UserError, cli, need, os_error_message, read_json, say
from data import data_fingerprint, load_meta
from experiments.report import SCORES, divergence, report, run_dir
from model import GPTConfig
from tools import check_writable
from train import EXECUTION_KEYS, TrainConfig, build_model_config, hms, parse_config, read_settings

OWNED_KEYS = ("seed", "data_seed", "run_name", "out_dir", "resume", "overwrite", "final_eval_tokens")
EXIT_DIVERGED = 3
# what says where a run is, how it computes or what it logs, not what it computes: a sweep may change it
NOT_DESIGN = {"out_dir", "run_name", "resume", "overwrite", "device", "compile", "fsdp", "log_interval", "ckpt_interval",
              "threads", "wandb_log", "wandb_project", "wandb_run_name", "wandb_group", "wandb_tags", *EXECUTION_KEYS}


def load_sweep(path, reference=None):
    """The sweep file's settings, each checked (one `error:` line before any run); paths made absolute."""
    def check(ok, message):
        need(ok, f"sweep file {path}: {message}")

    spec = {**read_settings(path, "sweep file"), "path": str(path)}
    spec["reference"] = reference or spec.get("reference")
    missing = [k for k in ("base", "variants", "seeds", "reference") if not spec.get(k)]
    check(not missing, f"must set {', '.join(missing)}")
    names = spec["variants"]
    check(isinstance(names, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()),
          'variants must be a dict of {name: "key=value ..."} strings')
    for name in names:
        check(name not in ("", ".", "..") and not set(name) & set("/\\") and name.isprintable() and len(name) < 200,
              f"variant name {name!r} is not a plain directory name (no /, \\, .., control characters; under 200 "
              "characters): it names the directory of the variant's runs")
    seeds = spec["seeds"]
    check(isinstance(seeds, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32
                                                   for s in seeds), "seeds must be a list of whole numbers >= 0")
    check(len(set(seeds)) == len(seeds), f"seeds {list(seeds)} name a seed twice: each seed is one paired run")
    spec.setdefault("overrides", "")
    spec.setdefault("out_dir", str(Path("runs") / Path(path).stem))
    for key in ("base", "overrides", "out_dir"):
        check(isinstance(spec[key], str) and spec[key].isprintable(), f"{key} must be a string of printable characters")
    spec["base"], spec["out_dir"] = str(ROOT / spec["base"]), str(ROOT / spec["out_dir"])  # (absolute ones stay)
    for key in [k for k in ("reference", "second_reference") if k in spec]:
        check(spec[key] in names, f"{key} {spec[key]!r} is not one of the variants {list(names)}")
    primary, controls = spec.setdefault("primary", []), spec.setdefault("controls", {})
    check(isinstance(primary, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 and p[0] != p[1]
                                                     and all(x in names for x in p) for p in primary),
          f"primary must be a list of (variant, baseline) pairs of two different variants among {list(names)}")
    check(len({v for v, _ in primary}) == len(primary), "primary tests a variant twice: one claim per variant")
    check(isinstance(controls, dict) and all(v in dict(primary) and c in names and c not in (v, dict(primary)[v])
                                             for v, c in controls.items()),
          "controls must be {variant: control}: a variant with a primary test, and another variant, not its baseline")
    spec.setdefault("score", "val")
    check(spec["score"] in SCORES, f"score must be one of {', '.join(SCORES)}, got {spec['score']!r}")
    spec.setdefault("alpha", 0.05)
    check(isinstance(spec["alpha"], float) and 0 < spec["alpha"] < 1, f"alpha must be in (0, 1), got {spec['alpha']!r}")
    margin = spec.setdefault("equivalence_margin", None)
    check(margin is None or (isinstance(margin, (int, float)) and not isinstance(margin, bool) and 0 < margin < 1e9
                             and primary), "equivalence_margin must be a positive number of nats, with primary tests")
    for variant, text in [("the overrides", spec["overrides"]), *names.items()]:
        try:
            owned = [k for kv in shlex.split(text) if (k := kv.partition("=")[0].lstrip("-")) in OWNED_KEYS]
        except ValueError as e:  # an unterminated quote
            raise UserError(f"sweep file {path}: {variant} ({text!r}): {e}") from None
        check(not owned, f"{variant} ({text!r}) sets {', '.join(owned)}, which the sweep sets for every run (its "
                         "pairing: seed and data_seed are each seed; its directories; its resumes; whole-split scores)")
    return spec


def overrides(spec, variant):
    """A run's key=value overrides, in the order train.py reads them: the sweep's, then the variant's."""
    return shlex.split(spec["overrides"]) + shlex.split(spec["variants"][variant])


def design(spec, variant, seed, vocab_size=1):
    """{key: value} of what a run of `variant` computes (every train.py and model key but NOT_DESIGN), as train.py
    reads it: a bad variant is one line naming it."""
    try:
        tc, model_settings = parse_config([spec["base"], f"--seed={seed}", f"--data_seed={seed}",
                                           "--final_eval_tokens=0", *(f"--{kv}" for kv in overrides(spec, variant))])
        mc = build_model_config(model_settings, tc, {"vocab_size": vocab_size, "tokenizer": None})
    except UserError as e:
        raise UserError(f"sweep variant {variant!r} ({spec['variants'][variant]!r}): {e}") from None
    return {k: v for k, v in {**asdict(tc), **asdict(mc)}.items() if k not in NOT_DESIGN}


def check_design(spec):
    """Every run's config.json against what the sweep file says now (one line before any run and any table, naming
    the runs and keys): a table never pools runs of different designs or data."""
    changed = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            recorded = read_json(run_dir(spec, variant, seed) / "config.json") or {}
            if not isinstance(recorded.get("train"), dict) or not isinstance(recorded.get("model"), dict):
                continue  # not started
            ran = {**{f.name: f.default for cls in (TrainConfig, GPTConfig) for f in fields(cls)},
                   **recorded["train"], **recorded["model"]}
            now = design(spec, variant, seed, recorded["model"].get("vocab_size", 1))
            diff = [f"{k} {ran.get(k)!r} (now {v!r})" for k, v in now.items() if ran.get(k) != v]
            if recorded.get("data_fingerprint") not in (None, data_now(now["data_dir"])):
                diff.append(f"other data (its data_dir {now['data_dir']} was prepared again since)")
            if diff:
                changed.append(f"{variant} seed {seed} ran with {', '.join(diff[:3])}")
    need(not changed, f"the sweep's design changed since some of its runs ran: {'; '.join(changed[:3])}"
                      f"{f' and {len(changed) - 3} more runs' if len(changed) > 3 else ''}; restore the sweep file, give "
                      f"the new design its own out_dir (not {spec['out_dir']}), or delete those runs")


@functools.cache
def data_now(data_dir):
    """The fingerprint of the prepared data a run of the sweep would open (None: not prepared, or no digests)."""
    try:
        return data_fingerprint(load_meta(ROOT / data_dir))
    except UserError:
        return None


def held(d):
    """Whether a live train.py holds the run directory's lock (its own: train.claim_run_dir)."""
    try:
        fd = os.open(d / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def status(spec, variant, seed):
    """"finished", "diverged" (final), "busy" (another process runs it) or None (to run)."""
    d = run_dir(spec, variant, seed)
    if read_json(d / "summary.json") is not None:
        return "finished"
    return "diverged" if divergence(d) else "busy" if held(d) else None


def train_command(spec, variant, seed, launcher):
    d = run_dir(spec, variant, seed)
    args = [str(ROOT / "train.py"), spec["base"], f"--out_dir={d.parent}", f"--run_name={d.name}", f"--seed={seed}",
            f"--data_seed={seed}", "--final_eval_tokens=0"]
    if spec.get("wandb"):  # one W&B group per sweep; the overrides below may still change these
        args += ["--wandb_log=true", f"--wandb_group={Path(spec['out_dir']).name}", f"--wandb_tags={variant},seed{seed}",
                 f"--wandb_run_name={variant}-seed{seed}"]
    args += [f"--{kv}" for kv in overrides(spec, variant)]
    args += ["--resume=true"] if d.exists() else []  # (no checkpoint yet: train.py starts over; a lost one: it refuses)
    return shlex.split(launcher) + args if launcher else [sys.executable, *args]


def die_with_parent():
    """A preexec_fn: Linux sends the child SIGTERM when the sweep dies (kill -9 too), so a run never outlives it and
    writes a checkpoint as it stops. None where there is no prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child():  # between fork and exec
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the sweep died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return in_child


def run_child(cmd):
    """Run a training command from the project root; its exit status. Ctrl-C reaches the child too (one process
    group), which finishes its step and writes a checkpoint: wait for it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=die_with_parent())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()


def run_all(spec, launcher):
    """Every run not finished, diverged or busy, seed by seed (a partial sweep holds whole paired sets); a progress
    line after each."""
    runs = [(variant, seed) for seed in spec["seeds"] for variant in spec["variants"]]
    need(not spec.get("wandb") or importlib.util.find_spec("wandb"), "the sweep logs to W&B, but wandb is not "
                                                                     "installed: pip install wandb")
    try:
        Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
        check_writable(spec["out_dir"])
    except OSError as e:
        raise UserError(f"{os_error_message(e, spec['out_dir'])}: the sweep writes its runs there; make it writable, "
                        "or choose another out_dir (--table_only only reads the runs)") from None
    t0, durations = time.monotonic(), []
    for variant, seed in runs:
        if status(spec, variant, seed):
            continue
        cmd = train_command(spec, variant, seed, launcher)
        say(f"\n=== {variant}, seed {seed}: {' '.join(cmd)}")
        start, returncode = time.monotonic(), run_child(cmd)
        if returncode in (130, 143):
            raise Stopped(f"run {variant} seed {seed} stopped with a checkpoint; run the sweep again to resume it",
                          returncode - 128)
        if returncode != 0 and status(spec, variant, seed) is None:
            raise UserError(f"run {variant} seed {seed} failed (above); fix it and run the sweep again to resume")
        if returncode == 0:
            durations.append(time.monotonic() - start)
        states = Counter(status(spec, v, s) for v, s in runs)
        done = states["finished"] + states["diverged"]
        eta = statistics.fmean(durations) * (len(runs) - done - states["busy"]) if durations else None
        say(f"sweep: {done}/{len(runs)} runs done" + "".join(f", {states[k]} {k}" for k in ("diverged", "busy")
                                                              if states[k])
            + f", {hms(time.monotonic() - t0)} elapsed, ETA {'?' if eta is None else hms(eta)} (this process)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (see above)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    p.add_argument("--table_only", action="store_true", help="no training: the report of the finished runs")
    p.add_argument("--out_dir", help="override the sweep file's out_dir")
    p.add_argument("--reference", help="override the sweep file's reference variant")
    p.add_argument("--score", choices=list(SCORES), help="override the sweep file's score")
    p.add_argument("--wandb", action="store_true", help="log every run to W&B, one group per sweep")
    args = p.parse_args(argv)
    spec = load_sweep(args.sweep, args.reference)
    if args.out_dir:
        need(args.out_dir.isprintable(), f"--out_dir {args.out_dir!r} holds a control character")
        spec["out_dir"] = str(Path(args.out_dir).absolute())
    spec["score"], spec["wandb"] = args.score or spec["score"], args.wandb or spec.get("wandb", False)
    for variant in spec["variants"]:  # every variant as train.py reads it, before any run
        for seed in spec["seeds"]:
            design(spec, variant, seed)
    check_design(spec)
    if not args.table_only:
        run_all(spec, args.launcher)
    report(spec)
    return EXIT_DIVERGED if any(status(spec, v, s) == "diverged" for v in spec["variants"] for s in spec["seeds"]) else 0


if __name__ == "__main__":
    sys.exit(cli(main))
