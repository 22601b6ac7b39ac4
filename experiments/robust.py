"""
Does the advantage hold? Learning rate, training length and compute, from one design file.

    python -m experiments.robust experiments/configs/robust_cpu.py                  # every stage, then the report
    python -m experiments.robust experiments/configs/robust_cpu.py --stage tune     # one stage: tune | compare | best
    python -m experiments.robust experiments/configs/robust_cpu.py --list           # every run of every stage, finished or not
    python -m experiments.robust experiments/configs/robust_cpu.py --table_only [--out_dir DIR]   # the report alone
    python -m experiments.robust experiments/configs/robust_gpu.py --launcher "torchrun --standalone --nproc_per_node=8"

A design file is Python, like a sweep file (experiments/sweep.py), and sets:
    base          a train.py config file: the recipe (its lr, min_lr and length, with `overrides` applied)
    variants      {name: "key=value ..."}: the residual variants; their overrides may not set lr, min_lr,
                  max_steps or max_tokens (the design's axes); names may not contain "--"
    reference     the variant the others are compared with, and the one the ladder trains
    lrs           the learning-rate grid, e.g. [1.5e-3, 3e-3, 6e-3]; must hold the recipe's lr
    tuning_seeds  the seeds the lr is chosen on, e.g. [100, 101]
    seeds         the comparison's seeds, e.g. [0, 1, 2]; disjoint from tuning_seeds
    steps         lengths (optimizer steps) every variant trains at, e.g. [400, 1200]; must hold the
                  recipe's own length
    ladder        the reference's lengths for the compute fit, e.g. [400, 600, 800, 1200] (>= 2)
    overrides     (optional) "key=value ..." for every run
    score         (optional) "val" (default: the whole validation split) or "val_prefix" (see Scores below)
    out_dir       (optional) where runs, and the report, go; default runs/<design file name>
    fit           (optional) "loglinear" (default) or "power": the ladder's curve (see fit_ladder)
    min_lr_ratio  (optional, 0.1) an lr-grid run at lr x ends its cosine at min_lr = x * min_lr_ratio
    bench         (optional) a tools.bench JSON file measured at the design's model size: the only
                  source of wall-clock ratios (never one run's own time)
    contrasts     (optional) [(variant, baseline), ...]: pairs besides the reference (e.g. a paper's own
                  comparison), paired at every length of `steps` and at both best lrs; exploratory
    bootstrap     (optional, 2000) resamples of the comparison seeds; bootstrap_seed (optional, 0)

Every run is a plain sweep run, out_dir/<name>/seed<s>, named:
    <variant>                the recipe (its lr, min_lr, length)
    <variant>--lr<x:g>       the recipe at lr=x, min_lr=x*min_lr_ratio (e.g. standard--lr0.0015)
    <variant>--steps<n>      the recipe with max_steps=n: its own warmup and cosine, ending at step n
Stages (each a sweep through experiments.sweep's run_all: finished runs are skipped, interrupted ones resumed,
and several processes may share a design as they share a sweep):
    tune     every variant at every lr of the grid, on the tuning seeds, at the recipe's length
    compare  every variant at every length of `steps` and the reference at every length of `ladder`,
             at the recipe's lr, on the comparison seeds
    best     each variant whose best lr (chosen on the tuning seeds alone) is not the recipe's, at that
             lr on the comparison seeds (runs only for variants whose tuning runs have all finished)
Before any run, the design is checked and every run's overrides are read as train.py reads them: a bad
design is one `error:` line, exit status 2 (common.cli).

The report, printed, then written into out_dir (robust.md, robust.json, loss_vs_flops.png; run paths relative
to out_dir), each file whole or not at all; a file that cannot be written (a full or read-only disk) is one
`warning:` line after the printed report, as in a sweep's:
    a. the lr x variant table on the tuning seeds, the best lr per variant, and the ranking of the
       variants at the shared lr and at each one's own best lr; then the comparison at the best lrs on
       the comparison seeds (or the runs it still needs)
    b. the paired gap to the reference at each length of `steps`, each at its own schedule's end; then
       each of `contrasts` at each length and at both best lrs (uncorrected p: exploratory)
    c. the compute multiplier: "the reference needs X times the compute" (FLOP-matched: the variant
       charged its own FLOPs per token) and X in steps (step-matched: the same tokens), with a
       bootstrap interval over the comparison seeds, and the loss-vs-FLOPs plot
    d. wall-clock, only as the bench file's measured speed ratios
Scores: `score = "val"` (the default) is the whole validation split, each run's scores.json (experiments/rescore.py;
each stage's sweep scores the runs it finishes, and any finished run it finds unscored): a finished run without
it is left out and listed as unscored. `score = "val_prefix"` reads summary.json's val_loss instead, the fixed
eval_tokens prefix the runs log (the report states it, read from their config.json). The test split is reported
beside the runs, never tested.
"""

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from common import UserError, cli, write_atomic
from experiments import sweep
from experiments.multiplier import bootstrap, fit_ladder, inside, multiple
from experiments.report import PROVENANCE, provenance, save_outputs
from experiments.robust_design import SCORES, STAGES, bench_path, check_design_runs, load_design, lr_name, stage_spec, steps_name
from experiments.robust_report import plot, render, strict
from experiments.rundirs import finished_run, finite, token_unit, whole_split_scores
from experiments.stats import holm, paired_t
from model_fast import make_model
from train import model_config

