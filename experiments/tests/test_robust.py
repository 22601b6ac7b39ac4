"""experiments/robust.py (with robust_design, multiplier, robust_report): the design's run names, its checks, the lr
chosen on tuning seeds alone, the compute multiplier on synthetic power-law ladders (known answers), the
bootstrap, and a tiny design end to end."""

import json
import math
import shlex
from pathlib import Path

import pytest

import train
from common import UserError, cli
from experiments import multiplier, rescore, robust, robust_report, sweep

from sweeps import fake_train

ROOT = Path(__file__).resolve().parents[2]


# --- the CPU design: exactly the runs of issue 26 ------------------------------------------------------

TUNE = {  # name: overrides, on seeds 100 and 101
    "standard--lr0.0015": "residual=standard lr=0.0015 min_lr=0.00015",
    "standard": "residual=standard",
    "standard--lr0.006": "residual=standard lr=0.006 min_lr=0.0006",
    "block_attnres--lr0.0015": "residual=block_attnres lr=0.0015 min_lr=0.00015",
    "block_attnres": "residual=block_attnres",
    "block_attnres--lr0.006": "residual=block_attnres lr=0.006 min_lr=0.0006",
    "rd_attnres--lr0.0015": "residual=rd_attnres lr=0.0015 min_lr=0.00015",
    "rd_attnres": "residual=rd_attnres",
    "rd_attnres--lr0.006": "residual=rd_attnres lr=0.006 min_lr=0.0006",
    "muddformer--lr0.0015": "residual=muddformer lr=0.0015 min_lr=0.00015",
    "muddformer": "residual=muddformer",
    "muddformer--lr0.006": "residual=muddformer lr=0.006 min_lr=0.0006",
    "delta_attnres--lr0.0015": "residual=delta_attnres lr=0.0015 min_lr=0.00015",
    "delta_attnres": "residual=delta_attnres",
    "delta_attnres--lr0.006": "residual=delta_attnres lr=0.006 min_lr=0.0006",
}
COMPARE = {  # on seeds 0, 1 and 2
    "standard": "residual=standard",
    "block_attnres": "residual=block_attnres",
    "rd_attnres": "residual=rd_attnres",
    "muddformer": "residual=muddformer",
    "delta_attnres": "residual=delta_attnres",
    "standard--steps600": "residual=standard max_steps=600",
    "standard--steps800": "residual=standard max_steps=800",
    "standard--steps1200": "residual=standard max_steps=1200",
    "block_attnres--steps1200": "residual=block_attnres max_steps=1200",
    "rd_attnres--steps1200": "residual=rd_attnres max_steps=1200",
    "muddformer--steps1200": "residual=muddformer max_steps=1200",
    "delta_attnres--steps1200": "residual=delta_attnres max_steps=1200",
}


def train_argv(spec, name):
    return [spec["base"]] + [f"--{kv}" for kv in shlex.split(spec["overrides"]) + shlex.split(spec["variants"][name])]


def test_the_cpu_design_names_exactly_the_runs_of_issue_26():
    d = robust.load_design("experiments/configs/robust_cpu.py")
    assert d["recipe"] == dict(lr=3e-3, min_lr=3e-4, steps=400, batch_tokens=1024) and d["out_dir"] == "runs/robust_cpu"
    tune, compare = robust.stage_spec(d, "tune"), robust.stage_spec(d, "compare")
    assert tune["variants"] == TUNE and tune["seeds"] == [100, 101]
    assert compare["variants"] == COMPARE and compare["seeds"] == [0, 1, 2]
    assert tune["overrides"] == compare["overrides"] == "ckpt_interval=200"
    # what train.py reads: the lr-grid runs end their cosine at lr / 10, the length runs keep the recipe's lr
    tc, _ = train.parse_config(train_argv(tune, "rd_attnres--lr0.006"))
    assert (tc.lr, tc.min_lr, tc.max_steps, tc.ckpt_interval) == (0.006, 0.0006, 400, 200)
    tc, _ = train.parse_config(train_argv(compare, "muddformer--steps1200"))
    assert (tc.lr, tc.min_lr, tc.max_steps) == (0.003, 0.0003, 1200)
    # the best-lr stage: a variant whose best lr is the shared one needs no run; the others run on seeds 0-2
    best = robust.stage_spec(d, "best", {"standard": 3e-3, "muddformer": 6e-3, "rd_attnres": 1.5e-3})
    assert best["variants"] == {"muddformer--lr0.006": TUNE["muddformer--lr0.006"],
                                "rd_attnres--lr0.0015": TUNE["rd_attnres--lr0.0015"]} and best["seeds"] == [0, 1, 2]
    assert robust.stage_spec(d, "best", {"standard": 3e-3}) is None


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT))
                                         for p in (ROOT / "experiments" / "configs").glob("robust_*.py")))
