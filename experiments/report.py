"""
A sweep's report: what its finished runs say. The sweep prints it after its runs; `python -m experiments.sweep
SWEEP_FILE --table_only` prints it alone. The protocol it carries out is declared in the sweep file
(experiments/sweep.py checks it; docs/experiments.md says what each table means):

    primary   [(variant, baseline), ...]: the claims, one family: paired t-tests on the declared score, Holm within it
    controls  {variant: its parameter-matched control}: a gate, tested once the variant's primary test rejects, at
              the level that rejection frees (stats.gated_holm)
    equivalence_margin  a margin in nats: each primary test is also a TOST, so it shows a difference, equivalence
              or neither
    score     "val" (default) or "test": the whole split, each run's final evaluation (final_eval_tokens=0)

Every other comparison (each variant against the reference and the second reference) is exploratory. Outputs in
out_dir, each written whole or not at all: results.md (the printed tables), results.json (strict JSON), results.csv
(one line per run), forest.png and curves.png (with matplotlib).
"""

import csv
import io
import json
import math
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from scipy import stats as scipy_stats

from common import ROOT, UserError, log_records, read_json, say, write_atomic
from experiments.stats import gated_holm, holm, paired_t, tost
from tools import pyplot, write_figure
from tools.diagnose import plot_curves, val_curve

SCORES = {"val": "the whole validation split", "test": "the whole test split"}  # summary.json's final scores


# --- the runs: out_dir/<variant>/seed<s>, each a train.py run directory ------------------------------------------

def run_dir(spec, variant, seed):
    return Path(spec["out_dir"]) / variant / f"seed{seed}"


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def divergence(d):
    """The "diverged" record train.py left in a run's log.jsonl (its step and error), or None."""
    return next((r for r in reversed(log_records(d)) if r.get("kind") == "diverged"), None)


def collect(spec):
    """The finished runs (a readable summary.json with a finite val_loss): each summary with its variant, seed,
    run directory (relative to out_dir) and validation curve."""
    runs = []
    for variant in spec["variants"]:
        for seed in spec["seeds"]:
            d = run_dir(spec, variant, seed)
            summary = read_json(d / "summary.json")
            if summary is None and (d / "summary.json").exists():
                print(f"note: {d / 'summary.json'} is not readable (torn or damaged): {variant} seed {seed} counts as "
                      "unfinished; the sweep resumes it to write it again", file=sys.stderr)
            if summary is not None and finite(summary.get("val_loss")):
                runs.append({**summary, "variant": variant, "seed": seed, "run_dir": f"{variant}/seed{seed}",
                             "curve": {str(step): loss for step, loss in val_curve(d)}})
    return runs


def collect_diverged(spec):
    return [dict(variant=v, seed=s, step=r.get("step")) for v in spec["variants"] for s in spec["seeds"]
            if not (run_dir(spec, v, s) / "summary.json").exists() and (r := divergence(run_dir(spec, v, s)))]


def nats(spec, runs):
    """The unit of the losses, from the runs' tokenizer (config.json): nats per byte, per token, or nats."""
    kinds = {"byte" if t == "byte" else "token" for r in runs
             if isinstance(t := (read_json(run_dir(spec, r["variant"], r["seed"]) / "config.json") or {}).get("tokenizer"),
                           str)}
    return f"nats per {kinds.pop()}" if len(kinds) == 1 else "nats"


# --- the statistics ----------------------------------------------------------------------------------------------

def score_of(run, score):
    """A run's whole-split loss (None: the run scored a prefix only, or has no such split)."""
    x = run.get(f"{score}_loss")
    return x if run.get("final_eval_tokens") == 0 and finite(x) else None


def compare(mine, theirs, score):
    """The paired comparison of two variants' runs ({seed: run}) on the seeds where both have the score."""
    deltas = {s: a - b for s in sorted(mine) if s in theirs
              and (a := score_of(mine[s], score)) is not None and (b := score_of(theirs[s], score)) is not None}
    t = paired_t(list(deltas.values()))
    return dict(deltas={str(s): x for s, x in deltas.items()}, paired_seeds=len(deltas),
                wins=sum(x < 0 for x in deltas.values()), delta_mean=t["mean"], delta_sd=t["sd"], p=t["p"],
                ci95=[t["lo"], t["hi"]])


def tested_interval(c):
    """A family test's interval at the level the procedure finally tested it at (it excludes 0 exactly when the test
    rejects); an exploratory one's, or one without that level, the uncorrected 95%."""
    n, level = c["paired_seeds"], c.get("level", 0)
    if c["kind"] == "exploratory" or n < 2 or not level > 0:
        return tuple(c["ci95"])
    half = c["delta_sd"] / math.sqrt(n) * scipy_stats.t.ppf(1 - level / 2, n - 1)
    return c["delta_mean"] - half, c["delta_mean"] + half


