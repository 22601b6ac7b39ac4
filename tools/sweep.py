"""
Paired comparisons: every variant with every seed, and a table of what came out.

    python -m tools.sweep configs/sweep_cpu.py                          # one run after another, on this machine
    python -m tools.sweep configs/sweep_cpu.py --launcher "torchrun --nproc_per_node=8"
    python -m tools.sweep configs/sweep_cpu.py --table_only             # just the table, from finished runs
    python -m tools.sweep configs/sweep_cpu.py --table_only --reference block_attnres
    python -m tools.sweep configs/sweep_cpu.py --wandb                  # every run logged to Weights & Biases

A sweep file is Python that sets:
    base       a train.py config file
    variants   {name: "key=value key=value"}, train.py overrides per variant ("" for the base itself);
               a name is a plain directory name (the runs' directory)
    seeds      [0, 1, 2]: run s uses seed=s and data_seed=s for every variant, so partners share
               their initial weights, their batches and their schedule (no seed twice)
    reference  the variant the others are compared with
    overrides  (optional) "key=value ..." for every run
    out_dir    (optional) where runs go: out_dir/<variant>/seed<s>; default runs/<sweep file name>
    wandb      (optional) True: log every run to W&B, as --wandb does
The sweep owns seed, data_seed, run_name and out_dir: a variant or overrides that sets one would break
the pairing (every "seed" the same run, or runs elsewhere), and is refused before the first run.

Paths: those in a sweep file (base, out_dir, and paths in overrides such as data_dir) are relative to
the project root (where train.py is), as the sweep files in configs/ are written, and every run's
train.py runs there, so a sweep means the same from any working directory. Paths on the command line
(the sweep file, --out_dir, --base) are relative to the working directory, as any command's.

With W&B (--wandb, `wandb = True`, or wandb_log=true in the overrides or a variant's), each run gets
wandb_group=<the sweep's name, out_dir's last part>, wandb_tags=<variant>,seed<s> and
wandb_run_name=<variant>-seed<s>; overrides that set these keys win.

A finished run (its summary.json readable) is skipped, a run with a checkpoint is resumed and one
without is started over, so an interrupted sweep continues where it stopped. A run that diverged
(train.py's log.jsonl ends on a "diverged" record) is final: the sweep goes on with the other runs,
tabulates it as diverged and skips it on later invocations (delete its directory to run it again, say
with a lower lr). A run that another process holds (another sweep process, or a train.py of its own)
is skipped with a note. A training run dies with the sweep that started it: if the sweep is killed,
even by kill -9, its run gets SIGTERM, so it writes a checkpoint and stops (Linux). After each run a
progress line gives the runs done out of all (skipped finished runs count as done), the time since
the sweep started, and an ETA: the mean duration of the runs this invocation has run, times the runs
left (a resumed run counts with the part it ran, so right after a resume the ETA can be low). At the
end the table is printed and saved as results.md, results.json (strict JSON: null where a number is
undefined, such as a confidence interval from one seed) and results.csv in out_dir, with plots when
matplotlib is installed; each file is written whole or not at all, and a file that cannot be written
(a read-only out_dir) is one `warning:` line after the printed tables.

Exit status: 0 done; 1 with one `error:` line, before any run where the input is bad: a bad sweep file
or variant (every variant's overrides are checked as train.py reads them), an out_dir it cannot write,
no finished run of the reference to tabulate, or a run that failed (not by diverging); 3 done, but
some runs diverged (the tables mark them).
"""

import argparse
import csv
import ctypes
import fcntl
import importlib.util
import io
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from contextlib import suppress
from pathlib import Path

from depthres.config import build_model_config, control_character, parse_config
from depthres.files import os_error_message
from depthres.sharded import holds_checkpoint
from tools.diagnose import plot_curves, pyplot
from tools.stats import holm, paired_t

