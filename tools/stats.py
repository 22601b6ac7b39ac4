"""
The statistics of a paired comparison, in plain Python (no SciPy):

    paired_t(d)          Student's t of paired differences d (one per seed): mean / (sd / sqrt(n)),
                         its degrees of freedom n - 1 and two-sided p-value
    t_quantile(q, df)    the q-quantile of Student's t, for confidence intervals
    holm(ps)             Holm-Bonferroni adjusted p-values across a family of tests
    sign_flip_p(d)       the exact paired permutation (sign-flip) p-value: no normality assumed
    detectable(sd, n)    the smallest mean difference a paired t-test detects with 80% power

A variant is compared with a reference on the same seeds (same initial weights, same batches), so
the differences d_s = loss(variant, s) - loss(reference, s) are the data; seed noise common to both
cancels in them.
"""

import math
import statistics


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
    noncentral t, slightly optimistic at small n). A family corrected by Holm tests its first
    hypothesis at alpha / m: pass that level for a corrected design."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)
