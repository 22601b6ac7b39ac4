"""
The statistics of a paired comparison (scipy.stats for the t distribution):

    paired_t(d)          Student's t of paired differences d (one per seed): its mean, sd, two-sided p, 95% interval
    holm(ps)             Holm-Bonferroni adjusted p-values across a family of tests
    gated_holm(ps, gated, alpha)
                         Holm across primary tests, with gated tests (a variant against its control) that take the
                         level their primary test frees once it rejects
    tost(d, margin)      equivalence: two one-sided paired t-tests against -margin and +margin

A variant is compared with a reference on the same seeds (same initial weights, same batches), so the differences
d_s = loss(variant, s) - loss(reference, s) are the data; seed noise common to both cancels in them.
"""

import math
import statistics
from fractions import Fraction

from scipy import stats


def paired_t(d, confidence=0.95):
    """Student's paired t-test of the differences d: dict n, mean, sd, t, p (two-sided) and the `confidence`
    interval (lo, hi) of the mean. With n < 2 there is no test (nan); with sd = 0, t is 0 (mean 0) or infinite."""
    n = len(d)
    mean = statistics.fmean(d) if d else math.nan
    if n < 2:
        return dict(n=n, mean=mean, sd=math.nan, t=math.nan, p=math.nan, lo=math.nan, hi=math.nan)
    sd = statistics.stdev(d)
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * se
    return dict(n=n, mean=mean, sd=sd, t=t, p=float(2 * stats.t.sf(abs(t), n - 1)), lo=mean - half, hi=mean + half)


def holm(ps):
    """Holm-Bonferroni adjusted p-values, in the order given: the i-th smallest of m p-values is
    multiplied by m - i + 1 (i from 1), then made non-decreasing in that order and capped at 1.
    Rejecting where the adjusted p is below alpha keeps the family-wise error rate at alpha. nan
    (no test) stays nan and does not count in m."""
    order = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    m, adjusted, running = len(order), [math.nan] * len(ps), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def graph_procedure(ps, weights, graph, alpha=0.05):
    """The sequentially rejective graphical procedure of Bretz, Maurer, Brannath and Posch (2009) on
    weighted Bonferroni tests. Hypothesis i starts with level weights[i] * alpha (the weights sum to at
    most 1); when it is rejected, its weight moves along graph[i] (graph[i][k]: the share that goes to
    k, a row sums to at most 1) and the graph is updated so that it stays a valid path between the
    rest. The family-wise error rate is at most alpha, in the strong sense. Returns (adjusted, local):
      adjusted[i]  the smallest alpha at which i is rejected (the adjusted p-value, Bretz et al. 2011:
                   reject i at alpha exactly where adjusted[i] <= alpha);
      local[i]     the weight i is finally tested with at this alpha: the weight it was rejected at, or
                   the one it holds when the procedure stops; i is rejected iff local[i] > 0 and
                   ps[i] / local[i] <= alpha, so an interval at level 1 - local[i] * alpha excludes 0
                   exactly when i is rejected.
    No p may be nan (leave a missing test out, or give it p = 1). Weights and graph may be Fractions:
    then p / w is p times an exact 1 / w, and the procedure with equal weights is Holm's to the bit."""
    def ratio(p, w):
        return p * (1 / w) if w > 0 else math.inf

    def run(level):
        """(the order of the rejections with each one's weight, the weights when no more rejects)."""
        w, g, left, steps = list(weights), [list(row) for row in graph], set(range(len(ps))), []
        while left:
            j = min(left, key=lambda i: ratio(ps[i], w[i]))
            if level is not None and not ratio(ps[j], w[j]) <= level:
                break
            steps.append((j, w[j]))
            left.discard(j)
            for k in left:
                w[k] += w[j] * g[j][k]
            g = [[0.0 if k == i or i == j or k == j else
                  (g[i][k] + g[i][j] * g[j][k]) / (1 - g[i][j] * g[j][i]) if g[i][j] * g[j][i] < 1 else 0.0
                  for k in range(len(ps))] for i in range(len(ps))]
        return steps, w

    adjusted, running = [math.nan] * len(ps), 0.0
    for j, wj in run(None)[0]:  # every hypothesis, in the order the procedure would reject them
        running = max(running, min(1.0, ratio(ps[j], wj)))
        adjusted[j] = running
    steps, w = run(alpha)
    local = list(w)
    for j, wj in steps:
        local[j] = wj
    return adjusted, [float(x) for x in local]


def gated_holm(ps, gated, alpha=0.05):
    """Holm across the primary p-values ps, with gated tests: gated {i: p} is a test (a variant against
    its parameter-matched control) asked only once primary i rejects. Each primary starts at alpha / m;
    a rejected primary passes its level to its gated test if it has one, else equally to the other
    primaries; a rejected gated test passes its level equally to the other primaries (a graphical
    procedure, see graph_procedure: the family-wise error rate over all of them is at most alpha).
    Without gated tests it is Holm's procedure exactly. nan (no test) is left out, as holm() does.
    Returns (adjusted, local) for the primaries then adjusted, local for the gated ones, as dicts:
    ({"primary": [...], "gated": {i: ...}} for each)."""
    live = [i for i, p in enumerate(ps) if not math.isnan(p)]
    gates = {i: p for i, p in gated.items() if i in live and not math.isnan(p)}
    nodes = live + [("gate", i) for i in gates]  # primaries first, then the gated tests
    at = {node: n for n, node in enumerate(nodes)}
    m = len(live)
    out_adj = {"primary": [math.nan] * len(ps), "gated": {}}
    out_local = {"primary": [math.nan] * len(ps), "gated": {}}
    if not m:
        return out_adj, out_local
    weights = [Fraction(1, m)] * m + [Fraction(0)] * len(gates)  # exact: equal weights give Holm to the bit
    graph = [[Fraction(0)] * len(nodes) for _ in nodes]
    for i in live:
        others = [at[k] for k in live if k != i]
        if i in gates:
            graph[at[i]][at[("gate", i)]] = Fraction(1)
        for k in others:
            if i not in gates:
                graph[at[i]][k] = Fraction(1, len(others))
            if i in gates:
                graph[at[("gate", i)]][k] = Fraction(1, len(others))
    flat = [ps[i] for i in live] + list(gates.values())
    adjusted, local = graph_procedure(flat, weights, graph, alpha)
    for node, a, w in zip(nodes, adjusted, local):
        if isinstance(node, tuple):
            out_adj["gated"][node[1]], out_local["gated"][node[1]] = a, w
        else:
            out_adj["primary"][node], out_local["primary"][node] = a, w
    return out_adj, out_local


def tost(d, margin):
    """Equivalence of paired differences d within +-margin: Schuirmann's two one-sided t-tests (1987); the p-value
    is the larger of the two, <= alpha exactly where the (1 - 2 alpha) t interval lies inside (-margin, +margin).
    With n < 2 there is no test (nan); with sd = 0 it is 0 inside the margin and 1 outside."""
    n = len(d)
    if n < 2:
        return math.nan
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(n)
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    return float(max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1)))