def test_every_run_of_every_design_is_a_valid_config(path):
    d = robust.load_design(path)
    every_lr = {v: lr for v in d["variants"] for lr in d["lrs"]}  # the best stage's runs are the tune stage's
    for spec in (robust.stage_spec(d, "tune"), robust.stage_spec(d, "compare"), robust.stage_spec(d, "best", every_lr)):
        for name in spec["variants"]:
            tc, model_settings = train.parse_config(train_argv(spec, name))
            train.build_model_config(model_settings, tc, dict(vocab_size=50257, tokenizer="gpt2"))


def test_the_gpu_design_is_the_cpu_protocol_at_rd_s():
    d = robust.load_design("experiments/configs/robust_gpu.py")
    assert d["base"] == "configs/rd_s.py" and d["recipe"]["steps"] == 3814 and d["recipe"]["lr"] == 3e-3
    assert d["steps"] == [3814, 11442] and d["ladder"] == [3814, 5721, 7628, 11442]
    cpu = robust.load_design("experiments/configs/robust_cpu.py")
    assert d["variants"] == cpu["variants"] and d["lrs"] == cpu["lrs"]
    assert (d["tuning_seeds"], d["seeds"]) == (cpu["tuning_seeds"], cpu["seeds"])


# --- a bad design: one line, before any run ---------------------------------------------------------------

GOOD = dict(base='"configs/test.py"', variants='{"a": "residual=standard", "b": "residual=block_attnres"}',
            reference='"a"', lrs="[0.005, 0.01]", tuning_seeds="[100]", seeds="[0, 1]", steps="[6]", ladder="[6, 9]")
BAD_DESIGNS = {
    "shared_seeds": (dict(tuning_seeds="[1, 100]"), "tuning_seeds and seeds share [1]"),
    "negative_lr": (dict(lrs="[0.01, -0.02]"), "lrs must be a non-empty list of positive numbers"),
    "zero_steps": (dict(steps="[6, 0]"), "steps must be a list of at least 1 distinct positive whole numbers"),
    "one_rung": (dict(ladder="[6]"), "ladder must be a list of at least 2 distinct positive whole numbers"),
    "no_recipe_lr": (dict(lrs="[0.005, 0.02]"), "lrs [0.005, 0.02] must hold the recipe's lr 0.01"),
    "no_recipe_length": (dict(steps="[9]"), "steps [9] must hold the recipe's length 6"),
    "variant_sets_lr": (dict(variants='{"a": "", "b": "lr=0.1"}'), "variant 'b' sets lr: the design sets"),
    "dashes": (dict(variants='{"a": "", "b--x": ""}'), "variant name 'b--x'"),
    "reference": (dict(reference='"c"'), "reference 'c' is not one of the variants"),
    "missing": (dict(ladder=None), "must set ladder"),
    "power_short": (dict(fit='"power"'), "the ladder needs at least 4 lengths"),
    "score": (dict(score='"test"'), "score must be one of val, val_prefix, got 'test'"),
    "contrast_unknown": (dict(contrasts='[("b", "c")]'), "contrast ('b', 'c'): two different variants of ['a', 'b']"),
    "contrast_itself": (dict(contrasts='[("b", "b")]'), "contrast ('b', 'b'): two different variants"),
    "contrast_not_a_pair": (dict(contrasts='[("b",)]'), "contrasts must be a list of (variant, baseline) pairs"),
    "contrast_not_names": (dict(contrasts='[(["b"], "a")]'), "contrasts must be a list of (variant, baseline) pairs"),
    "unknown_key": (dict(variants='{"a": "", "b": "n_layers=4"}'), "unknown key 'n_layers' in the command line"),
    "raises": (dict(steps="[6] + 1"), "line 7: TypeError"),
    "seed_too_large": (dict(seeds="[0, 2**32]"), "error: seed 4294967296 (each run's seed and data_seed): seed must be "
                       "in [0, 2**32), got 4294967296"),
    "tuning_seed_too_large": (dict(tuning_seeds="[2**40]"), "error: seed 1099511627776 (each run's seed"),
}


@pytest.mark.parametrize("case", BAD_DESIGNS)
def test_a_bad_design_is_one_line_before_any_run(case, tmp_path, monkeypatch):
    change, message = BAD_DESIGNS[case]
    keys = {**GOOD, **change}
    path = tmp_path / "design.py"
    path.write_text("".join(f"{k} = {v}\n" for k, v in keys.items() if v is not None))
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError) as e:
        robust.main([str(path), "--out_dir", str(tmp_path / "runs")])
    assert message.removeprefix("error: ") in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "runs").exists()


def test_a_missing_design_file(tmp_path):
    with pytest.raises(UserError, match="^design file .* not found$"):
        robust.main([str(tmp_path / "nope.py")])


# --- fake runs ------------------------------------------------------------------------------------------

TINY = dict(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)
BATCH = 256


PREFIX = 0.05  # a fake run's eval_tokens prefix scores this much above its whole validation split