ROOT = Path(__file__).resolve().parent.parent
OWNED_KEYS = ("seed", "data_seed", "run_name", "out_dir")  # what the sweep sets for every run: its pairing
EXIT_DIVERGED = 3  # the sweep finished, but some of its runs diverged


def fail(message):
    """The sweep's one `error:` line (exit status 1)."""
    raise SystemExit(f"error: {message}")


def in_root(path):
    """A path of a sweep file: relative ones are relative to the project root."""
    return str(path) if Path(path).is_absolute() else str(ROOT / path)


def read_settings(path, what):
    """The names a Python settings file (a sweep or design file) assigns; a missing file, a syntax error
    or an exception in it is one `error: <what> <path>: ...` line (SystemExit), naming the line."""
    if not Path(path).is_file():
        raise SystemExit(f"error: {what} {path} not found")
    settings = {}
    try:
        exec(compile(Path(path).read_text(), str(path), "exec"), {}, settings)
    except SyntaxError as e:
        raise SystemExit(f"error: {what} {path}: line {e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == str(path)), "?")
        raise SystemExit(f"error: {what} {path}: line {line}: {type(e).__name__}: {e}") from None
    return settings


def load_sweep(path, reference=None):
    """The sweep file's settings, each checked: a bad file is one `error:` line (SystemExit) before any run.
    Its relative paths (base, out_dir) are made absolute, against the project root."""
    def fail(message):
        raise SystemExit(f"error: sweep file {path}: {message}")

    spec = read_settings(path, "sweep file")
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
        if not name or name in (".", "..") or "/" in name or "\\" in name or control_character(name):
            fail(f"variant name {name!r} is not a plain directory name (no /, \\, .. or control characters): "
                 "it names the directory of the variant's runs")
    spec.setdefault("overrides", "")
    spec.setdefault("out_dir", str(Path("runs") / Path(path).stem))
    for key in ("base", "overrides", "out_dir"):
        if not isinstance(spec[key], str):
            fail(f"{key} must be a string, got {type(spec[key]).__name__}")
    for key in ("base", "out_dir"):
        if control_character(spec[key]):
            fail(f"{key} {spec[key]!r} holds a control character")
    spec["base"], spec["out_dir"] = in_root(spec["base"]), in_root(spec["out_dir"])
    for key in ("reference", "second_reference"):
        if key in spec and spec[key] not in spec["variants"]:
            fail(f"{key} {spec[key]!r} is not one of the variants {list(spec['variants'])}")
    spec.setdefault("controls", {})
    if not isinstance(spec["controls"], dict) or not all(k in spec["variants"] and v in spec["variants"]
                                                        for k, v in spec["controls"].items()):
        fail("controls must be a dict {variant: its parameter-matched control}, both among the variants")
    check_owned(spec, lenient=True)  # before --table_only too: such a sweep's table pairs nothing
    return spec


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
           "(run_name, out_dir): that is its pairing")
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
    """Parse every variant's overrides as train.py will (keys, types, ranges, the model config), so a
    typo in the last variant stops the sweep before its first run, not after the others ran; and refuse
    keys the sweep owns (check_owned)."""
    for variant in spec["variants"]:
        try:
            check_owned({"overrides": spec["overrides"], "variants": {variant: spec["variants"][variant]}})
            args = [f"--{kv}" for kv in overrides(spec, variant)]
            tc, model_settings = parse_config([spec["base"], *args])
            build_model_config(model_settings, tc, {"vocab_size": 1, "tokenizer": "any"})
        except ValueError as e:  # shlex: an unterminated quote; ConfigError
            raise SystemExit(f"error: sweep variant {variant!r} ({spec['variants'][variant]!r}): {e}") from None


def run_dir(spec, variant, seed):
    return Path(spec["out_dir"]) / variant / f"seed{seed}"


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
    if holds_checkpoint(d):  # ckpt.pt, or an FSDP run's sharded ckpt/
        args.append("--resume=true")
    elif d.exists():  # a run that died before its first checkpoint: nothing to resume, start it over
        args.append("--overwrite=true")
    return shlex.split(launcher) + args if launcher else [sys.executable] + args