def by_variant(runs):
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    return by


def plan(spec, present):
    """(kind, variant, baseline) of every comparison: "primary" (declared), "control" (gated by its variant's primary
    test; exploratory without a family), then "exploratory": every other variant against the reference and the
    second reference, where both have runs. No pair twice."""
    primary, controls = [tuple(p) for p in spec.get("primary", [])], spec.get("controls", {})
    out = [("primary", v, b) for v, b in primary]
    out += [("control" if v in dict(primary) else "exploratory", v, c) for v, c in controls.items()]
    seen = {frozenset((v, b)) for _, v, b in out}
    for base in (spec["reference"], spec.get("second_reference")):
        for v in spec["variants"] if base else []:
            if v != base and frozenset((v, base)) not in seen and v in present and base in present:
                out.append(("exploratory", v, base))
                seen.add(frozenset((v, base)))
    return out


def tests(spec, runs):
    """Every comparison of plan() on the sweep's score; the family's with its adjusted p ("p_adj"), the level it was
    finally tested at ("level") and "rejected" (None: a gate that stayed shut); with a margin, each primary test's
    TOST ("p_equiv_adj") and what it shows ("shows": difference, equivalence or neither)."""
    score, alpha, by = spec.get("score", "val"), spec.get("alpha", 0.05), by_variant(runs)
    out = [dict(kind=k, variant=v, baseline=b, **compare(by.get(v, {}), by.get(b, {}), score))
           for k, v, b in plan(spec, by)]
    primary = [c for c in out if c["kind"] == "primary"]
    index = {c["variant"]: i for i, c in enumerate(primary)}
    gates = {index[c["variant"]]: c for c in out if c["kind"] == "control"}

    def p(c):  # a declared test without a p (fewer than 2 paired seeds) keeps its share and never rejects
        return 1.0 if math.isnan(c["p"]) else c["p"]
    adjusted, local = gated_holm([p(c) for c in primary], {i: p(c) for i, c in gates.items()}, alpha)
    for c, a, w in [(c, adjusted["primary"][i], local["primary"][i]) for i, c in enumerate(primary)] + \
            [(c, adjusted["gated"].get(i, math.nan), local["gated"].get(i, math.nan)) for i, c in gates.items()]:
        c.update(p_adj=a, level=w * alpha)
        c["rejected"] = None if not w > 0 and c["kind"] == "control" else bool(a <= alpha and not math.isnan(c["p"]))
    if (margin := spec.get("equivalence_margin")) is not None:  # TOST, Holm within the primary tests
        ps = [tost(list(c["deltas"].values()), margin) for c in primary]
        for c, pe, a in zip(primary, ps, holm([1.0 if math.isnan(x) else x for x in ps])):
            equivalent, (lo, hi) = bool(a <= alpha and not math.isnan(pe)), tested_interval(c)
            c.update(margin=margin, p_equiv=pe, p_equiv_adj=a,
                     shows="difference" if c["rejected"] else "equivalence" if equivalent else "neither",
                     beyond_margin=bool(c["rejected"] and (hi < -margin or lo > margin)))
    return out


# --- the tables --------------------------------------------------------------------------------------------------

def _num(x, fmt):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pval(p):
    return "n/a" if p is None or math.isnan(p) else "<0.001" if p < 0.0005 else f"{p:.3f}"


def _interval(c):
    if not c["paired_seeds"]:
        return "n/a (no paired seed)"
    if math.isnan(c["ci95"][0]):
        return f"{c['delta_mean']:+.4f} [needs 2 seeds]"
    return f"{c['delta_mean']:+.4f} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"


def _verdict(c):
    if c["rejected"] is None:
        return "not tested: its primary test did not reject"
    if "shows" in c and c["shows"] == "difference":
        return "**a difference beyond the margin**" if c["beyond_margin"] else \
            "**a difference**, not shown as large as the margin"
    if "shows" in c:
        return f"**equivalence** (inside ±{c['margin']:g})" if c["shows"] == "equivalence" else "neither"
    return "**rejects**" if c["rejected"] else "does not reject"


