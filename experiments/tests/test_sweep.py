"""experiments/sweep.py and experiments/report.py: the sweep file's checks, the pairing, resumes shared by processes
through train.py's own lock, the design check, and the report's verdicts, tables, files and provenance."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import train
from common import ROOT, UserError, cli
from experiments import report, sweep

from runs import run


def finished_run(d, val, test=None, params=1000, commits=("abc1234",), started="2026-01-01T00:00:00+00:00"):
    """A run directory as a finished sweep run leaves it: whole-split final scores, provenance, a val curve."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"tokenizer": "byte"}))
    (d / "log.jsonl").write_text("".join(json.dumps({"kind": "eval", "split": "val", "step": s, "loss": val + 1 / s,
                                                     "tokens": 64}) + "\n" for s in (2, 4)))
    (d / "summary.json").write_text(json.dumps(dict(
        step=4, val_loss=val, test_loss=val + 0.01 if test is None else test, final_eval_tokens=0, params=params,
        tokens_per_s=100.0, peak_memory_bytes=10, started_utc=started, finished_utc=started, commits=list(commits),
        torch=["2.13.0"], hosts=["h"])))


def spec_of(tmp_path, variants=("a", "b"), seeds=(0, 1, 2), **kw):
    return dict(dict(base="configs/test.py", variants={v: "" for v in variants}, seeds=list(seeds), overrides="",
                     reference=variants[0], out_dir=str(tmp_path / "runs"), primary=[], controls={}, score="val",
                     alpha=0.05, equivalence_margin=None), **kw)


def runs_with(tmp_path, deltas, base=3.0):
    """Finished runs of "a" and of each variant in deltas {variant: [Δ per seed]}."""
    for s in range(len(next(iter(deltas.values())))):
        finished_run(tmp_path / "runs" / "a" / f"seed{s}", base + 0.1 * s)
        for v, d in deltas.items():
            finished_run(tmp_path / "runs" / v / f"seed{s}", base + 0.1 * s + d[s])


def sweep_file(tmp_path, extra=""):
    path = tmp_path / "sweep_x.py"
    path.write_text('base = "configs/test.py"\nvariants = {"a": "residual=standard", "b": "residual=block_attnres"}\n'
                    f'seeds = [0, 1]\nreference = "a"\nout_dir = {str(tmp_path / "runs")!r}\n' + extra)
    return path


# --- the sweep file ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ('seeds = [0, 0]\n', "name a seed twice"),
    ('variants = {"x" * 300: ""}\nreference = "x" * 300\n', "not a plain directory name"),
    ('variants = {"a/b": ""}\nreference = "a/b"\n', "not a plain directory name"),
    ('overrides = "seed=3"\n', "sets seed, which the sweep sets"),
    ('variants = {"a": "final_eval_tokens=100", "b": ""}\n', "sets final_eval_tokens"),
    ('primary = [("b", "c")]\n', "primary must be a list"),
    ('equivalence_margin = 0.01\n', "with primary tests"),
    ('primary = [("b", "a")]\ncontrols = {"b": "a"}\n', "not its baseline"),
    ('score = "val_prefix"\n', "score must be one of val, test"),
    ('reference = "z"\n', "reference 'z' is not one of the variants"),
    ('1 / 0\n', "line 6: ZeroDivisionError"),
])
def test_a_bad_sweep_file_is_one_line_before_any_run(tmp_path, monkeypatch, extra, message):
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError, match=message):
        sweep.main([str(sweep_file(tmp_path, extra))])


def test_a_bad_variant_is_refused_before_the_first_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_child", None)
    with pytest.raises(UserError, match="sweep variant 'b' .*lr"):
        sweep.main([str(sweep_file(tmp_path, 'variants = {"a": "", "b": "lr=-1"}\n'))])