def eta_seconds(durations, remaining):
    """Seconds the remaining runs should take at the mean of the durations so far (None: none yet)."""
    return statistics.fmean(durations) * remaining if durations else None


def hms(seconds):
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def read_summary(d):
    """A run directory's summary.json as a dict, or None: not there, or not a JSON object (a torn or
    damaged file is an unfinished run: resumed at its last checkpoint, the run writes it again)."""
    try:
        summary = json.loads((Path(d) / "summary.json").read_bytes())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def tabulable(summary):
    return summary is not None and isinstance(summary.get("val_loss"), (int, float)) \
        and not isinstance(summary["val_loss"], bool) and math.isfinite(summary["val_loss"])


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


def divergence(d):
    """The "diverged" record train.py left in a run's log.jsonl (its step and error), or None."""
    return next((r for r in reversed(log_records(d)) if r.get("kind") == "diverged"), None)


def val_curve(d):
    """[(step, val loss)] of a run's log.jsonl."""
    return [(r["step"], r["loss"]) for r in log_records(d)
            if r.get("kind") == "eval" and r.get("split") == "val" and isinstance(r.get("step"), int)
            and isinstance(r.get("loss"), (int, float))]


def status(spec, variant, seed):
    """"finished", "diverged" (final: tabulated as such, never rerun) or None (to run)."""
    d = run_dir(spec, variant, seed)
    if read_summary(d) is not None:
        return "finished"
    return "diverged" if divergence(d) else None