# --- the runs ---------------------------------------------------------------------------------------

_FLOPS = {}


def flops_per_token(settings):
    """model.GPT.flops_per_token() of a run's config.json "model" dict (built on the meta device: no
    weights are allocated; None: not a model config train.py writes). Depth attention's elementwise work is
    not in this count."""
    key = json.dumps(settings, sort_keys=True)
    if key not in _FLOPS:
        try:
            with torch.device("meta"):
                _FLOPS[key] = make_model(model_config(settings)).flops_per_token()
        except (ValueError, TypeError):  # not a model config train.py writes (UserError, a value of another type)
            _FLOPS[key] = None
    return _FLOPS[key]


def read_run(out_dir, name, seed, score="val"):
    """A finished run (summary.json and config.json) as one flat record, or None. Its val_loss and
    test_loss are the design's score: the whole splits (scores.json; None while the run is unscored) for
    "val", the logged eval_tokens prefix (summary.json) for "val_prefix". The summary's PROVENANCE fields
    come with it where it has them."""
    d = Path(out_dir) / name / f"seed{seed}"
    run = finished_run(d)
    f = run and flops_per_token(run[1]["model"])
    if not f or not all(finite(run[1]["train"].get(k)) for k in ("lr", "min_lr")):  # not finished, or not train.py's
        return None
    (summary, cfg), steps = run, run[0]["step"]
    bt = cfg["train"]["batch_tokens"]
    whole = whole_split_scores(d, steps) if score == "val" else {}
    val, test = (whole.get("val"), whole.get("test")) if score == "val" else (summary.get("val_loss"), summary.get("test_loss"))
    return dict(name=name, seed=seed, dir=f"{name}/seed{seed}", val_loss=val,
                test_loss=test, params=summary.get("params"), seconds=summary.get("seconds"),
                steps=steps, tokens=steps * bt, lr=cfg["train"]["lr"], min_lr=cfg["train"]["min_lr"],
                eval_tokens=cfg["train"].get("eval_tokens"), flops_per_token=f, flops=f * steps * bt,
                **{k: summary[k] for k in PROVENANCE if k in summary})


def read_finished(spec):
    """{(name, seed): record} of a stage's finished runs: only its own seeds are read. A record's val_loss
    is None while the run lacks the stage's score (spec["score"]: not yet scored on the whole splits)."""
    if spec is None:
        return {}
    out = {}
    for name in spec["variants"]:
        for s in spec["seeds"]:
            r = read_run(spec["out_dir"], name, s, spec["score"])
            if r is not None:
                out[(name, s)] = r
    return out


def scored(finished):
    """The runs of `finished` that have their score: the ones every analysis reads."""
    return {k: r for k, r in finished.items() if r["val_loss"] is not None}


def read_stage(spec):
    """{(name, seed): record} of a stage's finished runs that have the stage's score."""
    return scored(read_finished(spec))


def unscored(spec, finished):
    """The stage's runs that finished but lack its score (not yet scored on the whole splits)."""
    return [] if spec is None else [(n, s) for s in spec["seeds"] for n in spec["variants"]
                                    if (n, s) in finished and finished[(n, s)]["val_loss"] is None]