def test_run_by_its_path_it_answers_help():
    out = subprocess.run([sys.executable, "experiments/sweep.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "sweep file" in out.stdout


# --- the runs ------------------------------------------------------------------------------------------------------

def fake_train(ran, diverging=()):
    """A run_child playing train.py: its run directory's lock held while it runs, a finished run or a divergence."""
    def run_child(cmd):
        arg = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--"))
        d = Path(arg["out_dir"]) / arg["run_name"]
        ran.append((d.parent.name, int(arg["seed"]), int(arg["data_seed"]), arg["final_eval_tokens"],
                    "resume" in arg, "overwrite" in arg))
        if d.parent.name in diverging:
            d.mkdir(parents=True)
            (d / "log.jsonl").write_text(json.dumps({"kind": "diverged", "step": 3, "error": "loss nan"}) + "\n")
            return 2
        finished_run(d, 3.0 + 0.01 * int(arg["seed"]) + 0.001 * (d.parent.name == "b"))
        return 0
    return run_child


def test_runs_are_paired_by_seed_scored_whole_and_resumed_or_started_over(tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "a" / "seed1").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "seed1" / "ckpt.pt").write_bytes(b"")  # a run to resume
    (tmp_path / "runs" / "b" / "seed0").mkdir(parents=True)  # died before its first checkpoint: train.py starts it over
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran))
    assert sweep.main([str(sweep_file(tmp_path))]) == 0
    assert ran == [("a", 0, 0, "0", False, False), ("b", 0, 0, "0", True, False), ("a", 1, 1, "0", True, False),
                   ("b", 1, 1, "0", False, False)]
    out = capsys.readouterr().out
    assert "sweep: 4/4 runs done" in out and "| `b` | 2 |" in out
    ran.clear()
    assert sweep.main([str(sweep_file(tmp_path))]) == 0 and ran == []  # finished runs are skipped


def test_a_run_another_process_holds_is_skipped_and_counted_busy(tmp_path, monkeypatch, capsys):
    import fcntl
    import os
    d = tmp_path / "runs" / "a" / "seed0"
    d.mkdir(parents=True)
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live train.py holds it
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran))
    try:
        with pytest.raises(UserError, match="no finished run of the reference"):  # its one run is busy
            sweep.main([str(sweep_file(tmp_path, 'seeds = [0]\n'))])
    finally:
        os.close(fd)
    assert ran == [("b", 0, 0, "0", False, False)] and "1 busy" in capsys.readouterr().out


def test_a_diverged_run_is_final_tabulated_and_exit_3(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran, diverging=("a", "b")))  # the first run too: no ETA yet
    first = f'reference = "c"\nvariants = {{"a": "", "b": "", "c": ""}}\nout_dir = {str(tmp_path / "first")!r}\n'
    assert sweep.main([str(sweep_file(tmp_path, first))]) == 3
    assert "ETA ?" in capsys.readouterr().out
    monkeypatch.setattr(sweep, "run_child", fake_train(ran, diverging=("b",)))
    assert sweep.main([str(sweep_file(tmp_path))]) == sweep.EXIT_DIVERGED
    assert "(diverged: seed 0, 1)" in capsys.readouterr().out
    ran.clear()
    assert sweep.main([str(sweep_file(tmp_path))]) == sweep.EXIT_DIVERGED and ran == []  # not run again


def test_a_failed_run_stops_the_sweep_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_child", lambda cmd: 1)
    with pytest.raises(UserError, match="run a seed 0 failed"):
        sweep.main([str(sweep_file(tmp_path))])