class Claim:
    """A flock held on an open file until release() or this process' end (the OS releases it however
    the process ends), with the holder's pid and host written in it where it can be."""

    def __init__(self, fd):
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_file(path, create):
    """A Claim on `path`, None when a live process holds it. A claim entry that this process cannot open
    for writing (a directory, a read-only file) is locked as it is: flock needs only an open file, and a
    claim is held only while a live process holds its lock, whatever is at the path."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except OSError as e:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            raise e from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    with suppress(OSError):  # for messages only (a directory takes no pid)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return Claim(fd)


def claim(spec, variant, seed):
    """This process' claim on a run (a lock beside its directory), or None when another sweep process
    holds it: several sweep processes on one sweep file share its runs, each taking the next free one.
    Only a live process holds a claim; an out_dir that cannot be written is one `error:` line."""
    d = run_dir(spec, variant, seed)
    path = d.parent / f".{d.name}.sweep-lock"
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        return lock_file(path, create=True)
    except OSError as e:
        fail(f"{os_error_message(e, e.filename or path)}: the sweep claims each run beside its directory before "
             f"it runs it; make {spec['out_dir']} writable, or choose another out_dir")


def holder(d):
    """The pid (a string) of the process that holds a run directory's own lock (train.py's .lock), or
    None: a run still going on without this sweep (another train.py, a run left by a killed sweep)."""
    lock = Path(d) / ".lock"
    if not lock.is_file():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None  # nobody holds it (closing the file lets go at once)
    except BlockingIOError:
        who = os.pread(fd, 256, 0).decode(errors="replace").split()
        return who[0] if who else "unknown"
    finally:
        os.close(fd)


def check_writable(spec):
    """out_dir exists (made if need be) and takes a file: one `error:` line before any run if not."""
    out = Path(spec["out_dir"])
    probe = out / f".sweep-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = out if e.filename in (None, str(probe)) else e.filename
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
        raise SystemExit("error: the sweep logs to W&B (wandb_log=true), but the wandb package is not installed: "
                         "pip install wandb")
    if any(status(spec, v, s) is None for v, s in runs):
        check_writable(spec)
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
            if (pid := holder(d)) is not None:
                print(f"sweep: {variant} seed {seed} is in use by another process (pid {pid}): skipped; run the sweep "
                      "again once it is done", flush=True)
                busy.append((variant, seed))
                continue
            cmd = train_command(spec, variant, seed, launcher)
            print(f"\n=== {variant}, seed {seed}: {' '.join(cmd)}", flush=True)
            start = time.monotonic()
            returncode = run_child(cmd)
            if returncode in (130, 143):
                raise SystemExit(f"run {variant} seed {seed} stopped with a checkpoint; run the sweep again to resume it")
            if returncode != 0 and (record := divergence(d)) is not None:
                print(f"sweep: {variant} seed {seed} diverged at step {record.get('step')}: tabulated as diverged; "
                      "the sweep goes on (delete its directory to run it again)", flush=True)
                diverged.append((variant, seed))
            elif returncode != 0 and (pid := holder(d)) is not None:  # taken between the check and the start
                print(f"sweep: {variant} seed {seed} is in use by another process (pid {pid}): skipped", flush=True)
                busy.append((variant, seed))
                continue
            elif returncode != 0:
                raise SystemExit(f"error: run {variant} seed {seed} failed; fix it and run the sweep again to resume")
            durations.append(time.monotonic() - start)
        finally:
            lock.release()
        states = Counter(status(spec, v, s) for v, s in runs)
        done = states["finished"] + states["diverged"]
        eta = eta_seconds(durations, len(runs) - done)
        note = f" ({states['diverged']} diverged)" if states["diverged"] else ""
        print(f"sweep: {done}/{len(runs)} runs done{note}, {hms(time.monotonic() - t0)} elapsed, ETA {hms(eta)}",
              flush=True)
    if busy:
        print(f"sweep: {len(busy)} run(s) were taken by another sweep process or run; the table counts what has "
              "finished", flush=True)
    return {"diverged": diverged, "busy": busy}


def collect(spec):
    """The finished runs: each summary.json with its variant, seed and validation curve (from log.jsonl).
    A summary.json that cannot be read is a run not finished, with a note."""
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
                             **{k: v for k, v in summary.items() if k not in ("variant", "seed", "curve")},
                             "curve": {str(step): loss for step, loss in val_curve(d)}})
    return runs


def collect_diverged(spec):
    """The runs that diverged: variant, seed, and the step and error of train.py's record."""
    out = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            if status(spec, variant, seed) == "diverged":
                record = divergence(run_dir(spec, variant, seed))
                out.append(dict(variant=variant, seed=seed, step=record.get("step"), error=record.get("error")))
    return out


def compare(mine, theirs, key=lambda r: r["val_loss"]):
    """The paired comparison of two variants' runs ({seed: run}) on the seeds both finished: each seed's
    difference (negative: `mine` is better), the paired t-test with its 95% interval, the wins."""
    deltas = {s: key(mine[s]) - key(theirs[s]) for s in sorted(mine) if s in theirs}
    t = paired_t(list(deltas.values()))  # with one seed: no sd, t, p or interval (nan; null in results.json)
    return dict(deltas={str(s): d for s, d in deltas.items()}, paired_seeds=len(deltas), wins=sum(d < 0 for d in deltas.values()),
                delta_mean=t["mean"], delta_std=t["sd"], t=t["t"], p=t["p"],
                ci95=[t["lo"], t["hi"]], ppl_change_pct=100 * (math.exp(t["mean"]) - 1) if deltas else math.nan)


