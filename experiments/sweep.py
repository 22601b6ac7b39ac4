"""
Paired comparisons: every variant with every seed, and a table of what came out.

    python -m experiments.sweep experiments/configs/sweep_cpu.py                          # one run after another, on this machine
    python -m experiments.sweep experiments/configs/sweep_cpu.py --launcher "torchrun --nproc_per_node=8"
    python -m experiments.sweep experiments/configs/sweep_cpu.py --table_only             # just the table, from finished runs
    python -m experiments.sweep experiments/configs/sweep_cpu.py --table_only --reference block_attnres
    python -m experiments.sweep experiments/configs/sweep_cpu.py --table_only --score test   # the tests on the whole test split
    python -m experiments.sweep experiments/configs/sweep_cpu.py --wandb                  # every run logged to Weights & Biases

A sweep file is Python that sets:
    base       a train.py config file
    variants   {name: "key=value key=value"}, train.py overrides per variant ("" for the base itself);
               a name is a plain directory name (the runs' directory)
    seeds      [0, 1, 2]: run s uses seed=s and data_seed=s for every variant, so partners share
               their initial weights, their batches and their schedule (no seed twice)
    reference  the variant the others are compared with
    overrides  (optional) "key=value ..." for every run
The comparison, declared before any run (what the report does with it: experiments/report.py):
    primary    (optional) [(variant, baseline), ...]: the claims, one family, Holm within it
    controls   (optional) {variant: its parameter-matched control}: tested once the variant's primary
               test rejects
    twins      (optional) {variant: twin}: trains bit for bit as its twin; checked equal, never tested
    score      (optional) "val" (default: the whole validation split), "test", "val_prefix", "test_prefix"
    alpha      (optional) the family-wise error rate, 0.05
    equivalence_margin  (optional, with primary) a margin in nats: each primary test is also a TOST
               equivalence test against +-margin, so a null result can be concluded
    second_reference  (optional) a second variant every other one is compared with (exploratory)
    out_dir    (optional) where runs go: out_dir/<variant>/seed<s>; default runs/<sweep file name>
    wandb      (optional) True: log every run to W&B, as --wandb does
The sweep owns seed, data_seed, run_name and out_dir: a variant or overrides that sets one would break
the pairing (every "seed" the same run, or runs elsewhere), and is refused before the first run; so are
resume and overwrite, which the sweep sets itself for each run.

Paths: those in a sweep file (base, out_dir, and paths in overrides such as data_dir) are relative to
the project root (where train.py is), as the sweep files in configs/ are written, and every run's
train.py runs there, so a sweep means the same from any working directory. Paths on the command line
(the sweep file, --out_dir, --base) are relative to the working directory, as any command's.

With W&B (--wandb, `wandb = True`, or wandb_log=true in the overrides or a variant's), each run gets
wandb_group=<the sweep's name, out_dir's last part>, wandb_tags=<variant>,seed<s> and
wandb_run_name=<variant>-seed<s>; overrides that set these keys win.

A finished run (its summary.json readable) is skipped, a run with a checkpoint is resumed and one
without is started over, so an interrupted sweep continues where it stopped. A sweep file edited under
runs it has is refused before any run (and before --table_only's table), naming the runs and the keys:
each run's config.json must record what the sweep would run now (NOT_DESIGN, the keys of where a run is,
how it computes and what it logs, may change), since a table never pools runs of different designs. A run that diverged
(train.py's log.jsonl ends on a "diverged" record) is final: the sweep goes on with the other runs,
tabulates it as diverged and skips it on later invocations (delete its directory to run it again, say
with a lower lr). A run that another process holds (another sweep process, or a train.py of its own)
is skipped with a note. A training run dies with the sweep that started it: if the sweep is killed,
even by kill -9, its run gets SIGTERM, so it writes a checkpoint and stops (Linux). After each run a
progress line gives the runs done out of all (skipped finished runs count as done), the time since
the sweep started, and an ETA: the mean duration of the runs this invocation has run, times the runs
left (a resumed run counts with the part it ran, so right after a resume the ETA can be low). Each run
that finishes is scored on its whole validation and test splits (python -m experiments.rescore, scores.json
in the run directory), and so is any finished run the sweep finds unscored. At the end the report
(experiments/report.py) is printed and saved as results.md, results.json and results.csv in out_dir, with
plots when matplotlib is installed; each file is written whole or not at all, and a file that cannot
be written (a read-only out_dir) is one `warning:` line after the printed tables.

Exit status (common.cli): 0 done; 2 with one `error:` line, before any run where the input is bad: a bad sweep file,
seed or variant (the overrides, every seed and every variant's overrides are checked as train.py reads
them), an out_dir it cannot write, no finished run of the reference to tabulate, or a run that failed
(not by diverging); 3 done, but some runs diverged (the tables mark them); 4 done, but a twin does not
match its twin (one `warning:` line; the Twins table says no), whether or not runs diverged too.
"""