def unfinished(spec, finished):
    """The stage's runs that have not finished."""
    return [] if spec is None else [(n, s) for s in spec["seeds"] for n in spec["variants"] if (n, s) not in finished]


# --- a. the learning rate -----------------------------------------------------------------------------

def lr_table(design, tune_runs):
    """Per variant, per lr: the tuning seeds' losses; and the best lr, chosen on the tuning seeds alone.
    `tune_runs` may hold other seeds (they are ignored: the comparison's seeds never choose an lr). The
    lrs are compared on the tuning seeds every lr of the variant has finished ("common"); `complete`
    when every lr has every tuning seed."""
    tuning = set(design["tuning_seeds"])
    out = {}
    for v in design["variants"]:
        cells = {}
        for lr in design["lrs"]:
            name = lr_name(design, v, lr)
            cells[f"{lr:g}"] = {s: tune_runs[(name, s)]["val_loss"] for s in design["tuning_seeds"]
                                if (name, s) in tune_runs and s in tuning}
        common = sorted(set.intersection(*(set(c) for c in cells.values())))
        means = {lr: statistics.fmean(c[s] for s in common) for lr, c in cells.items()} if common else {}
        best = min(means, key=means.get) if means else None
        out[v] = dict(cells={lr: dict(mean=statistics.fmean(c.values()) if c else None, n=len(c),
                                      losses={str(s): x for s, x in c.items()}) for lr, c in cells.items()},
                      common_seeds=common, best_lr=float(best) if best else None,
                      complete=all(len(c) == len(tuning) for c in cells.values()))
    return out


def ranking(losses):
    """Variant names, best (lowest loss) first; variants without a loss are left out."""
    return sorted((v for v, x in losses.items() if x is not None), key=losses.get)


def best_lrs(table, complete_only=True):
    return {v: t["best_lr"] for v, t in table.items() if t["best_lr"] is not None and (t["complete"] or not complete_only)}


# --- b. paired gaps -------------------------------------------------------------------------------------

def paired(runs, mine, theirs, seeds):
    """The paired comparison of run `mine` with run `theirs` over the seeds both finished."""
    d = {s: runs[(mine, s)]["val_loss"] - runs[(theirs, s)]["val_loss"] for s in seeds
         if (mine, s) in runs and (theirs, s) in runs}
    t = paired_t(list(d.values()))
    return dict(run=mine, against=theirs, deltas={str(s): x for s, x in d.items()}, n=len(d),
                wins=sum(x < 0 for x in d.values()), mean=t["mean"], ci95=[t["lo"], t["hi"]], t=t["t"], p=t["p"])


def with_holm(comparisons):
    for c, adjusted in zip(comparisons, holm([c["p"] for c in comparisons])):
        c["p_holm"] = adjusted
    return comparisons


def gaps(design, runs):
    """At each length of `steps`: every variant against the reference, paired over the comparison seeds,
    Holm across the variants at that length; and per variant the change of its gap from the shortest
    length to each longer one (paired over the seeds with all four runs)."""
    ref, seeds = design["reference"], design["seeds"]
    out = {}
    for n in sorted(design["steps"]):
        cs = [dict(variant=v, **paired(runs, steps_name(design, v, n), steps_name(design, ref, n), seeds))
              for v in design["variants"] if v != ref]
        out[str(n)] = with_holm(cs)
    short = min(design["steps"])
    change = {}
    for v in design["variants"]:
        if v == ref:
            continue
        for n in sorted(design["steps"])[1:]:
            d = {}
            for s in seeds:
                keys = [(steps_name(design, v, n), s), (steps_name(design, ref, n), s),
                        (steps_name(design, v, short), s), (steps_name(design, ref, short), s)]
                if all(k in runs for k in keys):
                    a, b, c, e = (runs[k]["val_loss"] for k in keys)
                    d[s] = (a - b) - (c - e)
            t = paired_t(list(d.values()))
            change.setdefault(v, {})[str(n)] = dict(n=len(d), mean=t["mean"], ci95=[t["lo"], t["hi"]], p=t["p"],
                                                    deltas={str(s): x for s, x in d.items()})
    return out, change


def at_best(design, runs, best):
    """On the comparison seeds at the recipe's length: each variant at its own best lr against the
    reference at its own best lr (Holm across the variants), beside the same at the shared lr."""
    ref = design["reference"]
    if ref not in best:
        return None
    ref_name = lr_name(design, ref, best[ref])
    rows = [dict(variant=v, best_lr=best[v], **paired(runs, lr_name(design, v, best[v]), ref_name, design["seeds"]))
            for v in design["variants"] if v != ref and v in best]
    return with_holm(rows)