def fake_run(out, name, seed, loss, steps, residual="standard", lr=1e-2, scored=True):
    """A finished run's directory as train.py and the sweep leave it (the files the report reads): `loss` on
    the whole validation split (scores.json, unless not `scored`), loss + PREFIX on the logged prefix."""
    d = Path(out) / name / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(dict(
        train=dict(batch_tokens=BATCH, max_steps=steps, lr=lr, min_lr=lr / 10, eval_tokens=1024),
        model=dict(TINY, residual=residual))))
    prefix = loss + PREFIX
    (d / "summary.json").write_text(json.dumps(dict(run_dir=str(d), step=steps, val_loss=prefix, test_loss=prefix + 0.01,
                                                    params=1000, seconds=60.0, tokens_per_s=1.0)))
    (d / "log.jsonl").write_text(json.dumps(dict(kind="eval", split="val", step=steps, loss=prefix)) + "\n")
    if scored:
        (d / "scores.json").write_text(json.dumps(dict(step=steps, max_tokens=None, data_dir="data", own_data=True,
                                                       val=dict(loss=loss, tokens=9999), test=dict(loss=loss + 0.01,
                                                                                                   tokens=9999))))


def design_file(tmp_path, **keys):
    text = dict(base='"configs/test.py"', variants='{"standard": "residual=standard", "mudd": "residual=muddformer"}',
                reference='"standard"', lrs="[0.01]", tuning_seeds="[100]", seeds="[0, 1, 2]", steps="[4, 12]",
                ladder="[4, 6, 8, 12]", overrides='"max_steps=4"', out_dir=repr(str(tmp_path / "runs")))
    text.update(keys)
    path = tmp_path / "design.py"
    path.write_text("".join(f"{k} = {v}\n" for k, v in text.items()))
    return robust.load_design(str(path))


F_STD = robust.flops_per_token(dict(TINY, residual="standard"))
F_MUDD = robust.flops_per_token(dict(TINY, residual="muddformer"))


def law(E, B, alpha):
    c1 = F_STD * BATCH * 4  # the ladder's first point: loss E + B
    return lambda C: E + B * (C / c1) ** -alpha


# --- c. the multiplier: known answers ---------------------------------------------------------------------

def test_a_power_law_ladder_recovers_its_exponent():
    C = [F_STD * BATCH * n for n in (400, 600, 800, 1200)]
    true = dict(E=1.3, A=25.0, alpha=0.27)
    L = [true["E"] + true["A"] * c ** -true["alpha"] for c in C]
    fit = multiplier.fit_ladder(C, L, "power")
    # not rounding: a golden-section search finds a smooth minimum to about sqrt(u) = 1.5e-8 in log alpha (the
    # squared error is flat to second order there), 1e-6 is 70x that; E and A follow from alpha (A through C^alpha,
    # log C ~ 13: 10x looser), and the residuals with them
    assert fit["alpha"] == pytest.approx(true["alpha"], rel=1e-6)
    assert fit["E"] == pytest.approx(true["E"], rel=1e-6) and fit["A"] == pytest.approx(true["A"], rel=1e-5)
    assert fit["rms"] < 1e-9
    pure = multiplier.fit_ladder(C, [25.0 * c ** -0.27 for c in C], "loglinear")  # no floor: log-linear is exact
    assert (pure["alpha"], pure["A"], pure["E"]) == (pytest.approx(0.27, rel=1e-12), pytest.approx(25.0, rel=1e-9), 0)
    for f in (fit, pure):  # the inverse reads the compute back
        assert multiplier.inverse(f, multiplier.predict(f, 1.7 * C[0])) == pytest.approx(1.7 * C[0], rel=1e-6)


def test_inverse_beyond_the_floor_and_of_a_curve_that_does_not_fall():
    fit = multiplier.fit_ladder([1.0, 2.0, 4.0, 8.0], [1.5 + 2 ** -k for k in range(4)], "power")
    assert multiplier.inverse(fit, 1.4) == math.inf  # below the floor: never reached
    rising = multiplier.fit_ladder([1.0, 2.0], [2.0, 2.1], "loglinear")
    assert rising["alpha"] < 0 and multiplier.inverse(rising, 2.05) is None