import argparse
import ctypes
import fcntl
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path

from common import Stopped, UserError, cli, os_error_message, write_atomic
from experiments.report import SCORES, report, unequal_twins
from experiments.rundirs import collect, divergence, locked, read_json, read_summary, run_dir, try_lock, whole_split_scores
from model import GPTConfig
from tools import check_writable as writable
from train import EXECUTION_KEYS, TrainConfig, build_model_config, hms, parse_config

ROOT = Path(__file__).resolve().parent.parent
OWNED_KEYS = ("seed", "data_seed", "run_name", "out_dir", "resume", "overwrite")  # what the sweep sets for every run
EXIT_DIVERGED = 3  # the sweep finished, but some of its runs diverged
EXIT_TWINS = 4  # the sweep finished, but a twin does not match its twin (a bug: they train bit for bit alike)
# the keys that say where a run is, how it computes or what it logs, not what it computes: a sweep may change them
NOT_DESIGN = {"out_dir", "run_name", "resume", "overwrite", "device", "compile", "fsdp", "log_interval", "ckpt_interval",
              "wandb_log", "wandb_project", "wandb_run_name", "wandb_group", "wandb_tags", *EXECUTION_KEYS}


def fail(message):
    """The sweep's one `error:` line (a UserError: exit status 2)."""
    raise UserError(message)


def in_root(path):
    """A path of a sweep file: relative ones are relative to the project root."""
    return str(path) if Path(path).is_absolute() else str(ROOT / path)


def read_settings(path, what):
    """The names a Python settings file (a sweep or design file) assigns; a missing file, a syntax error
    or an exception in it is one `error: <what> <path>: ...` line (a UserError), naming the line."""
    if not Path(path).is_file():
        raise UserError(f"{what} {path} not found")
    settings = {}  # one namespace, as a module has: a comprehension sees the file's names
    try:
        exec(compile(Path(path).read_text(), str(path), "exec"), settings)
    except SyntaxError as e:
        raise UserError(f"{what} {path}: line {e.lineno}: syntax error: {e.msg}") from None
    except (Exception, SystemExit) as e:  # (sys.exit in the file too)
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == str(path)), "?")
        raise UserError(f"{what} {path}: line {line}: {type(e).__name__}: {e}") from None
    settings.pop("__builtins__", None)
    return settings


