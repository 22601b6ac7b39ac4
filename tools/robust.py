"""
Does the advantage hold? Learning rate, training length and compute, from one design file.

    python -m tools.robust configs/robust_cpu.py                  # every stage, then the report
    python -m tools.robust configs/robust_cpu.py --stage tune     # one stage: tune | compare | best
    python -m tools.robust configs/robust_cpu.py --list           # every run of every stage, finished or not
    python -m tools.robust configs/robust_cpu.py --table_only [--out_dir DIR]   # the report alone
    python -m tools.robust configs/robust_gpu.py --launcher "torchrun --standalone --nproc_per_node=8"

A design file is Python, like a sweep file (tools/sweep.py), and sets:
    base          a train.py config file: the recipe (its lr, min_lr and length, with `overrides` applied)
    variants      {name: "key=value ..."}: the residual variants; their overrides may not set lr, min_lr,
                  max_steps or max_tokens (the design's axes); names may not contain "--"
    reference     the variant the others are compared with, and the one the ladder trains
    lrs           the learning-rate grid, e.g. [1.5e-3, 3e-3, 6e-3]; must hold the recipe's lr
    tuning_seeds  the seeds the lr is chosen on, e.g. [100, 101]
    seeds         the comparison's seeds, e.g. [0, 1, 2]; disjoint from tuning_seeds
    steps         lengths (optimizer steps) every variant trains at, e.g. [400, 1200]; must hold the
                  recipe's own length
    ladder        the reference's lengths for the compute fit, e.g. [400, 600, 800, 1200] (>= 2)
    overrides     (optional) "key=value ..." for every run
    out_dir       (optional) where runs, and the report, go; default runs/<design file name>
    fit           (optional) "loglinear" (default) or "power": the ladder's curve (see fit_ladder)
    min_lr_ratio  (optional, 0.1) an lr-grid run at lr x ends its cosine at min_lr = x * min_lr_ratio
    bench         (optional) a tools.bench JSON file measured at the design's model size: the only
                  source of wall-clock ratios (never one run's own time)
    bootstrap     (optional, 2000) resamples of the comparison seeds; bootstrap_seed (optional, 0)

Every run is a plain sweep run, out_dir/<name>/seed<s>, named:
    <variant>                the recipe (its lr, min_lr, length)
    <variant>--lr<x:g>       the recipe at lr=x, min_lr=x*min_lr_ratio (e.g. standard--lr0.0015)
    <variant>--steps<n>      the recipe with max_steps=n: its own warmup and cosine, ending at step n
Stages (each a sweep through tools.sweep's run_all: finished runs are skipped, interrupted ones resumed,
and several processes may share a design as they share a sweep):
    tune     every variant at every lr of the grid, on the tuning seeds, at the recipe's length
    compare  every variant at every length of `steps` and the reference at every length of `ladder`,
             at the recipe's lr, on the comparison seeds
    best     each variant whose best lr (chosen on the tuning seeds alone) is not the recipe's, at that
             lr on the comparison seeds (runs only for variants whose tuning runs have all finished)
Before any run, the design is checked and every run's overrides are read as train.py reads them: a bad
design is one `error:` line, exit status 1.

The report (robust.md, robust.json, loss_vs_flops.png in out_dir; run paths relative to out_dir):
    a. the lr x variant table on the tuning seeds, the best lr per variant, and the ranking of the
       variants at the shared lr and at each one's own best lr; then the comparison at the best lrs on
       the comparison seeds (or the runs it still needs)
    b. the paired gap to the reference at each length of `steps`, each at its own schedule's end
    c. the compute multiplier: "the reference needs X times the compute" (FLOP-matched: the variant
       charged its own FLOPs per token) and X in steps (step-matched: the same tokens), with a
       bootstrap interval over the comparison seeds, and the loss-vs-FLOPs plot
    d. wall-clock, only as the bench file's measured speed ratios
Scores are the runs' summary.json val_loss: whatever chunk the runs evaluate (the report states the
eval_tokens it read from their config.json).
"""

import argparse
import json
import math
import random
import shlex
import statistics
from pathlib import Path

import torch

from depthres.config import parse_config, total_steps
from model import GPT, GPTConfig
from tools import sweep
from tools.diagnose import pyplot
from tools.stats import holm, paired_t

ROOT = Path(__file__).resolve().parent.parent
AXES = ("lr", "min_lr", "max_steps", "max_tokens")  # keys the design sets per run; a variant may not
STAGES = ("tune", "compare", "best")


