"""
The statistics of a paired comparison, in plain Python (no SciPy):

    paired_t(d)          Student's t of paired differences d (one per seed): mean / (sd / sqrt(n)),
                         its degrees of freedom n - 1 and two-sided p-value
    t_quantile(q, df)    the q-quantile of Student's t, for confidence intervals
    holm(ps)             Holm-Bonferroni adjusted p-values across a family of tests
    gated_holm(ps, gated, alpha)
                         Holm across primary tests, with gated tests (a variant against its control)
                         that take the level their primary test frees once it rejects
    sign_flip_p(d)       the exact paired permutation (sign-flip) p-value: no normality assumed
    tost(d, margin)      equivalence: two one-sided paired t-tests against -margin and +margin
    detectable(sd, n)    the smallest mean difference a paired t-test detects with 80% power

A variant is compared with a reference on the same seeds (same initial weights, same batches), so
the differences d_s = loss(variant, s) - loss(reference, s) are the data; seed noise common to both
cancels in them.
"""

import functools
import math
import statistics
from fractions import Fraction


def _betacf(a, b, x):
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1 + aa * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < eps:
            break
    return h


def betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    if math.isnan(t):
        return 1.0
    if math.isinf(t):
        return 0.0
    return betainc(df / 2, 0.5, df / (df + t * t))


@functools.cache  # every interval of a simulation asks for the same few quantiles
def t_quantile(q, df):
    """The q-quantile of Student's t with df degrees of freedom (bisection on the distribution)."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1 - q, df)
    target = 2 * (1 - q)  # two-sided tail of the positive quantile
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return (lo + hi) / 2


def paired_t(d, confidence=0.95):
    """Student's paired t-test of the differences d (a list, one per seed). Returns a dict: n, mean,
    sd, t, df, p (two-sided) and the `confidence` interval (lo, hi) of the mean difference. With n < 2
    there is no test (t, p and the interval are nan); with sd = 0, t is 0 (mean 0) or infinite."""
    n = len(d)
    mean = statistics.fmean(d) if d else math.nan
    if n < 2:
        return dict(n=n, mean=mean, sd=math.nan, t=math.nan, df=0, p=math.nan, lo=math.nan, hi=math.nan)
    sd = statistics.stdev(d)
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    half = t_quantile(0.5 + confidence / 2, n - 1) * se
    return dict(n=n, mean=mean, sd=sd, t=t, df=n - 1, p=t_two_sided_p(t, n - 1), lo=mean - half, hi=mean + half)


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


def t_upper_p(t, df):
    """P(T >= t) for Student's t with df degrees of freedom: a one-sided p-value."""
    if math.isnan(t):
        return 1.0
    half = t_two_sided_p(t, df) / 2
    return half if t >= 0 else 1 - half


def tost(d, margin):
    """Equivalence of paired differences d within +-margin: Schuirmann's two one-sided t-tests (1987),
    H0: mean <= -margin (t = (mean + margin) / se, upper tail) and H0: mean >= +margin (t = (mean -
    margin) / se, lower tail); the p-value is the larger of the two. It is <= alpha exactly when the
    (1 - 2 alpha) t interval of the mean lies inside (-margin, +margin). With n < 2 there is no test
    (nan); with sd = 0 it is 0 inside the margin and 1 outside."""
    n = len(d)
    if n < 2:
        return math.nan
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(n)
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    return max(t_upper_p((mean + margin) / se, n - 1), t_upper_p(-(mean - margin) / se, n - 1))


def sign_flip_p(d):
    """The exact two-sided sign-flip p-value of paired differences d: under "no difference" each d_s
    is as likely to have either sign, so the p-value is the share of the 2^n sign patterns whose
    |mean| is at least the observed one. It assumes symmetry, not normality; with n seeds it cannot
    go below 2 / 2^n (0.0625 at n = 5)."""
    n = len(d)
    if n == 0:
        return math.nan
    observed = abs(sum(d)) * (1 - 1e-12)  # ties count as at least as extreme, whatever the rounding
    hits = sum(abs(sum(x if mask >> i & 1 else -x for i, x in enumerate(d))) >= observed for mask in range(2 ** n))
    return hits / 2 ** n


def detectable(sd, n, alpha=0.05, power=0.8):
    """The smallest true mean difference that a two-sided paired t-test at level `alpha` detects
    with probability `power`, given the differences' sd over n seeds: (t_{1-alpha/2} + t_{power})
    sd / sqrt(n), both quantiles with n - 1 degrees of freedom (the usual approximation of the
    noncentral t, optimistic at few seeds: at n = 5 the power at this difference is 0.79 at alpha 0.05
    and 0.74 at 0.05 / 8, by simulation; and sd is itself estimated from those few seeds). A family
    corrected by Holm tests its first hypothesis at alpha / m: pass that level for a corrected design."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)