def contrasts(design, runs, best):
    """Each of the design's (variant, baseline) pairs, paired over the comparison seeds: at the shared lr at
    every length of `steps` ({steps: comparison}), and with each at its own best lr at the recipe's length
    (None until both best lrs are settled). Uncorrected p: these are exploratory."""
    out = []
    for a, b in design["contrasts"]:
        lengths = {str(n): paired(runs, steps_name(design, a, n), steps_name(design, b, n), design["seeds"])
                   for n in sorted(design["steps"])}
        both = None
        if a in best and b in best:
            both = dict(lrs=[best[a], best[b]], **paired(runs, lr_name(design, a, best[a]), lr_name(design, b, best[b]),
                                                         design["seeds"]))
        out.append(dict(variant=a, baseline=b, lengths=lengths, at_best=both))
    return out


# --- c. the compute multiplier (its math: experiments/multiplier.py) -----------------------------------------

def multipliers(design, runs):
    """Per variant and length of `steps`: "the reference needs X times the compute". Each cell uses the
    comparison seeds on which the variant's run and every ladder length the fit uses have finished: the
    ladder lengths finished on all of those seeds (at least 2; 4 for "power"). `partial` when a seed or
    a ladder length is missing."""
    ref, kind = design["reference"], design["fit"]
    least = 4 if kind == "power" else 2
    out = {}
    for v in design["variants"]:
        for n in sorted(design["steps"]):
            name = steps_name(design, v, n)
            seeds = [s for s in design["seeds"] if (name, s) in runs]
            used = [m for m in sorted(design["ladder"]) if seeds and all((steps_name(design, ref, m), s) in runs
                                                                         for s in seeds)]
            cell = dict(variant=v, steps=n, run=name, seeds=seeds, ladder=used,
                        partial=len(seeds) < len(design["seeds"]) or len(used) < len(design["ladder"]))
            out.setdefault(v, {})[str(n)] = cell
            if len(used) < least:
                cell.update(flops=None, steps_x=None, note=f"needs {least} ladder lengths finished on the same seeds")
                continue
            ladder = {m: {s: (runs[(steps_name(design, ref, m), s)]["flops"], runs[(steps_name(design, ref, m), s)]["val_loss"])
                          for s in seeds} for m in used}
            fref = runs[(steps_name(design, ref, used[0]), seeds[0])]["flops_per_token"]
            variant = {s: (runs[(name, s)]["flops"], runs[(name, s)]["val_loss"], fref * runs[(name, s)]["tokens"])
                       for s in seeds}
            f, st, c_star, fit = multiple(ladder, variant, kind)
            iv = bootstrap(ladder, variant, kind, design["bootstrap"], design["bootstrap_seed"]) if len(seeds) > 1 else None
            fv = runs[(name, seeds[0])]["flops_per_token"]
            cell.update(flops=f, steps_x=st, reference_flops=c_star, flops_per_token=fv, flops_per_token_ratio=fv / fref,
                        loss=statistics.fmean(x for _, x, _ in variant.values()),
                        extrapolated=None if c_star is None else not inside(fit, c_star),
                        interval=iv)  # one seed: no interval
    return out


def ladder_points(design, runs):
    """The ladder's points on every comparison seed that finished them: {length: dict(flops, mean, sd, n)}."""
    out = {}
    for m in sorted(design["ladder"]):
        rs = [runs[(steps_name(design, design["reference"], m), s)] for s in design["seeds"]
              if (steps_name(design, design["reference"], m), s) in runs]
        if rs:
            losses = [r["val_loss"] for r in rs]
            out[str(m)] = dict(flops=statistics.fmean(r["flops"] for r in rs), mean=statistics.fmean(losses),
                               sd=statistics.stdev(losses) if len(losses) > 1 else 0.0, n=len(rs))
    return out


# --- d. wall-clock ------------------------------------------------------------------------------------

def bench_name(overrides):
    """A variant's name in tools.bench (residual[:key=value...]) from its overrides."""
    kv = dict(x.partition("=")[::2] for x in shlex.split(overrides))
    residual = kv.pop("residual", "standard")
    return ":".join([residual] + [f"{k}={v}" for k, v in kv.items()])