# --- the design ---------------------------------------------------------------------------------------

def _whole(x):
    return isinstance(x, int) and not isinstance(x, bool)


def load_design(path, out_dir=None):
    """The design file's settings, each checked, with the recipe it implies (lr, min_lr, length): a bad
    design is one `error:` line (SystemExit) before any run."""
    def fail(message):
        raise SystemExit(f"error: design file {path}: {message}")

    d = sweep.read_settings(path, "design file")
    missing = [k for k in ("base", "variants", "reference", "lrs", "tuning_seeds", "seeds", "steps", "ladder")
               if k not in d]
    if missing:
        fail(f"must set {', '.join(missing)}")
    if not isinstance(d["variants"], dict) or not d["variants"] or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in d["variants"].items()):
        fail('variants must be a non-empty dict of {name: "key=value ..."} strings')
    for name, ov in d["variants"].items():
        if not name or "--" in name or "/" in name or "\\" in name or name.startswith("."):
            fail(f"variant name {name!r}: a plain directory name without '--' (run names add --lr<x>, --steps<n>)")
        try:
            keys = [kv.partition("=")[0] for kv in shlex.split(ov)]
        except ValueError as e:
            fail(f"variant {name!r} ({ov!r}): {e}")
        if set(keys) & set(AXES):
            fail(f"variant {name!r} sets {', '.join(sorted(set(keys) & set(AXES)))}: the design sets lr, min_lr "
                 "and the length of every run (lrs, steps, ladder)")
    if d["reference"] not in d["variants"]:
        fail(f"reference {d['reference']!r} is not one of the variants {list(d['variants'])}")
    for key in ("tuning_seeds", "seeds"):
        s = d[key]
        if not isinstance(s, (list, tuple)) or not s or not all(_whole(x) and x >= 0 for x in s) or len(set(s)) < len(s):
            fail(f"{key} must be a non-empty list of distinct whole numbers >= 0")
    if set(d["tuning_seeds"]) & set(d["seeds"]):
        fail(f"tuning_seeds and seeds share {sorted(set(d['tuning_seeds']) & set(d['seeds']))}: the lr is chosen on "
             "seeds the comparison never uses")
    lrs = d["lrs"]
    if not isinstance(lrs, (list, tuple)) or not lrs or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in lrs):
        fail("lrs must be a non-empty list of positive numbers")
    if len({f"{x:g}" for x in lrs}) < len(lrs):
        fail(f"lrs {list(lrs)} holds the same lr twice (as run names write it, {{lr:g}})")
    for key, least in (("steps", 1), ("ladder", 2)):
        s = d[key]
        if not isinstance(s, (list, tuple)) or len(s) < least or not all(_whole(x) and x > 0 for x in s) \
                or len(set(s)) < len(s):
            fail(f"{key} must be a list of at least {least} distinct positive whole numbers of steps")
    d.setdefault("fit", "loglinear")
    if d["fit"] not in ("loglinear", "power"):
        fail(f"fit must be 'loglinear' or 'power', got {d['fit']!r}")
    if d["fit"] == "power" and len(d["ladder"]) < 4:
        fail("fit = 'power' has 3 parameters: the ladder needs at least 4 lengths")
    d.setdefault("min_lr_ratio", 0.1)
    if not isinstance(d["min_lr_ratio"], (int, float)) or not 0 <= d["min_lr_ratio"] <= 1:
        fail("min_lr_ratio must be a number in [0, 1]")
    d.setdefault("bootstrap", 2000)
    d.setdefault("bootstrap_seed", 0)
    if not _whole(d["bootstrap"]) or d["bootstrap"] < 1 or not _whole(d["bootstrap_seed"]):
        fail("bootstrap must be a whole number >= 1, bootstrap_seed a whole number")
    d.setdefault("overrides", "")
    if not isinstance(d["overrides"], str):
        fail('overrides must be a "key=value ..." string')
    d.setdefault("bench", None)
    if d["bench"] is not None and not bench_path(d["bench"]).is_file():
        fail(f"bench file {d['bench']} not found")
    d["out_dir"] = str(out_dir or d.get("out_dir") or Path("runs") / Path(path).stem)
    try:
        tc, _ = parse_config([d["base"], *(f"--{kv}" for kv in shlex.split(d["overrides"]))])
    except ValueError as e:  # ConfigError, or shlex's unterminated quote
        fail(f"base {d['base']!r} with overrides {d['overrides']!r}: {e}")
    d["recipe"] = dict(lr=tc.lr, min_lr=tc.min_lr, steps=total_steps(tc), batch_tokens=tc.batch_tokens)
    if not any(f"{x:g}" == f"{tc.lr:g}" for x in lrs):
        fail(f"lrs {list(lrs)} must hold the recipe's lr {tc.lr:g} (the shared lr every other stage uses)")
    if d["recipe"]["steps"] not in d["steps"]:
        fail(f"steps {list(d['steps'])} must hold the recipe's length {d['recipe']['steps']} (the lr grid's)")
    return d


