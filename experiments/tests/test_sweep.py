"""experiments/sweep.py: its progress lines, its claims, bad sweep files, a tiny sweep end to end, the
sweep's reliability rounds; tools/diagnose.py on a sweep's runs."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

import train
from common import Stopped, UserError, cli
from experiments import sweep
from model_fast import make_model
from tools import diagnose

from runs import poll
from sweeps import fake_train, finished_run, sweep_file, sweep_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_sweep_controls_match_their_variants_parameters():
    spec = sweep.load_sweep("experiments/configs/sweep_cpu.py")
    assert spec["controls"] and spec["seeds"] == [0, 1, 2, 3, 4] and spec["second_reference"] == "block_attnres"

    def params(variant):
        argv = [spec["base"]] + [f"--{kv}" for kv in sweep.overrides(spec, variant)]
        tc, model_settings = train.parse_config(argv)
        return make_model(train.build_model_config(model_settings, tc, dict(vocab_size=257, tokenizer="byte"))).num_params()

    standard = params("standard")
    controls = set(spec["controls"].values())
    for variant in set(spec["variants"]) - controls:  # every variant with over 1% extra parameters has a control
        assert (params(variant) > 1.01 * standard) == (variant in spec["controls"]), variant
    for variant, control in spec["controls"].items():
        assert abs(params(control) / params(variant) - 1) < 0.005, (variant, control)
        residual, width = sweep.overrides(spec, control)  # standard, with only the MLP's hidden width changed
        assert residual == "residual=standard" and re.fullmatch(r"mlp_hidden=\d+", width)


# --- the sweep's progress lines ----------------------------------------------------------------------

def test_eta_is_the_mean_duration_times_the_runs_left():
    assert sweep.eta_seconds([10.0, 20.0], 3) == pytest.approx(45.0)
    assert sweep.eta_seconds([7.0], 0) == 0
    assert sweep.eta_seconds([], 3) is None
    assert sweep.hms(0) == "0:00:00" and sweep.hms(59.6) == "0:01:00" and sweep.hms(3725.4) == "1:02:05"
    assert sweep.hms(30 * 3600 + 61) == "30:01:01"


def test_progress_lines_count_finished_runs_as_done(tmp_path, monkeypatch, capsys):
    """2 variants x 2 seeds, one finished before: three runs of 60, 120 and 30 seconds (a fake clock)."""
    spec = dict(base="configs/test.py", variants={"a": "", "b": ""}, seeds=[0, 1], overrides="",
                out_dir=str(tmp_path))
    (tmp_path / "b" / "seed0").mkdir(parents=True)
    (tmp_path / "b" / "seed0" / "summary.json").write_text("{}")
    now, durations = [1000.0], iter([60, 120, 30])

    def fake_run(cmd):
        out_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--out_dir="))
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("--run_name="))
        (Path(out_dir) / name).mkdir(parents=True)
        (Path(out_dir) / name / "summary.json").write_text("{}")
        now[0] += next(durations)
        return 0

    monkeypatch.setattr(sweep, "run_child", fake_run)
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    sweep.run_all(spec, launcher="")
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("sweep:")]
    assert lines == ["sweep: 2/4 runs done, 0:01:00 elapsed, ETA 0:02:00",  # a, seed 0; 2 left at 60 s
                     "sweep: 3/4 runs done, 0:03:00 elapsed, ETA 0:01:30",  # a, seed 1; 1 left at 90 s
                     "sweep: 4/4 runs done, 0:03:30 elapsed, ETA 0:00:00"]  # b, seed 1


def test_ctrl_c_waits_for_the_run_to_checkpoint_and_the_sweep_says_so(tmp_path, monkeypatch):
    class Child:  # a training run that gets the terminal's SIGINT too: it checkpoints and exits 130
        waits = 0

        def __init__(self, cmd, **kwargs):  # (cwd, preexec_fn)
            pass

        def wait(self):
            Child.waits += 1
            if Child.waits == 1:
                raise KeyboardInterrupt  # Ctrl-C while the sweep waits
            return 130
    monkeypatch.setattr(sweep.subprocess, "Popen", Child)
    spec = dict(base="configs/test.py", variants={"a": ""}, seeds=[0], overrides="", out_dir=str(tmp_path))
    with pytest.raises(Stopped, match="run a seed 0 stopped with a checkpoint; run the sweep again to resume it"):
        sweep.run_all(spec, launcher="")
    assert Child.waits == 2  # waited for, not killed


def test_sweep_processes_share_the_runs_of_one_sweep_file(tmp_path, monkeypatch, capsys):
    spec = dict(base="configs/test.py", variants={"a": "", "b": ""}, seeds=[0, 1], overrides="",
                out_dir=str(tmp_path))
    other = sweep.claim(spec, "a", 1)  # another sweep process is running a, seed 1
    ran = []

    def fake_run(cmd):
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("--run_name="))
        variant = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("--out_dir="))).name
        ran.append((variant, name))
        (tmp_path / variant / name).mkdir(parents=True)
        (tmp_path / variant / name / "summary.json").write_text("{}")
        return 0

    monkeypatch.setattr(sweep, "run_child", fake_run)
    sweep.run_all(spec, launcher="")
    assert ran == [("a", "seed0"), ("b", "seed0"), ("b", "seed1")]
    assert "sweep: 1 run(s) were taken by another sweep process" in capsys.readouterr().out
    assert sweep.claim(spec, "b", 0) is not None  # this process let go of its claims
    os.close(other)
    assert sweep.claim(spec, "a", 1) is not None


ABC = 'base = "configs/test.py"\nvariants = {"a": "", "b": "", "c": ""}\nseeds = [0]\nreference = "a"\n'
BAD_SWEEPS = {
    "missing": (None, "not found"),
    "syntax": ('base = "configs/test.py"\nvariants = {"a": ""\n', "line 2: syntax error"),
    "raises": ('base = "configs/test.py"\nvariants = {"a": ""}\nseeds = [0]\nreference = "a"\nx = 1 / 0\n',
               "line 5: ZeroDivisionError"),
    "exits": ('import sys\nbase = "configs/test.py"\nsys.exit(3)\n', "line 3: SystemExit: 3"),  # (round five)
    "variants_list": ('base = "configs/test.py"\nvariants = ["a", "b"]\nseeds = [0]\nreference = "a"\n',
                      'variants must be a dict of {name: "key=value ..."} strings'),
    "seeds": ('base = "configs/test.py"\nvariants = {"a": ""}\nseeds = "0 1"\nreference = "a"\n',
              "seeds must be a non-empty list of whole numbers >= 0"),
    "quote": ('base = "configs/test.py"\nvariants = {"a": "", "b": "run_name=\'x"}\nseeds = [0]\nreference = "a"\n',
              "sweep variant 'b' (\"run_name='x\"): No closing quotation"),
    "unknown_key": ('base = "configs/test.py"\nvariants = {"a": "", "b": "", "c": "n_layers=4"}\nseeds = [0]\n'
                    'reference = "a"\n', "sweep variant 'c' ('n_layers=4'): unknown key 'n_layers' in the command line; "
                                          "did you mean n_layer"),
    "bad_value": ('base = "configs/test.py"\nvariants = {"a": "", "c": "residual=dar rd_mode=tied"}\nseeds = [0]\n'
                  'reference = "a"\n', "rd_mode='tied' only applies to residual='rd_attnres'"),
    # keys the sweep sets for every run: its pairing (round three)
    "owned_seed": ('base = "configs/test.py"\nvariants = {"standard": "residual=standard", '
                   '"dar_seedfix": "residual=dar seed=7 data_seed=7"}\nseeds = [0, 1]\nreference = "standard"\n',
                   "sweep variant 'dar_seedfix' ('residual=dar seed=7 data_seed=7') sets seed, which the sweep owns"),
    "owned_data_seed": ('base = "configs/test.py"\nvariants = {"a": "", "b": "data_seed=3"}\nseeds = [0, 1]\n'
                        'reference = "a"\n', "sweep variant 'b' ('data_seed=3') sets data_seed, which the sweep owns"),
    "owned_run_name": ('base = "configs/test.py"\nvariants = {"a": "", "b": "run_name=fixed"}\nseeds = [0, 1]\n'
                       'reference = "a"\n', "sweep variant 'b' ('run_name=fixed') sets run_name, which the sweep owns"),
    "owned_out_dir": ('base = "configs/test.py"\nvariants = {"a": "", "b": "out_dir=/tmp/elsewhere"}\nseeds = [0]\n'
                      'reference = "a"\n', "sets out_dir, which the sweep owns"),
    "owned_in_overrides": ('base = "configs/test.py"\nvariants = {"a": "", "b": ""}\nseeds = [0, 1]\nreference = "a"\n'
                           'overrides = "max_steps=2 seed=7"\n',
                           "the sweep's overrides ('max_steps=2 seed=7') set seed, which the sweep owns"),
    # round five: the sweep resumes or starts over each run itself (overwrite=true failed only at a resume)
    "owned_overwrite": ('base = "configs/test.py"\nvariants = {"a": "", "b": ""}\nseeds = [0]\nreference = "a"\n'
                        'overrides = "overwrite=true"\n',
                        "the sweep's overrides ('overwrite=true') set overwrite, which the sweep owns"),
    "owned_resume": ('base = "configs/test.py"\nvariants = {"a": "", "b": "resume=runs/x"}\nseeds = [0]\n'
                     'reference = "a"\n', "sweep variant 'b' ('resume=runs/x') sets resume, which the sweep owns"),
    # round four: the overrides and every seed, before the first run, each named as what is wrong
    "overrides_quote": ('base = "configs/test.py"\nvariants = {"a": "", "b": ""}\nseeds = [0]\nreference = "a"\n'
                        'overrides = "max_steps=2 run_name=\'x"\n',
                        "error: the overrides (\"max_steps=2 run_name='x\") of every run: No closing quotation"),
    "seed_too_large": ('base = "configs/test.py"\nvariants = {"a": "", "b": ""}\nseeds = [0, 2**32]\nreference = "a"\n',
                       "error: seed 4294967296 (each run's seed and data_seed): seed must be in [0, 2**32), got "
                       "4294967296"),
    "seeds_twice": ('base = "configs/test.py"\nvariants = {"a": "", "b": ""}\nseeds = [0, 0]\nreference = "a"\n',
                    "seeds [0, 0] name 0 more than once"),
    "variant_path": ('base = "configs/test.py"\nvariants = {"a": "", "../escape": ""}\nseeds = [0]\nreference = "a"\n',
                     "variant name '../escape' is not a plain directory name"),
    "variant_newline": ('base = "configs/test.py"\nvariants = {"a": "", "b\\ndone: FAKE": ""}\nseeds = [0]\n'
                        'reference = "a"\n', "variant name 'b\\ndone: FAKE' is not a plain directory name"),
    # the declared comparison (experiments/report.py)
    "primary_typo": (ABC + 'primary = [("b", "a"), ("cc", "a")]\n', "primary names 'cc', which is not one of the variants"),
    "primary_self": (ABC + 'primary = [("b", "b")]\n', "primary compares 'b' with itself"),
    "primary_shape": (ABC + 'primary = ["b"]\n', "primary must be a list of (variant, baseline) pairs"),
    "primary_twice": (ABC + 'primary = [("b", "a"), ("b", "c")]\n', "primary tests a variant twice"),
    "control_ungated": (ABC + 'primary = [("b", "a")]\ncontrols = {"c": "a"}\n',
                        "controls gives 'c' a control, but 'c' has no primary test"),
    "twin_in_family": (ABC + 'primary = [("b", "a")]\ntwins = {"b": "c"}\n', "twin 'b' is in a family"),
    "twin_unknown": (ABC + 'twins = {"b": "zz"}\n', "twins must be a dict {variant: the variant it trains bit for bit as}"),
    "twin_baseline": (ABC + 'primary = [("b", "c")]\ntwins = {"c": "b"}\n', "twin 'c' is in a family"),
    "control_self": (ABC + 'primary = [("b", "a")]\ncontrols = {"b": "b"}\n', "the control of 'b' is 'b', itself"),
    "control_baseline": (ABC + 'primary = [("b", "a")]\ncontrols = {"b": "a"}\n', "the control of 'b' is 'a', its baseline"),
    "score": (ABC + 'score = "validation"\n', "score must be one of val, test, val_prefix, test_prefix, got 'validation'"),
    "alpha": (ABC + 'alpha = 5\n', "alpha must be a number between 0 and 1, got 5"),
    "margin_negative": (ABC + 'primary = [("b", "a")]\nequivalence_margin = -0.01\n',
                        "equivalence_margin must be a positive number of nats (e.g. 0.006), got -0.01"),
    "margin_text": (ABC + 'primary = [("b", "a")]\nequivalence_margin = "0.01"\n',
                    "equivalence_margin must be a positive number of nats (e.g. 0.006), got '0.01'"),
    "margin_no_primary": (ABC + 'equivalence_margin = 0.01\n', "equivalence_margin is set but primary is empty"),
}


@pytest.mark.parametrize("case", BAD_SWEEPS)
def test_a_bad_sweep_file_is_one_line_before_any_run(case, tmp_path, monkeypatch):
    text, message = BAD_SWEEPS[case]
    path = tmp_path / "sweep_bad.py"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError) as e:
        sweep.main([str(path), "--out_dir", str(tmp_path / "runs")])
    assert message.removeprefix("error: ") in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_a_sweep_file_may_compute_its_settings(tmp_path):
    """A comprehension sees the file's names, as in any Python file (exec'd with separate globals and locals,
    it raised NameError)."""
    path = tmp_path / "sweep_x.py"
    path.write_text('base = "configs/test.py"\nnames = ["a", "b"]\ndepth = 3\n'
                    'variants = {v: f"n_layer={depth}" for v in names}\nseeds = [0, 1]\nreference = names[0]\n')
    spec = sweep.load_sweep(path)
    assert spec["variants"] == {"a": "n_layer=3", "b": "n_layer=3"} and spec["reference"] == "a"


def test_sweep_runs_log_to_wandb_in_one_group_when_asked(tmp_path):
    spec = dict(base="configs/test.py", variants={"a": "", "b": "wandb_log=true", "c": "wandb_group=mine"},
                seeds=[0], overrides="", out_dir=str(tmp_path / "sweep_x"))

    def wandb_keys(variant, seed=0):
        cmd = sweep.train_command(spec, variant, seed, launcher="")
        tc, _ = train.parse_config(cmd[2:])  # train.py reads every key it is given
        return tc.wandb_log, tc.wandb_group, [t for t in tc.wandb_tags.split(",") if t], tc.wandb_run_name

    assert wandb_keys("a") == (False, "", [], "")  # not asked: nothing added
    assert wandb_keys("b") == (True, "sweep_x", ["b", "seed0"], "b-seed0")  # asked by the variant
    spec["wandb"] = True  # --wandb, or `wandb = True` in the sweep file
    assert wandb_keys("a", seed=2) == (True, "sweep_x", ["a", "seed2"], "a-seed2")
    assert wandb_keys("c") == (True, "mine", ["c", "seed0"], "c-seed0")  # the sweep's overrides win
    spec["overrides"] = "wandb_log=false"
    assert wandb_keys("a")[0] is False and wandb_keys("b")[0] is True  # the variant's word is the last


def test_a_wandb_sweep_without_wandb_stops_before_any_run(tmp_path, monkeypatch):
    spec = dict(base="configs/test.py", variants={"a": ""}, seeds=[0], overrides="", out_dir=str(tmp_path),
                wandb=True)
    monkeypatch.setattr(sweep.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError, match="the sweep logs to W&B .* wandb package is not installed"):
        sweep.run_all(spec, launcher="")


# --- diagnose on a sweep's runs ----------------------------------------------------------------------

def diagnose_cli(capsys, *args):
    rc = diagnose.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_diagnose_curves_label_a_sweeps_runs_by_variant_and_seed(tmp_path, capsys, monkeypatch):
    """A sweep's runs are <variant>/seed<s>: labelled by folder name, the runs of one seed collided and only
    the last was drawn. Each is labelled by its path from the runs' common parent; a lone run by its name."""
    drawn = []
    monkeypatch.setattr(diagnose, "plot_curves", lambda groups, path: drawn.append(groups) or path)
    runs = [tmp_path / "sweep" / variant / f"seed{s}" for variant in ("a", "b") for s in (0, 1)]
    for run in runs:
        run.mkdir(parents=True)
        (run / "log.jsonl").write_text('{"kind": "eval", "split": "val", "step": 2, "loss": 3.0}\n')
    for given, labels in ((runs, ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]), (runs[:1], ["seed0"])):
        assert diagnose_cli(capsys, "--curves", *given, "--out", tmp_path / "curves.png")[0] == 0
        assert drawn.pop() == {label: [str(run)] for label, run in zip(labels, given, strict=True)}


