"""
The compute multiplier from a size ladder (issue 37): `standard` at several model sizes on one recipe,
its loss against training compute across the sizes, and "standard needs X times the compute" for each
variant that ran at one of the sizes, read off that curve. The papers fit a curve per method; here each
variant, run at one size, is taken to lie on a curve parallel to standard's.

    python -m experiments.ladder experiments/configs/ladder_cpu.py   # ladder.md, .json, .png in the ladder's out_dir

The ladder's design file is a sweep file (experiments/sweep.py runs it) that also sets:
    rung    the ladder's variant at the size the variants ran at: they pair with it seed by seed
    pairs   {a sweep's out_dir: [its variants to read off]}, relative to the project root
    level   the interval's confidence (0.95)

The arithmetic (experiments/configs/ladder_cpu.py declares it):
    C      = GPT.flops_per_token() x the training tokens of a run
    fit    log L = a - alpha log C, least squares over the sizes' mean log NLL (whole validation split);
           alpha's standard error from the residuals (sizes - 2 degrees of freedom)
    r_s    = log L_variant(s) - log L_rung(s), one per paired seed
    X      = exp(-mean r / alpha): the compute at which a curve parallel to the ladder's, through the
           rung's point, reaches the variant's loss, over the rung's compute (step-matched: the same tokens);
           FLOP-matched X divides by the variant's FLOPs per token over the rung's
    interval  X's range over the (1 - (1 - level) / 2) t-interval of mean r and the same of alpha: each
           covers with that probability, so both do with at least `level` (Bonferroni), whatever their
           correlation. Where alpha's interval reaches 0 the ladder does not fix the slope and the
           interval is unbounded on the side the gap points to.
No bootstrap: with 3 seeds it has 10 distinct resamples and covers far less than it says.
experiments/tests/test_ladder.py checks the interval's coverage by simulation, and that it is not uselessly wide.
The read-off names its runs' provenance (experiments.report.provenance) against the design file's commit.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from common import UserError, cli, write_atomic
from experiments.report import PROVENANCE, provenance, provenance_text, save_outputs, strict_json
from experiments.robust import flops_per_token
from experiments.rundirs import finished_run, nats, token_unit, whole_split_scores
from experiments.stats import paired_t, t_quantile
from experiments.sweep import in_root, load_sweep
from tools import pyplot, write_figure


def slope_fit(log_c, log_l):
    """Least squares of log L on log C: dict(alpha (minus the slope), a, se (alpha's standard error),
    df, residuals). se is nan with fewer than 3 points (no residual degrees of freedom)."""
    n = len(log_c)
    mx, my = statistics.fmean(log_c), statistics.fmean(log_l)
    sxx = sum((x - mx) ** 2 for x in log_c)
    if n < 2 or sxx == 0:
        raise ValueError("a ladder needs at least 2 distinct sizes")
    b = sum((x - mx) * (y - my) for x, y in zip(log_c, log_l)) / sxx
    a = my - b * mx
    residuals = [y - (a + b * x) for x, y in zip(log_c, log_l)]
    df = n - 2
    se = math.sqrt(sum(e * e for e in residuals) / df / sxx) if df > 0 else math.nan
    return dict(alpha=-b, a=a, se=se, df=df, residuals=residuals)


def _exp(v):
    """exp(v), inf where it overflows a float (an interval that the slope leaves unbounded)."""
    return math.inf if v > 709.0 else math.exp(v)


def _log_x(r, alpha):
    """-r / alpha, with alpha -> 0+ as its limit (an infinite multiplier, or none at r = 0)."""
    if alpha > 0:
        return -r / alpha
    return 0.0 if r == 0 else -math.copysign(math.inf, r)


def multiplier(r, fit, level=0.95):
    """X = exp(-mean r / alpha) and its interval (see the module's docstring) from the paired log gaps r
    (one per seed) and the ladder's fit. Returns dict(x, lo, hi, r (paired_t of r at the split level),
    alpha_lo, alpha_hi); lo/hi are None with fewer than 2 seeds or no slope error, x None where alpha <= 0."""
    each = 1 - (1 - level) / 2  # each of the two intervals' confidence
    t = paired_t(list(r), confidence=each)
    alpha = fit["alpha"]
    x = _exp(-t["mean"] / alpha) if alpha > 0 and not math.isnan(t["mean"]) else None
    out = dict(x=x, lo=None, hi=None, r=t, alpha_lo=None, alpha_hi=None, level=level)
    if t["n"] < 2 or not fit["df"] > 0 or math.isnan(fit["se"]):
        return out
    half = t_quantile(1 - (1 - each) / 2, fit["df"]) * fit["se"]
    a_lo, a_hi = alpha - half, alpha + half
    out.update(alpha_lo=a_lo, alpha_hi=a_hi)
    if a_hi <= 0:  # the ladder does not fall with compute even at its steepest: no multiplier
        return out
    corners = [_log_x(rr, aa) for rr in (t["lo"], t["hi"]) for aa in (max(a_lo, 0.0), a_hi)]
    out.update(lo=_exp(min(corners)), hi=_exp(max(corners)))
    return out


# --- the runs ----------------------------------------------------------------------------------------

def read_run(d):
    """A finished, whole-split-scored run: dict(loss on the whole validation split, flops_per_token,
    tokens, and its summary's PROVENANCE fields where it has them), or None (not finished, or not scored
    yet)."""
    run = finished_run(d)
    if run is None or flops_per_token(run[1]["model"]) is None:  # not finished, or not train.py's files
        return None
    summary, cfg = run
    val = whole_split_scores(d, summary.get("step")).get("val")
    if val is None:
        return None
    tokens = summary["step"] * cfg["train"]["batch_tokens"]
    return dict(loss=val, flops_per_token=flops_per_token(cfg["model"]), tokens=tokens,
                **{k: summary[k] for k in PROVENANCE if k in summary})


def read_off(spec):
    """The ladder's fit and every paired variant's multiplier, as one JSON-able dict."""
    out_dir, seeds, rung = Path(spec["out_dir"]), spec["seeds"], spec["rung"]
    sizes = {}
    for name in spec["variants"]:
        runs = {s: r for s in seeds if (r := read_run(out_dir / name / f"seed{s}"))}
        if runs:
            sizes[name] = runs
    missing = [f"{n}/seed{s}" for n in spec["variants"] for s in seeds if s not in sizes.get(n, {})]
    result = dict(design=spec.get("path"), seeds=seeds, rung=rung, missing_ladder_runs=missing, sizes={}, fit=None,
                  variants={}, level=spec["level"],
                  token_unit=token_unit(out_dir / n / f"seed{s}" for n in sizes for s in sizes[n]),
                  provenance=provenance([r for runs in sizes.values() for r in runs.values()], spec.get("path")))
    for name, runs in sizes.items():
        result["sizes"][name] = dict(n=len(runs), flops=statistics.fmean(r["flops_per_token"] * r["tokens"]
                                                                          for r in runs.values()),
                                     mean_log_loss=statistics.fmean(math.log(r["loss"]) for r in runs.values()),
                                     losses={str(s): r["loss"] for s, r in runs.items()})
    if len(sizes) < 2 or rung not in sizes:
        return result
    pts = list(result["sizes"].values())
    fit = slope_fit([math.log(p["flops"]) for p in pts], [p["mean_log_loss"] for p in pts])
    result["fit"] = dict(alpha=fit["alpha"], a=fit["a"], alpha_se=fit["se"], df=fit["df"],
                         residuals=dict(zip(result["sizes"], fit["residuals"])))
    for where, variants in spec["pairs"].items():
        for v in variants:
            mine = {s: r for s in seeds if (r := read_run(Path(in_root(where)) / v / f"seed{s}"))}
            both = [s for s in seeds if s in mine and s in sizes[rung]]
            r = [math.log(mine[s]["loss"]) - math.log(sizes[rung][s]["loss"]) for s in both]
            m = multiplier(r, fit, spec["level"]) if both else dict(x=None, lo=None, hi=None)
            ratio = mine[both[0]]["flops_per_token"] / sizes[rung][both[0]]["flops_per_token"] if both else None
            flop = {k: (m[k] / ratio if m.get(k) is not None and ratio else None) for k in ("x", "lo", "hi")}
            result["variants"][v] = dict(seeds=both, log_gaps=dict(zip(map(str, both), r)),
                                         gap_nats=[mine[s]["loss"] - sizes[rung][s]["loss"] for s in both],
                                         x_step=[m["x"], m["lo"], m["hi"]], flops_per_token_ratio=ratio,
                                         x_flops=[flop["x"], flop["lo"], flop["hi"]])
    return result


def _x(v):
    return "-" if v is None else "inf" if math.isinf(v) else f"{v:.3f}"


def table(result):
    """ladder.md: the sizes, the fit and each variant's multiplier."""
    lines = [f"# The size ladder: `standard` needs X times the compute (seeds {result['seeds']}, rung "
             f"`{result['rung']}`)", "",
             "| size | seeds | training FLOPs | mean log NLL (whole val) | residual |", "| --- | --- | --- | --- | --- |"]
    fit = result["fit"]
    for name, p in result["sizes"].items():
        res = f"{fit['residuals'][name]:+.4f}" if fit else "-"
        lines.append(f"| `{name}` | {p['n']} | {p['flops']:.3g} | {p['mean_log_loss']:.4f} | {res} |")
    if result["missing_ladder_runs"]:
        lines += ["", f"Not finished or not scored yet: {', '.join(result['missing_ladder_runs'])}."]
    if not fit:
        return "\n".join(lines + ["", "No fit yet: the ladder needs its rung and one more size.", "", _provenance(result)])
    lines += ["", f"Fit: log L = {fit['a']:.4f} - {fit['alpha']:.4f} log C, alpha's standard error {fit['alpha_se']:.4f} "
                  f"({fit['df']} degrees of freedom).", "",
              f"X: exp(-mean log gap / alpha), the gap paired seed by seed with `{result['rung']}`; "
              f"{100 * result['level']:g}% interval over the t-intervals of the gap and of alpha (Bonferroni).", "",
              f"| variant | seeds | gap, {nats(result['token_unit'])} (mean) | X step-matched [interval] | FLOPs/token vs rung "
              "| X FLOP-matched [interval] |",
              "| --- | --- | --- | --- | --- | --- |"]
    for v, c in result["variants"].items():
        gap = f"{statistics.fmean(c['gap_nats']):+.4f}" if c["gap_nats"] else "-"
        ratio = f"{c['flops_per_token_ratio']:.3f}" if c["flops_per_token_ratio"] else "-"
        xs, xf = c["x_step"], c["x_flops"]
        lines.append(f"| `{v}` | {len(c['seeds'])} | {gap} | {_x(xs[0])} [{_x(xs[1])}, {_x(xs[2])}] | {ratio} | "
                     f"{_x(xf[0])} [{_x(xf[1])}, {_x(xf[2])}] |")
    return "\n".join(lines + ["", _provenance(result)])


def _provenance(result):
    return provenance_text(result["provenance"]) + " (The ladder's own runs: the paired variants' are their study's.)"


def plot(result, path):
    """ladder.png: loss against training compute (log-log), each size's seeds and their geometric mean, the
    ladder's fit, its parallel through the rung (the curve X is read off), and each variant's mean at its
    compute with a dotted line to where that parallel reaches it (at X times the rung's compute)."""
    plt = pyplot()
    fit = result["fit"]
    if plt is None or not fit:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    sizes = result["sizes"]
    for p in sizes.values():
        ax.plot([p["flops"]] * len(p["losses"]), list(p["losses"].values()), ".", color="0.6", ms=4)
    cs = [p["flops"] for p in sizes.values()]
    ax.plot(cs, [math.exp(p["mean_log_loss"]) for p in sizes.values()], "o", color="black", mfc="none", ms=8,
            zorder=5, label=f"standard at {len(sizes)} sizes ({', '.join(sizes)}): seeds, geometric mean")
    rung = sizes[result["rung"]]
    reach = [rung["flops"] * c["x_step"][0] for c in result["variants"].values()  # where the dotted lines end
             if c["x_step"][0] is not None and 0 < c["x_step"][0] < math.inf]
    lo, hi = min(cs + reach) / 1.15, max(cs + reach) * 1.15
    grid = [lo * (hi / lo) ** (k / 100) for k in range(101)]
    ax.plot(grid, [math.exp(fit["a"] - fit["alpha"] * math.log(c)) for c in grid], "-", color="black", lw=1,
            label=f"fit: L = {math.exp(fit['a']):.3g} C^{-fit['alpha']:+.4f}" + (" (does not fall: no X)"
                                                                                  if fit["alpha"] <= 0 else ""))
    through = rung["mean_log_loss"] + fit["alpha"] * math.log(rung["flops"])  # the fit's parallel through the rung
    ax.plot(grid, [math.exp(through - fit["alpha"] * math.log(c)) for c in grid], "--", color="black", lw=0.8,
            label=f"its parallel through {result['rung']}")
    for i, (v, c) in enumerate(result["variants"].items()):
        if not c["seeds"]:
            continue
        loss = math.exp(rung["mean_log_loss"] + statistics.fmean(c["log_gaps"].values()))  # paired with the rung
        x = c["x_step"][0]
        ax.plot([rung["flops"] * c["flops_per_token_ratio"]], [loss], "Dsv^<>"[i % 6], color=f"C{i}", mfc="none",
                mew=1.5, ms=7, label=f"{v} (n {len(c['seeds'])}): X " + ("-" if x is None else f"{x:.2f}") + " step-matched")
        if x is not None and 0 < x < math.inf:
            ax.plot([rung["flops"] * c["flops_per_token_ratio"], rung["flops"] * x], [loss, loss], ":", color=f"C{i}", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter  # matplotlib is there: pyplot() found it
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    ax.set_xlabel("training FLOPs (flops_per_token x tokens)", fontsize=8)
    ax.set_ylabel("val NLL, whole split")
    ax.legend(fontsize=6.5, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    write_figure(path, fig)
    return path


def main(argv=None):
    """The command line (run as a command through common.cli: a UserError is one `error:` line, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("design", help="the ladder's sweep file, e.g. experiments/configs/ladder_cpu.py")
    args = p.parse_args(argv)
    spec = load_sweep(args.design)
    for key in ("rung", "pairs"):
        if key not in spec:
            raise UserError(f"{args.design} must set {key} (see experiments/ladder.py)")
    if spec["rung"] not in spec["variants"]:
        raise UserError(f"{args.design}: rung {spec['rung']!r} is not one of the variants {list(spec['variants'])}")
    if not isinstance(spec["pairs"], dict) or not all(isinstance(v, list) for v in spec["pairs"].values()):
        raise UserError(f'{args.design}: pairs must be a dict {{"a sweep\'s out_dir": [variants]}}')
    spec.setdefault("level", 0.95)
    if not isinstance(spec["level"], float) or not 0 < spec["level"] < 1:
        raise UserError(f"{args.design}: level must be a number between 0 and 1, got {spec['level']!r}")
    result = read_off(spec)
    text = table(result)
    print(text)
    out = Path(spec["out_dir"])
    stale = out / "ladder.png"
    if out.is_dir() and not result["fit"] and stale.is_file():  # a picture of an older read-off would stand beside this one
        stale.unlink()
    # (an out_dir that is missing or a file: one warning line, as save_outputs says; it wrote nothing, silently)
    save_outputs(out, {"ladder.md": lambda p: write_atomic(p, (text + "\n").encode()),
                       "ladder.json": lambda p: write_atomic(p, (json.dumps(strict_json(result), indent=1) + "\n").encode()),
                       "ladder.png": lambda p: plot(result, p)}, "the read-off above is complete")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main))