def bench_path(p):
    p = Path(p)
    return p if p.is_absolute() or p.exists() else ROOT / p


def lr_name(design, variant, lr):
    return variant if f"{lr:g}" == f"{design['recipe']['lr']:g}" else f"{variant}--lr{lr:g}"


def steps_name(design, variant, n):
    return variant if n == design["recipe"]["steps"] else f"{variant}--steps{n}"


def lr_run(design, variant, lr):
    """(name, overrides) of `variant` at lr (the recipe itself at the recipe's lr)."""
    ov = design["variants"][variant]
    if lr_name(design, variant, lr) == variant:
        return variant, ov
    return lr_name(design, variant, lr), f"{ov} lr={lr:g} min_lr={lr * design['min_lr_ratio']:g}".strip()


def steps_run(design, variant, n):
    ov = design["variants"][variant]
    if n == design["recipe"]["steps"]:
        return variant, ov
    return steps_name(design, variant, n), f"{ov} max_steps={n}".strip()


def lengths(design, variant):
    """The lengths `variant` trains at on the comparison seeds: `steps`, and the ladder for the reference."""
    own = set(design["steps"]) | (set(design["ladder"]) if variant == design["reference"] else set())
    return sorted(own)


def _spec(design, runs, seeds):
    return dict(base=design["base"], variants=dict(runs), seeds=list(seeds), reference=next(iter(runs)),
                overrides=design["overrides"], out_dir=design["out_dir"], controls={})


def stage_spec(design, stage, best=None):
    """A stage as a plain sweep spec (tools.sweep): its runs' names and overrides, and its seeds. `best`
    ({variant: lr}) names the best-lr runs; a variant without an entry has none yet."""
    if stage == "tune":
        runs = [lr_run(design, v, lr) for v in design["variants"] for lr in design["lrs"]]
        return _spec(design, runs, design["tuning_seeds"])
    if stage == "compare":  # shortest first, so a partial design already holds every variant at one length
        runs = [steps_run(design, v, n) for n in sorted(set(design["steps"]) | set(design["ladder"]))
                for v in design["variants"] if n in lengths(design, v)]
        return _spec(design, runs, design["seeds"])
    if stage == "best":
        runs = [lr_run(design, v, lr) for v, lr in (best or {}).items()
                if lr is not None and lr_name(design, v, lr) != v]
        return _spec(design, runs, design["seeds"]) if runs else None
    raise ValueError(stage)


def check_design_runs(design):
    """Every run's overrides as train.py reads them (the best-lr runs are tuning runs on other seeds)."""
    for stage in ("tune", "compare"):
        sweep.check_runs(stage_spec(design, stage))


# --- the runs ---------------------------------------------------------------------------------------

_FLOPS = {}


def flops_per_token(model_config):
    """model.GPT.flops_per_token() of a run's config.json "model" dict (built on the meta device: no
    weights are allocated). Depth attention's elementwise work is not in this count."""
    key = json.dumps(model_config, sort_keys=True)
    if key not in _FLOPS:
        with torch.device("meta"):
            _FLOPS[key] = GPT(GPTConfig(**model_config)).flops_per_token()
    return _FLOPS[key]


def read_run(out_dir, name, seed):
    """A finished run (summary.json and config.json) as one flat record, or None."""
    d = Path(out_dir) / name / f"seed{seed}"
    try:
        summary = json.loads((d / "summary.json").read_text())
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    steps, bt = summary.get("step"), cfg["train"]["batch_tokens"]
    f = flops_per_token(cfg["model"])
    return dict(name=name, seed=seed, dir=f"{name}/seed{seed}", val_loss=summary["val_loss"],
                test_loss=summary.get("test_loss"), params=summary.get("params"), seconds=summary.get("seconds"),
                steps=steps, tokens=steps * bt, lr=cfg["train"]["lr"], min_lr=cfg["train"]["min_lr"],
                eval_tokens=cfg["train"].get("eval_tokens"), flops_per_token=f, flops=f * steps * bt)


