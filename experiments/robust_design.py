"""
The design file of experiments/robust.py (its format: that module's docstring): reading and checking it,
and the runs it asks for: their names, their overrides and the stages that group them.
"""

import math
import shlex
from pathlib import Path

from common import UserError
from experiments import sweep
from train import parse_config

ROOT = Path(__file__).resolve().parent.parent
AXES = ("lr", "min_lr", "max_steps", "max_tokens")  # keys the design sets per run; a variant may not
STAGES = ("tune", "compare", "best")
SCORES = ("val", "val_prefix")  # the whole validation split (scores.json), or the logged eval_tokens prefix


def _whole(x):
    return isinstance(x, int) and not isinstance(x, bool)


def load_design(path, out_dir=None):
    """The design file's settings, each checked, with the recipe it implies (lr, min_lr, length): a bad
    design is one `error:` line (a UserError) before any run."""
    def fail(message):
        raise UserError(f"design file {path}: {message}")

    d = sweep.read_settings(path, "design file")
    d["path"] = str(path)  # its declaration: the report names the commit that added it
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
    d.setdefault("score", "val")
    if d["score"] not in SCORES:
        fail(f"score must be one of {', '.join(SCORES)}, got {d['score']!r}")
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
    d.setdefault("contrasts", [])
    c = d["contrasts"]
    if not isinstance(c, (list, tuple)) or not all(isinstance(x, (list, tuple)) and len(x) == 2
                                                   and all(isinstance(v, str) for v in x) for x in c):
        fail('contrasts must be a list of (variant, baseline) pairs, e.g. [("rd_attnres", "block_attnres")]')
    for a, b in c:
        if a not in d["variants"] or b not in d["variants"] or a == b:
            fail(f"contrast ({a!r}, {b!r}): two different variants of {list(d['variants'])}")
    d["contrasts"] = [list(x) for x in c]
    d.setdefault("overrides", "")
    if not isinstance(d["overrides"], str):
        fail('overrides must be a "key=value ..." string')
    d.setdefault("bench", None)
    if d["bench"] is not None and not bench_path(d["bench"]).is_file():
        fail(f"bench file {d['bench']} not found")
    d["out_dir"] = str(out_dir or d.get("out_dir") or Path("runs") / Path(path).stem)
    try:
        tc, _ = parse_config([d["base"], *(f"--{kv}" for kv in shlex.split(d["overrides"]))])
    except ValueError as e:  # UserError, or shlex's unterminated quote
        fail(f"base {d['base']!r} with overrides {d['overrides']!r}: {e}")
    d["recipe"] = dict(lr=tc.lr, min_lr=tc.min_lr, steps=tc.steps, batch_tokens=tc.batch_tokens)
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
                overrides=design["overrides"], out_dir=design["out_dir"], controls={}, score=design["score"])


def stage_spec(design, stage, best=None):
    """A stage as a plain sweep spec (experiments.sweep): its runs' names and overrides, and its seeds. `best`
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