@pytest.mark.parametrize("kind,E", [("loglinear", 0.0), ("power", 1.0)])
def test_a_variant_at_a_known_multiple_reads_as_that_multiple(kind, E, tmp_path):
    """The ladder lies on an exact law; `mudd` reaches, with its own FLOPs, the loss the reference reaches
    with k times them: X FLOP-matched is k, X step-matched k times the FLOPs-per-token ratio."""
    d = design_file(tmp_path, fit=repr(kind))
    L = law(E, 1.0, 0.3)
    out = tmp_path / "runs"
    k = {4: 1.5, 12: 2.0}
    for s in d["seeds"]:
        for n in d["ladder"]:
            fake_run(out, robust.steps_name(d, "standard", n), s, L(F_STD * BATCH * n), n)
        for n in d["steps"]:
            fake_run(out, robust.steps_name(d, "mudd", n), s, L(k[n] * F_MUDD * BATCH * n), n, "muddformer")
    result = robust.analyze(d)
    ratio = F_MUDD / F_STD
    assert ratio > 1.01  # MUDDFormer costs more per token: charged for it
    tol = 1e-9 if kind == "loglinear" else 1e-6
    for n, m in result["multipliers"]["mudd"].items():
        n = int(n)
        assert m["flops"] == pytest.approx(k[n], rel=tol)
        assert m["steps_x"] == pytest.approx(k[n] * ratio, rel=tol)
        assert m["steps_x"] / m["flops"] == pytest.approx(ratio, rel=1e-12)  # exactly the FLOPs-per-token ratio
        assert m["flops_per_token_ratio"] == pytest.approx(ratio, rel=1e-12)
        assert not m["partial"] and m["seeds"] == [0, 1, 2] and m["ladder"] == [4, 6, 8, 12]
        # noiseless seeds: every resample is the same data, the interval is the truth
        assert m["interval"]["flops"] == [pytest.approx(k[n], rel=tol)] * 2
        assert m["interval"]["steps"] == [pytest.approx(k[n] * ratio, rel=tol)] * 2
    assert result["multipliers"]["mudd"]["4"]["extrapolated"] is False  # 1.5 x 1.03 x 4 steps: inside 4..12
    assert result["multipliers"]["mudd"]["12"]["extrapolated"] is True  # 2 x 1.03 x 12 steps: beyond 12
    for n in (4, 12):  # the reference against its own exact ladder
        assert result["multipliers"]["standard"][str(n)]["flops"] == pytest.approx(1.0, rel=tol)
    assert result["fit"]["alpha"] == pytest.approx(0.3, rel=tol) and result["fit"]["E"] == pytest.approx(E, abs=1e-6)


def noisy_design(tmp_path):
    d = design_file(tmp_path)
    L = law(0.0, 1.0, 0.3)
    noise = {0: 0.01, 1: -0.004, 2: 0.006}
    for s in d["seeds"]:
        for n in d["ladder"]:
            fake_run(tmp_path / "runs", robust.steps_name(d, "standard", n), s, L(F_STD * BATCH * n) + noise[s], n)
        for n in d["steps"]:
            fake_run(tmp_path / "runs", robust.steps_name(d, "mudd", n), s,
                     L(1.5 * F_MUDD * BATCH * n) + 0.5 * noise[s] + 0.002 * s, n, "muddformer")
    return d


def test_the_bootstrap_is_reproducible_and_pairs_the_seeds(tmp_path):
    d = noisy_design(tmp_path)
    a, b = robust.analyze(d)["multipliers"]["mudd"]["4"], robust.analyze(d)["multipliers"]["mudd"]["4"]
    assert a["interval"] == b["interval"] and a["interval"]["undefined"] == 0  # a fixed RNG seed
    lo, hi = a["interval"]["flops"]
    assert lo < a["flops"] < hi and lo < hi
    ratio = F_MUDD / F_STD  # each resample's two multipliers differ by the FLOPs ratio: so do the percentiles
    assert a["interval"]["steps"] == [pytest.approx(lo * ratio, rel=1e-12), pytest.approx(hi * ratio, rel=1e-12)]
    # by hand: the same draws of seed indices for the ladder and the variant
    ladder = {n: {s: (F_STD * BATCH * n, robust.read_run(d["out_dir"], robust.steps_name(d, "standard", n), s)["val_loss"])
                  for s in d["seeds"]} for n in d["ladder"]}
    variant = {s: (F_MUDD * BATCH * 4, robust.read_run(d["out_dir"], "mudd", s)["val_loss"], F_STD * BATCH * 4)
               for s in d["seeds"]}
    assert multiplier.bootstrap(ladder, variant, "loglinear", 2000, 0) == a["interval"]
    # 3 seeds give 10 distinct resamples (multisets); the percentiles are values of them
    draws = [(i, j, k) for i in range(3) for j in range(i, 3) for k in range(j, 3)]
    values = [multiplier.multiple({n: dict(enumerate(pts[s] for s in draw)) for n, pts in ladder.items()},
                              dict(enumerate(variant[s] for s in draw)), "loglinear")[0] for draw in draws]
    assert len(draws) == 10 and lo in values and hi in values


def test_percentile_is_linear_between_order_statistics():
    assert multiplier.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert multiplier.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.025) == pytest.approx(1.1)
    assert multiplier.percentile([1.0, math.inf], 1.0) == math.inf


# --- a. the lr: chosen on the tuning seeds, never on the comparison's ------------------------------------

