"""experiments/report.py: the declared family (selection, Holm, the gate of the controls), exploratory
and twin comparisons, whole-split scores, the tables and plots, on runs with known numbers."""

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments import plots, report, stats, sweep

from sweeps import finished_run, strict_json, sweep_file, sweep_spec


def fake_runs():
    """Two variants x three seeds; the whole-split scores are the prefix ones plus a shift per variant."""
    val = {("base", 0): 3.00, ("base", 1): 3.10, ("base", 2): 2.90,
           ("new", 0): 2.95, ("new", 1): 3.12, ("new", 2): 2.80}
    return [dict(variant=v, seed=s, val_loss=loss, test_loss=loss + 0.5, whole={"val": loss + (v == "new") * 0.01},
                 tokens_per_s=1000.0 if v == "base" else 900.0, peak_memory_bytes=100 if v == "base" else 120,
                 params=1000 if v == "base" else 1012, curve={}) for (v, s), loss in val.items()]


def runs_of(deltas, base=3.0):
    """Runs of "ref" and of each variant in deltas {variant: [Δ per seed]}, the same Δ on every score."""
    out = []
    for seed in range(len(next(iter(deltas.values())))):
        loss = base + 0.1 * seed
        out.append(dict(variant="ref", seed=seed, val_loss=loss, test_loss=loss, whole={"val": loss, "test": loss}))
        for v, d in deltas.items():
            x = loss + d[seed]
            out.append(dict(variant=v, seed=seed, val_loss=x, test_loss=x, whole={"val": x, "test": x}))
    return out


# --- the comparisons ----------------------------------------------------------------------------------

def test_a_comparison_s_arithmetic_on_each_score():
    by = report.by_variant(fake_runs())
    c = report.compare(by["new"], by["base"], "val_prefix")
    assert c["deltas"] == pytest.approx({"0": -0.05, "1": 0.02, "2": -0.10})
    t = stats.paired_t([-0.05, 0.02, -0.10])
    assert (c["delta_mean"], c["delta_std"], c["p"]) == (pytest.approx(t["mean"]), pytest.approx(t["sd"]), pytest.approx(t["p"]))
    assert c["ci95"] == pytest.approx([t["lo"], t["hi"]]) and c["wins"] == 2 and c["paired_seeds"] == 3
    assert c["sign_flip_p"] == stats.sign_flip_p(list(c["deltas"].values()))
    assert c["detectable"] == pytest.approx(stats.detectable(t["sd"], 3))
    assert c["ppl_change_pct"] == pytest.approx(100 * (math.exp(-0.13 / 3) - 1))
    whole = report.compare(by["new"], by["base"], "val")  # the whole split: the variant's shift of +0.01
    assert whole["delta_mean"] == pytest.approx(-0.13 / 3 + 0.01)
    assert report.compare(by["new"], by["base"], "test")["paired_seeds"] == 0  # no run has it: nothing paired
    assert report.compare(by["new"], by["base"], "test_prefix")["delta_mean"] == pytest.approx(-0.13 / 3)


def test_only_seeds_both_have_are_paired():
    runs = [r for r in fake_runs() if not (r["variant"] == "base" and r["seed"] == 2)]
    runs[0]["whole"] = {}  # base seed 0 not scored on the whole split yet
    by = report.by_variant(runs)
    assert report.compare(by["new"], by["base"], "val_prefix")["paired_seeds"] == 2
    assert report.compare(by["new"], by["base"], "val")["deltas"] == pytest.approx({"1": 0.02 + 0.01})


def test_the_variant_rows():
    rows = {r["variant"]: r for r in report.describe(fake_runs(), "base", "val")}
    new = rows["new"]
    assert new["params_vs_reference_pct"] == pytest.approx(1.2)
    assert new["scores"]["val_prefix"]["mean"] == pytest.approx((2.95 + 3.12 + 2.80) / 3)
    assert new["scores"]["val"]["mean"] == pytest.approx((2.95 + 3.12 + 2.80) / 3 + 0.01)
    assert new["scores"]["test"] == dict(n=0, mean=None, sd=None)
    assert new["tokens_per_s_ratio"] == pytest.approx(0.9) and new["memory_ratio"] == pytest.approx(1.2)


# --- the family -----------------------------------------------------------------------------------------

