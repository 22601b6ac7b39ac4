"""
The compute multiplier of experiments/robust.py: the reference's loss against training compute, fitted to a
ladder of its runs at several lengths, and "the reference needs X times the compute" to reach a
variant's loss, with a bootstrap interval over the seeds. Plain Python, no torch: experiments/tests/test_robust.py
checks it on synthetic ladders with known answers.
"""

import math
import random
import statistics


def fit_ladder(C, L, kind="loglinear"):
    """The reference's loss against training compute, fitted to the ladder's points (C FLOPs, L loss):

    "loglinear" (the default): log L = a - alpha log C, i.e. L = A C^-alpha (a power law without a floor).
        Two parameters, a straight line in log-log, least squares on log L.
    "power": L = E + A C^-alpha, least squares on L (alpha profiled: for a fixed alpha, E and A are a
        linear fit; alpha by a grid then golden-section search on log alpha).

    Why log-linear by default: the CPU ladder is 4 lengths over a 3x range of compute. A 3-parameter law
    on 4 points leaves 1 degree of freedom, and over a 3x range E and alpha trade off almost perfectly
    (a higher floor with a steeper exponent bends the curve by less than the seed noise), so the fitted
    E, and every multiplier read off the curve beyond the ladder, would follow that trade-off rather
    than the data, and its bootstrap would be dominated by it. Log-linear is the 2-parameter local law:
    exact when E = 0, and within the ladder's range the two agree to well under the seed noise. Its
    bias is known: with a real floor E > 0 the true curve is convex in log-log, so the fitted line lies
    below it outside the ladder and reaches a given loss at less compute than the true curve would:
    extrapolated multipliers are then too small, not too large. A multiplier whose C* falls outside the
    ladder's compute is marked as extrapolated. "power" is there for longer ladders (at least 4 lengths
    required; it takes a decade of compute or more to pin E).

    C is normalised by its geometric mean c0 for the arithmetic. Returns dict(kind, E, A, alpha, c0,
    A_norm: A for C / c0, range: [min C, max C], rms: the residuals' root mean square, residuals)."""
    if len(C) < 2 or len(C) != len(L):
        raise ValueError("a ladder needs at least 2 points")
    c0 = math.exp(statistics.fmean(math.log(c) for c in C))
    x = [math.log(c / c0) for c in C]
    if kind == "loglinear":
        y = [math.log(v) for v in L]
        mx, my = statistics.fmean(x), statistics.fmean(y)
        sxx = sum((a - mx) ** 2 for a in x)
        if sxx == 0:
            raise ValueError("a ladder needs at least 2 distinct compute values")
        b = sum((a - mx) * (c - my) for a, c in zip(x, y)) / sxx
        E, alpha, A_norm = 0.0, -b, math.exp(my - b * mx)
    elif kind == "power":
        if len(C) < 4:
            raise ValueError("the power law has 3 parameters: at least 4 points")

        def linear(al):  # E, A and the squared error of L = E + A (C/c0)^-al
            z = [math.exp(-al * a) for a in x]
            mz, ml = statistics.fmean(z), statistics.fmean(L)
            szz = sum((a - mz) ** 2 for a in z)
            A = sum((a - mz) * (b - ml) for a, b in zip(z, L)) / szz if szz > 0 else 0.0
            E = ml - A * mz
            return E, A, sum((E + A * a - b) ** 2 for a, b in zip(z, L))

        grid = [math.exp(math.log(1e-3) + i * (math.log(10.0) - math.log(1e-3)) / 120) for i in range(121)]
        sse = [linear(a)[2] for a in grid]
        i = min(range(len(grid)), key=sse.__getitem__)
        lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
        g = (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = linear(math.exp(a))[2], linear(math.exp(b))[2]
        for _ in range(200):
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = linear(math.exp(a))[2]
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = linear(math.exp(b))[2]
        alpha = math.exp((lo + hi) / 2)
        E, A_norm, _ = linear(alpha)
    else:
        raise ValueError(f"fit must be loglinear or power, got {kind!r}")
    fit = dict(kind=kind, E=E, A_norm=A_norm, alpha=alpha, c0=c0, A=A_norm * c0 ** alpha, range=[min(C), max(C)])
    fit["residuals"] = [v - predict(fit, c) for c, v in zip(C, L)]
    fit["rms"] = math.sqrt(statistics.fmean(r * r for r in fit["residuals"]))
    return fit


def predict(fit, C):
    return fit["E"] + fit["A_norm"] * (C / fit["c0"]) ** -fit["alpha"]


def inside(fit, C):
    """Whether compute C lies within the ladder's (to rounding): a read-off there is no extrapolation."""
    lo, hi = fit["range"]
    return lo * (1 - 1e-9) <= C <= hi * (1 + 1e-9)


def inverse(fit, loss):
    """The compute at which the fit reaches `loss`: math.inf when the loss is at or below the floor E
    (never reached), None when the fit does not fall with compute (alpha or A not positive)."""
    if fit["alpha"] <= 0 or fit["A_norm"] <= 0:
        return None
    if loss <= fit["E"]:
        return math.inf
    return fit["c0"] * ((loss - fit["E"]) / fit["A_norm"]) ** (-1 / fit["alpha"])


def multiple(ladder, variant, kind):
    """The compute multiplier of one variant's runs against the reference's ladder, from per-seed data
    on the same seeds: ladder {length: {seed: (flops, loss)}}, variant {seed: (flops, loss, flops at the
    same tokens for the reference)}. The ladder's points are the mean over the seeds at each length;
    the variant's loss is its mean. Returns (X FLOP-matched, X step-matched, the reference's compute C*)
    with None where the fit cannot be inverted; X = C* / the variant's compute, and C* / the reference's
    compute at the variant's tokens."""
    C = [statistics.fmean(f for f, _ in pts.values()) for pts in ladder.values()]
    L = [statistics.fmean(x for _, x in pts.values()) for pts in ladder.values()]
    fit = fit_ladder(C, L, kind)
    c_star = inverse(fit, statistics.fmean(x for _, x, _ in variant.values()))
    if c_star is None:
        return None, None, None, fit
    c_var = statistics.fmean(f for f, _, _ in variant.values())
    c_ref = statistics.fmean(r for _, _, r in variant.values())
    return c_star / c_var, c_star / c_ref, c_star, fit


def percentile(xs, q):
    """The q-quantile (0..1) of xs, linear between order statistics (numpy's default); inf allowed."""
    xs = sorted(xs)
    h = (len(xs) - 1) * q
    lo, hi = math.floor(h), math.ceil(h)
    if xs[lo] == xs[hi]:
        return xs[lo]
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def bootstrap(ladder, variant, kind, resamples=2000, seed=0, level=0.95):
    """Percentile interval of the multipliers over resampled seeds: each resample draws len(seeds) seed
    indices with replacement (random.Random(seed)), the same draw for the ladder and the variant (the
    pairing). Returns dict(flops=[lo, hi], steps=[lo, hi], undefined: resamples whose fit could not be
    inverted, left out; inf counts as a value: the loss is below the fit's floor)."""
    seeds = sorted(variant)
    rng = random.Random(seed)
    xf, xs, undefined, seen = [], [], 0, {}
    for _ in range(resamples):
        draw = tuple(sorted(seeds[rng.randrange(len(seeds))] for _ in seeds))  # means ignore the order
        if draw not in seen:  # 3 seeds have 10 distinct draws: fit each once
            lad = {n: {i: pts[s] for i, s in enumerate(draw)} for n, pts in ladder.items()}
            seen[draw] = multiple(lad, {i: variant[s] for i, s in enumerate(draw)}, kind)
        f, st, _, _ = seen[draw]
        if f is None:
            undefined += 1
            continue
        xf.append(f)
        xs.append(st)
    tail = (1 - level) / 2

    def iv(v):
        return [percentile(v, tail), percentile(v, 1 - tail)] if v else [None, None]
    return dict(flops=iv(xf), steps=iv(xs), undefined=undefined, resamples=resamples)
