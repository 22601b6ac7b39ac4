"""
The report of experiments/robust.py: robust.md from the analysis, the loss-vs-FLOPs plot, and JSON-safe values.
"""

import math
import statistics

from experiments.multiplier import inverse, predict
from experiments.report import provenance_text
from experiments.robust_design import STAGES, steps_name
from experiments.rundirs import nats
from tools import pyplot, write_figure


def _f(x, fmt, none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return format(x, fmt)


def _p(c, holm=True):
    text = f"{_f(c['p'], '.3f')}" + (f" ({_f(c.get('p_holm'), '.3f')})" if holm else "")
    return text.replace("0.000", "<0.001")


def _gap_cells(c, holm=True):
    if c is None or c["n"] == 0:
        return ["-", "-", "-"]
    return [f"{c['mean']:+.4f} [{_f(c['ci95'][0], '+.4f')}, {_f(c['ci95'][1], '+.4f')}]", f"{c['wins']}/{c['n']}",
            _p(c, holm)]


def render(result, design):
    r, lr = result, result["lr"]
    seeds_n = len(design["seeds"])
    shared = f"{design['recipe']['lr']:g}"
    ref = design["reference"]
    out = [f"# Does the advantage hold? lr, length, compute (`{design['base']}`, reference `{ref}`)", ""]
    et = ", ".join(f"{x:,}" for x in r["eval_tokens"]) or "?"
    unit = r["token_unit"]
    tokens = f"{unit or 'token'}s"  # what the runs' tokens are: bytes with the byte tokenizer
    if design["score"] == "val":
        scores = (f"Scores: validation NLL in {nats(unit)} on the whole validation split (each run's scores.json, "
                  "experiments/rescore.py), the design's declared score. ")
    else:
        scores = (f"Scores: validation NLL in {nats(unit)} (summary.json `val_loss`) on the fixed first {et} {tokens} of "
                  "the validation split (the runs' `eval_tokens`), the same chunk for every run: not whole-split scores. ")
    unscored = sum(len(x) for x in r["unscored"].values())
    if unscored:
        scores += (f"**{unscored} finished run(s) have no whole-split scores yet and are left out** (listed under Runs; "
                   "`python -m experiments.robust DESIGN` without --table_only scores them). ")
    out += [scores + f"Recipe: lr {shared}, min_lr {design['recipe']['min_lr']:g}, {design['recipe']['steps']} steps of "
            f"{design['recipe']['batch_tokens']:,} {tokens}. Tuning seeds {list(design['tuning_seeds'])}; comparison "
            f"seeds {list(design['seeds'])}. Finished runs: {len(r['runs'])}, "
            f"{sum(r['cpu_seconds'].values()) / 3600:.2f} hours of run time (summary.json `seconds`, summed).", ""]
    # a.
    lrs = [f"{x:g}" for x in design["lrs"]]
    out += ["## a. Learning rate (tuning seeds only)", "",
            f"Mean val NLL over the tuning seeds (n seeds); best: the lowest mean over the tuning seeds every lr of "
            f"the variant finished. `{shared}` is the shared lr.", "",
            "| variant | " + " | ".join(f"lr {x}" + (" (shared)" if x == shared else "") for x in lrs) + " | best lr |",
            "|" + " --- |" * (len(lrs) + 2)]
    for v, t in lr["table"].items():
        cells = [f"{_f(t['cells'][x]['mean'], '.4f')} ({t['cells'][x]['n']})" for x in lrs]
        best = _f(t["best_lr"], "g") + ("" if t["complete"] or t["best_lr"] is None else " (partial)")
        out.append(f"| `{v}` | " + " | ".join(cells) + f" | {best} |")
    lo_lr, hi_lr = f"{min(design['lrs']):g}", f"{max(design['lrs']):g}"
    edge = [v for v, t in lr["table"].items() if t["best_lr"] is not None and f"{t['best_lr']:g}" in (lo_lr, hi_lr)]
    if edge and len(lrs) > 1:
        out += ["", f"At the grid's edge ({lo_lr} or {hi_lr}): {', '.join(f'`{v}`' for v in edge)}; their optimum may lie "
                "outside the grid."]
    out += ["", f"Ranking on the tuning seeds at the shared lr: {' < '.join(f'`{v}`' for v in lr['ranking_shared']) or '-'}",
            f"at each variant's own best lr: {' < '.join(f'`{v}`' for v in lr['ranking_best']) or '-'}"]
    if lr["ranking_changes"] is None:
        out.append(f"(not settled: tuning runs unfinished for {', '.join(f'`{v}`' for v in lr['unsettled'])})")
    else:
        out.append(f"The ranking {'changes' if lr['ranking_changes'] else 'does not change'}. (On the tuning seeds, "
                   "the best-lr ranking is chosen on the same data it ranks: optimistic; the comparison seeds below "
                   "are not.)")
    out += ["", f"### At each variant's own best lr, comparison seeds, {r['recipe_steps']} steps", ""]
    c = lr["comparison"]
    need = result["missing"]["best"]
    if c["at_best"] is None:
        out.append("Not yet: the reference's best lr is not settled (tuning runs unfinished).")
    else:
        shared_gap = {g["variant"]: g for g in r["gaps"][str(r["recipe_steps"])]}
        out += [f"| variant | best lr | Δ vs `{ref}` at its best lr [95% CI] | wins | p (Holm) "
                "| Δ at the shared lr [95% CI] | wins |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for g in c["at_best"]:
            s = _gap_cells(shared_gap.get(g["variant"]))
            out.append(f"| `{g['variant']}` | {g['best_lr']:g} | " + " | ".join(_gap_cells(g)) + f" | {s[0]} | {s[1]} |")
        out.append("")
        if c["ranking_changes"] is not None:
            out.append(f"Ranking on the comparison seeds at the shared lr: {' < '.join(f'`{v}`' for v in c['ranking_shared'])}; "
                       f"at the best lrs: {' < '.join(f'`{v}`' for v in c['ranking_best'])}: "
                       f"{'changes' if c['ranking_changes'] else 'unchanged'}.")
    if need:
        out.append(f"Missing best-lr runs on the comparison seeds ({len(need)}): {', '.join(f'`{x}`' for x in need)} "
                   f"(`python -m experiments.robust <design> --stage best`).")
    unsettled = lr["unsettled"]
    if unsettled:
        out.append(f"Best-lr runs not yet named for {', '.join(f'`{v}`' for v in unsettled)}: their tuning runs are unfinished.")
    # b.
    out += ["", "## b. The gap to the reference at each length (each its own schedule's end)", "",
            f"Paired over the comparison seeds: Δ = variant - `{ref}` (negative: better), mean [95% t interval], "
            f"wins/paired seeds, two-sided paired t p (Holm across the variants at that length).", ""]
    ns = sorted(design["steps"])
    head = "| variant | " + " | ".join(f"Δ at {n} steps [95% CI] | wins | p (Holm)" for n in ns)
    head += "".join(f" | change {ns[0]} -> {n} [95% CI]" for n in ns[1:]) + " |"
    out += [head, "|" + " --- |" * (1 + 3 * len(ns) + len(ns) - 1)]
    by = {n: {g["variant"]: g for g in r["gaps"][str(n)]} for n in ns}
    for v in design["variants"]:
        if v == ref:
            continue
        cells = [x for n in ns for x in _gap_cells(by[n][v])]
        for n in ns[1:]:
            ch = r["gap_change"][v][str(n)]
            cells.append(f"{ch['mean']:+.4f} [{_f(ch['ci95'][0], '+.4f')}, {_f(ch['ci95'][1], '+.4f')}] ({ch['n']})"
                         if ch["n"] else "-")
        out.append(f"| `{v}` | " + " | ".join(cells) + " |")
    partial = [n for n in ns if any(g["n"] < seeds_n for g in by[n].values())]
    if partial:
        out.append(f"\nPartial: at {', '.join(map(str, partial))} steps not every comparison seed has finished (n above).")
    if r["contrasts"]:
        out += ["", "### Contrasts besides the reference (the design's `contrasts`)", "",
                "Paired over the comparison seeds: Δ = variant - baseline, mean [95% t interval], wins/paired seeds, "
                "two-sided paired t p, uncorrected (exploratory).", "",
                "| variant - baseline | " + " | ".join(f"Δ at {n} steps [95% CI] | wins | p" for n in ns)
                + " | Δ at both best lrs [95% CI] | wins | p | best lrs |",
                "|" + " --- |" * (1 + 3 * len(ns) + 4)]
        for c in r["contrasts"]:
            cells = [x for n in ns for x in _gap_cells(c["lengths"][str(n)], holm=False)]
            best = c["at_best"]
            cells += _gap_cells(best, holm=False) + ([f"{best['lrs'][0]:g}, {best['lrs'][1]:g}"] if best else ["not settled"])
            out.append(f"| `{c['variant']}` - `{c['baseline']}` | " + " | ".join(cells) + " |")
    # c.
    out += ["", "## c. Compute along the data axis: the reference needs X times the compute", "",
            f"A data multiplier: `{ref}` at one size trained for several lengths, not the papers' multiplier across model "
            "sizes (experiments/ladder.py reads that one off a size ladder). X is the paired gap rescaled through the "
            "ladder's slope, so it adds no evidence beyond the gap, and a bootstrap of 3 seeds has 10 distinct "
            "resamples: its intervals cover less than they say.", ""]
    pts = r["ladder"]
    out.append(f"The ladder: `{ref}` at " + ", ".join(f"{m} steps {p['mean']:.4f}" + (f" ± {p['sd']:.4f}" if p["n"] > 1 else "")
                                                    + f" (n {p['n']}, {p['flops']:.3g} FLOP)" for m, p in pts.items()) + "."
               if pts
               else f"The ladder: no `{ref}` run of it has finished yet.")
    fit = r["fit"]
    if fit:
        law = (f"L = {fit['A']:.4g} C^-{fit['alpha']:.4f}" if fit["kind"] == "loglinear"
               else f"L = {fit['E']:.4f} + {fit['A']:.4g} C^-{fit['alpha']:.4f}")
        out.append(f"Fit ({fit['kind']}, on the mean of each length): {law}; residuals "
                   f"{', '.join(f'{x:+.4f}' for x in fit['residuals'])} (rms {fit['rms']:.4f}).")
    out += ["", "Training FLOPs = `GPT.flops_per_token()` (6 per matmul weight + attention; depth attention's "
            "elementwise work is not in it) x tokens. FLOP-matched: C* / the variant's FLOPs (the variant is "
            "charged its own FLOPs per token); step-matched: C* / the reference's FLOPs at the same tokens "
            "(X in steps), where C* is the compute at which the ladder's fit reaches the variant's mean loss. "
            f"Intervals: {design['bootstrap']} bootstrap resamples of the comparison seeds (paired across the ladder "
            f"and the variant; RNG seed {design['bootstrap_seed']}), 2.5 and 97.5 percentiles. *extrapolated*: C* "
            "lies outside the ladder's compute.", ""]
    bench = r["bench"]
    head = "| variant | FLOPs/token vs ref | " + " | ".join(
        f"X FLOP-matched at {n} [95%] | X step-matched at {n} [95%]" for n in ns)
    if bench:
        head += " | " + " | ".join(f"X time-matched at {n}" for n in ns)
    head += " | seeds, ladder lengths |"
    out += [head, "|" + " --- |" * (head.count("|") - 1)]
    for v in design["variants"]:
        cells, info = [], []
        ratio = None
        for n in ns:
            m = r["multipliers"][v][str(n)]
            ratio = m.get("flops_per_token_ratio", ratio)
            iv = m.get("interval") or {}
            ext = " *extrapolated*" if m.get("extrapolated") else ""
            cells += [f"{_f(m['flops'], '.3f')} [{_f((iv.get('flops') or [None])[0], '.3f')}, "
                      f"{_f((iv.get('flops') or [None, None])[1], '.3f')}]{ext}",
                      f"{_f(m['steps_x'], '.3f')} [{_f((iv.get('steps') or [None])[0], '.3f')}, "
                      f"{_f((iv.get('steps') or [None, None])[1], '.3f')}]{ext}"]
            info.append(f"{n}: {len(m['seeds'])}/{seeds_n} seeds, ladder {'/'.join(map(str, m['ladder'])) or '-'}"
                        + (" (partial)" if m["partial"] else "")
                        + (f", {iv['undefined']} resamples without a read-off" if iv.get("undefined") else ""))
        if bench:
            b = bench["variants"].get(v)
            cells += [_f(r["multipliers"][v][str(n)]["steps_x"] * b["speed_ratio"]
                         if b and r["multipliers"][v][str(n)]["steps_x"] is not None else None, ".3f") for n in ns]
        out.append(f"| `{v}`{' (reference)' if v == ref else ''} | {_f(ratio, '.3f')} | " + " | ".join(cells)
                   + f" | {'; '.join(info)} |")
    out += ["", "The reference's own rows read its runs against its own fit: their distance from 1 is the fit's error "
            "there. With few seeds the bootstrap has few distinct resamples (3 seeds: 10), so its interval is coarse; "
            "with one seed there is none.",
            "", "![loss against training FLOPs](loss_vs_flops.png)"]
    # d.
    out += ["", "## d. Wall-clock: measured speed ratios only", ""]
    if bench:
        size = ", ".join(f"{k}={v}" for k, v in bench["size"].items() if v is not None)
        out += [f"From `{bench['file']}` (tools.bench: every variant's training step timed in one process, repeats "
                f"interleaved; {bench['device']}, {bench['dtype']}, {size}). Speed ratio: the variant's steps per "
                f"second over `{ref}`'s, median [quartiles of the per-round ratios]. X time-matched = X step-matched "
                "x speed ratio: the wall-clock the reference needs to reach the variant's loss, over the variant's. "
                "No run's own timing is used (runs share cores).", "",
                "| variant | bench variant | speed ratio [quartiles] |", "| --- | --- | --- |"]
        for v, b in bench["variants"].items():
            out.append(f"| `{v}` | `{b['bench_variant']}` | {b['speed_ratio']:.3f} [{b['quartiles'][0]:.3f}, "
                       f"{b['quartiles'][1]:.3f}] |")
    else:
        out.append("No bench file named in the design (`bench = ...`): measure with `python -m tools.bench` at the "
                   "design's size and name its JSON; wall-clock is not read from the runs' own timings.")
    # what remains
    out += ["", "## Runs", ""]
    for st in STAGES:
        miss, waiting = r["missing"][st], r["unscored"][st]
        out.append(f"- {st}: {r['cpu_seconds'][st] / 3600:.2f} h of finished runs; "
                   + (f"{len(miss)} unfinished: {', '.join(f'`{x}`' for x in miss)}" if miss else "all finished")
                   + (f"; {len(waiting)} unscored: {', '.join(f'`{x}`' for x in waiting)}" if waiting else ""))
    out += ["", provenance_text(r["provenance"])]
    return "\n".join(out) + "\n"


def plot(result, design, path):
    """Loss against training FLOPs (log-log): the ladder's mean ± sd and its fit (solid over the ladder,
    dashed where it extrapolates), each variant's mean ± sd over the seeds at every length of `steps`."""
    plt = pyplot()
    if plt is None or not result["ladder"]:
        return None
    runs = {(x["name"], x["seed"]): x for x in result["runs"]}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    pts = result["ladder"]
    ax.errorbar([p["flops"] for p in pts.values()], [p["mean"] for p in pts.values()],
                yerr=[p["sd"] for p in pts.values()], fmt="o", color="black", capsize=3,
                label=f"{design['reference']} ladder ({', '.join(pts)} steps)")
    xs_all = [p["flops"] for p in pts.values()]
    markers = "osD^v"
    fit = result.get("fit")
    for i, v in enumerate(x for x in design["variants"] if x != design["reference"]):  # the reference: the ladder
        for j, n in enumerate(sorted(design["steps"])):
            rs = [runs[(steps_name(design, v, n), s)] for s in design["seeds"] if (steps_name(design, v, n), s) in runs]
            if not rs:
                continue
            losses = [x["val_loss"] for x in rs]
            fx, mean = statistics.fmean(x["flops"] for x in rs), statistics.fmean(losses)
            xs_all.append(fx)
            ax.errorbar([fx], [mean], yerr=[statistics.stdev(losses) if len(losses) > 1 else 0],
                        fmt=markers[j % len(markers)], color=f"C{i}", capsize=3, mfc="white" if j else f"C{i}",
                        label=f"{v}, {n} steps (n {len(rs)})")
            c_star = inverse(fit, mean) if fit else None
            if c_star is not None and math.isfinite(c_star):  # to where the reference's fit reaches its loss
                ax.plot([fx, c_star], [mean, mean], ":", color=f"C{i}", lw=1)
                xs_all.append(c_star)
    if fit:
        lo, hi = min(xs_all) / 1.1, max(xs_all) * 1.1
        grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
        inside = [c for c in grid if fit["range"][0] <= c <= fit["range"][1]]
        ax.plot(inside, [predict(fit, c) for c in inside], "-", color="black", lw=1, label=f"fit ({fit['kind']})")
        for part in ([c for c in grid if c <= fit["range"][0]], [c for c in grid if c >= fit["range"][1]]):
            if len(part) > 1:
                ax.plot(part, [predict(fit, c) for c in part], "--", color="black", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter  # matplotlib is there: pyplot() found it
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    ax.set_xlabel("training FLOPs (flops_per_token x tokens)\nthe ladder's fit: solid, dashed where extrapolated; "
                  "dotted: to where it reaches the variant's loss", fontsize=8)
    ax.set_ylabel("val NLL (mean ± sd over seeds)")
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    write_figure(path, fig)
    return path


def strict(x):
    """JSON-safe: nan and inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return x