def read_stage(spec):
    """{(name, seed): record} of a stage's finished runs: only its own seeds are read."""
    if spec is None:
        return {}
    out = {}
    for name in spec["variants"]:
        for s in spec["seeds"]:
            r = read_run(spec["out_dir"], name, s)
            if r is not None:
                out[(name, s)] = r
    return out


def unfinished(spec, runs):
    return [] if spec is None else [(n, s) for s in spec["seeds"] for n in spec["variants"] if (n, s) not in runs]


# --- a. the learning rate -----------------------------------------------------------------------------

def lr_table(design, tune_runs):
    """Per variant, per lr: the tuning seeds' losses; and the best lr, chosen on the tuning seeds alone.
    `tune_runs` may hold other seeds (they are ignored: the comparison's seeds never choose an lr). The
    lrs are compared on the tuning seeds every lr of the variant has finished ("common"); `complete`
    when every lr has every tuning seed."""
    tuning = set(design["tuning_seeds"])
    out = {}
    for v in design["variants"]:
        cells = {}
        for lr in design["lrs"]:
            name = lr_name(design, v, lr)
            cells[f"{lr:g}"] = {s: tune_runs[(name, s)]["val_loss"] for s in design["tuning_seeds"]
                                if (name, s) in tune_runs and s in tuning}
        common = sorted(set.intersection(*(set(c) for c in cells.values())))
        means = {lr: statistics.fmean(c[s] for s in common) for lr, c in cells.items()} if common else {}
        best = min(means, key=means.get) if means else None
        out[v] = dict(cells={lr: dict(mean=statistics.fmean(c.values()) if c else None, n=len(c),
                                      losses={str(s): x for s, x in c.items()}) for lr, c in cells.items()},
                      common_seeds=common, best_lr=float(best) if best else None,
                      complete=all(len(c) == len(tuning) for c in cells.values()))
    return out


def ranking(losses):
    """Variant names, best (lowest loss) first; variants without a loss are left out."""
    return sorted((v for v, x in losses.items() if x is not None), key=losses.get)


def best_lrs(table, complete_only=True):
    return {v: t["best_lr"] for v, t in table.items() if t["best_lr"] is not None and (t["complete"] or not complete_only)}


# --- b. paired gaps -------------------------------------------------------------------------------------

def paired(runs, mine, theirs, seeds):
    """The paired comparison of run `mine` with run `theirs` over the seeds both finished."""
    d = {s: runs[(mine, s)]["val_loss"] - runs[(theirs, s)]["val_loss"] for s in seeds
         if (mine, s) in runs and (theirs, s) in runs}
    t = paired_t(list(d.values()))
    return dict(run=mine, against=theirs, deltas={str(s): x for s, x in d.items()}, n=len(d),
                wins=sum(x < 0 for x in d.values()), mean=t["mean"], ci95=[t["lo"], t["hi"]], t=t["t"], p=t["p"])


def with_holm(comparisons):
    for c, adjusted in zip(comparisons, holm([c["p"] for c in comparisons])):
        c["p_holm"] = adjusted
    return comparisons


def gaps(design, runs):
    """At each length of `steps`: every variant against the reference, paired over the comparison seeds,
    Holm across the variants at that length; and per variant the change of its gap from the shortest
    length to each longer one (paired over the seeds with all four runs)."""
    ref, seeds = design["reference"], design["seeds"]
    out = {}
    for n in sorted(design["steps"]):
        cs = [dict(variant=v, **paired(runs, steps_name(design, v, n), steps_name(design, ref, n), seeds))
              for v in design["variants"] if v != ref]
        out[str(n)] = with_holm(cs)
    short = min(design["steps"])
    change = {}
    for v in design["variants"]:
        if v == ref:
            continue
        for n in sorted(design["steps"])[1:]:
            d = {}
            for s in seeds:
                keys = [(steps_name(design, v, n), s), (steps_name(design, ref, n), s),
                        (steps_name(design, v, short), s), (steps_name(design, ref, short), s)]
                if all(k in runs for k in keys):
                    a, b, c, e = (runs[k]["val_loss"] for k in keys)
                    d[s] = (a - b) - (c - e)
            t = paired_t(list(d.values()))
            change.setdefault(v, {})[str(n)] = dict(n=len(d), mean=t["mean"], ci95=[t["lo"], t["hi"]], p=t["p"],
                                                    deltas={str(s): x for s, x in d.items()})
    return out, change