def load_sweep(path, reference=None):
    """The sweep file's settings, each checked: a bad file is one `error:` line (a UserError) before any run.
    Its relative paths (base, out_dir) are made absolute, against the project root."""
    def fail(message):
        raise UserError(f"sweep file {path}: {message}")

    spec = read_settings(path, "sweep file")
    spec["path"] = str(path)  # its declaration: the report names the commit that added it
    if reference:
        spec["reference"] = reference
    missing = [k for k in ("base", "variants", "seeds", "reference") if k not in spec]
    if missing:
        fail(f"must set {', '.join(missing)}")
    if not isinstance(spec["variants"], dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in spec["variants"].items()):
        fail('variants must be a dict of {name: "key=value ..."} strings')
    if not isinstance(spec["seeds"], (list, tuple)) or not spec["seeds"] or \
            not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in spec["seeds"]):
        fail("seeds must be a non-empty list of whole numbers >= 0")
    twice = sorted(s for s, n in Counter(spec["seeds"]).items() if n > 1)
    if twice:
        fail(f"seeds {spec['seeds']} name {', '.join(map(str, twice))} more than once: each seed is one paired run "
             "of every variant, so each may appear once")
    for name in spec["variants"]:
        if not name or name in (".", "..") or "/" in name or "\\" in name or not name.isprintable():
            fail(f"variant name {name!r} is not a plain directory name (no /, \\, .. or control characters): "
                 "it names the directory of the variant's runs")
    spec.setdefault("overrides", "")
    spec.setdefault("out_dir", str(Path("runs") / Path(path).stem))
    for key in ("base", "overrides", "out_dir"):
        if not isinstance(spec[key], str):
            fail(f"{key} must be a string, got {type(spec[key]).__name__}")
    for key in ("base", "out_dir"):
        if not spec[key].isprintable():
            fail(f"{key} {spec[key]!r} holds a control character")
    spec["base"], spec["out_dir"] = in_root(spec["base"]), in_root(spec["out_dir"])
    for key in ("reference", "second_reference"):
        if key in spec and spec[key] not in spec["variants"]:
            fail(f"{key} {spec[key]!r} is not one of the variants {list(spec['variants'])}")
    spec.setdefault("controls", {})
    if not isinstance(spec["controls"], dict) or not all(k in spec["variants"] and v in spec["variants"]
                                                        for k, v in spec["controls"].items()):
        fail("controls must be a dict {variant: its parameter-matched control}, both among the variants")
    check_protocol(spec, fail)
    check_owned(spec, lenient=True)  # before --table_only too: such a sweep's table pairs nothing
    return spec


def check_protocol(spec, fail):
    """The declared comparison (experiments/report.py): primary [(variant, baseline)], twins {variant: twin},
    score and alpha; each checked against the variants, so a typo is an error before any run, not a
    family that silently lost a test."""
    names = list(spec["variants"])
    primary = spec.setdefault("primary", [])
    if not isinstance(primary, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in primary):
        fail('primary must be a list of (variant, baseline) pairs, e.g. [("block_attnres", "standard")]')
    for variant, baseline in primary:
        for name in (variant, baseline):
            if name not in names:
                fail(f"primary names {name!r}, which is not one of the variants {names}")
        if variant == baseline:
            fail(f"primary compares {variant!r} with itself")
    tested = [v for v, _ in primary]
    if len(set(tested)) < len(tested):
        fail("primary tests a variant twice: declare one claim per variant (others are exploratory)")
    if primary:
        for variant in spec["controls"]:
            if variant not in tested:
                fail(f"controls gives {variant!r} a control, but {variant!r} has no primary test: a control is tested "
                     "once its variant's primary test rejects; declare that test in primary, or drop the control")
    twins = spec.setdefault("twins", {})
    if not isinstance(twins, dict) or not all(k in names and v in names and k != v for k, v in twins.items()):
        fail(f"twins must be a dict {{variant: the variant it trains bit for bit as}}, both among the variants {names}")
    in_family = {x for pair in primary for x in pair} | set(spec["controls"]) | set(spec["controls"].values())
    for variant in twins:
        if variant in in_family:
            fail(f"twin {variant!r} is in a family: a twin is only checked for equality with its twin, never tested")
    baseline = dict(primary)
    for variant, control in spec["controls"].items():
        if control in (variant, baseline.get(variant)):
            fail(f"the control of {variant!r} is {control!r}, {'itself' if control == variant else 'its baseline'}: a "
                 "control is another variant, matched to it in parameters")
    spec.setdefault("score", "val")
    if spec["score"] not in SCORES:
        fail(f"score must be one of {', '.join(SCORES)}, got {spec['score']!r}")
    spec.setdefault("alpha", 0.05)
    if not isinstance(spec["alpha"], float) or not 0 < spec["alpha"] < 1:
        fail(f"alpha must be a number between 0 and 1, got {spec['alpha']!r}")
    margin = spec.setdefault("equivalence_margin", None)
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin < float("inf"):
            fail(f"equivalence_margin must be a positive number of nats (e.g. 0.006), got {margin!r}")
        if not primary:
            fail("equivalence_margin is set but primary is empty: the margin makes each primary test an equivalence "
                 "test too; declare the primary tests, or drop the margin")