# --- a tiny sweep, end to end -----------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_sweep_end_to_end_and_resume(tmp_path, byte_data):
    spec = tmp_path / "sweep.py"
    spec.write_text(f'base = "configs/test.py"\n'
                    f'variants = {{"block": "", "tied": "residual=rd_attnres rd_mode=tied"}}\n'
                    f'seeds = [0, 1]\nreference = "block"\ntwins = {{"tied": "block"}}\n'
                    f'overrides = "data_dir={byte_data} max_steps=4 eval_interval=2 ckpt_interval=2"\n'
                    f'out_dir = "{tmp_path / "runs"}"\n')
    cmd = [sys.executable, "-m", "experiments.sweep", str(spec)]
    died_early = tmp_path / "runs" / "tied" / "seed1"  # a run killed before its first checkpoint
    died_early.mkdir(parents=True)
    (died_early / "log.jsonl").write_text('{"kind": "train", "step": 1, "lo')
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    progress = re.findall(r"^sweep: (\d+)/(\d+) runs done, \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d$",
                          first.stdout, re.M)
    assert progress == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")]
    assert "sweep: scoring up to 4 finished run(s) on the whole validation and test splits" in first.stdout
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert all(set(r["whole"]) == {"val", "test"} for r in results["runs"])
    tied = {t["variant"]: t for t in results["tests"]}["tied"]
    # rd_attnres with tied queries is exactly block_attnres: a twin, checked equal and in no family
    # twins run the same float32 ops on the same data: 0; 1e-5 admits a sum another build orders otherwise (a few u a
    # step over 4 steps, as tests/test_fsdp.py's runs), far below any difference between variants
    assert tied["kind"] == "twin" and tied["paired_seeds"] == 2 and abs(tied["delta_mean"]) < 1e-5
    assert [t["kind"] for t in results["tests"]] == ["twin"]
    assert (tmp_path / "runs" / "results.csv").read_text().count("\n") == 5
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # everything finished: nothing reruns
    assert again.returncode == 0 and "===" not in again.stdout and "sweep:" not in again.stdout