def at_best(design, runs, best):
    """On the comparison seeds at the recipe's length: each variant at its own best lr against the
    reference at its own best lr (Holm across the variants), beside the same at the shared lr."""
    ref = design["reference"]
    if ref not in best:
        return None
    ref_name = lr_name(design, ref, best[ref])
    rows = [dict(variant=v, best_lr=best[v], **paired(runs, lr_name(design, v, best[v]), ref_name, design["seeds"]))
            for v in design["variants"] if v != ref and v in best]
    return with_holm(rows)


# --- c. the compute multiplier --------------------------------------------------------------------------

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


def multipliers(design, runs):
    """Per variant and length of `steps`: "the reference needs X times the compute". Each cell uses the
    comparison seeds on which the variant's run and every ladder length the fit uses have finished: the
    ladder lengths finished on all of those seeds (at least 2; 4 for "power"). `partial` when a seed or
    a ladder length is missing."""
    ref, kind = design["reference"], design["fit"]
    least = 4 if kind == "power" else 2
    out = {}
    for v in design["variants"]:
        for n in sorted(design["steps"]):
            name = steps_name(design, v, n)
            seeds = [s for s in design["seeds"] if (name, s) in runs]
            used = [m for m in sorted(design["ladder"]) if seeds and all((steps_name(design, ref, m), s) in runs
                                                                         for s in seeds)]
            cell = dict(variant=v, steps=n, run=name, seeds=seeds, ladder=used,
                        partial=len(seeds) < len(design["seeds"]) or len(used) < len(design["ladder"]))
            out.setdefault(v, {})[str(n)] = cell
            if len(used) < least:
                cell.update(flops=None, steps_x=None, note=f"needs {least} ladder lengths finished on the same seeds")
                continue
            ladder = {m: {s: (runs[(steps_name(design, ref, m), s)]["flops"], runs[(steps_name(design, ref, m), s)]["val_loss"])
                          for s in seeds} for m in used}
            fref = runs[(steps_name(design, ref, used[0]), seeds[0])]["flops_per_token"]
            variant = {s: (runs[(name, s)]["flops"], runs[(name, s)]["val_loss"], fref * runs[(name, s)]["tokens"])
                       for s in seeds}
            f, st, c_star, fit = multiple(ladder, variant, kind)
            iv = bootstrap(ladder, variant, kind, design["bootstrap"], design["bootstrap_seed"]) if len(seeds) > 1 else None
            fv = runs[(name, seeds[0])]["flops_per_token"]
            cell.update(flops=f, steps_x=st, reference_flops=c_star, flops_per_token=fv, flops_per_token_ratio=fv / fref,
                        loss=statistics.fmean(x for _, x, _ in variant.values()),
                        extrapolated=None if c_star is None else not inside(fit, c_star),
                        interval=iv)  # one seed: no interval
    return out


def ladder_points(design, runs):
    """The ladder's points on every comparison seed that finished them: {length: dict(flops, mean, sd, n)}."""
    out = {}
    for m in sorted(design["ladder"]):
        rs = [runs[(steps_name(design, design["reference"], m), s)] for s in design["seeds"]
              if (steps_name(design, design["reference"], m), s) in runs]
        if rs:
            losses = [r["val_loss"] for r in rs]
            out[str(m)] = dict(flops=statistics.fmean(r["flops"] for r in rs), mean=statistics.fmean(losses),
                               sd=statistics.stdev(losses) if len(losses) > 1 else 0.0, n=len(rs))
    return out


# --- d. wall-clock ------------------------------------------------------------------------------------

def bench_name(overrides):
    """A variant's name in tools.bench (residual[:key=value...]) from its overrides."""
    kv = dict(x.partition("=")[::2] for x in shlex.split(overrides))
    residual = kv.pop("residual", "standard")
    return ":".join([residual] + [f"{k}={v}" for k, v in kv.items()])


