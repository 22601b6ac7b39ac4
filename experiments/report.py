"""
A sweep's report: what its finished runs say, with the statistics a reviewer asks for. The sweep
prints it after its runs; `python -m experiments.sweep SWEEP_FILE --table_only` prints it alone.

The protocol is declared in the sweep file, before any run (experiments/sweep.py checks it):
    primary   [(variant, baseline), ...]: the claims under test, one family: each a paired t-test on
              the declared score, Holm-adjusted within the family (family-wise error rate alpha)
    controls  {variant: its parameter-matched control}: a gate. "variant - control" is tested only once
              the variant's primary test rejects, at the level that rejection frees (stats.gated_holm;
              Holm exactly where no variant has a control)
    twins     {variant: twin}: a variant that trains bit for bit as its twin (rd_tied is Block AttnRes):
              checked for equality, in no family
    score     the split the tests use: "val" (default) the whole validation split, "test" the whole test
              split (both from each run's scores.json, experiments/rescore.py), "val_prefix"/"test_prefix" the
              fixed eval_tokens prefix each run scored itself (its summary.json)
    alpha     the family-wise error rate (default 0.05)
    equivalence_margin  (optional) a margin in nats: each primary test is also an equivalence test,
              two one-sided paired t-tests against -margin and +margin (stats.tost), Holm-adjusted within
              the primary tests as the difference tests are; each primary test then shows one of three
              things: a difference (the t-test rejects), equivalence (TOST rejects: |Δ| < margin), or
              neither (the design cannot tell); a difference is "beyond the margin" where its 95%
              interval lies wholly outside +-margin, and "not shown as large as the margin" where it
              reaches inside
Every other comparison (each variant against the reference, and against the second reference) is
exploratory: its p-value is uncorrected, labelled so, and claims nothing. A sweep file without
`primary` has only exploratory comparisons.

Each comparison gives the mean paired difference over seeds (< 0: the variant is better) with its 95%
t-interval, the wins, the t-test's p (adjusted in the family), the exact sign-flip p (no normality;
never below 2 / 2^n), and the smallest difference the design detects with 80% power at its level
(alpha / m in the family, where Holm makes its first test; alpha outside it).

The report names where and when its runs ran (provenance(): each run's summary.json, and the commit that
added the sweep file, its declaration).

Outputs, in out_dir, each written whole or not at all: results.md (the printed tables), results.json
(strict JSON; run paths relative to out_dir), results.csv (one line per run), forest.png, curves.png
and gap_over_training.png (with matplotlib).
"""

import csv
import io
import json
import math
import shutil
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from common import UserError, write_atomic
from experiments.plots import SHORT, plot_forest, plot_gaps, undefined
from experiments.rundirs import collect, collect_diverged, finite, nats, run_dir, token_unit
from experiments.stats import detectable, gated_holm, holm, paired_t, sign_flip_p, tost
from tools.diagnose import plot_curves

SCORES = {  # score -> what it is, as the tables say
    "val": "the whole validation split",
    "test": "the whole test split",
    "val_prefix": "the fixed validation prefix each run scores (eval_tokens)",
    "test_prefix": "the fixed test prefix each run scores (eval_tokens)",
}


# --- the statistics ----------------------------------------------------------------------------------

def score_of(run, score):
    """A run's loss on a score (SCORES), or None where it has none (a run not rescored yet)."""
    x = run.get("val_loss") if score == "val_prefix" else run.get("test_loss") if score == "test_prefix" \
        else run.get("whole", {}).get(score)
    return x if finite(x) else None


def compare(mine, theirs, score="val_prefix", alpha=0.05):
    """The paired comparison of two variants' runs ({seed: run}) on the seeds where both have the score:
    each seed's difference (negative: `mine` is better), the paired t-test with its 95% interval, the
    exact sign-flip p, the wins, and the difference detectable with 80% power at level alpha."""
    deltas = {s: a - b for s in sorted(mine) if s in theirs
              and (a := score_of(mine[s], score)) is not None and (b := score_of(theirs[s], score)) is not None}
    d = list(deltas.values())
    t = paired_t(d)  # with one seed: no sd, t, p or interval (nan; null in results.json)
    return dict(score=score, deltas={str(s): x for s, x in deltas.items()}, paired_seeds=len(d),
                wins=sum(x < 0 for x in d), delta_mean=t["mean"], delta_std=t["sd"], t=t["t"], p=t["p"],
                ci95=[t["lo"], t["hi"]], sign_flip_p=sign_flip_p(d), detectable=detectable(t["sd"], len(d), alpha),
                ppl_change_pct=100 * (math.exp(t["mean"]) - 1) if d else math.nan)