def check_owned(spec, lenient=False):
    """Refuse a variant, or the sweep's overrides, that sets a key the sweep sets for every run (OWNED_KEYS):
    every seed would be the same run, or the runs would go elsewhere. lenient: an override that shlex cannot
    split is left to check_runs, which says so."""
    def keys(text):
        try:
            return [kv.partition("=")[0].lstrip("-") for kv in shlex.split(text)]
        except ValueError:
            if lenient:
                return []
            raise
    why = ("the sweep sets seed and data_seed to each of its seeds and puts each run in out_dir/<variant>/seed<s> "
           "(run_name, out_dir): that is its pairing; and it resumes or starts over each run itself (resume, "
           "overwrite)")
    for key in keys(spec["overrides"]):
        if key in OWNED_KEYS:
            fail(f"the sweep's overrides ({spec['overrides']!r}) set {key}, which the sweep owns: {why}; drop {key} "
                 "(the seeds are the sweep file's `seeds`, its directory `out_dir`)")
    for variant, text in spec["variants"].items():
        for key in keys(text):
            if key in OWNED_KEYS:
                fail(f"sweep variant {variant!r} ({text!r}) sets {key}, which the sweep owns: {why}; drop {key} "
                     "from the variant")


def check_runs(spec):
    """Parse the sweep's overrides, then every seed, then every variant's overrides as train.py will
    (keys, types, ranges, the model config), so a typo in the last variant, or a seed train.py refuses,
    stops the sweep before its first run, not after the others ran; each error names what is wrong (the
    overrides, the seed or the variant); and refuse keys the sweep owns (check_owned)."""
    try:
        parse_config([spec["base"], *(f"--{kv}" for kv in shlex.split(spec["overrides"]))])
    except ValueError as e:  # shlex: an unterminated quote; UserError
        raise UserError(f"the overrides ({spec['overrides']!r}) of every run: {e}") from None
    for seed in spec["seeds"]:
        try:
            parse_config([spec["base"], f"--seed={seed}", f"--data_seed={seed}"])
        except ValueError as e:
            raise UserError(f"seed {seed} (each run's seed and data_seed): {e}") from None
    for variant in spec["variants"]:
        try:
            check_owned({"overrides": spec["overrides"], "variants": {variant: spec["variants"][variant]}})
            args = [f"--{kv}" for kv in overrides(spec, variant)]
            tc, model_settings = parse_config([spec["base"], *args])
            build_model_config(model_settings, tc, {"vocab_size": 1, "tokenizer": "any"})
        except ValueError as e:  # shlex: an unterminated quote; UserError
            raise UserError(f"sweep variant {variant!r} ({spec['variants'][variant]!r}): {e}") from None


def design_of(spec, variant, seed, vocab_size=1):
    """{key: value} of what a run of `variant` computes (every train.py and model key but NOT_DESIGN)."""
    try:
        tc, model_settings = parse_config([spec["base"], f"--seed={seed}", f"--data_seed={seed}",
                                           *(f"--{kv}" for kv in overrides(spec, variant))])
        mc = build_model_config(model_settings, tc, {"vocab_size": vocab_size, "tokenizer": None})
    except ValueError as e:  # shlex: an unterminated quote; UserError
        raise UserError(f"sweep variant {variant!r} ({spec['variants'][variant]!r}): {e}") from None
    return {k: v for k, v in {**asdict(tc), **asdict(mc)}.items() if k not in NOT_DESIGN}


def design_changes(spec, variant, seed):
    """[(key, the value the run ran with, the value the sweep gives it now)] for each key of what a run
    computes (not NOT_DESIGN) that changed since the run last started, as its config.json records it (a key
    it lacks had its default then); [] for a run without train.py's config.json (not started)."""
    recorded = read_json(run_dir(spec, variant, seed) / "config.json") or {}
    train, model = recorded.get("train"), recorded.get("model")
    if not isinstance(train, dict) or not isinstance(model, dict):
        return []
    now = design_of(spec, variant, seed, model.get("vocab_size", 1))
    ran = {**{f.name: f.default for cls in (TrainConfig, GPTConfig) for f in fields(cls)}, **train, **model}
    return [(k, ran.get(k), v) for k, v in now.items() if ran.get(k) != v]