def test_a_design_changed_under_its_runs_is_refused_before_runs_and_tables(tmp_path, monkeypatch, data_dir):
    monkeypatch.chdir(tmp_path)
    path = sweep_file(tmp_path, f'overrides = "max_steps=2 data_dir={data_dir}"\n')
    spec = sweep.load_sweep(str(path))
    for variant, seed in (("a", 0), ("b", 0)):  # a real run's config.json, as the sweep ran it
        cmd = sweep.train_command(spec, variant, seed, "")
        assert cli(train.main, cmd[2:]) == 0
    path.write_text(path.read_text().replace("max_steps=2", "max_steps=3"))
    monkeypatch.setattr(sweep, "run_child", None)
    for argv in ([str(path)], [str(path), "--table_only"]):
        with pytest.raises(UserError, match="design changed.*a seed 0 ran with max_steps 2 \\(now 3\\)"):
            sweep.main(argv)


@pytest.mark.slow
def test_a_quick_sweep_of_train_py_gives_the_table_plots_and_provenance(tmp_path, data_dir, monkeypatch, capsys):
    """Two variants, two seeds, a declared primary pair, the real train.py: the report names the commit."""
    path = sweep_file(tmp_path, f'primary = [("b", "a")]\nequivalence_margin = 0.05\n'
                                f'overrides = "data_dir={data_dir} max_steps=3"\n')
    assert sweep.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| `b` − `a` |" in out and "Provenance (4 of 4 runs)" in out
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert git[:7] in out
    assert {p.name for p in (tmp_path / "runs").iterdir()} >= {"results.md", "results.json", "results.csv", "forest.png",
                                                               "curves.png"}
    whole = json.loads((tmp_path / "runs" / "a" / "seed0" / "summary.json").read_text())
    assert whole["final_eval_tokens"] == 0 and whole["val_loss"] == report.collect(sweep.load_sweep(str(path)))[0]["val_loss"]


# --- the report ----------------------------------------------------------------------------------------------------

def test_each_primary_test_shows_a_difference_equivalence_or_neither(tmp_path):
    runs_with(tmp_path, {"big": [-0.05, -0.06, -0.055, -0.052], "same": [0.0001, -0.0002, 0.0001, 0.0],
                         "noisy": [0.02, -0.03, 0.01, -0.005]})
    spec = spec_of(tmp_path, ("a", "big", "same", "noisy"), (0, 1, 2, 3), equivalence_margin=0.01,
                   primary=[("big", "a"), ("same", "a"), ("noisy", "a")])
    shows = {c["variant"]: (c["shows"], c["beyond_margin"]) for c in report.report(spec) if c["kind"] == "primary"}
    assert shows == {"big": ("difference", True), "same": ("equivalence", False), "noisy": ("neither", False)}


def test_a_control_is_tested_only_once_its_variant_s_test_rejects(tmp_path, capsys):
    runs_with(tmp_path, {"v": [-0.05, -0.06, -0.055], "w": [0.01, -0.01, 0.02], "cv": [-0.051, -0.06, -0.056],
                         "cw": [0.0, 0.0, 0.01]})
    spec = spec_of(tmp_path, ("a", "v", "w", "cv", "cw"), primary=[("v", "a"), ("w", "a")], controls={"v": "cv", "w": "cw"})
    ts = {(c["kind"], c["variant"]): c for c in report.report(spec)}
    assert ts["primary", "v"]["rejected"] and not ts["primary", "w"]["rejected"]
    assert ts["control", "v"]["rejected"] is False and ts["control", "w"]["rejected"] is None
    assert "not tested: its primary test did not reject" in capsys.readouterr().out