def test_gated_holm_on_hand_computed_cases():
    # two primaries at 0.025 each; the first rejects (0.01 <= 0.025) and passes its 0.025 to its control
    # (0.02 <= 0.025: rejects), which passes it on to the second primary (0.04 <= 0.05)
    adjusted, local = stats.gated_holm([0.01, 0.04], {0: 0.02})
    assert adjusted["primary"] == pytest.approx([0.02, 0.04]) and adjusted["gated"] == pytest.approx({0: 0.04})
    assert local["primary"] == pytest.approx([0.5, 1.0]) and local["gated"] == pytest.approx({0: 0.5})
    # the gate stays shut: the control's tiny p counts for nothing until its variant's test rejects
    adjusted, local = stats.gated_holm([0.6, 0.08], {0: 0.001})
    assert adjusted["primary"] == pytest.approx([0.6, 0.16]) and adjusted["gated"] == pytest.approx({0: 0.6})
    assert local["gated"] == {0: 0.0}
    # without gated tests it is Holm's procedure to the bit (exact weights), nan left out as holm() leaves it;
    # also on the boundary, where float weights (1/7 + 1/7 ...) would miss a rejection
    for ps in ([0.01, 0.04, 0.03, 0.005], [0.5, 0.9], [0.02, math.nan, 0.04], [0.2], [0.05 / (7 - i) for i in range(7)]):
        got = stats.gated_holm(ps, {})[0]["primary"]
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, stats.holm(ps)))
    assert stats.gated_holm([0.05 / (7 - i) for i in range(7)], {})[0]["primary"] == [0.05] * 7
    # a gated primary that rejects keeps its level for its control: the other primaries are tested at
    # less than Holm's level when the control does not reject (the price of the gate)
    assert stats.gated_holm([0.001, 0.04], {0: 0.5})[0]["primary"] == pytest.approx([0.002, 0.08])


def test_graph_procedure_rejects_exactly_where_the_local_level_is_met():
    import random
    rng = random.Random(0)
    for _ in range(200):
        m = rng.randint(1, 6)
        ps = [rng.random() ** 3 for _ in range(m)]
        gated = {i: rng.random() ** 3 for i in range(m) if rng.random() < 0.5}
        adjusted, local = stats.gated_holm(ps, gated, alpha=0.05)
        for a, w, p in [(adjusted["primary"][i], local["primary"][i], ps[i]) for i in range(m)] + \
                [(adjusted["gated"][i], local["gated"][i], gated[i]) for i in gated]:
            assert (a <= 0.05) == (w > 0 and p <= w * 0.05)


def test_the_family_of_the_cpu_sweep_is_the_declared_one():
    spec = sweep.load_sweep("experiments/configs/sweep_cpu.py")
    kinds = {}
    for kind, v, b in report.plan(spec, spec["variants"]):
        kinds.setdefault(kind, []).append((v, b))
    assert kinds["primary"] == [tuple(p) for p in spec["primary"]] and len(kinds["primary"]) == 8
    assert kinds["control"] == [("muddformer", "standard_mlp549"), ("mhc", "standard_mlp608")]
    assert kinds["twin"] == [("rd_tied", "block_attnres")]
    assert not any("rd_tied" in pair for pair in kinds["exploratory"])  # a twin is in no family
    assert ("standard", "block_attnres") not in kinds["exploratory"]  # the reference is no variant of the second
    assert ("standard_mlp549", "block_attnres") not in kinds["exploratory"]
    assert ("rd_average", "block_attnres") in kinds["exploratory"] and ("rd_attnres", "standard") in kinds["exploratory"]
    every = [pair for pairs in kinds.values() for pair in pairs]
    assert len(every) == len(set(every))  # no comparison twice