def bench_ratios(design):
    """Per variant: the bench file's median speed ratio against standard and its quartiles (a bench run
    interleaves its repeats; its ratios are the only wall-clock numbers this report uses)."""
    if design["bench"] is None:
        return None
    path = bench_path(design["bench"])
    try:
        b = json.loads(path.read_text())
        steps = {s["variant"]: s for s in b["steps"] if isinstance(s.get("speed_ratio"), float)
                 and len(s.get("speed_ratio_quartiles", ())) == 2}
        size = {k: b["args"].get(k) for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "vocab_size",
                                               "compile")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"bench file {path} is not a tools.bench JSON file ({type(e).__name__}: {e}): "
                         "run python -m tools.bench at the design's size, or drop bench from the design") from None
    ref = steps.get(bench_name(design["variants"][design["reference"]]))
    out = dict(file=str(design["bench"]), device=b.get("device"), dtype=b.get("dtype"), size=size, variants={})
    for v, ov in design["variants"].items():
        s = steps.get(bench_name(ov))
        if s and ref:  # the ratio against the bench's standard, re-based on the design's reference
            out["variants"][v] = dict(bench_variant=s["variant"], speed_ratio=s["speed_ratio"] / ref["speed_ratio"],
                                      quartiles=[q / ref["speed_ratio"] for q in s["speed_ratio_quartiles"]])
    return out


# --- the report -----------------------------------------------------------------------------------------

def analyze(design):
    specs = {"tune": stage_spec(design, "tune"), "compare": stage_spec(design, "compare")}
    tune_finished = read_finished(specs["tune"])
    tune_runs = scored(tune_finished)
    table = lr_table(design, tune_runs)
    specs["best"] = stage_spec(design, "best", best_lrs(table))
    comp_finished = {**read_finished(specs["compare"]), **read_finished(specs["best"])}
    comp_runs = scored(comp_finished)
    shared = f"{design['recipe']['lr']:g}"
    rank_shared = ranking({v: t["cells"][shared]["mean"] for v, t in table.items()})
    rank_best = ranking({v: t["cells"][f"{t['best_lr']:g}"]["mean"] if t["best_lr"] else None for v, t in table.items()})
    best_all = best_lrs(table)
    gap, change = gaps(design, comp_runs)
    recipe_n = design["recipe"]["steps"]
    cmp_shared = ranking({v: statistics.fmean(comp_runs[(v, s)]["val_loss"] for s in design["seeds"])
                          if all((v, s) in comp_runs for s in design["seeds"]) else None for v in design["variants"]})
    cmp_best = ranking({v: statistics.fmean(comp_runs[(lr_name(design, v, lr), s)]["val_loss"] for s in design["seeds"])
                        if all((lr_name(design, v, lr), s) in comp_runs for s in design["seeds"]) else None
                        for v, lr in best_all.items()}) if len(best_all) == len(design["variants"]) else []
    everything = {**tune_runs, **comp_runs}
    finished = {**tune_finished, **comp_finished}
    missing = {st: [f"{n}/seed{s}" for n, s in unfinished(specs[st], finished)] for st in STAGES}
    not_scored = {st: [f"{n}/seed{s}" for n, s in unscored(specs[st], finished)] for st in STAGES}
    unsettled = [v for v, t in table.items() if not t["complete"]]
    result = dict(
        design={k: design[k] for k in ("base", "variants", "reference", "lrs", "tuning_seeds", "seeds", "steps", "ladder",
                                       "overrides", "score", "fit", "min_lr_ratio", "bootstrap", "bootstrap_seed",
                                       "bench", "contrasts")},
        recipe=design["recipe"],
        eval_tokens=sorted({r["eval_tokens"] for r in everything.values() if r["eval_tokens"] is not None}),
        lr=dict(table=table, best=best_lrs(table, complete_only=False), settled=best_all, unsettled=unsettled,
                ranking_shared=rank_shared, ranking_best=rank_best,
                ranking_changes=None if unsettled else rank_shared != rank_best,
                comparison=dict(at_best=at_best(design, comp_runs, best_all), ranking_shared=cmp_shared,
                                ranking_best=cmp_best, ranking_changes=(cmp_shared != cmp_best) if cmp_best
                                and len(cmp_shared) == len(cmp_best) else None)),
        gaps=gap, gap_change=change, contrasts=contrasts(design, comp_runs, best_all), recipe_steps=recipe_n,
        ladder=ladder_points(design, comp_runs), fit=None, multipliers=multipliers(design, comp_runs),
        bench=bench_ratios(design),
        runs=sorted(everything.values(), key=lambda r: (r["name"], r["seed"])),
        missing=missing,
        unscored=not_scored,
        cpu_seconds={st: sum(r["seconds"] or 0 for k, r in everything.items()
                             if specs[st] and k[0] in specs[st]["variants"] and k[1] in specs[st]["seeds"])
                     for st in STAGES},
        token_unit=token_unit(Path(design["out_dir"]) / r["dir"] for r in finished.values()),
        provenance=provenance(list(finished.values()), design.get("path")),
    )
    pts = result["ladder"]
    if len(pts) >= (4 if design["fit"] == "power" else 2):  # the ladder's means, every seed that finished each
        result["fit"] = fit_ladder([p["flops"] for p in pts.values()], [p["mean"] for p in pts.values()], design["fit"])
    return result