def test_the_lr_is_chosen_on_tuning_seeds_only(tmp_path):
    d = design_file(tmp_path, variants='{"standard": "residual=standard", "block": "residual=block_attnres"}',
                    lrs="[0.005, 0.01, 0.02]", tuning_seeds="[100, 101]", steps="[4]", ladder="[4, 6]",
                    contrasts='[("block", "standard")]')
    out = tmp_path / "runs"
    tuning = {("standard", 0.005): 2.0, ("standard", 0.01): 1.9, ("standard", 0.02): 2.1,  # best: 0.01
              ("block", 0.005): 2.0, ("block", 0.01): 1.95, ("block", 0.02): 1.8}  # best: 0.02
    for (v, lr), loss in tuning.items():
        for s in (100, 101):
            fake_run(out, robust.lr_name(d, v, lr), s, loss + 0.001 * s, 4, lr=lr)
    # the comparison seeds would choose otherwise: standard at 0.02, block at 0.005
    comparison = {("standard", 0.01): 1.85, ("standard", 0.02): 1.0, ("block", 0.005): 0.5, ("block", 0.01): 1.84,
                  ("block", 0.02): 1.83}
    for (v, lr), loss in comparison.items():
        for s in (0, 1, 2):
            fake_run(out, robust.lr_name(d, v, lr), s, loss + 0.01 * s, 4, lr=lr)
    for s in (0, 1, 2):
        fake_run(out, "standard--steps6", s, 1.7, 6)
    everything = {**robust.read_stage(robust.stage_spec(d, "tune")),
                  **{(n, s): robust.read_run(out, n, s) for n in ("standard--lr0.02", "block--lr0.005") for s in (0, 1, 2)}}
    table = robust.lr_table(d, everything)  # handed the comparison seeds' runs too: it ignores them
    assert {v: t["best_lr"] for v, t in table.items()} == {"standard": 0.01, "block": 0.02}
    assert all(t["complete"] and t["common_seeds"] == [100, 101] for t in table.values())
    assert table["block"]["cells"]["0.005"]["losses"] == {"100": pytest.approx(2.1), "101": pytest.approx(2.101)}

    result = robust.analyze(d)
    assert result["lr"]["settled"] == {"standard": 0.01, "block": 0.02}
    assert result["lr"]["ranking_shared"] == ["standard", "block"] and result["lr"]["ranking_best"] == ["block", "standard"]
    assert result["lr"]["ranking_changes"] is True
    best = robust.stage_spec(d, "best", result["lr"]["settled"])
    assert best["variants"] == {"block--lr0.02": "residual=block_attnres lr=0.02 min_lr=0.002"} and best["seeds"] == [0, 1, 2]
    # the comparison: seeds 0-2 only, though standard/seed100 and seed101 (tuning) share the name standard
    (at_best,) = result["lr"]["comparison"]["at_best"]
    assert (at_best["run"], at_best["against"]) == ("block--lr0.02", "standard")
    assert set(at_best["deltas"]) == {"0", "1", "2"} and at_best["mean"] == pytest.approx(1.83 - 1.85)
    (gap,) = result["gaps"]["4"]
    assert set(gap["deltas"]) == {"0", "1", "2"} and gap["mean"] == pytest.approx(1.84 - 1.85)
    for cells in result["multipliers"].values():
        assert all(set(c["seeds"]) <= {0, 1, 2} for c in cells.values())
    assert result["missing"] == dict(tune=[], compare=[], best=[])
    # a contrast: the same pairs at the shared lr, and each side at its own best lr (block 0.02, standard 0.01)
    (c,) = result["contrasts"]
    assert (c["variant"], c["baseline"]) == ("block", "standard") and c["lengths"]["4"]["deltas"] == gap["deltas"]
    assert c["at_best"]["lrs"] == [0.02, 0.01] and c["at_best"]["mean"] == pytest.approx(1.83 - 1.85)
    assert c["at_best"]["wins"] == 3 and "p_holm" not in c["at_best"]  # exploratory: uncorrected
    text = robust.render(result, d)
    row = next(line for line in text.splitlines() if line.startswith("| `block` - `standard` |"))
    assert row.endswith("| -0.0200 [-0.0200, -0.0200] | 3/3 | <0.001 | 0.02, 0.01 |"), row