def family_table(ts, spec, unit):
    fam = [c for c in ts if c["kind"] == "primary"]
    fam = [x for c in fam for x in [c] + [g for g in ts if g["kind"] == "control" and g["variant"] == c["variant"]]]
    if not fam:
        return "No primary family is declared in the sweep file (`primary`): every comparison below is exploratory."
    margin = spec.get("equivalence_margin")
    head = (f"Primary family ({sum(c['kind'] == 'primary' for c in fam)} tests, declared in the sweep file), on "
            f"{SCORES[spec.get('score', 'val')]}, NLL in {unit}: paired t-tests, Holm at α = {spec.get('alpha', 0.05):g}, "
            "each control a gate tested once its variant's test rejects (Bretz et al. 2009)"
            + (f"; TOST at ±{margin:g}, Holm-adjusted the same way." if margin is not None else "."))
    out = [head, "", "| hypothesis | Δ [95% CI] | wins | p | p (adj.) |" + (" TOST p (adj.) |" if margin else "")
           + " verdict |", "|" + " --- |" * (6 + (margin is not None))]
    for c in fam:
        label = f"`{c['variant']}` − `{c['baseline']}`" + (" (its control)" if c["kind"] == "control" else "")
        tost_cell = f" {_pval(c.get('p_equiv_adj'))} |" if margin is not None else ""
        out.append(f"| {label} | {_interval(c)} | {c['wins']}/{c['paired_seeds']} | {_pval(c['p'])} | "
                   f"{'-' if c['rejected'] is None else _pval(c['p_adj'])} |{tost_cell} {_verdict(c)} |")
    return "\n".join(out)


def exploratory_table(ts, spec, unit):
    rows = [c for c in ts if c["kind"] == "exploratory"]
    if not rows:
        return None
    out = [f"Exploratory, on {SCORES[spec.get('score', 'val')]}, NLL in {unit}: uncorrected p-values, no claim.", "",
           "| comparison | Δ [95% CI] | wins | p (uncorrected) |", "| --- | --- | --- | --- |"]
    out += [f"| `{c['variant']}` − `{c['baseline']}` | {_interval(c)} | {c['wins']}/{c['paired_seeds']} | {_pval(c['p'])} |"
            for c in rows]
    return "\n".join(out)


def variant_rows(spec, runs, diverged):
    """Per variant: parameters against the reference, mean ± sd of each score, tokens/s and peak-memory ratios."""
    by, rows = by_variant(runs), []
    ref = by.get(spec["reference"], {})
    for v in spec["variants"]:
        seeds, bad = by.get(v, {}), [d["seed"] for d in diverged if d["variant"] == v]
        if not seeds and not bad:
            continue

        def ratio(key):
            both = [s for s in seeds if s in ref and seeds[s].get(key) and ref[s].get(key)]
            return statistics.fmean(seeds[s][key] for s in both) / statistics.fmean(ref[s][key] for s in both) \
                if both else None
        params = next(iter(seeds.values()), {}).get("params")
        ref_params = next(iter(ref.values()), {}).get("params")
        scores = {sc: [x for r in seeds.values() if (x := score_of(r, sc)) is not None] for sc in SCORES}
        rows.append(dict(variant=v, seeds=len(seeds), diverged_seeds=bad, params=params,
                         params_vs_reference_pct=100 * (params / ref_params - 1) if params and ref_params else None,
                         **{f"{sc}_mean": statistics.fmean(xs) if xs else None for sc, xs in scores.items()},
                         **{f"{sc}_sd": statistics.stdev(xs) if len(xs) > 1 else None for sc, xs in scores.items()},
                         tokens_per_s_ratio=ratio("tokens_per_s"), memory_ratio=ratio("peak_memory_bytes")))
    return rows