def bench_ratios(design):
    """Per variant: the bench file's median speed ratio against standard and its quartiles (a bench run
    interleaves its repeats; its ratios are the only wall-clock numbers this report uses)."""
    if design["bench"] is None:
        return None
    b = json.loads(bench_path(design["bench"]).read_text())
    steps = {s["variant"]: s for s in b["steps"]}
    ref = steps.get(bench_name(design["variants"][design["reference"]]))
    out = dict(file=str(design["bench"]), device=b.get("device"), dtype=b.get("dtype"),
               size={k: b["args"].get(k) for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size",
                                                   "vocab_size", "compile")}, variants={})
    for v, ov in design["variants"].items():
        s = steps.get(bench_name(ov))
        if s and ref:  # the ratio against the bench's standard, re-based on the design's reference
            out["variants"][v] = dict(bench_variant=s["variant"], speed_ratio=s["speed_ratio"] / ref["speed_ratio"],
                                      quartiles=[q / ref["speed_ratio"] for q in s["speed_ratio_quartiles"]])
    return out


# --- the report -----------------------------------------------------------------------------------------

def analyze(design):
    specs = {"tune": stage_spec(design, "tune"), "compare": stage_spec(design, "compare")}
    tune_runs = read_stage(specs["tune"])
    table = lr_table(design, tune_runs)
    specs["best"] = stage_spec(design, "best", best_lrs(table))
    comp_runs = {**read_stage(specs["compare"]), **read_stage(specs["best"])}
    shared = f"{design['recipe']['lr']:g}"
    rank_shared = ranking({v: t["cells"][shared]["mean"] for v, t in table.items()})
    rank_best = ranking({v: t["cells"][f"{t['best_lr']:g}"]["mean"] if t["best_lr"] else None for v, t in table.items()})
    best_all = best_lrs(table)
    gap, change = gaps(design, comp_runs)
    recipe_n = design["recipe"]["steps"]
    cmp_shared = ranking({v: statistics.fmean(comp_runs[(v, s)]["val_loss"] for s in design["seeds"])
                          if all((v, s) in comp_runs for s in design["seeds"]) else None for v in design["variants"]})
    cmp_best = ranking({v: statistics.fmean(comp_runs[(lr_name(design, v, lr), s)]["val_loss"] for s in design["seeds"])
                        if all((lr_name(design, v, lr), s) in comp_runs for s in design["seeds"]) else None
                        for v, lr in best_all.items()}) if len(best_all) == len(design["variants"]) else []
    everything = {**tune_runs, **comp_runs}
    missing = {st: [f"{n}/seed{s}" for n, s in unfinished(specs[st], everything)] for st in STAGES}
    unsettled = [v for v, t in table.items() if not t["complete"]]
    result = dict(
        design={k: design[k] for k in ("base", "variants", "reference", "lrs", "tuning_seeds", "seeds", "steps", "ladder",
                                       "overrides", "fit", "min_lr_ratio", "bootstrap", "bootstrap_seed", "bench")},
        recipe=design["recipe"],
        eval_tokens=sorted({r["eval_tokens"] for r in everything.values() if r["eval_tokens"] is not None}),
        lr=dict(table=table, best=best_lrs(table, complete_only=False), settled=best_all, unsettled=unsettled,
                ranking_shared=rank_shared, ranking_best=rank_best,
                ranking_changes=None if unsettled else rank_shared != rank_best,
                comparison=dict(at_best=at_best(design, comp_runs, best_all), ranking_shared=cmp_shared,
                                ranking_best=cmp_best, ranking_changes=(cmp_shared != cmp_best) if cmp_best
                                and len(cmp_shared) == len(cmp_best) else None)),
        gaps=gap, gap_change=change, recipe_steps=recipe_n,
        ladder=ladder_points(design, comp_runs), fit=None, multipliers=multipliers(design, comp_runs),
        bench=bench_ratios(design),
        runs=sorted(everything.values(), key=lambda r: (r["name"], r["seed"])),
        missing=missing,
        cpu_seconds={st: sum(r["seconds"] or 0 for k, r in everything.items()
                             if specs[st] and k[0] in specs[st]["variants"] and k[1] in specs[st]["seeds"])
                     for st in STAGES},
    )
    pts = result["ladder"]
    if len(pts) >= (4 if design["fit"] == "power" else 2):  # the ladder's means, every seed that finished each
        result["fit"] = fit_ladder([p["flops"] for p in pts.values()], [p["mean"] for p in pts.values()], design["fit"])
    return result


