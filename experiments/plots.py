"""
The plots of a sweep's report (experiments/report.py): the forest of its comparisons and the paired gap over
training. Each reads the report's tests and gaps; None where there is nothing to draw or no matplotlib.
"""

import math

from experiments.stats import t_quantile
from tools import pyplot, write_figure

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
                  "blue / orange: the family / its controls, interval at the level the procedure\n"
                  "tested it at (the test's acceptance region, not a simultaneous interval)\n"
                  "grey: exploratory, uncorrected 95% interval; filled: the interval excludes 0", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    write_figure(path, fig)
    return path


def gap_cells(panels):
    """The panels of the gap plot: (baseline, variant, that baseline's gaps) for each highlighted variant
    with gaps, baselines in order and each baseline's variants in the order given."""
    return [(b, v, gaps) for b, (gaps, highlight) in panels.items() for v in highlight if gaps.get(v)]


def plot_gaps(panels, path):
    """The mean paired gap over training as small multiples ({baseline: (gaps, highlighted variants)}):
    one panel per highlighted comparison (the primary family's, in declared order) with its pointwise
    paired 95% band, on one shared y axis; the same baseline's other comparisons as faint grey lines
    behind it, for context."""
    cells = gap_cells(panels)
    if not cells:
        return None
    plt = pyplot()
    if plt is None:
        return None
    ncols = min(4, len(cells))
    nrows = math.ceil(len(cells) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 2.7 * nrows + 0.6), sharex=True, sharey=True,
                             squeeze=False)
    palette = [c for j, c in enumerate(plt.get_cmap("tab10").colors) if j != 7]  # tab10 without its grey
    for i, (ax, (baseline, variant, gaps)) in enumerate(zip(axes.flat, cells)):
        for other, g in gaps.items():
            if other != variant:
                steps = sorted(g)
                ax.plot(steps, [g[s][0] for s in steps], color="0.8", lw=0.6, zorder=1)
        g, color = gaps[variant], palette[i % len(palette)]
        steps = sorted(g)
        band = [s for s in steps if not undefined(g[s][3])]
        ax.fill_between(band, [g[s][3] for s in band], [g[s][4] for s in band], color=color, alpha=0.2, lw=0, zorder=2)
        ax.plot(steps, [g[s][0] for s in steps], color=color, marker=".", zorder=3)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"{variant} − {baseline}", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for k, ax in enumerate(axes.flat[:len(cells)]):
        if k + ncols >= len(cells):  # the lowest panel of its column: its steps and label show
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("paired Δ NLL (nats)")
    fig.suptitle("paired gap over training on the validation prefix each run evaluates (< 0: the first is better); "
                 "band: pointwise paired 95% t interval; grey: the same baseline's other comparisons", fontsize=8)
    fig.tight_layout()
    write_figure(path, fig)
    return path
