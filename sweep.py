"""
Paired comparisons: every variant with every seed, and a table of what came out.

    python sweep.py configs/sweep_cpu.py                          # one run after another, on this machine
    python sweep.py configs/sweep_cpu.py --launcher "torchrun --nproc_per_node=8"
    python sweep.py configs/sweep_cpu.py --table_only             # just the table, from finished runs
    python sweep.py configs/sweep_cpu.py --table_only --reference block_attnres
    python sweep.py configs/sweep_cpu.py --wandb                  # every run logged to Weights & Biases

A sweep file is Python that sets:
    base       a train.py config file
    variants   {name: "key=value key=value"}, train.py overrides per variant ("" for the base itself)
    seeds      [0, 1, 2]: run s uses seed=s and data_seed=s for every variant, so partners share
               their initial weights, their batches and their schedule
    reference  the variant the others are compared with
    overrides  (optional) "key=value ..." for every run
    out_dir    (optional) where runs go: out_dir/<variant>/seed<s>; default runs/<sweep file name>
    wandb      (optional) True: log every run to W&B, as --wandb does

With W&B (--wandb, `wandb = True`, or wandb_log=true in the overrides or a variant's), each run gets
wandb_group=<the sweep's name, out_dir's last part>, wandb_tags=<variant>,seed<s> and
wandb_run_name=<variant>-seed<s>; overrides that set these keys win.

A finished run (its summary.json exists) is skipped, a run with a checkpoint is resumed and one
without is started over, so an interrupted sweep continues where it stopped. After each run a
progress line gives the runs done out of all (skipped finished runs count as done), the time since
the sweep started, and an ETA: the mean duration of the runs this invocation has run, times the runs
left (a resumed run counts with the part it ran, so right after a resume the ETA can be low). At the
end the table is printed and saved as results.json and results.csv in out_dir, with curves.png
(validation loss, mean over seeds) when matplotlib is installed.
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prepare_data import DirLock

HERE = Path(__file__).resolve().parent


def load_sweep(path, reference=None):
    spec = {}
    exec(Path(path).read_text(), {}, spec)
    if reference:
        spec["reference"] = reference
    missing = [k for k in ("base", "variants", "seeds", "reference") if k not in spec]
    if missing:
        raise SystemExit(f"error: sweep file {path} must set {', '.join(missing)}")
    if spec["reference"] not in spec["variants"]:
        raise SystemExit(f"error: reference {spec['reference']!r} is not one of the variants {list(spec['variants'])}")
    spec.setdefault("overrides", "")
    spec.setdefault("out_dir", str(Path("runs") / Path(path).stem))
    return spec


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
    args = [str(HERE / "train.py"), spec["base"], f"--out_dir={d.parent}", f"--run_name={d.name}",
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


def hms(seconds):
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def claim(spec, variant, seed):
    """This process' claim on a run (a DirLock beside its directory), or None when another sweep process
    holds it: several sweep processes on one sweep file share its runs, each taking the next free one."""
    d = run_dir(spec, variant, seed)
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        return DirLock(d.parent, "sweep process", RuntimeError, name=f".{d.name}.sweep-lock")
    except RuntimeError:
        return None


def run_all(spec, launcher):
    # seed-major: a partial sweep already holds complete paired sets
    runs = [(variant, seed) for seed in spec["seeds"] for variant in spec["variants"]]
    finished = lambda v, s: (run_dir(spec, v, s) / "summary.json").exists()  # noqa: E731
    if any(wants_wandb(spec, v) for v, _ in runs) and importlib.util.find_spec("wandb") is None:
        raise SystemExit("error: the sweep logs to W&B (wandb_log=true), but the wandb package is not installed: "
                         "pip install wandb")
    t0, durations, busy = time.monotonic(), [], 0  # durations of the runs this invocation ran
    for variant, seed in runs:
        if finished(variant, seed):
            continue
        lock = claim(spec, variant, seed)
        if lock is None:  # another sweep process is running it
            busy += 1
            continue
        try:
            if finished(variant, seed):  # the other process finished it meanwhile
                continue
            cmd = train_command(spec, variant, seed, launcher)
            print(f"\n=== {variant}, seed {seed}: {' '.join(cmd)}", flush=True)
            start = time.monotonic()
            if subprocess.run(cmd).returncode != 0:
                raise SystemExit(f"error: run {variant} seed {seed} failed; fix it and run the sweep again to resume")
            durations.append(time.monotonic() - start)
        finally:
            lock.release()
        done = sum(finished(v, s) for v, s in runs)
        eta = eta_seconds(durations, len(runs) - done)
        print(f"sweep: {done}/{len(runs)} runs done, {hms(time.monotonic() - t0)} elapsed, ETA {hms(eta)}", flush=True)
    if busy:
        print(f"sweep: {busy} run(s) were taken by another sweep process; the table counts what has finished", flush=True)


def collect(spec):
    runs = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            path = run_dir(spec, variant, seed) / "summary.json"
            if path.exists():
                runs.append(dict(variant=variant, seed=seed, **json.loads(path.read_text())))
    return runs


def summarize(runs, reference):
    """Per variant: val NLL over seeds, the paired difference with the reference (per seed, mean,
    spread), wins (seeds where the variant's loss is lower), the perplexity change exp(mean diff) - 1,
    and tokens/s and peak-memory ratios. Only seeds the reference also finished are paired."""
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    ref = by[reference]
    rows = []
    for variant, seeds in by.items():
        losses = [seeds[s]["val_loss"] for s in sorted(seeds)]
        paired = {s: seeds[s]["val_loss"] - ref[s]["val_loss"] for s in sorted(seeds) if s in ref}
        mean_delta = statistics.fmean(paired.values()) if paired else float("nan")

        def ratio(key):
            mine = [seeds[s][key] for s in paired if seeds[s].get(key) and ref[s].get(key)]
            theirs = [ref[s][key] for s in paired if seeds[s].get(key) and ref[s].get(key)]
            return statistics.fmean(mine) / statistics.fmean(theirs) if mine else None

        rows.append(dict(
            variant=variant, seeds=len(losses),
            val_loss_mean=statistics.fmean(losses), val_loss_std=statistics.stdev(losses) if len(losses) > 1 else 0.0,
            delta_mean=mean_delta,
            delta_std=statistics.stdev(paired.values()) if len(paired) > 1 else 0.0,
            deltas={str(s): d for s, d in paired.items()},
            wins=sum(d < 0 for d in paired.values()), paired_seeds=len(paired),
            ppl_change_pct=100 * (math.exp(mean_delta) - 1),
            tokens_per_s_ratio=ratio("tokens_per_s"), memory_ratio=ratio("peak_memory_bytes")))
    return rows


def table(rows, reference):
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    out = [f"| variant | seeds | val NLL (mean ± sd) | Δ vs `{reference}` (mean ± sd) | per seed | wins | ppl change | tokens/s | peak memory |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        per_seed = " ".join(f"{d:+.4f}" for d in r["deltas"].values())
        out.append(f"| `{r['variant']}` | {r['seeds']} | {r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | "
                   f"{r['delta_mean']:+.4f} ± {r['delta_std']:.4f} | {per_seed} | {r['wins']}/{r['paired_seeds']} | "
                   f"{r['ppl_change_pct']:+.2f}% | {num(r['tokens_per_s_ratio'], '.3f')} | {num(r['memory_ratio'], '.3f')} |")
    return "\n".join(out)


def report(spec):
    runs = collect(spec)
    if not any(r["variant"] == spec["reference"] for r in runs):
        raise SystemExit(f"error: no finished run of the reference {spec['reference']!r} yet")
    rows = summarize(runs, spec["reference"])
    text = table(rows, spec["reference"])
    print(text)
    out = Path(spec["out_dir"])
    (out / "results.json").write_text(json.dumps(dict(reference=spec["reference"], rows=rows, runs=runs), indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seed", "val_loss", "test_loss", "delta_vs_reference", "tokens_per_s", "peak_memory_bytes"])
        ref = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == spec["reference"]}
        for r in runs:
            delta = r["val_loss"] - ref[r["seed"]] if r["seed"] in ref else ""
            w.writerow([r["variant"], r["seed"], r["val_loss"], r.get("test_loss"), delta,
                        r.get("tokens_per_s"), r.get("peak_memory_bytes")])
    from diagnose import plot_curves
    groups = {v: [run_dir(spec, v, s) for s in spec["seeds"] if (run_dir(spec, v, s) / "log.jsonl").exists()]
              for v in spec["variants"]}
    plot_curves({v: d for v, d in groups.items() if d}, out / "curves.png")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (see above)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    p.add_argument("--table_only", action="store_true", help="skip training; tabulate the finished runs")
    p.add_argument("--out_dir", help="override the sweep file's out_dir")
    p.add_argument("--reference", help="override the sweep file's reference variant")
    p.add_argument("--base", help="override the sweep file's base config (e.g. another model size)")
    p.add_argument("--wandb", action="store_true", help="log every run to W&B, one group per sweep (pip install wandb)")
    args = p.parse_args(argv)
    spec = load_sweep(args.sweep, args.reference)
    spec.update({k: v for k, v in (("out_dir", args.out_dir), ("base", args.base), ("wandb", args.wandb)) if v})
    if not args.table_only:
        run_all(spec, args.launcher)
    return report(spec)


if __name__ == "__main__":
    main()