def test_a_control_is_tested_only_once_its_variant_rejects():
    runs = runs_of({"strong": [-0.05, -0.06, -0.055, -0.052, -0.058], "weak": [0.01, -0.02, 0.03, -0.01, 0.0],
                    "ctrl_s": [-0.01, -0.012, -0.008, -0.011, -0.009], "ctrl_w": [-0.03, -0.03, -0.031, -0.029, -0.03]})
    spec = sweep_spec(None, variants=("ref", "strong", "weak", "ctrl_s", "ctrl_w"), out_dir="unused",
                      primary=[("strong", "ref"), ("weak", "ref")], controls={"strong": "ctrl_s", "weak": "ctrl_w"})
    ts = {(c["kind"], c["variant"]): c for c in report.tests(spec, runs)}
    strong, weak = ts[("primary", "strong")], ts[("primary", "weak")]
    assert strong["rejected"] and not weak["rejected"]
    ps = [strong["p"], weak["p"]]
    adjusted, local = stats.gated_holm(ps, {0: ts[("control", "strong")]["p"], 1: ts[("control", "weak")]["p"]})
    assert [strong["p_adj"], weak["p_adj"]] == pytest.approx(adjusted["primary"])
    assert ts[("control", "strong")]["rejected"] is True and ts[("control", "strong")]["level"] == pytest.approx(0.025)
    shut = ts[("control", "weak")]  # strong against ctrl_w would reject, but weak did not: never tested
    assert shut["rejected"] is None and shut["level"] == 0 and shut["p"] < 0.05
    assert strong["detectable"] == pytest.approx(stats.detectable(strong["delta_std"], 5, 0.05 / 2))
    explore = [c for c in report.tests(spec, runs) if c["kind"] == "exploratory"]
    assert {(c["variant"], c["baseline"]) for c in explore} == {("ctrl_s", "ref"), ("ctrl_w", "ref")}  # does width help?
    assert not any("p_adj" in c for c in explore)  # uncorrected: no claim


def test_without_a_declared_family_everything_is_exploratory(tmp_path, capsys):
    spec = sweep_spec(tmp_path, controls={"b": "a"})
    for v, d in (("a", 0.0), ("b", -0.01)):
        for s in (0, 1):
            finished_run(tmp_path / "runs" / v / f"seed{s}", 3.0 + d + 0.003 * s * (v == "b"))
    ts = report.report(spec)
    assert [c["kind"] for c in ts] == ["exploratory"] and "p_adj" not in ts[0]
    out = capsys.readouterr().out
    assert out.startswith("No primary family is declared in the sweep file (`primary`): every comparison below is "
                          "exploratory.")
    assert "| `b` − `a` | -0.0085 [" in out  # (-0.010 and -0.007 on the whole val split)


def test_the_forest_interval_excludes_zero_exactly_where_the_marker_is_filled():
    runs = runs_of({"a": [-0.02, -0.021, -0.019], "b": [-0.01, 0.002, -0.012], "c": [-0.03, -0.02, -0.035],
                    "d": [0.001, -0.001, 0.0005]})
    spec = sweep_spec(None, variants=("ref", "a", "b", "c", "d"), out_dir="unused",
                      primary=[("a", "ref"), ("b", "ref"), ("c", "ref")])
    for c in report.tests(spec, runs):
        lo, hi, filled = plots.forest_interval(c)
        if c["kind"] == "primary":
            assert filled == c["rejected"] == (lo > 0 or hi < 0)
        else:  # exploratory: the uncorrected 95% interval
            assert (lo, hi) == pytest.approx(tuple(c["ci95"])) and filled == (c["p"] < 0.05)


# --- the report ---------------------------------------------------------------------------------------------

def test_the_report_uses_whole_split_scores_and_keeps_no_machine_paths(tmp_path, capsys):
    spec = sweep_spec(tmp_path, variants=("a", "b", "twin"), seeds=(0, 1, 2), primary=[("b", "a")], twins={"twin": "a"})
    for s in (0, 1, 2):
        finished_run(tmp_path / "runs" / "a" / f"seed{s}", 3.0 + 0.1 * s)
        finished_run(tmp_path / "runs" / "twin" / f"seed{s}", 3.0 + 0.1 * s)
        finished_run(tmp_path / "runs" / "b" / f"seed{s}", 2.98 + 0.1 * s + 0.001 * s)
    stale = tmp_path / "runs" / "b" / "seed2" / "scores.json"  # scored at another checkpoint: not this run's
    stale.write_text(stale.read_text().replace('"step": 4', '"step": 2'))
    report.report(spec)
    out, err = capsys.readouterr()
    assert "note: 1 of 9 finished runs have no score on the whole validation split" in err
    assert "Primary family (1 tests, declared in the sweep file), on the whole validation split" in out
    assert "| `b` − `a` | -0.0195 [" in out and "| 2/2 |" in out  # seeds 0 and 1: -0.020, -0.019
    assert "| `twin` | `a` | 3 | 0.0e+00 | 0.0e+00 | 0.0e+00 | 0.0e+00 | yes, bit for bit |" in out
    assert "The same family on every score (Δ, adjusted p; the tests use val (whole)):" in out
    results = strict_json(tmp_path / "runs" / "results.json")
    assert {r["run_dir"] for r in results["runs"]} == {f"{v}/seed{s}" for v in ("a", "b", "twin") for s in (0, 1, 2)}
    assert str(tmp_path) not in (tmp_path / "runs" / "results.json").read_text()
    assert [(t["kind"], t["variant"]) for t in results["tests"]] == [("primary", "b"), ("twin", "twin")]
    lines = (tmp_path / "runs" / "results.csv").read_text().splitlines()
    assert lines[0].startswith("variant,seed,val_loss,test_loss,val_whole,test_whole,") and len(lines) == 10