def design_refused(spec, changed):
    """The one line that refuses a design changed under runs: changed [(run, [(key, then, now)])]."""
    runs = [f"{run} ran with " + ", ".join(f"{k} {old!r} (now {new!r})" for k, old, new in c[:3])
            + (f" and {len(c) - 3} more" if len(c) > 3 else "") for run, c in changed[:3]]
    more = f" and {len(changed) - 3} more runs" if len(changed) > 3 else ""
    fail(f"the sweep's design changed since some of its runs ran: {', '.join(runs)}{more}; a sweep never pools "
         "runs of different designs: restore the sweep file's settings, or give the new design its own out_dir "
         f"(not {spec['out_dir']}), or delete those runs to run them again")


def check_design(spec):
    """Refuse a sweep whose settings changed under runs it has (finished, or to be resumed): its table would
    pool runs of different designs. One `error:` line before any run, and before --table_only's table."""
    changed = [(f"{v} seed {s}", c) for s in spec["seeds"] for v in spec["variants"] if (c := design_changes(spec, v, s))]
    if changed:
        design_refused(spec, changed)


def record_design(spec):
    """Before any run: each variant's design, held in out_dir/design.json from its first run on. A sweep (or a
    robustness stage) whose variant has another design there is refused, even when no run has begun yet (two
    processes started together on one out_dir) or its runs predate it."""
    out = Path(spec["out_dir"])
    fd = os.open(out / ".design.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one process at a time reads and extends the record
        recorded = read_json(out / "design.json") or {}
        now = {v: design_of(spec, v, spec["seeds"][0]) for v in spec["variants"]}
        for d in now.values():
            d.pop("seed"), d.pop("data_seed"), d.pop("vocab_size")  # a run's own, or the data's
        changed = [(v, [(k, recorded[v].get(k), x) for k, x in d.items() if recorded[v].get(k) != x])
                   for v, d in now.items() if v in recorded]
        if any(c for _, c in changed):
            design_refused(spec, [(v, c) for v, c in changed if c])
        if set(now) - set(recorded):
            write_atomic(out / "design.json", json.dumps({**recorded, **now}, indent=1) + "\n")
    finally:
        os.close(fd)


def overrides(spec, variant):
    """A run's key=value overrides, in the order train.py reads them: the sweep's, then the variant's."""
    return shlex.split(spec["overrides"]) + shlex.split(spec["variants"][variant])


def wants_wandb(spec, variant):
    """Whether a run logs to W&B: --wandb or `wandb = True`, or wandb_log set true by the overrides
    (the last one wins, as in train.py)."""
    on = bool(spec.get("wandb"))
    for kv in overrides(spec, variant):
        key, _, value = kv.partition("=")
        if key == "wandb_log":
            on = value.lower() in ("true", "1")
    return on


def train_command(spec, variant, seed, launcher):
    d = run_dir(spec, variant, seed)
    args = [str(ROOT / "train.py"), spec["base"], f"--out_dir={d.parent}", f"--run_name={d.name}",
            f"--seed={seed}", f"--data_seed={seed}"]
    if wants_wandb(spec, variant):  # one W&B group per sweep; the overrides below may still change these
        args += ["--wandb_log=true", f"--wandb_group={Path(spec['out_dir']).name}",
                 f"--wandb_tags={variant},seed{seed}", f"--wandb_run_name={variant}-seed{seed}"]
    args += [f"--{kv}" for kv in overrides(spec, variant)]
    if (d / "ckpt.pt").exists():
        args.append("--resume=true")
    elif d.exists():  # a run that died before its first checkpoint: nothing to resume, start it over
        args.append("--overwrite=true")
    return shlex.split(launcher) + args if launcher else [sys.executable] + args


def eta_seconds(durations, remaining):
    """Seconds the remaining runs should take at the mean of the durations so far (None: none yet)."""
    return statistics.fmean(durations) * remaining if durations else None


def status(spec, variant, seed):
    """"finished", "diverged" (final: tabulated as such, never rerun) or None (to run)."""
    d = run_dir(spec, variant, seed)
    if read_summary(d) is not None:
        return "finished"
    return "diverged" if divergence(d) else None


def claim(spec, variant, seed):
    """This process' claim on a run (a lock beside its directory), or None when another sweep process
    holds it: several sweep processes on one sweep file share its runs, each taking the next free one.
    Only a live process holds a claim; an out_dir that cannot be written is one `error:` line."""
    d = run_dir(spec, variant, seed)
    path = d.parent / f".{d.name}.sweep-lock"
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        return try_lock(path)
    except OSError as e:
        fail(f"{os_error_message(e, e.filename or path)}: the sweep claims each run beside its directory before "
             f"it runs it; make {spec['out_dir']} writable, or choose another out_dir")


def check_writable(spec):
    """out_dir exists (made if need be) and takes a file: one `error:` line before any run if not."""
    out = Path(spec["out_dir"])
    try:
        out.mkdir(parents=True, exist_ok=True)
        writable(out)
    except OSError as e:
        where = out if e.filename is None or Path(e.filename).parent == out else e.filename  # the probe: out
        fail(f"{os_error_message(e, where)}: the sweep writes its runs under {out}; make it writable, "
             "or choose another out_dir (--table_only only reads the runs)")


PR_SET_PDEATHSIG = 1


def die_with_parent():
    """A preexec_fn for a child: Linux sends it SIGTERM when the process that started it dies (a kill -9
    too), so a training run never outlives its sweep; SIGTERM lets train.py write a checkpoint and stop.
    Where there is no prctl, None (nothing to do)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, in the parent
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child():  # between fork and exec
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the sweep died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return in_child


def run_child(cmd):
    """Run a training command to its end, from the project root; its exit status. The child dies with
    the sweep (die_with_parent). Ctrl-C reaches the child too (the same process group), which finishes
    its step and writes a checkpoint: wait for it rather than kill it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=die_with_parent())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()  # a second Ctrl-C stops the child at once, and this wait with it