def test_a_sweep_whose_design_changed_under_its_runs_refuses_before_any_run(tmp_path, byte_data, monkeypatch):
    """A sweep file edited between invocations (max_steps 2 -> 4): the runs left trained at the new length
    and were pooled with the finished ones, exit 0. Each run's config.json is compared with what the sweep
    would run now: a change of what a run computes is one line before any run, --table_only too; a change of
    how it computes or logs (ckpt_interval) is not."""
    from experiments import rescore

    def in_process(cmd):  # train.py and experiments.rescore as the sweep runs them, in this process
        return rescore.main(cmd[3:]) if cmd[1:3] == ["-m", "experiments.rescore"] else cli(train.main, cmd[2:])
    monkeypatch.setattr(sweep, "run_child", in_process)
    path = sweep_file(tmp_path, seeds=(0,), extra=f'overrides = "data_dir={byte_data} max_steps=2"\n')
    assert sweep.main([str(path)]) == 0
    path.write_text(path.read_text().replace("max_steps=2", "max_steps=2 ckpt_interval=1"))
    assert sweep.main([str(path)]) == 0  # nothing to run: a finished sweep, of the same design
    path.write_text(path.read_text().replace("max_steps=2", "max_steps=4"))
    (tmp_path / "runs" / "b" / "seed0" / "summary.json").unlink()  # b's last run is unfinished: it would resume
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    for args in ([], ["--table_only"]):
        with pytest.raises(UserError) as e:
            sweep.main([str(path), *args])
        assert str(e.value) == (
            "the sweep's design changed since some of its runs ran: a seed 0 ran with max_steps 2 (now 4), "
            "b seed 0 ran with max_steps 2 (now 4); a sweep never pools runs of different designs: restore the "
            f"sweep file's settings, or give the new design its own out_dir (not {tmp_path / 'runs'}), or delete "
            "those runs to run them again")