def test_one_seed_gives_strict_json_and_tables_that_say_so(tmp_path, capsys):
    spec = sweep_spec(tmp_path, seeds=(0,))
    finished_run(tmp_path / "runs" / "a" / "seed0", 3.0)
    finished_run(tmp_path / "runs" / "b" / "seed0", 3.01)
    report.report(spec)
    out = capsys.readouterr().out
    assert "± 0.0000" not in out and "3.0010 (1 seed)" in out
    assert "| `b` − `a` | +0.0100 [needs 2 seeds] | 0/1 | n/a | 1.000 | - |" in out
    tests = strict_json(tmp_path / "runs" / "results.json")["tests"]
    assert tests[0]["ci95"] == [None, None] and tests[0]["p"] is None and tests[0]["delta_std"] is None


def test_the_tables_of_a_sweep_where_only_the_reference_finished(tmp_path, capsys):
    spec = sweep_spec(tmp_path, primary=[("b", "a")])
    finished_run(tmp_path / "runs" / "a" / "seed0", 3.0)
    finished_run(tmp_path / "runs" / "a" / "seed1", 3.1)
    report.report(spec)
    out = capsys.readouterr().out
    for block in out.strip().split("\n\n"):  # every table well formed: as many cells in each line as columns
        lines = block.splitlines()
        if lines[0].startswith("|"):
            assert len({line.count("|") for line in lines}) == 1 and len(lines) > 2, block
        else:
            assert len(lines) == 1, block
    assert "Each seed's difference to `a`: none yet (no other variant has finished a run)." in out
    strict_json(tmp_path / "runs" / "results.json")


def test_gap_over_training_pairs_each_evaluation_with_its_band():
    curves = {("base", 0): {"100": 3.0, "200": 2.5}, ("base", 1): {"100": 3.2, "200": 2.7},
              ("new", 0): {"100": 2.9, "200": 2.45}, ("new", 1): {"100": 3.3, "200": 2.6}}
    runs = [dict(variant=v, seed=s, curve=c) for (v, s), c in curves.items()]
    gaps = report.gap_over_training(runs, "base", ["base", "new"])
    assert list(gaps) == ["new"] and list(gaps["new"]) == [100, 200]
    t = stats.paired_t([-0.05, -0.1])
    assert gaps["new"][200] == (pytest.approx(-0.075), 2, 2, pytest.approx(t["lo"]), pytest.approx(t["hi"]))
    assert gaps["new"][100][:3] == (pytest.approx(0.0), 1, 2)
    assert report.gap_over_training(runs, "second", ["base", "second"]) == {}  # no run of that reference yet


def test_plots_of_a_sweep_that_has_barely_started(tmp_path):
    runs = [dict(variant="base", seed=0, val_loss=3.0, whole={}, curve={"2": 3.0})]
    spec = sweep_spec(tmp_path, variants=("base",))
    assert plots.plot_forest(report.tests(spec, runs), "val", tmp_path / "forest.png") is None  # nothing to compare
    assert plots.plot_gaps({"base": ({}, [])}, tmp_path / "gaps.png") is None