def test_a_contrast_pairs_two_variants_besides_the_reference(tmp_path):
    """a - b, neither the reference: at each length (one seed at 12 steps: no interval) and with a at its best lr
    (the shared 0.01) against b at its own (0.005); unsettled until b's tuning has finished."""
    d = design_file(tmp_path, variants='{"standard": "", "a": "residual=block_attnres", "b": "residual=rd_attnres"}',
                    lrs="[0.005, 0.01]", steps="[4, 12]", ladder="[4, 12]", contrasts='[("a", "b")]')
    out = tmp_path / "runs"
    for v, losses in {"standard": (2.0, 1.9), "a": (2.0, 1.8), "b": (1.7, 1.9)}.items():  # lr 0.005, 0.01
        for lr, loss in zip((0.005, 0.01), losses):
            fake_run(out, robust.lr_name(d, v, lr), 100, loss, 4, lr=lr)
    for s in (0, 1, 2):
        for v, loss in {"standard": 1.95, "a": 1.80 + 0.01 * s, "b": 1.90 + 0.02 * s}.items():
            fake_run(out, v, s, loss, 4)
        fake_run(out, "b--lr0.005", s, 1.7, 4, lr=0.005)
    for v, loss in {"a": 1.5, "b": 1.6}.items():
        fake_run(out, robust.steps_name(d, v, 12), 0, loss, 12)
    (c,) = robust.analyze(d)["contrasts"]
    assert (c["variant"], c["baseline"]) == ("a", "b") and c["lengths"]["4"]["mean"] == pytest.approx(-0.11)
    assert c["lengths"]["4"]["deltas"] == {"0": pytest.approx(-0.10), "1": pytest.approx(-0.11), "2": pytest.approx(-0.12)}
    assert c["lengths"]["12"]["n"] == 1 and c["lengths"]["12"]["mean"] == pytest.approx(-0.1)
    assert c["at_best"]["lrs"] == [0.01, 0.005] and c["at_best"]["against"] == "b--lr0.005"
    assert c["at_best"]["mean"] == pytest.approx(0.11) and c["at_best"]["wins"] == 0
    row = next(x for x in robust.render(robust.analyze(d), d).splitlines() if x.startswith("| `a` - `b` |"))
    assert "| -0.1000 [-, -] | 1/1 | - |" in row, row  # one seed at 12 steps: no interval, no p
    assert row.endswith("| +0.1100 [+0.0852, +0.1348] | 0/3 | 0.003 | 0.01, 0.005 |"), row
    (out / "b--lr0.005" / "seed100").rename(out / "gone")  # b's tuning unfinished: its best lr is not settled
    (c,) = robust.analyze(d)["contrasts"]
    assert c["at_best"] is None and c["lengths"]["4"]["n"] == 3


# --- the report ----------------------------------------------------------------------------------------

def test_the_bench_ratios_are_the_bench_files():
    ratios = robust.bench_ratios(robust.load_design("experiments/configs/robust_cpu.py"))
    bench = {s["variant"]: s for s in json.loads((ROOT / "docs/results/bench_cpu_exp_size.json").read_text())["steps"]}
    assert set(ratios["variants"]) == {"standard", "block_attnres", "rd_attnres", "muddformer", "delta_attnres"}
    assert ratios["variants"]["muddformer"]["speed_ratio"] == bench["muddformer"]["speed_ratio"]
    assert robust.bench_name("residual=delta_attnres delta_block_size=4") == "delta_attnres:delta_block_size=4"


def strict_json(path):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(Path(path).read_text(), parse_constant=refuse)


def test_a_partial_design_reports_what_exists_and_what_is_missing(tmp_path):
    d = noisy_design(tmp_path)
    for s in d["seeds"]:  # the long runs have not finished
        for name in ("mudd--steps12", "standard--steps12"):
            for f in (tmp_path / "runs" / name / f"seed{s}").iterdir():
                f.unlink()
    robust.report(d)
    result = strict_json(tmp_path / "runs" / "robust.json")
    cell = result["multipliers"]["mudd"]["4"]
    assert cell["partial"] and cell["ladder"] == [4, 6, 8] and cell["flops"] > 1
    assert result["multipliers"]["mudd"]["12"]["flops"] is None  # no run: null, never invented
    assert result["gaps"]["12"][0]["n"] == 0 and result["gaps"]["12"][0]["mean"] is None
    assert "mudd--steps12/seed0" in result["missing"]["compare"]
    text = (tmp_path / "runs" / "robust.md").read_text()
    assert "(partial)" in text and "on the whole validation split (each run's scores.json" in text
    assert "## c. Compute along the data axis" in text and "not the papers' multiplier across model sizes" in text
    assert str(tmp_path) not in text + (tmp_path / "runs" / "robust.json").read_text()  # run paths relative
    for s in (1, 2):  # one seed left: a read-off, no interval
        for f in (tmp_path / "runs" / "mudd" / f"seed{s}").iterdir():
            f.unlink()
    one = robust.analyze(d)["multipliers"]["mudd"]["4"]
    assert one["seeds"] == [0] and one["flops"] > 1 and one["interval"] is None