def by_variant(runs):
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    return by


def describe(runs, reference, score):
    """Per variant: its seeds, parameters (and against the reference's), mean ± sd of each score, and the
    tokens/s and peak-memory ratios against the reference (over the seeds both finished)."""
    by = by_variant(runs)
    ref = by[reference]
    rows = []
    for variant, seeds in by.items():
        def ratio(key):
            both = [s for s in seeds if s in ref and seeds[s].get(key) and ref[s].get(key)]
            return statistics.fmean(seeds[s][key] for s in both) / statistics.fmean(ref[s][key] for s in both) \
                if both else None

        params, ref_params = next(iter(seeds.values())).get("params"), ref[min(ref)].get("params")
        means = {}
        for sc in SCORES:
            xs = [x for s in sorted(seeds) if (x := score_of(seeds[s], sc)) is not None]
            means[sc] = dict(n=len(xs), mean=statistics.fmean(xs) if xs else None,
                             sd=statistics.stdev(xs) if len(xs) > 1 else None)
        rows.append(dict(variant=variant, seeds=len(seeds), params=params,
                         params_vs_reference_pct=100 * (params / ref_params - 1) if params and ref_params else None,
                         scores=means, val_loss_mean=means["val_prefix"]["mean"],
                         tokens_per_s_ratio=ratio("tokens_per_s"), memory_ratio=ratio("peak_memory_bytes")))
    return rows


def plan(spec, present):
    """The comparisons a sweep makes, in the order the tables give them: (kind, variant, baseline) with
    kind "primary" (declared), "control" (gated by its variant's primary test; exploratory where no
    primary family is declared), "twin" (must be equal) or "exploratory" (every other variant against
    the reference and the second reference; a twin is in none, a control not against the second). The
    declared family is kept whole whatever has run (a test without runs counts in it and never rejects);
    the rest only where both sides have runs. No pair is compared twice, in either order."""
    primary = [tuple(p) for p in spec.get("primary", [])]
    controls, twins = spec.get("controls", {}), spec.get("twins", {})
    gated = {v for v, _ in primary}
    out = [("primary", v, b) for v, b in primary]
    out += [("control" if v in gated else "exploratory", v, c) for v, c in controls.items()]
    out += [("twin", v, t) for v, t in twins.items()]
    seen = {frozenset((v, b)) for _, v, b in out}
    for base, others in ((spec["reference"], spec["variants"]),
                         (spec.get("second_reference"), [v for v in spec["variants"] if v not in controls.values()
                                                          and v != spec["reference"]])):
        if base is None:
            continue
        for v in others:
            if v != base and v not in twins and base not in twins and frozenset((v, base)) not in seen:
                out.append(("exploratory", v, base))
                seen.add(frozenset((v, base)))
    return [(k, v, b) for k, v, b in out if k in ("primary", "control") or (v in present and b in present)]


def tests(spec, runs, score=None):
    """Every comparison of plan() on `score` (default: the sweep's), as dicts: compare()'s fields with
    kind, variant, baseline, and for the family (primary and control) the adjusted p ("p_adj"), the level
    it was finally tested at ("level": weight x alpha), "rejected" (or None: a gate that stayed shut) and
    the detectable difference at alpha / m. Each test also holds every other score's paired comparison
    ("on": {score: {delta_mean, ci95, p, wins, paired_seeds}})."""
    score, alpha = score or spec.get("score", "val"), spec.get("alpha", 0.05)
    by = by_variant(runs)
    out = []
    for kind, variant, baseline in plan(spec, by):
        mine, theirs = by.get(variant, {}), by.get(baseline, {})
        c = dict(kind=kind, variant=variant, baseline=baseline, **compare(mine, theirs, score, alpha))
        c["on"] = {sc: {k: x[k] for k in ("delta_mean", "ci95", "p", "wins", "paired_seeds")}
                   for sc in SCORES if sc != score and (x := compare(mine, theirs, sc))["paired_seeds"]}
        out.append(c)
    primary = [c for c in out if c["kind"] == "primary"]
    index = {c["variant"]: i for i, c in enumerate(primary)}
    gates = {index[c["variant"]]: c for c in out if c["kind"] == "control"}

    def p(c):  # a declared test without a p (fewer than 2 paired seeds) keeps its share and never rejects
        return 1.0 if math.isnan(c["p"]) else c["p"]
    adjusted, local = gated_holm([p(c) for c in primary], {i: p(c) for i, c in gates.items()}, alpha)
    m = len(primary)
    for c, a, w in [(c, adjusted["primary"][i], local["primary"][i]) for i, c in enumerate(primary)] + \
            [(c, adjusted["gated"].get(i, math.nan), local["gated"].get(i, math.nan)) for i, c in gates.items()]:
        c.update(p_adj=a, level=w * alpha, detectable=detectable(c["delta_std"], c["paired_seeds"], alpha / max(m, 1)))
        c["rejected"] = None if not w > 0 and c["kind"] == "control" else bool(a <= alpha and not math.isnan(c["p"]))
    if spec.get("equivalence_margin") is not None:
        equivalence(primary, spec["equivalence_margin"], alpha)
    return out