@pytest.mark.slow
def test_a_sweep_with_a_diverging_variant_end_to_end(tmp_path, byte_data):
    """train.py's log tells the sweep that a run diverged: the sweep tabulates it and exits 3, every time."""
    spec = tmp_path / "sweep.py"
    spec.write_text(f'base = "configs/test.py"\n'
                    f'variants = {{"ok": "", "bad": "lr=3e3 min_lr=0 grad_clip=0 warmup_steps=0"}}\n'
                    f'seeds = [0]\nreference = "ok"\n'
                    f'overrides = "data_dir={byte_data} max_steps=8 eval_interval=4 ckpt_interval=4"\n'
                    f'out_dir = "{tmp_path / "runs"}"\n')
    cmd = [sys.executable, "-m", "experiments.sweep", str(spec)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert first.returncode == 3, first.stderr[-2000:]
    assert re.search(r"^sweep: bad seed 0 diverged at step \d: tabulated as diverged; the sweep goes on", first.stdout, re.M)
    assert "| `bad` (diverged: seed 0) | diverged |" in first.stdout and "Traceback" not in first.stderr
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 3 and "===" not in again.stdout and "| `bad` (diverged: seed 0) |" in again.stdout


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT))
                                        for p in (ROOT / "experiments" / "configs").glob("sweep_*.py")))