def test_the_score_is_the_whole_split_and_an_unscored_run_waits(tmp_path, capsys):
    """The declared score is the whole validation split: a finished run without scores.json is left out
    and listed as unscored (not unfinished); score = "val_prefix" reads the logged prefix instead."""
    d = noisy_design(tmp_path)
    whole = robust.analyze(d)
    assert whole["design"]["score"] == "val" and whole["unscored"] == dict(tune=[], compare=[], best=[])
    (tmp_path / "runs" / "mudd" / "seed1" / "scores.json").unlink()
    partial = robust.analyze(d)
    assert partial["unscored"]["compare"] == ["mudd/seed1"] and partial["missing"]["compare"] == []
    assert partial["gaps"]["4"][0]["n"] == 2 and partial["multipliers"]["mudd"]["4"]["seeds"] == [0, 2]
    robust.report(d)
    text = (tmp_path / "runs" / "robust.md").read_text()
    assert "1 finished run(s) have no whole-split scores yet and are left out" in text and "1 unscored: `mudd/seed1`" in text
    capsys.readouterr()
    robust.list_runs(d)  # --list: finished is finished, scored or not
    assert "  done  mudd/seed1  " in capsys.readouterr().out
    d["score"] = "val_prefix"  # as --score val_prefix sets it
    prefix = robust.analyze(d)
    assert prefix["unscored"]["compare"] == [] and prefix["gaps"]["4"][0]["n"] == 3
    assert {r["dir"]: r["val_loss"] for r in prefix["runs"]}["standard/seed0"] == pytest.approx(
        {r["dir"]: r["val_loss"] for r in whole["runs"]}["standard/seed0"] + PREFIX)
    robust.report(d)
    assert "not whole-split scores" in (tmp_path / "runs" / "robust.md").read_text()


# --- a tiny design, end to end ---------------------------------------------------------------------------

def test_a_tiny_design_end_to_end(tmp_path, data_dir, monkeypatch):
    """2 variants x 2 lrs on 1 tuning seed, then 2 comparison seeds at 4 and 6 steps: trained in this
    process (experiments.sweep's runner, with train.py called in place of a child process), then the report."""
    path = tmp_path / "design.py"
    path.write_text(f'base = "configs/test.py"\n'
                    f'variants = {{"standard": "residual=standard", "block": "residual=block_attnres"}}\n'
                    f'reference = "standard"\nlrs = [1e-2, 3e-2]\ntuning_seeds = [7]\nseeds = [0, 1]\n'
                    f'steps = [4, 6]\nladder = [4, 6]\n'
                    f'overrides = "data_dir={data_dir} max_steps=4 eval_interval=2 ckpt_interval=0 log_interval=2"\n'
                    f'out_dir = {str(tmp_path / "runs")!r}\n')
    ran, scored = [], []

    def in_process(cmd):
        if cmd[1:3] == ["-m", "experiments.rescore"]:  # the sweep scores its finished runs on whole splits
            scored.extend(cmd[3:])
            return rescore.main(cmd[3:])
        ran.append(next(a for a in cmd if a.startswith("--out_dir=")).rsplit("/", 1)[1] + "/" +
                   next(a for a in cmd if a.startswith("--run_name=")).split("=")[1])
        return cli(train.main, cmd[2:])

    monkeypatch.setattr(sweep, "run_child", in_process)
    result = robust.main([str(path)])
    best = result["lr"]["settled"]
    assert set(best) == {"standard", "block"}
    expected = {"standard/seed7", "standard--lr0.03/seed7", "block/seed7", "block--lr0.03/seed7"} | \
        {f"{n}/seed{s}" for n in ("standard", "block", "standard--steps6", "block--steps6") for s in (0, 1)} | \
        {f"{v}--lr0.03/seed{s}" for v, lr in best.items() if lr == 0.03 for s in (0, 1)}
    assert set(ran) == expected and len(ran) == len(expected)
    out = tmp_path / "runs"
    assert sorted(scored) == sorted(str(out / d) for d in expected)  # each run scored once, on whole splits
    report = strict_json(out / "robust.json")
    assert {r["dir"] for r in report["runs"]} == expected and all(r["steps"] in (4, 6) for r in report["runs"])
    assert report["missing"] == dict(tune=[], compare=[], best=[])
    assert report["gaps"]["4"][0]["n"] == 2 and report["multipliers"]["block"]["6"]["seeds"] == [0, 1]
    text = (out / "robust.md").read_text()
    for heading in ("## a. Learning rate", "## b. The gap", "## c. Compute", "## d. Wall-clock", "## Runs"):
        assert heading in text
    assert str(tmp_path) not in text
    assert f"Provenance: not recorded (none of the {len(expected)} runs' summary.json has it" in text
    assert "Declared in `design.py`, at a commit not known here (" in text  # no git checkout holds it
    if robust_report.pyplot() is not None:
        assert (out / "loss_vs_flops.png").stat().st_size > 0
    ran.clear()
    robust.main([str(path)])  # everything finished and scored: nothing reruns
    assert ran == [] and len(scored) == len(expected)


# --- the report's files: whole or not at all ---------------------------------------------------------------

REPORT_FILES = ("robust.md", "robust.json", "loss_vs_flops.png")
NO_MATPLOTLIB = "matplotlib is not installed: skipping plots (pip install matplotlib)\n"