def test_the_gap_plot_draws_one_panel_per_highlighted_comparison(tmp_path):
    gaps = {"base": {"a": {100: (-0.01, 1, 2, -0.05, 0.03)}, "b": {100: (0.02, 1, 2, -0.1, 0.14)}, "c": {}},
            "second": {"d": {100: (0.0, 2, 2, -0.02, 0.02)}}}
    panels = {"base": (gaps["base"], ["b", "c", "a"]), "second": (gaps["second"], ["d"])}
    assert [(b, v) for b, v, _ in plots.gap_cells(panels)] == [("base", "b"), ("base", "a"), ("second", "d")]
    if plots.pyplot() is not None:
        assert plots.plot_gaps(panels, tmp_path / "gaps.png") == tmp_path / "gaps.png"
        assert (tmp_path / "gaps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_file_declares_its_family_and_the_sweep_scores_its_runs(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path, variants=("a", "b", "c"), seeds=(0,), extra='primary = [("b", "a")]\ntwins = {"c": "a"}\n')
    spec = sweep.load_sweep(str(path))
    assert (spec["primary"], spec["twins"], spec["score"], spec["alpha"]) == ([("b", "a")], {"c": "a"}, "val", 0.05)
    finished_run(tmp_path / "runs" / "a" / "seed0", 3.0, whole=False)  # finished, not scored: with its checkpoint
    (tmp_path / "runs" / "a" / "seed0" / "ckpt.pt").write_bytes(b"")
    finished_run(tmp_path / "runs" / "c" / "seed0", 3.0, whole=False)  # no single-file checkpoint: nothing to score
    ran = []

    def child(cmd):
        ran.append(cmd[1:])
        if cmd[1:3] != ["-m", "experiments.rescore"]:
            finished_run(tmp_path / "runs" / "b" / "seed0", 2.9)
        return 0
    monkeypatch.setattr(sweep, "run_child", child)
    assert sweep.main([str(path)]) == 0
    assert ran[1:] == [["-m", "experiments.rescore", str(tmp_path / "runs" / "a" / "seed0")]]  # one child, after the runs
    err = capsys.readouterr().err
    assert f"note: 2 of 3 finished runs have no score on the whole validation split (the tests pair only the seeds that " \
           f"have it): python -m experiments.rescore --sweep {path}" in err
    assert json.loads((tmp_path / "runs" / "results.json").read_text())["primary"] == [["b", "a"]]


def test_two_sweep_processes_share_the_scoring(tmp_path, monkeypatch):
    """Each finished run is claimed and scored on its own: a second sweep process that reaches the scoring
    while the first scores one run takes the next ones (it used to find them all claimed and stop)."""
    spec = sweep_spec(tmp_path, variants=("a", "b"), seeds=(0, 1))
    for v in ("a", "b"):
        for seed in (0, 1):
            finished_run(tmp_path / "runs" / v / f"seed{seed}", 3.0, whole=False)
            (tmp_path / "runs" / v / f"seed{seed}" / "ckpt.pt").write_bytes(b"")
    scored = []

    def rescore(cmd, by="first"):
        d = Path(cmd[3])
        scored.append((by, f"{d.parent.name}/{d.name}"))
        if len(scored) == 1:  # the second process arrives while the first scores its first run
            monkeypatch.setattr(sweep, "run_child", lambda c: rescore(c, "second"))
            sweep.score_all(spec)
            monkeypatch.setattr(sweep, "run_child", rescore)
        finished_run(d, 3.0)  # scores.json written
        return 0
    monkeypatch.setattr(sweep, "run_child", rescore)
    sweep.score_all(spec)
    assert scored == [("first", "a/seed0"), ("second", "b/seed0"), ("second", "a/seed1"), ("second", "b/seed1")]


def test_a_declared_test_without_runs_stays_in_the_family_and_never_rejects(tmp_path, capsys):
    """A primary whose baseline has not run yet, and a control with one paired seed: each keeps its
    share of alpha (m counts every declared test), says why it has no test, and the report does not
    stop on it."""
    runs = runs_of({"v": [-0.05, -0.051, -0.049], "w": [-0.05, -0.06, -0.055]})
    runs += [dict(variant="ctrl", seed=0, val_loss=3.0, test_loss=3.0, whole={"val": 3.0, "test": 3.0})]
    spec = sweep_spec(None, variants=("ref", "v", "w", "ctrl", "late"), out_dir="unused",
                      primary=[("v", "ref"), ("w", "late")], controls={"v": "ctrl", "w": "ctrl"})
    ts = {(c["kind"], c["variant"]): c for c in report.tests(spec, runs)}
    late, gate = ts[("primary", "w")], ts[("control", "v")]
    assert late["paired_seeds"] == 0 and late["rejected"] is False
    assert ts[("primary", "v")]["rejected"] and ts[("primary", "v")]["level"] == pytest.approx(0.025)  # alpha / 2
    assert gate["paired_seeds"] == 1 and gate["rejected"] is False and gate["level"] == pytest.approx(0.025)
    table = report.family_table(list(ts.values()), spec, "val")
    assert "Primary family (2 tests, declared in the sweep file)" in table
    assert "| `w` − `late` | n/a (no paired seed) | 0/0 | n/a | 1.000 | n/a | - | no test: 0 paired seeds (counts in the " \
           "family) |" in table
    assert "no test: 1 paired seed (counts in the family) |" in table


# --- equivalence: a difference, equivalence, or neither --------------------------------------------------

def test_tost_rejects_exactly_where_the_1_minus_2alpha_interval_is_inside_the_margin():
    import random
    rng = random.Random(3)
    for _ in range(200):
        n = rng.choice([2, 3, 5, 16])
        d = [rng.gauss(rng.uniform(-0.01, 0.01), rng.uniform(0.001, 0.01)) for _ in range(n)]
        margin, alpha = rng.uniform(0.002, 0.02), rng.choice([0.05, 0.025])
        t = stats.paired_t(d, confidence=1 - 2 * alpha)
        inside = -margin < t["lo"] and t["hi"] < margin
        p = stats.tost(d, margin)
        if abs(p - alpha) > 1e-9:  # away from the boundary, where rounding could go either way
            assert (p <= alpha) == inside
    assert math.isnan(stats.tost([0.001], 0.01))  # one seed: no test
    assert stats.tost([0.001, 0.001], 0.01) == 0.0 and stats.tost([0.02, 0.02], 0.01) == 1.0  # sd 0


def test_each_primary_test_shows_a_difference_equivalence_or_neither(tmp_path):
    deltas = {"diff": [-0.05, -0.048, -0.052, -0.051, -0.049],      # far from 0: a difference beyond the margin
              "same": [0.0004, -0.0006, 0.0002, 0.0, -0.0003],      # tight around 0: inside +-0.006
              "vague": [0.012, -0.02, 0.015, -0.011, 0.004],        # wide: the design cannot tell
              "small": [0.0010, 0.0011, 0.0009, 0.00105, 0.00095],  # a real difference, smaller than the margin
              "near": [-0.010, -0.004, -0.008, -0.012, -0.005]}     # a difference; its interval reaches inside it
    runs = runs_of(deltas)
    spec = sweep_spec(None, variants=("ref", *deltas), out_dir="unused", equivalence_margin=0.006,
                      primary=[(v, "ref") for v in deltas])
    ts = {c["variant"]: c for c in report.tests(spec, runs) if c["kind"] == "primary"}
    assert {v: c["shows"] for v, c in ts.items()} == dict(diff="difference", same="equivalence", vague="neither",
                                                         small="difference", near="difference")
    assert ts["small"]["inside_margin"] and ts["small"]["equivalent"] and not ts["diff"]["inside_margin"]
    # beyond the margin exactly where the 95% interval lies wholly outside +-0.006 (near's: [-0.0119, -0.0037])
    assert {v for v, c in ts.items() if c["beyond_margin"]} == {"diff"}
    assert ts["near"]["ci95"][0] < -0.006 < ts["near"]["ci95"][1] < 0 and ts["near"]["rejected"]
    ps = [stats.tost(deltas[v], 0.006) for v in deltas]
    assert [ts[v]["p_equiv"] for v in deltas] == pytest.approx(ps)
    assert [ts[v]["p_equiv_adj"] for v in deltas] == pytest.approx(stats.holm(ps))  # Holm within the primary tests
    assert ts["vague"]["p_equiv_adj"] > 0.05 and not ts["vague"]["rejected"]
    table = report.family_table(list(ts.values()), spec, "val")
    assert "Equivalence margin ±0.006 nats:" in table and "| TOST p (adj.) | verdict |" in table
    assert "| **a difference beyond the margin** |" in table and "**equivalence** (inside ±0.006) |" in table
    assert "| **a difference**, not shown as large as the margin |" in table
    assert "neither: no difference shown, nor equivalence within ±0.006 |" in table
    assert "**a difference** (and inside ±0.006) |" in table
    assert "NLL in nats per byte" in report.family_table(list(ts.values()), spec, "val", "byte")


def test_a_margin_without_runs_shows_neither_and_the_report_keeps_it(tmp_path, capsys):
    spec = sweep_spec(tmp_path, variants=("a", "b", "c"), primary=[("b", "a"), ("c", "a")], equivalence_margin=0.01)
    for v, d in (("a", 0.0), ("b", -0.001)):
        for s in (0, 1):
            finished_run(tmp_path / "runs" / v / f"seed{s}", 3.0 + 0.1 * s + d)
    ts = {c["variant"]: c for c in report.report(spec) if c["kind"] == "primary"}
    assert ts["c"]["shows"] == "neither" and math.isnan(ts["c"]["p_equiv"]) and ts["c"]["p_equiv_adj"] == 1.0
    assert "neither: no test, 0 paired seeds" in capsys.readouterr().out
    saved = strict_json(tmp_path / "runs" / "results.json")
    assert saved["equivalence_margin"] == 0.01 and saved["tests"][1]["shows"] == "neither"


def test_reports_written_at_once_share_no_temporary_file(tmp_path, monkeypatch, capsys):
    """Three --table_only processes at once shared fixed temporary names (.curves.tmp.png): one renamed
    the other's away and reported a missing file. Here a second report writes every file between the
    first one's write of results.md and its rename."""
    spec = sweep_spec(tmp_path, seeds=(0, 1))
    for v, s in (("a", 0), ("a", 1), ("b", 0), ("b", 1)):
        finished_run(tmp_path / "runs" / v / f"seed{s}", 3.0 + 0.1 * s + (v == "b") * 0.01)
    real, nested = os.replace, []

    def replace(src, dst):
        if Path(dst).name == "results.md" and not nested:
            nested.append(1)
            report.report(spec)  # the other process, all of it
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    report.report(spec)
    err = capsys.readouterr().err
    assert nested and "warning" not in err, err
    assert strict_json(tmp_path / "runs" / "results.json")["reference"] == "a"
    assert not [p.name for p in (tmp_path / "runs").iterdir() if p.name.endswith(".tmp") or ".tmp." in p.name]


def test_a_twin_that_does_not_match_is_a_warning_and_exit_status_4(tmp_path, capsys):
    """It was tabulated as "no", with no warning, and the sweep exited 0."""
    path = sweep_file(tmp_path, variants=("a", "b", "c"), seeds=(0, 1), extra='twins = {"c": "a"}\n')
    for s in (0, 1):
        finished_run(tmp_path / "runs" / "a" / f"seed{s}", 3.0 + 0.1 * s)
        finished_run(tmp_path / "runs" / "b" / f"seed{s}", 2.9 + 0.1 * s)
        finished_run(tmp_path / "runs" / "c" / f"seed{s}", 3.0 + 0.1 * s + 0.002 * s)  # seed 1 differs
    assert sweep.main([str(path), "--table_only"]) == sweep.EXIT_TWINS == 4
    out, err = capsys.readouterr()
    assert "| `c` | `a` | 2 | 2.0e-03 | 2.0e-03 | 2.0e-03 | 2.0e-03 | **no** |" in out
    assert err.splitlines()[-1] == ("warning: c does not match its twin a (largest |Δ| 2.0e-03 over 2 seeds): a twin "
                                    "trains bit for bit as its twin, so their code or settings differ (the Twins "
                                    "table says no)")
    finished_run(tmp_path / "runs" / "c" / "seed1", 3.1)  # equal again: no warning, exit 0
    assert sweep.main([str(path), "--table_only"]) == 0
    assert "warning" not in capsys.readouterr().err


# --- provenance: the runs' commits and span against the declaration's commit --------------------------------

def git(repo, *args, when="2026-01-01T10:00:00+00:00"):
    env = dict(os.environ, GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when, GIT_AUTHOR_NAME="t", GIT_COMMITTER_NAME="t",
               GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_EMAIL="t@example.org")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def recorded(d, start, commits, finish="2026-01-01T12:00:00+00:00"):
    """A finished run's summary.json with the provenance train.py wrote before issue 53."""
    summary = json.loads((d / "summary.json").read_text())
    summary.update(started_utc=start, finished_utc=finish, commits=commits, torch=["2.13.0"], hosts=["box"])
    (d / "summary.json").write_text(json.dumps(summary))


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_report_names_its_runs_commits_and_span_against_the_declaration(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    path = sweep_file(repo, out_dir=tmp_path / "runs")
    git(repo, "add", path.name)
    git(repo, "commit", "-qm", "declared")
    declared = git(repo, "rev-parse", "HEAD")
    for v, s in (("a", 0), ("a", 1), ("b", 0), ("b", 1)):
        finished_run(tmp_path / "runs" / v / f"seed{s}", 3.0 + 0.1 * s + (v == "b") * 0.01)
        recorded(tmp_path / "runs" / v / f"seed{s}", f"2026-01-01T10:0{1 + 2 * s + (v == 'b')}:00+00:00", [declared])
    assert sweep.main([str(path), "--table_only"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out == (f"Provenance (each run's summary.json): 4 runs from 2026-01-01 10:01:00 UTC (the first start) to "
                   f"2026-01-01 12:00:00 UTC (the last finish), on one commit, {declared[:7]}; torch 2.13.0; host box. "
                   f"Declared in `{path.name}`, added at {declared[:7]} (2026-01-01 10:00:00 UTC): every recorded run ran on "
                   "it; it precedes the first recorded start.")
    p = strict_json(tmp_path / "runs" / "results.json")["provenance"]
    assert p["declaration"] == dict(file=path.name, commit=declared, utc="2026-01-01T10:00:00+00:00", last_change=None)
    assert p["one_commit"] and p["on_declared_commit"] and p["declared_before_first_start"] and p["recorded"] == 4
    # a design file moved (as into experiments/configs/), its contents the same: declared where it was first added
    (repo / "moved").mkdir()
    git(repo, "mv", path.name, "moved/" + path.name)
    git(repo, "commit", "-qm", "moved", when="2026-01-02T10:00:00+00:00")
    assert report.declared_at(repo / "moved" / path.name) == dict(file=path.name, commit=declared,
                                                                  utc="2026-01-01T10:00:00+00:00", last_change=None)
    git(repo, "mv", "moved/" + path.name, path.name)
    git(repo, "commit", "-qm", "back", when="2026-01-02T11:00:00+00:00")

    # a run on a dirty tree before the declaration, a run that predates provenance, and a later change to the file
    recorded(tmp_path / "runs" / "b" / "seed1", "2026-01-01T09:00:00+00:00", ["0123456789abcdef+dirty"])
    (tmp_path / "runs" / "a" / "seed1" / "summary.json").write_text(
        json.dumps({k: v for k, v in json.loads((tmp_path / "runs" / "a" / "seed1" / "summary.json").read_text()).items()
                    if k not in report.PROVENANCE}))
    path.write_text(path.read_text() + "# changed\n")
    git(repo, "commit", "-qam", "changed", when="2026-01-01T11:00:00+00:00")
    changed = git(repo, "rev-parse", "HEAD")
    assert sweep.main([str(path), "--table_only"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("Provenance (each run's summary.json; not recorded for 1 older run): 3 runs from 2026-01-01 "
                          "09:00:00 UTC (the first start) to ")
    assert "on 2 commits, " in out and "0123456+dirty" in out and f"{declared[:7]}; torch" in out + declared and out.endswith(
        f"added at {declared[:7]} (2026-01-01 10:00:00 UTC), last changed at {changed[:7]} (2026-01-01 11:00:00 UTC): "
        "not every recorded run ran on it; it does not precede the first recorded start, and its last change does not.")
    p = strict_json(tmp_path / "runs" / "results.json")["provenance"]
    assert (p["one_commit"], p["on_declared_commit"], p["declared_before_first_start"], p["changed_before_first_start"]) \
        == (False, False, False, False) and p["runs"] == 4 and p["recorded"] == 3


def test_provenance_that_git_or_the_runs_cannot_give(tmp_path, monkeypatch):
    runs = [dict(variant="a", seed=0), dict(variant="b", seed=0)]  # runs older than the provenance fields
    assert report.provenance_text(report.provenance(runs, None)) == (
        "Provenance: not recorded (none of the 2 runs' summary.json has it: they predate it). No declaration file named.")
    if shutil.which("git") is not None:
        git(tmp_path, "init", "-q")
        git(tmp_path, "commit", "-q", "--allow-empty", "-m", "before")
        (tmp_path / "sweep_x.py").write_text("seeds = [0]\n")
        assert report.declared_at(tmp_path / "sweep_x.py")["why"].startswith("no commit here adds it: not committed")
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    p = report.provenance(runs, tmp_path / "sweep_x.py")
    assert p["declaration"]["why"] == "git is not available" and p["on_declared_commit"] is None
    assert report.provenance_text(p).endswith("Declared in `sweep_x.py`, at a commit not known here (git is not "
                                              "available).")  # outside the project: its name, no machine's path


def test_the_loss_unit_is_what_the_runs_tokenizer_makes_a_token(tmp_path):
    from experiments.rundirs import nats, token_unit
    for name, tokenizer in (("a", "byte"), ("b", "byte"), ("c", "gpt2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"tokenizer": tokenizer}))
    assert token_unit([tmp_path / "a", tmp_path / "b"]) == "byte" and token_unit([tmp_path / "c"]) == "token"
    assert token_unit([tmp_path / "a", tmp_path / "c"]) is None and token_unit([tmp_path / "none"]) is None
    assert (nats("byte"), nats("token"), nats(None)) == ("nats per byte", "nats per token", "nats")