def equivalence(primary, margin, alpha):
    """The declared equivalence tests of the primary tests (TOST against +-margin, Holm within them), and
    what each primary test shows: "difference" (its t-test rejects in the family), "equivalence" (its
    TOST rejects: the mean difference is inside +-margin) or "neither". A test with fewer than 2 paired
    seeds keeps its share (p 1) and shows neither. Both can reject (a difference smaller than the
    margin): that shows a difference, with "inside_margin" set. A difference whose 95% interval lies
    wholly outside +-margin has "beyond_margin" set: one whose interval reaches inside the margin is a
    difference not shown as large as the margin."""
    ps = [tost(list(c["deltas"].values()), margin) for c in primary]
    adjusted = holm([1.0 if math.isnan(p) else p for p in ps])
    for c, p, a in zip(primary, ps, adjusted):
        equivalent = bool(a <= alpha and not math.isnan(p))
        lo, hi = c["ci95"]
        c.update(margin=margin, p_equiv=p, p_equiv_adj=a, equivalent=equivalent,
                 shows="difference" if c["rejected"] else "equivalence" if equivalent else "neither",
                 inside_margin=bool(c["rejected"] and equivalent),
                 beyond_margin=bool(c["rejected"] and (hi < -margin or lo > margin)))


def gap_over_training(runs, reference, variants):
    """{variant: {step: (mean paired difference of val loss against the reference, wins, seeds, 95% lo,
    95% hi)}} at every evaluation the paired runs share (the prefix each run evaluates)."""
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
        gaps[variant] = {}
        for step in steps:
            d = [c[step] - by[reference][s][step] for s, c in mine.items()]
            t = paired_t(d)
            gaps[variant][int(step)] = (t["mean"], sum(x < 0 for x in d), len(d), t["lo"], t["hi"])
    return gaps


# --- the tables --------------------------------------------------------------------------------------