def report(design):
    """The report, printed, then written into out_dir (robust.md, robust.json, loss_vs_flops.png), each
    file whole or not at all (experiments.report.save_outputs): what cannot be written (a read-only or full
    disk, no out_dir) is one `warning:` line after the printed report, as in a sweep's report."""
    result = analyze(design)
    text = render(result, design)
    print(text, flush=True)
    result_json = json.dumps(strict(result), indent=1, allow_nan=False) + "\n"
    save_outputs(design["out_dir"], {"robust.md": lambda p: write_atomic(p, text),
                                     "robust.json": lambda p: write_atomic(p, result_json),
                                     "loss_vs_flops.png": lambda p: plot(result, design, p)},
                 "the report above is complete")
    return result


def list_runs(design):
    table = lr_table(design, read_stage(stage_spec(design, "tune")))
    for st in STAGES:
        spec = stage_spec(design, st, best_lrs(table))
        if spec is None:
            waiting = any(not t["complete"] for t in table.values())
            print(f"{st}: no runs" + (" yet (tuning unfinished)" if waiting else " (every best lr is the shared lr)"))
            continue
        done = read_finished(spec)  # finished, scored or not
        print(f"{st}: {len(done)}/{len(spec['variants']) * len(spec['seeds'])} finished")
        for s in spec["seeds"]:
            for n in spec["variants"]:
                print(f"  {'done' if (n, s) in done else 'todo'}  {n}/seed{s}  {spec['variants'][n]}")


def main(argv=None):
    """The command line (run as a command through common.cli: a UserError is one `error:` line, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("design", help="design file (see above)")
    p.add_argument("--stage", choices=("all",) + STAGES, default="all", help="run one stage only (default: all, in order)")
    p.add_argument("--table_only", action="store_true", help="skip training; report on the finished runs")
    p.add_argument("--list", action="store_true", help="list every run of every stage, finished or not; no training")
    p.add_argument("--out_dir", help="override the design's out_dir (runs and report)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    p.add_argument("--score", choices=SCORES, help="override the design's score: val (the whole validation split, "
                                                   "scores.json) or val_prefix (summary.json's eval_tokens prefix)")
    args = p.parse_args(argv)
    design = load_design(args.design, args.out_dir)
    if args.score:
        design["score"] = args.score
    check_design_runs(design)  # one `error:` line (experiments.sweep.check_runs) before any run
    if args.list:
        return list_runs(design)
    if not args.table_only:
        stages = STAGES if args.stage == "all" else (args.stage,)
        for st in stages:
            if st == "best":
                table = lr_table(design, read_stage(stage_spec(design, "tune")))
                spec = stage_spec(design, "best", best_lrs(table))
                unsettled = [v for v, t in table.items() if not t["complete"]]
                if unsettled:
                    print(f"robust: best lr not settled for {', '.join(unsettled)} (tuning runs unfinished): "
                          "their best-lr runs wait for a later --stage best", flush=True)
            else:
                spec = stage_spec(design, st)
            if spec is not None:
                print(f"robust: stage {st}: {len(spec['variants'])} runs x {len(spec['seeds'])} seeds", flush=True)
                sweep.run_all(spec, args.launcher)
    return report(design)


if __name__ == "__main__":
    sys.exit(cli(main))