def test_every_sweep_variant_is_a_valid_config(path):
    spec = sweep.load_sweep(path)
    for overrides in spec["variants"].values():
        argv = [spec["base"]] + [f"--{kv}" for kv in shlex.split(spec["overrides"]) + shlex.split(overrides)]
        tc, model_settings = train.parse_config(argv)
        train.build_model_config(model_settings, tc, dict(vocab_size=50257, tokenizer="gpt2"))


# --- the sweep, round three: runs that die with it, odd claims, read-only, divergence, one seed -----------

def test_a_sweep_run_dies_with_the_sweep(tmp_path):
    """kill -9 of the sweep: its training run gets SIGTERM (train.py then checkpoints and stops), never
    an orphan that holds the run and makes the next sweep stop on 'in use by another run'."""
    child = ("import os, sys, time; print(os.getpid(), flush=True); time.sleep(120)")
    sweeper = subprocess.Popen([sys.executable, "-c", "import sys; from experiments import sweep; "
                                f"sweep.run_child([sys.executable, '-c', {child!r}])"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(sweeper.stdout.readline())
        sweeper.kill()  # kill -9
        sweeper.wait()

        def gone():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return True
            return state in ("Z", "X")  # a zombie waits for init to reap it: it runs no more
        poll(gone, timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(pid, signal.SIGKILL)


def test_a_run_held_by_another_process_is_skipped_not_fatal(tmp_path, monkeypatch, capsys):
    from experiments.rundirs import try_lock
    spec = sweep_spec(tmp_path)
    busy = tmp_path / "runs" / "a" / "seed0"
    busy.mkdir(parents=True)
    orphan = try_lock(busy / ".lock")  # a train.py still running it (an orphan of a killed sweep, or by hand)
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    try:
        sweep.run_all(spec, launcher="")
    finally:
        os.close(orphan)
    assert ran == [("b", 0), ("a", 1), ("b", 1)]
    out = capsys.readouterr().out
    assert "sweep: a seed 0 is in use by another process: skipped" in out
    sweep.run_all(spec, launcher="")  # once it is free, the next invocation runs it
    assert ran[-1] == ("a", 0) and sweep.status(spec, "a", 0) == "finished"


def test_a_claim_entry_that_is_a_directory_is_not_a_claim(tmp_path, monkeypatch):
    spec = sweep_spec(tmp_path, variants=("a",), seeds=(0,))
    (tmp_path / "runs" / "a" / ".seed0.sweep-lock" / "junk").mkdir(parents=True)  # no process holds it
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    sweep.run_all(spec, launcher="")
    assert ran == [("a", 0)]
    held = sweep.claim(spec, "a", 0)  # a live claim on it still keeps other sweep processes off
    assert held is not None and sweep.claim(spec, "a", 0) is None
    os.close(held)


def test_a_read_only_out_dir_is_one_line_and_the_table_still_prints(tmp_path, monkeypatch, capsys, read_only):
    spec = sweep_spec(tmp_path)
    for v, s in (("a", 0), ("b", 0)):
        finished_run(tmp_path / "runs" / v / f"seed{s}", 3.0 + 0.1 * s + (v == "b") * 0.01)
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    read_only(tmp_path / "runs")
    with pytest.raises(UserError) as e:  # the unfinished seed 1 cannot be run there
        sweep.run_all(spec, launcher="")
    assert str(e.value) == (f"cannot write {tmp_path / 'runs'}: read-only file system: "
                            f"the sweep writes its runs under {tmp_path / 'runs'}; make it writable, or choose another "
                            "out_dir (--table_only only reads the runs)")
    spec["out_dir"] = str(tmp_path / "runs" / "new" / "sweep")  # a new out_dir under the read-only mount
    with pytest.raises(UserError, match=r"^cannot write .*/runs/new: read-only file system: the sweep writes"):
        sweep.run_all(spec, launcher="")

    path = sweep_file(tmp_path, seeds=(0,))  # the finished part of the sweep: its table
    assert sweep.main([str(path), "--table_only"]) == 0
    out, err = capsys.readouterr()
    assert "| `b` − `a` | +0.0100 [needs 2 seeds] | 0/1 | n/a |" in out
    plots = ", curves.png, forest.png, gap_over_training.png" if "matplotlib is not installed" not in err else ""
    assert err.splitlines()[-1] == (f"warning: could not write results.md, results.json, results.csv{plots} in "
                                    f"{tmp_path / 'runs'} (read-only file system); the tables above are complete")
    assert not list((tmp_path / "runs").glob("*.tmp*")) and not (tmp_path / "runs" / "results.json").exists()


def test_a_diverged_run_is_tabulated_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path, variants=("a", "bad", "c"))
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(diverging={"bad"}, ran=ran))
    assert sweep.main([str(path)]) == sweep.EXIT_DIVERGED == 3
    assert ran == [("a", 0), ("bad", 0), ("c", 0), ("a", 1), ("bad", 1), ("c", 1)]
    out = capsys.readouterr().out
    assert "sweep: bad seed 0 diverged at step 3: tabulated as diverged; the sweep goes on" in out
    assert "sweep: 6/6 runs done (2 diverged)" in out
    assert "| `bad` (diverged: seed 0, 1) | diverged | diverged |" in out
    assert "| `bad` | diverged | diverged |" in out  # each seed's difference
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert [(d["variant"], d["seed"], d["step"]) for d in results["diverged"]] == [("bad", 0, 3), ("bad", 1, 3)]
    assert (tmp_path / "runs" / "results.csv").read_text().count(",diverged\n") == 2
    assert sweep.main([str(path)]) == 3  # a rerun does not stop on it again, nor runs it again
    assert len(ran) == 6 and "===" not in capsys.readouterr().out


def test_a_truncated_summary_is_an_unfinished_run(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path, seeds=(0,))
    finished_run(tmp_path / "runs" / "a" / "seed0", 3.0)
    finished_run(tmp_path / "runs" / "b" / "seed0", 3.01)
    summary = tmp_path / "runs" / "b" / "seed0" / "summary.json"
    summary.write_text(summary.read_text()[:20])  # a torn write (a copy cut short, a disk that filled)
    assert sweep.main([str(path), "--table_only"]) == 0
    out, err = capsys.readouterr()
    assert f"note: {summary} is not a readable summary (torn or damaged): b seed 0 counts as unfinished" in err
    assert "| `a` | +0.0% | 3.0010 (1 seed) | 3.0020 (1 seed) | 3.0000 (1 seed) | 3.0000 (1 seed) |" in out
    assert "`b`" not in out
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    assert sweep.main([str(path)]) == 0 and ran == [("b", 0)]  # the sweep runs it again (a resume, for train.py)
    assert "| `b` − `a` | +0.0100 [needs 2 seeds] | 0/1 | n/a |" in capsys.readouterr().out


def test_sweep_paths_and_where_table_only_looked(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = sweep_file(tmp_path, out_dir="runs/sweep_nowhere_28")  # relative: to the project root
    spec = sweep.load_sweep(str(path))
    assert spec["out_dir"] == str(ROOT / "runs" / "sweep_nowhere_28") and spec["base"] == str(ROOT / "configs" / "test.py")
    with pytest.raises(UserError) as e:
        sweep.main([str(path), "--table_only"])
    assert str(e.value) == (f"no finished run of the reference 'a' in {ROOT / 'runs' / 'sweep_nowhere_28'} "
                            "(looked for a/seed<s>/summary.json there): run the sweep first, or pass the --out_dir "
                            f"that holds its runs (a relative out_dir in a sweep file is relative to {ROOT})")
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    assert sweep.main([str(path), "--out_dir", "mine"]) == 0  # from another directory: base found, --out_dir here
    assert len(ran) == 4 and (elsewhere / "mine" / "results.json").exists()
    assert not (ROOT / "runs" / "sweep_nowhere_28").exists()


def test_a_link_planted_as_a_claim_is_refused_not_followed(tmp_path, monkeypatch):
    spec = sweep_spec(tmp_path, variants=("a",), seeds=(0,))
    outside = tmp_path / "outside.txt"
    outside.write_text("a user's file\n")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / ".seed0.sweep-lock").symlink_to(outside)
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    with pytest.raises(UserError, match=".*seed0.sweep-lock: too many levels of symbolic links"):
        sweep.run_all(spec, launcher="")
    assert ran == [] and outside.read_text() == "a user's file\n"


@pytest.mark.parametrize("command", ["rescore", "sweep"])
def test_a_path_longer_than_the_os_allows_is_one_line(command, tmp_path, capsys):
    """Round five: a traceback in each. As every command, through common.cli: one line, exit 2."""
    from experiments import rescore
    path = str(tmp_path / ("x" * 300))  # longer than a path component may be (255 bytes on Linux)
    main = {"rescore": rescore.main, "sweep": sweep.main}[command]
    assert cli(main, [path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "file name too long" in err, err


def test_two_sweeps_of_different_designs_on_one_out_dir_refuse_before_either_has_a_run(tmp_path, monkeypatch):
    """Two sweep processes started together on one out_dir (max_steps 2 and 4): neither run had a config.json
    yet, so both passed the design check, shared the runs and each printed a table pooling both lengths. The
    first records its design (design.json) before any run; the second is one line."""
    first = sweep_file(tmp_path, seeds=(0,), extra='overrides = "max_steps=2"\n')
    spec = sweep.load_sweep(str(first))
    (tmp_path / "runs").mkdir()
    sweep.record_design(spec)  # the first process, about to start its first run
    second = tmp_path / "sweep_y.py"
    second.write_text(first.read_text().replace("max_steps=2", "max_steps=4"))
    monkeypatch.setattr(sweep, "run_child", None)  # never reached
    with pytest.raises(UserError, match="design changed.*a ran with max_steps 2 \\(now 4\\)"):
        sweep.main([str(second)])
    ran = []
    monkeypatch.setattr(sweep, "run_child", fake_train(ran=ran))
    assert sweep.main([str(first)]) == 0 and len(ran) == 2  # the same design runs