def summarize(runs, reference, second=None, controls=None):
    """Per variant: val NLL over seeds, parameters, and paired comparisons with the reference (flat in
    the row, as before), with the second reference ("second") and with the variant's parameter-matched
    control ("control"). Each comparison's p-values are Holm-adjusted across its family: all variants
    against the reference, all against the second reference, every variant against its control.
    Tokens/s and peak-memory ratios are against the reference. Only seeds both finished are paired."""
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    ref, controls = by[reference], controls or {}
    rows = []
    for variant, seeds in by.items():
        losses = [seeds[s]["val_loss"] for s in sorted(seeds)]

        def ratio(key):
            both = [s for s in seeds if s in ref and seeds[s].get(key) and ref[s].get(key)]
            return statistics.fmean(seeds[s][key] for s in both) / statistics.fmean(ref[s][key] for s in both) \
                if both else None

        params = next(iter(seeds.values())).get("params")
        row = dict(variant=variant, seeds=len(losses), params=params,
                   params_vs_reference_pct=100 * (params / ref[min(ref)]["params"] - 1)
                   if params and ref[min(ref)].get("params") else None,
                   val_loss_mean=statistics.fmean(losses),
                   val_loss_std=statistics.stdev(losses) if len(losses) > 1 else None,
                   **compare(seeds, ref),
                   tokens_per_s_ratio=ratio("tokens_per_s"), memory_ratio=ratio("peak_memory_bytes"))
        if second in by and variant != second:
            row["second"] = dict(reference=second, **compare(seeds, by[second]))
        if controls.get(variant) in by:
            control = by[controls[variant]]
            cparams = next(iter(control.values())).get("params")
            row["control"] = dict(reference=controls[variant], params=cparams,
                                  params_diff_pct=100 * (params / cparams - 1) if params and cparams else None,
                                  **compare(seeds, control))
        rows.append(row)
    for family in (lambda r: r if r["variant"] != reference else None, lambda r: r.get("second"),
                   lambda r: r.get("control")):
        members = [family(r) for r in rows if family(r) is not None]
        for m, adjusted in zip(members, holm([m["p"] for m in members])):
            m["p_holm"] = adjusted
    return rows


def gap_over_training(runs, reference, variants):
    """{variant: {step: (mean paired difference of val loss against the reference, wins, seeds)}} at
    every evaluation the paired runs share."""
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r["curve"]
    gaps = {}
    if reference not in by:  # not one finished run of it yet
        return gaps
    for variant in variants:
        if variant == reference or variant not in by:
            continue
        mine = {s: c for s, c in by[variant].items() if s in by[reference]}
        steps = sorted(set.intersection(*(set(c) & set(by[reference][s]) for s, c in mine.items())), key=int) \
            if mine else []
        gaps[variant] = {int(step): (statistics.fmean(c[step] - by[reference][s][step] for s, c in mine.items()),
                                     sum(c[step] < by[reference][s][step] for s, c in mine.items()), len(mine))
                         for step in steps}
    return gaps