def _f(x, fmt, none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return format(x, fmt)


def _p(c):
    text = f"{_f(c['p'], '.3f')} ({_f(c.get('p_holm'), '.3f')})"
    return text.replace("0.000", "<0.001")


def _gap_cells(c):
    if c is None or c["n"] == 0:
        return ["-", "-", "-"]
    return [f"{c['mean']:+.4f} [{_f(c['ci95'][0], '+.4f')}, {_f(c['ci95'][1], '+.4f')}]", f"{c['wins']}/{c['n']}", _p(c)]


def render(result, design):
    r, lr = result, result["lr"]
    seeds_n = len(design["seeds"])
    shared = f"{design['recipe']['lr']:g}"
    ref = design["reference"]
    out = [f"# Does the advantage hold? lr, length, compute (`{design['base']}`, reference `{ref}`)", ""]
    et = ", ".join(f"{x:,}" for x in r["eval_tokens"]) or "?"
    out += [f"Scores: validation NLL (summary.json `val_loss`) on the fixed first {et} tokens of the validation "
            "split (the runs' `eval_tokens`), the same chunk for every run: not whole-split scores. "
            f"Recipe: lr {shared}, min_lr {design['recipe']['min_lr']:g}, {design['recipe']['steps']} steps of "
            f"{design['recipe']['batch_tokens']:,} tokens. Tuning seeds {list(design['tuning_seeds'])}; comparison "
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
                   f"(`python -m tools.robust <design> --stage best`).")
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
    # c.
    out += ["", "## c. Compute: the reference needs X times the compute", ""]
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
        miss = r["missing"][st]
        out.append(f"- {st}: {r['cpu_seconds'][st] / 3600:.2f} h of finished runs; "
                   + (f"{len(miss)} unfinished: {', '.join(f'`{x}`' for x in miss)}" if miss else "all finished"))
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
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


def report(design):
    result = analyze(design)
    text = render(result, design)
    out = Path(design["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "robust.md").write_text(text)
    (out / "robust.json").write_text(json.dumps(strict(result), indent=1, allow_nan=False) + "\n")
    plot(result, design, out / "loss_vs_flops.png")
    print(text)
    return result


def list_runs(design):
    table = lr_table(design, read_stage(stage_spec(design, "tune")))
    for st in STAGES:
        spec = stage_spec(design, st, best_lrs(table))
        if spec is None:
            waiting = any(not t["complete"] for t in table.values())
            print(f"{st}: no runs" + (" yet (tuning unfinished)" if waiting else " (every best lr is the shared lr)"))
            continue
        done = read_stage(spec)
        print(f"{st}: {len(done)}/{len(spec['variants']) * len(spec['seeds'])} finished")
        for s in spec["seeds"]:
            for n in spec["variants"]:
                print(f"  {'done' if (n, s) in done else 'todo'}  {n}/seed{s}  {spec['variants'][n]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("design", help="design file (see above)")
    p.add_argument("--stage", choices=("all",) + STAGES, default="all", help="run one stage only (default: all, in order)")
    p.add_argument("--table_only", action="store_true", help="skip training; report on the finished runs")
    p.add_argument("--list", action="store_true", help="list every run of every stage, finished or not; no training")
    p.add_argument("--out_dir", help="override the design's out_dir (runs and report)")
    p.add_argument("--launcher", default="", help='command prefix for each run, e.g. "torchrun --nproc_per_node=8"')
    args = p.parse_args(argv)
    design = load_design(args.design, args.out_dir)
    check_design_runs(design)  # one `error:` line (tools.sweep.check_runs) before any run
    if args.list:
        return list_runs(design)
    if not args.table_only:
        stages = STAGES if args.stage == "all" else (args.stage,)
        for st in stages:
            if st == "best":
                table = lr_table(design, read_stage(stage_spec(design, "tune")))
                spec = stage_spec(design, "best", best_lrs(table))
                unsettled = [v for v, t in table.items() if not t["complete"]]
                if unsettled:
                    print(f"robust: best lr not settled for {', '.join(unsettled)} (tuning runs unfinished): "
                          "their best-lr runs wait for a later --stage best", flush=True)
            else:
                spec = stage_spec(design, st)
            if spec is not None:
                print(f"robust: stage {st}: {len(spec['variants'])} runs x {len(spec['seeds'])} seeds", flush=True)
                sweep.run_all(spec, args.launcher)
    return report(design)


if __name__ == "__main__":
    main()
