"""
Paired comparisons: every variant with every seed, and a table of what came out.

    python -m tools.sweep configs/sweep_cpu.py                          # one run after another, on this machine
    python -m tools.sweep configs/sweep_cpu.py --launcher "torchrun --nproc_per_node=8"
    python -m tools.sweep configs/sweep_cpu.py --table_only             # just the table, from finished runs
    python -m tools.sweep configs/sweep_cpu.py --table_only --reference block_attnres
    python -m tools.sweep configs/sweep_cpu.py --wandb                  # every run logged to Weights & Biases

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

Exit status: 0 done; 1 with one `error:` line: a bad sweep file or variant (every variant's overrides
are checked as train.py reads them, before the first run), or a run that failed.
"""

import argparse
import csv
import importlib.util
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from depthres.config import build_model_config, parse_config
from depthres.files import DirLock
from depthres.sharded import holds_checkpoint
from tools.diagnose import plot_curves, pyplot, val_curve
from tools.stats import holm, paired_t

ROOT = Path(__file__).resolve().parent.parent


def load_sweep(path, reference=None):
    """The sweep file's settings, each checked: a bad file is one `error:` line (SystemExit) before any run."""
    def fail(message):
        raise SystemExit(f"error: sweep file {path}: {message}")

    if not Path(path).is_file():
        raise SystemExit(f"error: sweep file {path} not found")
    spec = {}
    try:
        exec(compile(Path(path).read_text(), str(path), "exec"), {}, spec)
    except SyntaxError as e:
        fail(f"line {e.lineno}: syntax error: {e.msg}")
    except Exception as e:
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == str(path)), "?")
        fail(f"line {line}: {type(e).__name__}: {e}")
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
    spec.setdefault("overrides", "")
    spec.setdefault("out_dir", str(Path("runs") / Path(path).stem))
    for key in ("reference", "second_reference"):
        if key in spec and spec[key] not in spec["variants"]:
            fail(f"{key} {spec[key]!r} is not one of the variants {list(spec['variants'])}")
    spec.setdefault("controls", {})
    if not isinstance(spec["controls"], dict) or not all(k in spec["variants"] and v in spec["variants"]
                                                        for k, v in spec["controls"].items()):
        fail("controls must be a dict {variant: its parameter-matched control}, both among the variants")
    return spec


def check_runs(spec):
    """Parse every variant's overrides as train.py will (keys, types, ranges, the model config), so a
    typo in the last variant stops the sweep before its first run, not after the others ran."""
    for variant in spec["variants"]:
        try:
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


def claim(spec, variant, seed):
    """This process' claim on a run (a DirLock beside its directory), or None when another sweep process
    holds it: several sweep processes on one sweep file share its runs, each taking the next free one."""
    d = run_dir(spec, variant, seed)
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        return DirLock(d.parent, "sweep process", name=f".{d.name}.sweep-lock")
    except RuntimeError:
        return None


def run_child(cmd):
    """Run a training command to its end; its exit status. Ctrl-C reaches the child too (the same
    process group), which finishes its step and writes a checkpoint: wait for it rather than kill it."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()  # a second Ctrl-C stops the child at once, and this wait with it


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
            returncode = run_child(cmd)
            if returncode in (130, 143):
                raise SystemExit(f"run {variant} seed {seed} stopped with a checkpoint; run the sweep again to resume it")
            if returncode != 0:
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
    """The finished runs: each summary.json with its variant, seed and validation curve (from log.jsonl)."""
    runs = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            d = run_dir(spec, variant, seed)
            if (d / "summary.json").exists():
                runs.append(dict(variant=variant, seed=seed, **json.loads((d / "summary.json").read_text()),
                                 curve={str(step): loss for step, loss in val_curve(str(d))}))
    return runs


def compare(mine, theirs, key=lambda r: r["val_loss"]):
    """The paired comparison of two variants' runs ({seed: run}) on the seeds both finished: each seed's
    difference (negative: `mine` is better), the paired t-test with its 95% interval, the wins."""
    deltas = {s: key(mine[s]) - key(theirs[s]) for s in sorted(mine) if s in theirs}
    t = paired_t(list(deltas.values()))
    return dict(deltas={str(s): d for s, d in deltas.items()}, paired_seeds=len(deltas), wins=sum(d < 0 for d in deltas.values()),
                delta_mean=t["mean"], delta_std=t["sd"] if len(deltas) > 1 else 0.0, t=t["t"], p=t["p"],
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
                   val_loss_std=statistics.stdev(losses) if len(losses) > 1 else 0.0,
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


def _p(row):
    """p (Holm-adjusted p), bold when the adjusted p is below 0.05."""
    text = f"{_num(row['p'], '.3f')} ({_num(row.get('p_holm'), '.3f')})"
    return f"**{text}**" if row.get("p_holm", 1) < 0.05 else text


def _compared(c, with_t):
    """A comparison's cells: mean difference [95% CI], wins, (t,) p (Holm); empty for none."""
    if c is None:
        return [""] * (4 if with_t else 3)
    return ([f"{c['delta_mean']:+.4f} [{_num(c['ci95'][0], '+.4f')}, {_num(c['ci95'][1], '+.4f')}]",
             f"{c['wins']}/{c['paired_seeds']}"] + ([_num(c["t"], ".2f")] if with_t else []) + [_p(c)])