@pytest.mark.parametrize("free", [0, 8192])
@pytest.mark.parametrize("older", [False, True])
def test_a_full_disk_leaves_each_report_file_whole_and_is_one_warning(free, older, tmp_path, full_disk, capsys):
    """robust.json was left at 0 bytes (or cut at 4,096 with 8 KB free) beside a new robust.md, with a
    traceback (from the plot, when older report files were there)."""
    d = noisy_design(tmp_path)
    out = tmp_path / "runs"
    if older:
        robust.report(d)
    before = {f: (out / f).read_bytes() for f in REPORT_FILES if (out / f).exists()}
    capsys.readouterr()
    full_disk(out, free)
    robust.report(d)
    printed, err = capsys.readouterr()
    err = err.replace(NO_MATPLOTLIB, "")
    assert "## a. Learning rate" in printed
    assert err.count("\n") == 1 and err.startswith("warning: could not write robust") and \
        err.endswith(f" in {out} (no space left on device); the report above is complete\n"), err
    unwritten = err.split("could not write ")[1].split(f" in {out}")[0].split(", ")
    assert "robust.json" in unwritten  # 8 KB is less than robust.json
    for f in REPORT_FILES:
        if f in unwritten:  # as it was: the older file, or none
            assert (out / f).read_bytes() == before[f] if f in before else not (out / f).exists()
    assert (out / "robust.md").exists() or "robust.md" in unwritten
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


def test_a_read_only_out_dir_is_one_warning_as_in_a_sweep(tmp_path, read_only, capsys):
    d = noisy_design(tmp_path)
    out = tmp_path / "runs"
    read_only(out)
    result = robust.report(d)
    printed, err = capsys.readouterr()
    err = err.replace(NO_MATPLOTLIB, "")
    assert result["multipliers"]["mudd"]["4"]["flops"] > 1 and "## c. Compute" in printed
    plot = ", loss_vs_flops.png" if robust_report.pyplot() is not None else ""
    assert err == (f"warning: could not write robust.md, robust.json{plot} in {out} (read-only file system); "
                   "the report above is complete\n")
    assert not any((out / f).exists() for f in REPORT_FILES)


def test_odd_run_files_are_unfinished_runs_and_a_bad_bench_file_is_one_line(tmp_path):
    """robust (and the ladder, which reads runs the same way: experiments.rundirs.finished_run) crashed on run files
    that are not train.py's: a summary.json that is a list, a step that is text, a config.json without its
    train keys, a model config no model.py builds, an lr that is missing. Such a run is unfinished (listed as
    such), never read; a bench file that is not tools.bench's is one `error:` line."""
    fake_run(tmp_path, "standard", 0, 2.0, 4)
    d = tmp_path / "standard" / "seed0"
    assert robust.read_run(tmp_path, "standard", 0)["val_loss"] == 2.0
    odd = [("summary.json", "[1, 2]"), ("summary.json", '{"step": "4", "val_loss": 2.0}'),
           ("config.json", '{"model": {}}'),
           ("config.json", json.dumps({"train": {"batch_tokens": 8, "lr": 0.01, "min_lr": 0.001}, "model": {"n_layer": "x"}})),
           ("config.json", json.dumps({"train": {"batch_tokens": BATCH}, "model": dict(TINY)}))]
    for name, text in odd:
        kept = (d / name).read_text()
        (d / name).write_text(text)
        assert robust.read_run(tmp_path, "standard", 0) is None, (name, text)
        (d / name).write_text(kept)
    for text in ("not json", "[]", '{"steps": 3}', '{"steps": [{"variant": "standard"}], "args": []}'):
        (tmp_path / "bench.json").write_text(text)
        design = design_file(tmp_path, bench=repr(str(tmp_path / "bench.json")))
        with pytest.raises(UserError, match=rf"^bench file {tmp_path / 'bench.json'} is not a tools.bench JSON "
                                             r"file \(.*\): run python -m tools.bench at the design's size, or drop bench"):
            robust.bench_ratios(design)


def test_a_design_whose_recipe_changed_under_its_runs_is_refused(tmp_path, monkeypatch):
    """experiments.robust ran its stages with the sweep's runner but never checked its design against the runs
    it had: after its overrides changed, new runs trained with the new recipe were paired with the old ones."""
    path = tmp_path / "design.py"
    path.write_text('base = "configs/test.py"\nvariants = {"standard": "residual=standard"}\nreference = "standard"\n'
                    'lrs = [0.01]\ntuning_seeds = [7]\nseeds = [0]\nsteps = [4]\nladder = [4, 6]\n'
                    f'overrides = "max_steps=4 warmup_steps=1"\nout_dir = {str(tmp_path / "runs")!r}\n')
    monkeypatch.setattr(sweep, "run_child", fake_train())
    robust.main([str(path), "--stage", "tune"])
    path.write_text(path.read_text().replace("warmup_steps=1", "warmup_steps=2"))
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError, match="design changed.*warmup_steps 1 \\(now 2\\)"):
        robust.main([str(path), "--stage", "compare"])