def run_all(spec, launcher):
    """Run every run that is not finished or diverged, seed by seed; skip those another process holds.
    Returns {"diverged": [(variant, seed), ..], "busy": [(variant, seed), ..]}."""
    # seed-major: a partial sweep already holds complete paired sets
    runs = [(variant, seed) for seed in spec["seeds"] for variant in spec["variants"]]
    if any(wants_wandb(spec, v) for v, _ in runs) and importlib.util.find_spec("wandb") is None:
        raise UserError("the sweep logs to W&B (wandb_log=true), but the wandb package is not installed: "
                         "pip install wandb")
    check_design(spec)
    if any(status(spec, v, s) is None for v, s in runs):
        check_writable(spec)
        record_design(spec)
    t0, durations, busy, diverged = time.monotonic(), [], [], []  # durations of the runs this invocation ran
    for variant, seed in runs:
        if status(spec, variant, seed):
            continue
        lock = claim(spec, variant, seed)
        if lock is None:  # another sweep process is running it
            busy.append((variant, seed))
            continue
        try:
            if status(spec, variant, seed):  # the other process finished it meanwhile
                continue
            d = run_dir(spec, variant, seed)
            if locked(d / ".lock"):  # a run going on without this sweep (another train.py, a killed sweep's)
                print(f"sweep: {variant} seed {seed} is in use by another process: skipped; run the sweep "
                      "again once it is done", flush=True)
                busy.append((variant, seed))
                continue
            cmd = train_command(spec, variant, seed, launcher)
            print(f"\n=== {variant}, seed {seed}: {' '.join(cmd)}", flush=True)
            start = time.monotonic()
            returncode = run_child(cmd)
            if returncode in (130, 143):
                raise Stopped(f"run {variant} seed {seed} stopped with a checkpoint; run the sweep again to resume it",
                              returncode - 128)
            if returncode != 0 and (record := divergence(d)) is not None:
                print(f"sweep: {variant} seed {seed} diverged at step {record.get('step')}: tabulated as diverged; "
                      "the sweep goes on (delete its directory to run it again)", flush=True)
                diverged.append((variant, seed))
            elif returncode != 0 and locked(d / ".lock"):  # taken between the check and the start
                print(f"sweep: {variant} seed {seed} is in use by another process: skipped", flush=True)
                busy.append((variant, seed))
                continue
            elif returncode != 0:
                raise UserError(f"run {variant} seed {seed} failed; fix it and run the sweep again to resume")
            durations.append(time.monotonic() - start)
        finally:
            os.close(lock)
        states = Counter(status(spec, v, s) for v, s in runs)
        done = states["finished"] + states["diverged"]
        eta = eta_seconds(durations, len(runs) - done)
        note = f" ({states['diverged']} diverged)" if states["diverged"] else ""
        print(f"sweep: {done}/{len(runs)} runs done{note}, {hms(time.monotonic() - t0)} elapsed, ETA {hms(eta)}",
              flush=True)
    if busy:
        print(f"sweep: {len(busy)} run(s) were taken by another sweep process or run; the table counts what has "
              "finished", flush=True)
    score_all(spec)
    return {"diverged": diverged, "busy": busy}