def table(rows, reference, compact=False):
    """One line per variant: its parameters against the reference, its comparisons with the reference
    and with the second reference; the full table adds the val NLL, t, and tokens/s and memory ratios."""
    second = next((r["second"]["reference"] for r in rows if "second" in r), None)
    full = not compact
    cols = (["variant", f"params vs `{reference}`"] + ["val NLL (mean ± sd)"] * full +
            [f"Δ vs `{reference}` [95% CI]", "wins"] + ["t"] * full + ["p (Holm)"] +
            ([f"Δ vs `{second}` [95% CI]", "wins", "p (Holm)"] if second else []) + ["tokens/s", "peak memory"] * full)
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        cells = [f"`{r['variant']}`", _num(r.get("params_vs_reference_pct"), "+.1f") + "%"]
        cells += [f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f}"] * full
        cells += _compared(r if r["variant"] != reference else None, with_t=full)
        cells += _compared(r.get("second"), with_t=False) if second else []
        cells += [_num(r["tokens_per_s_ratio"], ".3f"), _num(r["memory_ratio"], ".3f")] * full
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def seed_table(rows, reference):
    """Each seed's paired difference with the reference, per variant."""
    seeds = sorted({s for r in rows for s in r.get("deltas", {})}, key=int)
    out = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + " --- |" * (len(seeds) + 1)]
    for r in rows:
        if r["variant"] != reference:
            out.append(f"| `{r['variant']}` | " + " | ".join(_num(r["deltas"].get(s), "+.4f") for s in seeds) + " |")
    return "\n".join(out)


def control_table(rows):
    """Each variant against its parameter-matched control."""
    out = ["| variant | control | parameters (variant / control) | Δ vs control [95% CI] | per seed | wins | p (Holm) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "control" in r:
            c = r["control"]
            out.append(f"| `{r['variant']}` | `{c['reference']}` | {r['params']:,} / {c['params']:,} "
                       f"({_num(c['params_diff_pct'], '+.2f')}%) | {c['delta_mean']:+.4f} [{_num(c['ci95'][0], '+.4f')}, "
                       f"{_num(c['ci95'][1], '+.4f')}] | {' '.join(f'{d:+.4f}' for d in c['deltas'].values())} | "
                       f"{c['wins']}/{c['paired_seeds']} | {_p(c)} |")
    return "\n".join(out)


def gap_table(gaps, reference):
    """The paired gap to the reference at every evaluation: mean Δ (wins/seeds)."""
    steps = sorted({step for g in gaps.values() for step in g})
    out = [f"| Δ vs `{reference}` at step | " + " | ".join(str(s) for s in steps) + " |", "|" + " --- |" * (len(steps) + 1)]
    for variant, g in gaps.items():
        out.append(f"| `{variant}` | " + " | ".join(f"{g[s][0]:+.4f} ({g[s][1]}/{g[s][2]})" if s in g else "-"
                                                    for s in steps) + " |")
    return "\n".join(out)


def plot_forest(rows, reference, controls, path):
    """Each variant's paired Δ to the reference with its 95% interval, best first, each control just
    below the variant it matches; filled markers: Holm-adjusted p < 0.05."""
    plt = pyplot()
    if plt is None:
        return None
    by = {r["variant"]: r for r in rows if r["variant"] != reference}
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
    """The mean paired gap to the reference at every evaluation, one line per variant."""
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


def report(spec):
    """The tables (printed, and in results.md), results.json, results.csv and the plots, from the runs."""
    runs = collect(spec)
    reference, second, controls = spec["reference"], spec.get("second_reference"), spec.get("controls", {})
    if not any(r["variant"] == reference for r in runs):
        raise SystemExit(f"error: no finished run of the reference {reference!r} yet")
    rows = summarize(runs, reference, second, controls)
    gaps = gap_over_training(runs, reference, spec["variants"])
    second_gaps = gap_over_training(runs, second, spec["variants"]) if second else {}
    sections = [table(rows, reference, compact=True), table(rows, reference), seed_table(rows, reference)]
    if any("control" in r for r in rows):
        sections.append(control_table(rows))
    sections += [gap_table(gaps, reference)] + ([gap_table(second_gaps, second)] if second_gaps else [])
    text = "\n\n".join(sections)
    print(text)
    out = Path(spec["out_dir"])
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(dict(reference=reference, second_reference=second, controls=controls,
                                                      rows=rows, gaps={v: {str(k): x for k, x in g.items()}
                                                                       for v, g in gaps.items()}, runs=runs), indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seed", "val_loss", "test_loss", "delta_vs_reference", "params", "tokens_per_s",
                    "peak_memory_bytes"])
        ref = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == reference}
        for r in runs:
            delta = r["val_loss"] - ref[r["seed"]] if r["seed"] in ref else ""
            w.writerow([r["variant"], r["seed"], r["val_loss"], r.get("test_loss"), delta, r.get("params"),
                        r.get("tokens_per_s"), r.get("peak_memory_bytes")])
    groups = {v: [run_dir(spec, v, s) for s in spec["seeds"] if (run_dir(spec, v, s) / "log.jsonl").exists()]
              for v in spec["variants"]}
    plot_curves({v: d for v, d in groups.items() if d}, out / "curves.png")
    plot_forest(rows, reference, controls, out / "forest.png")
    plot_gaps(gaps, reference, out / "gap_over_training.png")
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
        check_runs(spec)
        run_all(spec, args.launcher)
    return report(spec)


if __name__ == "__main__":
    main()