def _num(x, fmt, none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pval(p):
    """A p-value as the tables print it: three decimals, "<0.001" below them, "n/a" without a test."""
    return "n/a" if undefined(p) else "<0.001" if p < 0.0005 else f"{p:.3f}"


def _interval(c):
    """A comparison's mean difference and its 95% interval, or why there is none."""
    if not c["paired_seeds"]:
        return "n/a (no paired seed)"
    if undefined(c["ci95"][0]):
        return f"{c['delta_mean']:+.4f} [needs 2 seeds]"
    return f"{c['delta_mean']:+.4f} [{_num(c['ci95'][0], '+.4f')}, {_num(c['ci95'][1], '+.4f')}]"


def _name(c):
    return f"`{c['variant']}` − `{c['baseline']}`"


def _verdict(c):
    if "shows" in c:  # a primary test with a declared equivalence margin: one of three things
        within = f"±{c['margin']:g}"
        if c["shows"] == "difference":
            if c["inside_margin"]:
                return f"**a difference** (and inside {within})"
            return "**a difference beyond the margin**" if c["beyond_margin"] else \
                "**a difference**, not shown as large as the margin"
        if c["shows"] == "equivalence":
            return f"**equivalence** (inside {within})"
        if undefined(c["p"]):
            return f"neither: no test, {c['paired_seeds']} paired seed{'s' * (c['paired_seeds'] != 1)}"
        return f"neither: no difference shown, nor equivalence within {within}"
    if c["rejected"] is None:
        return "not tested: its primary test did not reject"
    if undefined(c["p"]):
        return f"no test: {c['paired_seeds']} paired seed{'s' * (c['paired_seeds'] != 1)} (counts in the family)"
    return "**rejects**" if c["rejected"] else "does not reject"


def family_table(ts, spec, score, unit=None):
    """The declared family: each primary test, and each control test under its variant (unit: what a token
    of the runs is, rundirs.token_unit)."""
    fam = [c for c in ts if c["kind"] in ("primary", "control")]
    if not fam:
        return ("No primary family is declared in the sweep file (`primary`): every comparison below is "
                "exploratory.")
    m = sum(c["kind"] == "primary" for c in fam)
    alpha = spec.get("alpha", 0.05)
    margin = spec.get("equivalence_margin")
    head = (f"Primary family ({m} tests, declared in the sweep file), on {SCORES[score]}, NLL in {nats(unit)}: paired "
            f"t-tests; p (adj.): Holm's procedure at α = {alpha:g} with each control as a gate, tested only once its "
            "variant's primary test rejects, on the level that frees (the graphical procedure of Bretz et al. 2009; "
            f"without controls exactly Holm). Detectable: the difference found with about 80% power at α/m = "
            f"{alpha / max(m, 1):.4f} (t quantiles with the seeds' own sd, an approximation of the noncentral t: "
            "optimistic at few seeds).")
    if margin is not None:
        head += (f" Equivalence margin ±{margin:g} {nats(unit)}: TOST p (adj.) is the larger p of two one-sided paired "
                 f"t-tests against -{margin:g} and +{margin:g}, Holm-adjusted within the {m} primary tests; each primary "
                 "test shows a difference (its t-test rejects), equivalence (TOST rejects: the mean difference is inside "
                 "the margin), or neither. A difference is beyond the margin where its 95% interval lies wholly outside "
                 "it, and not shown as large as the margin where the interval reaches inside it.")
    tost_head, tost_rule = (" TOST p (adj.) |", " --- |") if margin is not None else ("", "")
    out = [head, "", f"| hypothesis | Δ [95% CI] | wins | p | p (adj.) | sign-flip p | detectable |{tost_head} verdict |",
           f"| --- | --- | --- | --- | --- | --- | --- |{tost_rule} --- |"]
    order = [c for c in fam if c["kind"] == "primary"]
    order = [x for c in order for x in [c] + [g for g in fam if g["kind"] == "control" and g["variant"] == c["variant"]]]
    for c in order:
        label = _name(c) + (" (its control)" if c["kind"] == "control" else "")
        equiv = "" if margin is None else f" {_pval(c['p_equiv_adj']) if 'p_equiv_adj' in c else '-'} |"
        out.append(f"| {label} | {_interval(c)} | {c['wins']}/{c['paired_seeds']} | {_pval(c['p'])} | "
                   f"{'-' if c['rejected'] is None else _pval(c['p_adj'])} | {_pval(c['sign_flip_p'])} | "
                   f"{_num(c['detectable'], '.4f')} |{equiv} {_verdict(c)} |")
    return "\n".join(out)


def family_on_every_score(spec, runs, score):
    """The primary family's Δ and Holm p on every score the runs have: how much the verdict depends on
    which tokens are scored."""
    scores = [sc for sc in SCORES if any(score_of(r, sc) is not None for r in runs)]
    per = {sc: {(c["kind"], c["variant"], c["baseline"]): c for c in tests(spec, runs, sc)} for sc in scores}
    fam = [c for c in per.get(score, {}).values() if c["kind"] in ("primary", "control")]
    keys = [(x["kind"], x["variant"], x["baseline"]) for c in fam if c["kind"] == "primary"
            for x in [c] + [g for g in fam if g["kind"] == "control" and g["variant"] == c["variant"]]]
    if not keys or len(scores) < 2:
        return None
    out = ["The same family on every score (Δ, adjusted p; the tests use " + SHORT[score] + "):", "",
           "| hypothesis | " + " | ".join(SHORT[sc] for sc in scores) + " |", "|" + " --- |" * (len(scores) + 1)]
    for key in keys:
        cells = []
        for sc in scores:
            c = per[sc][key]
            cells.append("n/a" if not c["paired_seeds"] else
                         f"{c['delta_mean']:+.4f}, " + ("not tested" if c["rejected"] is None else _pval(c["p_adj"])))
        out.append(f"| {_name(per[score][key])}{' (control)' if key[0] == 'control' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def exploratory_table(ts, spec, score, unit=None):
    rows = [c for c in ts if c["kind"] == "exploratory"]
    if not rows:
        return None
    alpha = spec.get("alpha", 0.05)
    out = [f"Exploratory, on {SCORES[score]}, NLL in {nats(unit)}: uncorrected p-values, no claim (not in the declared "
           f"family). Detectable: with about 80% power at α = {alpha:g}.", "",
           "| comparison | Δ [95% CI] | wins | p (uncorrected) | sign-flip p | detectable |",
           "| --- | --- | --- | --- | --- | --- |"]
    for c in rows:
        out.append(f"| {_name(c)} | {_interval(c)} | {c['wins']}/{c['paired_seeds']} | {_pval(c['p'])} | "
                   f"{_pval(c['sign_flip_p'])} | {_num(c['detectable'], '.4f')} |")
    return "\n".join(out)


def twin_diffs(c, by):
    """{score: [|Δ| of each seed both twins finished]} of a twin test c (by: by_variant of the runs)."""
    return {sc: [abs(a - b) for s in by[c["variant"]] if s in by[c["baseline"]]
                 and (a := score_of(by[c["variant"]][s], sc)) is not None
                 and (b := score_of(by[c["baseline"]][s], sc)) is not None] for sc in SCORES}


def unequal_twins(ts, runs):
    """The twin tests whose twins differ on some score of some seed: (test, largest |Δ|, seeds)."""
    by, out = by_variant(runs), []
    for c in ts:
        if c["kind"] == "twin":
            diffs = twin_diffs(c, by)
            if any(x != 0 for d in diffs.values() for x in d):
                out.append((c, max(x for d in diffs.values() for x in d), max(len(d) for d in diffs.values())))
    return out


def twin_table(ts, runs):
    rows = [c for c in ts if c["kind"] == "twin"]
    if not rows:
        return None
    out = ["Twins (trained bit for bit as their twin; in no family): the largest |Δ| over seeds on each score.", "",
           "| variant | twin | seeds | " + " | ".join(SHORT.values()) + " | equal |", "|" + " --- |" * (len(SCORES) + 4)]
    by = by_variant(runs)
    for c in rows:
        diffs = twin_diffs(c, by)
        cells = [_num(max(d), ".1e") if d else "-" for d in diffs.values()]
        equal = "yes, bit for bit" if all(x == 0 for d in diffs.values() for x in d) else "**no**"
        seeds = sum(s in by[c["baseline"]] for s in by[c["variant"]])
        out.append(f"| `{c['variant']}` | `{c['baseline']}` | {seeds} | " + " | ".join(cells) + f" | {equal} |")
    return "\n".join(out)


def _label(r):
    """A variant's cell: its name, and the seeds of its runs that diverged."""
    bad = r.get("diverged_seeds")
    return f"`{r['variant']}`" + (f" (diverged: seed {', '.join(map(str, bad))})" if bad else "")


def _mean_sd(m):
    if not m["n"]:
        return "-"
    return f"{m['mean']:.4f} ± {m['sd']:.4f}" if m["n"] > 1 else f"{m['mean']:.4f} (1 seed)"


def variant_table(rows, reference):
    """Per variant: parameters against the reference, each score's mean ± sd over seeds, the speed and
    memory ratios of its runs. A variant whose every run diverged has "diverged" in every cell."""
    scores = [sc for sc in SCORES if any(r.get("scores", {}).get(sc, {}).get("n") for r in rows)] or ["val_prefix"]
    cols = ["variant", f"params vs `{reference}`"] + [f"{SHORT[sc]} NLL" for sc in scores] + ["tokens/s", "peak memory"]
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        if "scores" not in r:
            out.append("| " + " | ".join([_label(r)] + ["diverged"] * (len(cols) - 1)) + " |")
            continue
        cells = [_label(r), _num(r["params_vs_reference_pct"], "+.1f") + "%"]
        cells += [_mean_sd(r["scores"][sc]) for sc in scores]
        cells += [_num(r["tokens_per_s_ratio"], ".3f"), _num(r["memory_ratio"], ".3f")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def seed_table(ts, rows, reference, score):
    """Each seed's paired difference with the reference on the score, per variant ("diverged" where the
    run did)."""
    mine = [c for c in ts if c["baseline"] == reference and c["kind"] != "twin"]
    diverged = {r["variant"]: r.get("diverged_seeds", []) for r in rows}
    seeds = sorted({int(s) for c in mine for s in c["deltas"]} | {s for d in diverged.values() for s in d})
    if not mine or not seeds:
        return f"Each seed's difference to `{reference}`: none yet (no other variant has finished a run)."
    out = [f"Each seed's difference to `{reference}` ({SHORT[score]}):", "",
           "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + " --- |" * (len(seeds) + 1)]
    for c in mine:
        cells = ["diverged" if s in diverged.get(c["variant"], []) else _num(c["deltas"].get(str(s)), "+.4f")
                 for s in seeds]
        out.append(f"| `{c['variant']}` | " + " | ".join(cells) + " |")
    out += [f"| `{v}` | " + " | ".join("diverged" if s in d else "-" for s in seeds) + " |"
            for v, d in diverged.items() if d and v not in {c["variant"] for c in mine} and v != reference]
    return "\n".join(out)


def gap_table(gaps, reference):
    """The paired gap to the reference at every evaluation: mean Δ (wins/seeds)."""
    steps = sorted({step for g in gaps.values() for step in g})
    if not steps:
        return f"The gap to `{reference}` over training: none yet (no other variant has an evaluation paired with it)."
    out = [f"| Δ vs `{reference}` at step (val prefix) | " + " | ".join(str(s) for s in steps) + " |",
           "|" + " --- |" * (len(steps) + 1)]
    for variant, g in gaps.items():
        out.append(f"| `{variant}` | " + " | ".join(f"{g[s][0]:+.4f} ({g[s][1]}/{g[s][2]})" if s in g else "-"
                                                    for s in steps) + " |")
    return "\n".join(out)


def diverged_table(diverged):
    """The runs that diverged (not in any statistic)."""
    out = ["| diverged run | seed | at step |", "| --- | --- | --- |"]
    out += [f"| `{d['variant']}` | {d['seed']} | {_num(d['step'], 'd')} |" for d in diverged]
    return "\n".join(out)


# --- provenance ----------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE = ("started_utc", "finished_utc", "commits", "torch", "hosts")  # summary.json (train.py before issue 53)


def _utc(text):
    return datetime.fromisoformat(text).astimezone(timezone.utc)


def declared_at(path):
    """The commit that added a study's declaration file (followed through renames: a design file that moved, as
    into experiments/configs/, is the one its first commit added) and that commit's time, and the last commit
    after it that changed the file's contents (a rename alone is no change): dict(file, commit, utc,
    last_change (dict(commit, utc), or None)), or dict(file, why) where git cannot tell (git is not available,
    the file is in no git checkout, or no commit adds it). The file is named relative to the project root, or
    by its name alone outside it."""
    p = Path(path).resolve()
    where = dict(file=str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name)  # no machine's paths
    if shutil.which("git") is None:
        return dict(where, why="git is not available")
    try:  # newest first, each commit's line then the file's status in it (A added, M changed, R100 renamed alone)
        git = subprocess.run(["git", "log", "--follow", "--format=%H %cI", "--name-status", "--", p.name], cwd=p.parent,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return dict(where, why=f"git did not answer ({type(e).__name__})")
    if git.returncode != 0:
        return dict(where, why="git: " + (git.stderr.strip().splitlines() or ["failed"])[0])
    commits = []  # (commit, time, status)
    for line in git.stdout.splitlines():
        if line.strip() and len(line.split()) == 2 and "\t" not in line:
            commits.append([*line.split(), None])
        elif line.strip() and commits and commits[-1][2] is None:
            commits[-1][2] = line.split("\t")[0]
    adds = [c for c in commits if c[2] == "A"]
    if not adds:
        return dict(where, why="no commit here adds it: not committed, or a shallow clone")
    commit, when, _ = adds[0]  # the newest add: the file as it stands (after a delete and a new add, the new one)
    later = [c for c in commits[:commits.index(adds[0])] if c[2] != "R100"]
    return dict(where, commit=commit, utc=_utc(when).isoformat(),
                last_change=dict(commit=later[0][0], utc=_utc(later[0][1]).isoformat()) if later else None)


def provenance(runs, path):
    """Where and when a study's runs ran, from each run's PROVENANCE fields (older runs have none), and its
    declaration file `path` (declared_at; None: none named): the commits (+dirty where the tree was), torch
    versions and hosts, the UTC span from the first start to the last finish, whether every recorded run ran
    on one commit and on the declaration's, and whether that commit (and the file's last change after it)
    precedes the first recorded start."""
    recorded = [r for r in runs if r.get("started_utc")]
    commits = sorted({c for r in recorded for c in r.get("commits") or []})
    no_commit = sum(not r.get("commits") for r in recorded)  # ran outside a git checkout
    out = dict(runs=len(runs), recorded=len(recorded), without_commit=no_commit, commits=commits,
               torch=sorted({v for r in recorded for v in r.get("torch") or []}),
               hosts=sorted({v for r in recorded for v in r.get("hosts") or []}),
               first_start=min((r["started_utc"] for r in recorded), key=_utc, default=None),
               last_finish=max((r["finished_utc"] for r in recorded if r.get("finished_utc")), key=_utc, default=None),
               one_commit=len(commits) == 1 and not no_commit if recorded else None,
               declaration=declared_at(path) if path else None, on_declared_commit=None,
               declared_before_first_start=None, changed_before_first_start=None)
    d = out["declaration"] or {}
    if recorded and d.get("commit"):
        first = _utc(out["first_start"])
        out["on_declared_commit"] = commits == [d["commit"]] and not no_commit
        out["declared_before_first_start"] = _utc(d["utc"]) < first
        if d["last_change"]:
            out["changed_before_first_start"] = _utc(d["last_change"]["utc"]) < first
    return out


def provenance_text(p):
    """provenance() as the report's paragraph."""
    def when(t):
        return _utc(t).strftime("%Y-%m-%d %H:%M:%S UTC")

    def short(c):
        return c[:7] + ("+dirty" if c.endswith("+dirty") else "")
    d, n, k = p["declaration"], p["runs"], p["recorded"]
    if k == 0:
        text = f"Provenance: not recorded (none of the {n} runs' summary.json has it: they predate it)."
    else:
        cs = p["commits"]
        older = "" if k == n else f"; not recorded for {n - k} older run{'s' * (n - k != 1)}"
        text = (f"Provenance (each run's summary.json{older}): "
                f"{k} runs from {when(p['first_start'])} (the first start) to "
                f"{when(p['last_finish']) if p['last_finish'] else '?'} (the last finish), on "
                + (f"one commit, {short(cs[0])}" if p["one_commit"] else f"{len(cs)} commits, {', '.join(map(short, cs))}")
                + (f" ({p['without_commit']} outside a git checkout)" if p["without_commit"] else "")
                + f"; torch {', '.join(p['torch'])}; host{'s' * (len(p['hosts']) != 1)} {', '.join(p['hosts'])}.")
    if d is None:
        return text + " No declaration file named."
    if "why" in d:
        return text + f" Declared in `{d['file']}`, at a commit not known here ({d['why']})."
    last = d["last_change"]
    text += (f" Declared in `{d['file']}`, added at {d['commit'][:7]} ({when(d['utc'])})"
             + (f", last changed at {last['commit'][:7]} ({when(last['utc'])})" if last else ""))
    if k == 0:
        return text + ": whether the runs ran on it, and after it, is not recorded."
    return (text + ": " + ("every recorded run ran on it" if p["on_declared_commit"] else "not every recorded run ran on it")
            + "; it " + ("precedes" if p["declared_before_first_start"] else "does not precede")
            + " the first recorded start" + ("" if not last else ", and so does its last change"
                                            if p["changed_before_first_start"] else ", and its last change does not")
            + ".")


# --- the report --------------------------------------------------------------------------------------

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
    """Write one output whole or not at all: write(path) writes it through common.write_atomic (a temporary
    name of this process alone, fsync, rename), or returns None when there is nothing to write (a plot
    without matplotlib). Returns None, or why it could not (a read-only or full disk, or a plot that
    failed), so the other outputs still go out."""
    try:
        write(path)
        return None
    except OSError as e:  # the OS's words; a plot's own one-line error ends with them ("cannot write P: why")
        return (e.strerror or str(e).rsplit(": ", 1)[-1]).lower()
    except Exception as e:  # a plot is an extra: the tables and the files that could be written stand
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def save_outputs(out, outputs, done="the tables above are complete"):
    """save_output of each {file name: write} in the directory `out`; what could not be written is one
    `warning:` line on stderr, after what was printed (a missing `out` too: it holds the runs, so a
    report never makes one). Returns the names not written."""
    if not Path(out).is_dir():
        problems = {name: "not a directory" if Path(out).exists() else "no such directory" for name in outputs}
    else:
        problems = {name: why for name, write in outputs.items() if (why := save_output(Path(out) / name, write))}
    if problems:
        reasons = sorted(set(problems.values()))
        print(f"warning: could not write {', '.join(problems)} in {out} ({'; '.join(reasons)}); {done}",
              file=sys.stderr, flush=True)
    return list(problems)


def report(spec, rescore_hint=None):
    """The tables (printed, and in results.md), results.json, results.csv and the plots, from the runs;
    returns the tests. A diverged run is marked in the tables and left out of the statistics. Files that
    cannot be written are one `warning:` line after the printed tables, and twins that do not match are
    another (unequal_twins). rescore_hint: the command that
    scores the runs that have no whole-split scores yet (for the note that says so)."""
    out = Path(spec["out_dir"])
    runs, diverged = collect(spec), collect_diverged(spec)
    reference, second, score = spec["reference"], spec.get("second_reference"), spec.get("score", "val")
    if not any(r["variant"] == reference for r in runs):
        bad = ", ".join(str(d["seed"]) for d in diverged if d["variant"] == reference)
        raise UserError(f"no finished run of the reference {reference!r} in {out} (looked for {reference}/seed<s>/summary.json"
            f" there{f'; seed {bad} diverged' if bad else ''}): run the sweep first, or pass the --out_dir that holds "
            f"its runs (a relative out_dir in a sweep file is relative to {ROOT})")
    unscored = [r for r in runs if score_of(r, score) is None]
    if unscored:
        print(f"note: {len(unscored)} of {len(runs)} finished runs have no score on {SCORES[score]} (the tests pair "
              f"only the seeds that have it){f': {rescore_hint}' if rescore_hint else ''}", file=sys.stderr)
    rows = describe(runs, reference, score)
    by = {r["variant"]: r for r in rows}
    for d in diverged:
        by.setdefault(d["variant"], {"variant": d["variant"], "seeds": 0}).setdefault("diverged_seeds", []).append(d["seed"])
    rows = [by[v] for v in spec["variants"] if v in by]
    ts = tests(spec, runs, score)
    baselines = [reference] + [b for _, b in spec.get("primary", []) if b != reference]
    baselines += [second] if second and second not in baselines else []
    twins = spec.get("twins", {})
    shown = [v for v in spec["variants"] if v not in twins]
    gaps = {b: gap_over_training(runs, b, shown if b in (reference, second) else
                                 [v for v, base in spec.get("primary", []) if base == b]) for b in baselines}
    unit = token_unit(run_dir(spec, r["variant"], r["seed"]) for r in runs)
    prov = provenance(runs, spec.get("path"))
    sections = [family_table(ts, spec, score, unit), family_on_every_score(spec, runs, score),
                exploratory_table(ts, spec, score, unit), twin_table(ts, runs), variant_table(rows, reference),
                seed_table(ts, rows, reference, score)]
    sections += [gap_table(g, b) for b, g in gaps.items() if g or b == reference]
    if diverged:
        sections.append(diverged_table(diverged))
    sections.append(provenance_text(prov))
    text = "\n\n".join(s for s in sections if s)
    print(text, flush=True)

    csv_text = io.StringIO()
    w = csv.writer(csv_text)
    w.writerow(["variant", "seed", "val_loss", "test_loss", "val_whole", "test_whole", "delta_vs_reference", "params",
                "tokens_per_s", "peak_memory_bytes", "status"])
    ref = {r["seed"]: r for r in runs if r["variant"] == reference}
    for r in runs:
        mine, theirs = score_of(r, score), score_of(ref[r["seed"]], score) if r["seed"] in ref else None
        w.writerow([r["variant"], r["seed"], r["val_loss"], r.get("test_loss"), score_of(r, "val"), score_of(r, "test"),
                    mine - theirs if mine is not None and theirs is not None else "", r.get("params"),
                    r.get("tokens_per_s"), r.get("peak_memory_bytes"), "finished"])
    for d in diverged:
        w.writerow([d["variant"], d["seed"]] + [""] * 8 + ["diverged"])
    results = dict(reference=reference, second_reference=second, score=score, alpha=spec.get("alpha", 0.05),
                   token_unit=unit, equivalence_margin=spec.get("equivalence_margin"), provenance=prov,
                   primary=[list(p) for p in spec.get("primary", [])], controls=spec.get("controls", {}), twins=twins,
                   tests=ts, rows=rows, gaps={b: {v: {str(k): x for k, x in g.items()} for v, g in gs.items()}
                                              for b, gs in gaps.items()}, runs=runs, diverged=diverged)
    results_json = json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n"
    finished = {v: [run_dir(spec, v, r["seed"]) for r in runs if r["variant"] == v] for v in shown}
    highlight = {b: [v for v, base in spec.get("primary", []) if base == b] for b in gaps}
    if not spec.get("primary"):  # nothing declared: the first ten variants in colour
        highlight[reference] = [v for v in gaps.get(reference, {})][:10]
    outputs = {
        "results.md": lambda p: write_atomic(p, text + "\n"),
        "results.json": lambda p: write_atomic(p, results_json),
        "results.csv": lambda p: write_atomic(p, csv_text.getvalue()),
        "curves.png": lambda p: plot_curves({v: d for v, d in finished.items() if d}, p),
        "forest.png": lambda p: plot_forest(ts, score, p),
        "gap_over_training.png": lambda p: plot_gaps({b: (gaps[b], highlight[b]) for b in gaps}, p),
    }
    save_outputs(out, outputs)
    if unequal := unequal_twins(ts, runs):
        print("warning: " + ", ".join(f"{c['variant']} does not match its twin {c['baseline']} (largest |Δ| {d:.1e} "
                                      f"over {n} seeds)" for c, d, n in unequal)
              + ": a twin trains bit for bit as its twin, so their code or settings differ (the Twins table says no)",
              file=sys.stderr, flush=True)
    return ts