def _num(x, fmt, none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _undefined(x):
    return x is None or (isinstance(x, float) and math.isnan(x))


def _p(row):
    """p (Holm-adjusted p), bold when the adjusted p is below 0.05; n/a without a test (one seed)."""
    if _undefined(row["p"]):
        return "n/a"
    text = f"{_num(row['p'], '.3f')} ({_num(row.get('p_holm'), '.3f')})"
    return f"**{text}**" if row.get("p_holm", 1) < 0.05 else text


def _interval(c):
    """A comparison's mean difference and its 95% interval, or why there is none."""
    if not c["paired_seeds"]:
        return "n/a (no paired seed)"
    if _undefined(c["ci95"][0]):
        return f"{c['delta_mean']:+.4f} [needs 2 seeds]"
    return f"{c['delta_mean']:+.4f} [{_num(c['ci95'][0], '+.4f')}, {_num(c['ci95'][1], '+.4f')}]"


def _compared(c, with_t):
    """A comparison's cells: mean difference [95% CI], wins, (t,) p (Holm); empty for none."""
    if c is None:
        return [""] * (4 if with_t else 3)
    return ([_interval(c), f"{c['wins']}/{c['paired_seeds']}"] + ([_num(c["t"], ".2f", "n/a")] if with_t else [])
            + [_p(c)])


def _label(r):
    """A variant's cell: its name, and the seeds of its runs that diverged."""
    bad = r.get("diverged_seeds")
    return f"`{r['variant']}`" + (f" (diverged: seed {', '.join(map(str, bad))})" if bad else "")


def table(rows, reference, compact=False):
    """One line per variant: its parameters against the reference, its comparisons with the reference
    and with the second reference; the full table adds the val NLL, t, and tokens/s and memory ratios.
    A variant whose every run diverged has "diverged" in every cell."""
    second = next((r["second"]["reference"] for r in rows if "second" in r), None)
    full = not compact
    cols = (["variant", f"params vs `{reference}`"] + ["val NLL (mean ± sd)"] * full +
            [f"Δ vs `{reference}` [95% CI]", "wins"] + ["t"] * full + ["p (Holm)"] +
            ([f"Δ vs `{second}` [95% CI]", "wins", "p (Holm)"] if second else []) + ["tokens/s", "peak memory"] * full)
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        if "val_loss_mean" not in r:  # no finished run: every one diverged
            out.append("| " + " | ".join([_label(r)] + ["diverged"] * (len(cols) - 1)) + " |")
            continue
        cells = [_label(r), _num(r.get("params_vs_reference_pct"), "+.1f") + "%"]
        cells += [f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f}" if r["seeds"] > 1 else
                  f"{r['val_loss_mean']:.4f} (1 seed)"] * full
        cells += _compared(r if r["variant"] != reference else None, with_t=full)
        cells += _compared(r.get("second"), with_t=False) if second else []
        cells += [_num(r["tokens_per_s_ratio"], ".3f"), _num(r["memory_ratio"], ".3f")] * full
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def seed_table(rows, reference):
    """Each seed's paired difference with the reference, per variant ("diverged" where the run did)."""
    others = [r for r in rows if r["variant"] != reference]
    seeds = sorted({int(s) for r in rows for s in r.get("deltas", {})} |
                   {s for r in rows for s in r.get("diverged_seeds", [])})
    if not others or not seeds:
        return f"Each seed's difference to `{reference}`: none yet (no other variant has finished a run)."
    out = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + " --- |" * (len(seeds) + 1)]
    for r in others:
        cells = ["diverged" if s in r.get("diverged_seeds", []) else _num(r.get("deltas", {}).get(str(s)), "+.4f")
                 for s in seeds]
        out.append(f"| `{r['variant']}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def control_table(rows):
    """Each variant against its parameter-matched control."""
    out = ["| variant | control | parameters (variant / control) | Δ vs control [95% CI] | per seed | wins | p (Holm) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "control" in r:
            c = r["control"]
            out.append(f"| `{r['variant']}` | `{c['reference']}` | {_num(r['params'], ',')} / {_num(c['params'], ',')} "
                       f"({_num(c['params_diff_pct'], '+.2f')}%) | {_interval(c)} | "
                       f"{' '.join(f'{d:+.4f}' for d in c['deltas'].values())} | "
                       f"{c['wins']}/{c['paired_seeds']} | {_p(c)} |")
    return "\n".join(out)


def gap_table(gaps, reference):
    """The paired gap to the reference at every evaluation: mean Δ (wins/seeds)."""
    steps = sorted({step for g in gaps.values() for step in g})
    if not steps:
        return f"The gap to `{reference}` over training: none yet (no other variant has an evaluation paired with it)."
    out = [f"| Δ vs `{reference}` at step | " + " | ".join(str(s) for s in steps) + " |", "|" + " --- |" * (len(steps) + 1)]
    for variant, g in gaps.items():
        out.append(f"| `{variant}` | " + " | ".join(f"{g[s][0]:+.4f} ({g[s][1]}/{g[s][2]})" if s in g else "-"
                                                    for s in steps) + " |")
    return "\n".join(out)


def diverged_table(diverged):
    """The runs that diverged (not in any statistic)."""
    out = ["| diverged run | seed | at step |", "| --- | --- | --- |"]
    out += [f"| `{d['variant']}` | {d['seed']} | {_num(d['step'], 'd')} |" for d in diverged]
    return "\n".join(out)


def plot_forest(rows, reference, controls, path):
    """Each variant's paired Δ to the reference with its 95% interval, best first, each control just
    below the variant it matches; filled markers: Holm-adjusted p < 0.05."""
    plt = pyplot()
    if plt is None:
        return None
    by = {r["variant"]: r for r in rows if r["variant"] != reference and r.get("paired_seeds")}
    order = [v for v in sorted(by, key=lambda v: by[v]["delta_mean"]) if v not in controls.values()]
    order = [x for v in order for x in [v] + ([controls[v]] if controls.get(v) in by else [])]
    order += [v for v in by if v not in order]
    if not order:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(order) + 1.2))
    for y, v in enumerate(order):
        r, is_control = by[v], v in controls.values()
        color = "tab:orange" if is_control else "black"
        ax.plot(r["ci95"], [y, y], color=color, lw=1.5)
        ax.plot(r["delta_mean"], y, "o", color=color, mfc=color if r.get("p_holm", 1) < 0.05 else "white")
    ax.axvline(0, color="grey", lw=0.8)
    labels = [f"{v} (control of {next(k for k, c in controls.items() if c == v)})" if v in controls.values() else v
              for v in order]
    ax.set_yticks(range(len(order)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"paired Δ val NLL vs {reference} (nats; < 0: better)\n"
                  f"mean and 95% CI over {by[order[0]]['paired_seeds']} seeds; filled: Holm-adjusted p < 0.05")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gaps(gaps, reference, path):
    """The mean paired gap to the reference at every evaluation, one line per variant (None: none yet)."""
    if not any(gaps.values()):
        return None
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for i, (variant, g) in enumerate(gaps.items()):
        steps = sorted(g)
        ax.plot(steps, [g[s][0] for s in steps], ("-", "--", ":")[i // 10 % 3], marker=".", label=variant)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"paired Δ val NLL vs {reference} (nats)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def strict_json(x):
    """x with every non-finite float as None: results.json is strict JSON (null where a number is undefined,
    such as the interval of one seed, or an infinite t where every seed differs by the same amount)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def save_output(path, write):
    """Write one output whole or not at all: write(a temporary path beside `path`) (None from it: nothing
    to write, such as a plot without matplotlib), then a rename over `path`. Returns None, or why it
    could not (a read-only or full disk, or a plot that failed), so the other outputs still go out."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        if write(tmp) is None:
            return None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return None
    except OSError as e:  # the OS's words; a plot's own one-line error ends with them ("cannot write P: why")
        return (e.strerror or str(e).rsplit(": ", 1)[-1]).lower()
    except Exception as e:  # a plot is an extra: the tables and the files that could be written stand
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    finally:
        with suppress(OSError):
            tmp.unlink()


def report(spec):
    """The tables (printed, and in results.md), results.json, results.csv and the plots, from the runs;
    returns the rows. A diverged run is marked in the tables and left out of the statistics. Files that
    cannot be written are one `warning:` line after the printed tables."""
    out = Path(spec["out_dir"])
    runs, diverged = collect(spec), collect_diverged(spec)
    reference, second, controls = spec["reference"], spec.get("second_reference"), spec.get("controls", {})
    if not any(r["variant"] == reference for r in runs):
        bad = ", ".join(str(d["seed"]) for d in diverged if d["variant"] == reference)
        fail(f"no finished run of the reference {reference!r} in {out} (looked for {reference}/seed<s>/summary.json "
             f"there{f'; seed {bad} diverged' if bad else ''}): run the sweep first, or pass the --out_dir that holds "
             f"its runs (a relative out_dir in a sweep file is relative to {ROOT})")
    rows = summarize(runs, reference, second, controls)
    by = {r["variant"]: r for r in rows}
    for d in diverged:
        by.setdefault(d["variant"], {"variant": d["variant"], "seeds": 0}).setdefault("diverged_seeds", []).append(d["seed"])
    rows = [by[v] for v in spec["variants"] if v in by]
    gaps = gap_over_training(runs, reference, spec["variants"])
    second_gaps = gap_over_training(runs, second, spec["variants"]) if second else {}
    sections = [table(rows, reference, compact=True), table(rows, reference), seed_table(rows, reference)]
    if any("control" in r for r in rows):
        sections.append(control_table(rows))
    sections += [gap_table(gaps, reference)] + ([gap_table(second_gaps, second)] if second_gaps else [])
    if diverged:
        sections.append(diverged_table(diverged))
    text = "\n\n".join(sections)
    print(text, flush=True)

    csv_text = io.StringIO()
    w = csv.writer(csv_text)
    w.writerow(["variant", "seed", "val_loss", "test_loss", "delta_vs_reference", "params", "tokens_per_s",
                "peak_memory_bytes", "status"])
    ref = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == reference}
    for r in runs:
        delta = r["val_loss"] - ref[r["seed"]] if r["seed"] in ref else ""
        w.writerow([r["variant"], r["seed"], r["val_loss"], r.get("test_loss"), delta, r.get("params"),
                    r.get("tokens_per_s"), r.get("peak_memory_bytes"), "finished"])
    for d in diverged:
        w.writerow([d["variant"], d["seed"], "", "", "", "", "", "", "diverged"])
    results = dict(reference=reference, second_reference=second, controls=controls, rows=rows,
                   gaps={v: {str(k): x for k, x in g.items()} for v, g in gaps.items()}, runs=runs, diverged=diverged)
    results_json = json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n"
    finished = {v: [run_dir(spec, v, r["seed"]) for r in runs if r["variant"] == v] for v in spec["variants"]}
    outputs = {
        "results.md": lambda p: p.write_text(text + "\n"),
        "results.json": lambda p: p.write_text(results_json),
        "results.csv": lambda p: p.write_text(csv_text.getvalue()),
        "curves.png": lambda p: plot_curves({v: d for v, d in finished.items() if d}, p),
        "forest.png": lambda p: plot_forest(rows, reference, controls, p),
        "gap_over_training.png": lambda p: plot_gaps(gaps, reference, p),
    }
    if not out.is_dir():
        problems = {name: "no such directory" for name in outputs}
    else:
        problems = {name: why for name, write in outputs.items() if (why := save_output(out / name, write))}
    if problems:
        reasons = sorted(set(problems.values()))
        print(f"warning: could not write {', '.join(problems)} in {out} ({'; '.join(reasons)}); the tables above are "
              "complete", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    """The command line; returns the exit status: 0, or EXIT_DIVERGED when some runs diverged (an error
    is a SystemExit with its `error:` line, status 1)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (see above)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    p.add_argument("--table_only", action="store_true", help="skip training; tabulate the finished runs")
    p.add_argument("--out_dir", help="override the sweep file's out_dir (relative: to the working directory)")
    p.add_argument("--reference", help="override the sweep file's reference variant")
    p.add_argument("--base", help="override the sweep file's base config, e.g. another model size (relative: to the "
                                   "working directory)")
    p.add_argument("--wandb", action="store_true", help="log every run to W&B, one group per sweep (pip install wandb)")
    args = p.parse_args(argv)
    spec = load_sweep(args.sweep, args.reference)
    for key in ("out_dir", "base"):
        if getattr(args, key):
            if control_character(getattr(args, key)):
                fail(f"--{key} {getattr(args, key)!r} holds a control character")
            spec[key] = str(Path(getattr(args, key)).absolute())
    if args.wandb:
        spec["wandb"] = True
    if not args.table_only:
        check_runs(spec)
        run_all(spec, args.launcher)
    report(spec)
    return EXIT_DIVERGED if collect_diverged(spec) else 0


if __name__ == "__main__":
    sys.exit(main())