def unscored(spec, variant, seed):
    """Whether a finished run lacks its whole-split scores (and has a checkpoint to score: ckpt.pt, or an FSDP
    run's too)."""
    d = run_dir(spec, variant, seed)
    summary = read_summary(d)
    return summary is not None and (d / "ckpt.pt").exists() and \
        set(whole_split_scores(d, summary.get("step"))) != {"val", "test"}


def score_all(spec):
    """Score every finished run that has no whole-split scores yet, one run at a time, each in its own
    experiments/rescore.py child process (the model is the child's, the sweep stays small) and each claimed as
    a run is: two sweep processes share the scoring and never score the same run (claiming them all at
    once left the second process idle for the first one's hour of scoring). A run that cannot be scored
    is a note: the report pairs the seeds that have scores, and says how many lack them."""
    todo = [(v, s) for s in spec["seeds"] for v in spec["variants"] if unscored(spec, v, s)]
    if todo:
        print(f"sweep: scoring up to {len(todo)} finished run(s) on the whole validation and test splits", flush=True)
    failed = 0
    for variant, seed in todo:
        if (lock := claim(spec, variant, seed)) is None:
            continue  # another process scores it
        try:
            if unscored(spec, variant, seed):  # not scored by another process meanwhile
                failed += run_child([sys.executable, "-m", "experiments.rescore", str(run_dir(spec, variant, seed))]) != 0
        finally:
            os.close(lock)
    if failed:
        print(f"sweep: {failed} run(s) could not be scored (the errors above); the report pairs the seeds that have "
              "scores (python -m experiments.rescore RUN_DIR to try again)", flush=True)


def main(argv=None):
    """The command line: its exit status, 0, EXIT_TWINS when a twin does not match, EXIT_DIVERGED when some
    runs diverged; bad input is a UserError (run as a command, common.cli: one `error:` line, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (see above)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    p.add_argument("--table_only", action="store_true", help="skip training; tabulate the finished runs")
    p.add_argument("--out_dir", help="override the sweep file's out_dir (relative: to the working directory)")
    p.add_argument("--reference", help="override the sweep file's reference variant")
    p.add_argument("--score", choices=list(SCORES), help="override the sweep file's score: the split the tests use "
                                                         "(val, test: whole splits; val_prefix, test_prefix: eval_tokens)")
    p.add_argument("--base", help="override the sweep file's base config, e.g. another model size (relative: to the "
                                   "working directory)")
    p.add_argument("--wandb", action="store_true", help="log every run to W&B, one group per sweep (pip install wandb)")
    args = p.parse_args(argv)
    spec = load_sweep(args.sweep, args.reference)
    for key in ("out_dir", "base"):
        if getattr(args, key):
            if not getattr(args, key).isprintable():
                fail(f"--{key} {getattr(args, key)!r} holds a control character")
            spec[key] = str(Path(getattr(args, key)).absolute())
    if args.wandb:
        spec["wandb"] = True
    if args.score:
        spec["score"] = args.score
    if not args.table_only:
        check_runs(spec)
    if args.table_only:
        check_design(spec)
    else:
        run_all(spec, args.launcher)
    ts = report(spec, rescore_hint=f"python -m experiments.rescore --sweep {args.sweep}" + (
        f" --out_dir {args.out_dir}" if args.out_dir else "") + " (the sweep scores each run it finishes)")
    if unequal_twins(ts, collect(spec)):
        return EXIT_TWINS
    diverged = any(read_summary(run_dir(spec, v, s)) is None and divergence(run_dir(spec, v, s))
                   for v in spec["variants"] for s in spec["seeds"])
    return EXIT_DIVERGED if diverged else 0


if __name__ == "__main__":
    sys.exit(cli(main))
