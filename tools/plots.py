"""
The plots of a sweep's report (tools/report.py): the forest of its comparisons and the paired gap over
training. Each reads the report's tests and gaps; None where there is nothing to draw or no matplotlib.
"""

import math

from tools.diagnose import pyplot
from tools.stats import t_quantile

SHORT = {"val": "val (whole)", "test": "test (whole)", "val_prefix": "val prefix", "test_prefix": "test prefix"}


def undefined(x):
    """None, or a float nan: a number a comparison does not have (one seed, no test)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def forest_interval(c):
    """A comparison's interval in the forest plot and whether its marker is filled, one meaning for both:
    a family test's interval is at the level the procedure finally tested it at (1 - c["level"]), so it
    excludes 0 exactly when the test rejects (an acceptance region, not a simultaneous confidence
    interval for a stepwise procedure); an exploratory one's is the uncorrected 95% interval. The
    marker is filled when the interval excludes 0. (lo, hi, filled); None for a gate that stayed shut."""
    if c["kind"] in ("primary", "control") and c["rejected"] is None:
        return None
    n, sd = c["paired_seeds"], c["delta_std"]
    if c["kind"] == "exploratory" or undefined(sd):
        lo, hi = c["ci95"]
    else:
        half = sd / math.sqrt(n) * t_quantile(1 - c["level"] / 2, n - 1) if c["level"] > 0 else math.inf
        lo, hi = c["delta_mean"] - half, c["delta_mean"] + half
    return lo, hi, not undefined(lo) and (lo > 0 or hi < 0)


def plot_forest(ts, score, path):
    """Each comparison's paired Δ with its interval (forest_interval), the family first (in declared
    order, each control under its variant) in colour, then the exploratory ones in grey; a gate that
    stayed shut is a hollow grey marker without an interval."""
    rows = [c for c in ts if c["kind"] in ("primary", "control")]
    rows = [x for c in rows if c["kind"] == "primary" for x in [c] + [g for g in rows if g["kind"] == "control"
                                                                      and g["variant"] == c["variant"]]]
    rows += [c for c in ts if c["kind"] == "exploratory"]
    rows = [c for c in rows if c["paired_seeds"]]
    if not rows:
        return None
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.3 * len(rows) + 1.5))
    for y, c in enumerate(rows):
        color = {"primary": "tab:blue", "control": "tab:orange"}.get(c["kind"], "0.55")
        if (interval := forest_interval(c)) is None:
            ax.plot(c["delta_mean"], y, "o", color="0.55", mfc="white")
            continue
        lo, hi, filled = interval
        if not undefined(lo):
            ax.plot([lo, hi], [y, y], color=color, lw=1.5)
        ax.plot(c["delta_mean"], y, "o", color=color, mfc=color if filled else "white")
    ax.axvline(0, color="grey", lw=0.8)
    labels = [f"{c['variant']} − {c['baseline']}" + {"control": " (control)", "exploratory": " (exploratory)"}.get(c["kind"], "")
              for c in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"paired Δ NLL on {SHORT[score]} (nats; < 0: the first is better), mean over seeds\n"
                  "blue/orange: the family and its controls, interval at the level the procedure tested it at\n"
                  "(the test's acceptance region, not a simultaneous interval); grey: exploratory, uncorrected 95%;\n"
                  "filled: the interval excludes 0", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gaps(panels, path):
    """The mean paired gap over training, one panel per baseline ({baseline: (gaps, highlighted variants)}):
    the highlighted variants (the primary family's) in their own colours with their paired 95% band, the
    rest thin grey lines."""
    panels = {b: (g, hi) for b, (g, hi) in panels.items() if any(g.values())}
    if not panels:
        return None
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    palette = plt.get_cmap("tab10").colors
    for ax, (baseline, (gaps, highlight)) in zip(axes[0], panels.items()):
        for variant, g in gaps.items():
            steps = sorted(g)
            if variant not in highlight:
                ax.plot(steps, [g[s][0] for s in steps], color="0.7", lw=0.8, zorder=1)
        for i, variant in enumerate(v for v in highlight if gaps.get(v)):
            g, color = gaps[variant], palette[i % len(palette)]
            steps = sorted(g)
            ax.plot(steps, [g[s][0] for s in steps], color=color, marker=".", label=variant, zorder=3)
            band = [s for s in steps if not undefined(g[s][3])]
            ax.fill_between(band, [g[s][3] for s in band], [g[s][4] for s in band], color=color, alpha=0.15, lw=0)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"paired Δ val NLL vs {baseline} (nats, val prefix)")
        ax.set_title(f"vs {baseline}: coloured with pointwise paired 95% bands; grey: the rest", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