def variant_table(rows, reference):
    out = [f"| variant | seeds | params vs `{reference}` | val NLL | test NLL | tokens/s | peak memory |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        bad = f" (diverged: seed {', '.join(map(str, r['diverged_seeds']))})" if r["diverged_seeds"] else ""
        cells = [f"`{r['variant']}`{bad}", str(r["seeds"]), _num(r["params_vs_reference_pct"], "+.1f") + "%"]
        cells += [_num(r[f"{sc}_mean"], ".4f") + (f" ± {r[f'{sc}_sd']:.4f}" if r[f"{sc}_sd"] is not None else "")
                  for sc in SCORES]
        out.append("| " + " | ".join(cells + [_num(r["tokens_per_s_ratio"], ".3f"), _num(r["memory_ratio"], ".3f")]) + " |")
    return "\n".join(out)


def seed_table(ts, spec):
    mine = [c for c in ts if c["baseline"] == spec["reference"] and c["paired_seeds"]]
    seeds = sorted({int(s) for c in mine for s in c["deltas"]})
    if not mine:
        return None
    out = [f"Each seed's difference to `{spec['reference']}`:", "",
           "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + " --- |" * (len(seeds) + 1)]
    out += [f"| `{c['variant']}` | " + " | ".join(_num(c["deltas"].get(str(s)), "+.4f") for s in seeds) + " |"
            for c in mine]
    return "\n".join(out)


# --- provenance: where and when the runs ran (each summary.json), and the sweep file's declaration ----------------

def declared_at(path):
    """(the commit that added the sweep file and its UTC time, the commit that last changed it and its time, whether it
    has uncommitted changes now), or None where git cannot tell."""
    def log(*how):
        try:
            git = subprocess.run(["git", "log", *how, "--format=%H %cI", "--", Path(path).name],
                                 cwd=Path(path).resolve().parent, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return []
        return git.stdout.split() if git.returncode == 0 else []
    added, last = log("--diff-filter=A", "--follow"), log("-1")
    if len(added) < 2 or len(last) < 2:
        return None
    status = subprocess.run(["git", "status", "--porcelain", "--", Path(path).name], cwd=Path(path).resolve().parent,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    return (*added[:2], *last[:2], bool(status))  # the last: uncommitted changes now


def provenance(spec, runs):
    """The runs' commits, torch versions, hosts and UTC span; runs that started before the declaration's commit or
    ran from a tree that was not clean (flagged)."""
    recorded = [r for r in runs if isinstance(r.get("started_utc"), str)]
    declared = declared_at(spec["path"]) if spec.get("path") else None

    def utc(text):  # (a hand-edited time that is no ISO time: the earliest, so flagged)
        try:
            return datetime.fromisoformat(text).astimezone(timezone.utc)
        except ValueError:
            return datetime.min.replace(tzinfo=timezone.utc)
    early = [r["run_dir"] for r in recorded if declared and utc(r["started_utc"]) < utc(declared[1])]
    edited = [r["run_dir"] for r in recorded if declared and utc(r["started_utc"]) < utc(declared[3]) and
              r["run_dir"] not in early]
    dirty = [r["run_dir"] for r in recorded if any(c.endswith("+dirty") for c in r.get("commits") or [])]
    return dict(recorded=len(recorded), runs=len(runs), commits=sorted({c for r in recorded for c in r.get("commits") or []}),
                torch=sorted({v for r in recorded for v in r.get("torch") or []}),
                hosts=sorted({v for r in recorded for v in r.get("hosts") or []}),
                first_start=min((r["started_utc"] for r in recorded), default=None),
                last_finish=max((r.get("finished_utc") or "" for r in recorded), default=None),
                declared=dict(commit=declared[0], utc=declared[1], last_change=declared[2], last_utc=declared[3],
                              uncommitted=declared[4])
                if declared else None, started_before_declaration=early, started_before_last_change=edited, dirty=dirty)


def provenance_text(p):
    if not p["recorded"]:
        return f"Provenance: not recorded in any of the {p['runs']} runs' summary.json."
    text = (f"Provenance ({p['recorded']} of {p['runs']} runs): {p['first_start']} to {p['last_finish']}, on commit"
            f"{'s' * (len(p['commits']) != 1)} {', '.join(c[:7] + '+dirty' * c.endswith('+dirty') for c in p['commits'])}"
            f"; torch {', '.join(p['torch'])}; host{'s' * (len(p['hosts']) != 1)} {', '.join(p['hosts'])}.")
    d = p["declared"]
    text += (f" The sweep file was added at {d['commit'][:7]} ({d['utc']}), last changed at {d['last_change'][:7]} "
             f"({d['last_utc']})." if d else
             " The sweep file's declaration commit is not known here (not committed, no git, or a shallow clone).")
    if d and d["uncommitted"]:
        text += " **The sweep file has uncommitted changes: what it declares now is in no commit.**"
    for runs, what in ((p["started_before_declaration"], "started before it was added"),
                       (p["started_before_last_change"], "started before its last change"),
                       (p["dirty"], "ran from a tree with uncommitted changes")):
        if runs:
            text += f" **{len(runs)} run{'s' * (len(runs) != 1)} {what}**: {', '.join(runs[:5])}{' ...' * (len(runs) > 5)}."
    return text


# --- the plots ---------------------------------------------------------------------------------------------------

def plot_forest(ts, score, path):
    """Each comparison's Δ with its interval: a family test's at the level the procedure finally tested it at (it
    excludes 0 exactly when the test rejects), an exploratory one's the uncorrected 95%; filled: excludes 0."""
    fam = [x for c in ts if c["kind"] == "primary"
           for x in [c] + [g for g in ts if g["kind"] == "control" and g["variant"] == c["variant"]]]
    rows = [c for c in fam + [c for c in ts if c["kind"] == "exploratory"] if c["paired_seeds"]]
    plt = pyplot() if rows else None
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.3 * len(rows) + 1.6))
    for y, c in enumerate(rows):
        color = {"primary": "tab:blue", "control": "tab:orange"}.get(c["kind"], "0.55")
        lo, hi = tested_interval(c)
        if (c["kind"] != "exploratory" and c["rejected"] is None) or math.isnan(lo):
            ax.plot(c["delta_mean"], y, "o", color="0.55", mfc="white")
            continue
        ax.plot([lo, hi], [y, y], color=color, lw=1.5)
        ax.plot(c["delta_mean"], y, "o", color=color, mfc=color if lo > 0 or hi < 0 else "white")
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), [f"{c['variant']} − {c['baseline']}" + (f" ({c['kind']})" if c["kind"] != "primary"
                                                                           else "") for c in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"paired Δ NLL, {SCORES[score]} (< 0: the first is better)\nblue / orange: the family / its controls, "
                  "at the level tested; grey: exploratory, 95%", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    write_figure(path, fig)
    return path


# --- the report --------------------------------------------------------------------------------------------------

def strict_json(x):
    """x with every non-finite float as None (results.json is strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    return [strict_json(v) for v in x] if isinstance(x, (list, tuple)) else x


def save_outputs(out, outputs):
    """Each {file name: write(path)} whole or not at all; what could not be written is one `warning:` line."""
    problems = {}
    for name, write in outputs.items():
        try:
            write(Path(out) / name)
        except OSError as e:
            problems[name] = (e.strerror or str(e)).lower()
        except Exception as e:  # a plot is an extra: the tables and the other files stand
            problems[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    if problems:
        print(f"warning: could not write {', '.join(problems)} in {out} ({'; '.join(sorted(set(problems.values())))}); "
              "the tables above are complete", file=sys.stderr, flush=True)


def report(spec):
    """The tables (printed, and in results.md), results.json, results.csv and the plots; returns the tests."""
    out, reference, score = Path(spec["out_dir"]), spec["reference"], spec.get("score", "val")
    runs, diverged = collect(spec), collect_diverged(spec)
    if not any(r["variant"] == reference for r in runs):
        raise UserError(f"no finished run of the reference {reference!r} in {out} (looked for "
                        f"{reference}/seed<s>/summary.json): run the sweep first, or pass the --out_dir that holds its "
                        f"runs (a relative out_dir in a sweep file is relative to {ROOT})")
    if unscored := [r["run_dir"] for r in runs if score_of(r, score) is None]:
        print(f"note: {len(unscored)} finished runs have no score on {SCORES[score]} (their final evaluation read a "
              f"prefix: final_eval_tokens was not 0): {', '.join(unscored[:3])}", file=sys.stderr)
    ts, unit, rows, prov = tests(spec, runs), nats(spec, runs), variant_rows(spec, runs, diverged), provenance(spec, runs)
    sections = [family_table(ts, spec, unit), exploratory_table(ts, spec, unit), variant_table(rows, reference),
                seed_table(ts, spec), provenance_text(prov)]
    text = "\n\n".join(s for s in sections if s)
    say(text)

    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(["variant", "seed", "val_loss", "test_loss", "params", "tokens_per_s", "peak_memory_bytes", "status"])
    for r in runs:
        w.writerow([r["variant"], r["seed"], score_of(r, "val"), score_of(r, "test"), r.get("params"),
                    r.get("tokens_per_s"), r.get("peak_memory_bytes"), "finished"])
    for d in diverged:
        w.writerow([d["variant"], d["seed"]] + [""] * 5 + ["diverged"])
    results = dict(reference=reference, second_reference=spec.get("second_reference"), score=score,
                   alpha=spec.get("alpha", 0.05), unit=unit, equivalence_margin=spec.get("equivalence_margin"),
                   primary=[list(p) for p in spec.get("primary", [])], controls=spec.get("controls", {}), tests=ts,
                   variants=rows, provenance=prov, runs=runs, diverged=diverged)
    finished = {v: [run_dir(spec, v, r["seed"]) for r in runs if r["variant"] == v] for v in spec["variants"]}
    save_outputs(out, {
        "results.md": lambda p: write_atomic(p, text + "\n"),
        "results.json": lambda p: write_atomic(p, json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n"),
        "results.csv": lambda p: write_atomic(p, table.getvalue()),
        "forest.png": lambda p: plot_forest(ts, score, p),
        "curves.png": lambda p: plot_curves({v: d for v, d in finished.items() if d}, p),
    })
    return ts