def test_the_report_s_numbers_are_the_paired_t_test_on_whole_split_scores(tmp_path):
    runs_with(tmp_path, {"b": [-0.05, 0.02, -0.10]})
    spec = spec_of(tmp_path, second_reference="b")
    (c,) = report.report(spec)
    assert c["kind"] == "exploratory" and c["deltas"] == pytest.approx({"0": -0.05, "1": 0.02, "2": -0.10})
    assert c["wins"] == 2 and c["p"] == pytest.approx(report.paired_t([-0.05, 0.02, -0.10])["p"])
    saved = json.loads((tmp_path / "runs" / "results.json").read_text(), parse_constant=lambda c: 1 / 0)  # strict
    assert saved["tests"][0]["p"] == c["p"] and saved["unit"] == "nats per byte"
    assert (tmp_path / "runs" / "forest.png").exists()  # exploratory rows drawn too
    rows = (tmp_path / "runs" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("variant,seed,val_loss") and len(rows) == 7


def test_a_run_scored_on_a_prefix_is_not_paired_and_the_report_says_so(tmp_path, capsys):
    runs_with(tmp_path, {"b": [-0.05, 0.02, -0.10]})
    summary = tmp_path / "runs" / "b" / "seed0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "final_eval_tokens": 1024}))
    (c,) = report.report(spec_of(tmp_path))
    assert c["paired_seeds"] == 2 and "1 finished runs have no score" in capsys.readouterr().err


def test_provenance_flags_runs_before_the_declaration_and_from_changed_trees(tmp_path, monkeypatch):
    finished_run(tmp_path / "runs" / "a" / "seed0", 3.0, commits=("abc1234+dirty",))
    finished_run(tmp_path / "runs" / "a" / "seed1", 3.1, started="2025-01-01T00:00:00+00:00")
    monkeypatch.setattr(report, "declared_at", lambda path: ("f" * 40, "2025-06-01T00:00:00+00:00", "e" * 40,
                                                             "2026-06-01T00:00:00+00:00", True))  # edited after a0 started
    p = report.provenance(spec_of(tmp_path, path="x.py"), report.collect(spec_of(tmp_path, seeds=(0, 1))))
    assert p["dirty"] == ["a/seed0"] and p["started_before_declaration"] == ["a/seed1"]
    assert p["started_before_last_change"] == ["a/seed0"]
    text = report.provenance_text(p)
    assert "**1 run started before it was added**" in text and "**1 run ran from a tree with uncommitted" in text
    assert "The sweep file has uncommitted changes" in text


def test_no_run_of_the_reference_is_one_line_and_unwritable_outputs_one_warning(tmp_path, capsys, read_only):
    with pytest.raises(UserError, match="no finished run of the reference 'a'"):
        report.report(spec_of(tmp_path))
    runs_with(tmp_path, {"b": [-0.05, 0.02, -0.10]})
    read_only(tmp_path / "runs")
    report.report(spec_of(tmp_path))
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "results.md" in err


def test_a_sweep_file_s_runs_go_through_train_py_s_own_checks(tmp_path, data_dir):
    """The sweep reads every variant as train.py does (train.read_settings, parse_config)."""
    spec = sweep.load_sweep(str(sweep_file(tmp_path)))
    assert sweep.design(spec, "b", 1)["residual"] == "block_attnres"
    assert run(data_dir, tmp_path, "--max_steps=1", "--final_eval_tokens=0")["final_eval_tokens"] == 0


def test_runs_on_data_prepared_again_are_not_pooled(tmp_path, monkeypatch):
    """The design check compares each run's data fingerprint, not data_dir's path."""
    from prepare_data import prepare
    source = tmp_path / "c.txt"
    source.write_text("to be or not to be " * 400)
    prepare(data_files=[str(source)], tokenizer="byte", out_dir=tmp_path / "d_byte")
    path = sweep_file(tmp_path, f'overrides = "max_steps=1 data_dir={tmp_path / "d_byte"} seq_len=16 eval_tokens=64"\n')
    spec = sweep.load_sweep(str(path))
    assert cli(train.main, sweep.train_command(spec, "a", 0, "")[2:]) == 0
    source.write_text("TO BE OR NOT TO BE " * 400)  # same size, other text
    prepare(data_files=[str(source)], tokenizer="byte", out_dir=tmp_path / "d_byte", overwrite=True)
    sweep.data_now.cache_clear()
    monkeypatch.setattr(sweep, "run_child", None)
    with pytest.raises(UserError, match="a seed 0 ran with other data"):
        sweep.main([str(path), "--table_only"])
