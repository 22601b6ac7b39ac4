"""experiments/rescore.py: a finished run's checkpoint scored again equals the run's own evaluation when
asked for the same tokens, and whole splits score every window of the split."""

import json

import pytest
import torch

from data import load_meta
from experiments import rescore

from runs import records, run


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rescore")
    run(data_dir, out, "--run_name=done")  # 6 steps; val and test scored on their first 1,024 tokens
    return out / "done"


def test_rescoring_the_run_s_tokens_equals_its_evaluation(finished, capsys):
    assert rescore.main([str(finished), "--tokens", "1024"]) == 0
    scores = json.loads((finished / "scores.json").read_text())
    logged = {r["split"]: r for r in records(finished, "eval") if r["step"] == 6}
    for split in ("val", "test"):
        assert scores[split]["loss"] == logged[split]["loss"]  # bit for bit
        assert scores[split]["tokens"] == logged[split]["tokens"] == 1024
    assert rescore.main([str(finished), "--tokens", "1024"]) == 0  # up to date: not scored again
    assert capsys.readouterr().out.endswith(": up to date\n")


def test_whole_splits_score_every_window(finished, data_dir):
    scores = rescore.rescore(finished, force=True)
    meta = load_meta(data_dir)
    for split in ("val", "test"):
        total = meta["splits"][split]["tokens"]
        assert scores[split]["tokens"] == (total - 1) // 32 * 32  # seq_len 32
    assert json.loads((finished / "scores.json").read_text())["max_tokens"] is None


def test_bad_input_is_one_line(tmp_path, capsys):
    assert rescore.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: no checkpoint at {tmp_path / 'ckpt.pt'}\n"
    assert rescore.main([]) == 2
    assert capsys.readouterr().err == "error: give run directories or --sweep SWEEP_FILE\n"
    assert rescore.main([str(tmp_path), "--splits", "dev"]) == 2
    assert "--splits takes train, val and test" in capsys.readouterr().err


def test_a_run_that_cannot_be_scored_is_one_line_and_the_others_are_scored(copy, tmp_path, capsys):
    """rescore stopped at the first run it could not score, leaving the rest unscored."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rescore.main([str(empty), str(copy), "--tokens", "1024"]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: no checkpoint at {empty / 'ckpt.pt'}\n" and out.startswith(f"{copy}: step 6, val ")
    assert json.loads((copy / "scores.json").read_text())["step"] == 6


def test_a_run_that_starts_over_or_continues_drops_its_scores(finished, data_dir, tmp_path):
    """scores.json describes one checkpoint: a run started over in the same directory (or continued
    past it) removes it, so a report never pairs a new run with the old one's scores."""
    import shutil
    d = tmp_path / "done"
    shutil.copytree(finished, d)
    rescore.rescore(d, force=True)
    assert json.loads((d / "scores.json").read_text())["device"] == "cpu"
    run(data_dir, tmp_path, "--run_name=done", "--overwrite=true", "--max_steps=2")
    assert not (d / "scores.json").exists() and (d / "summary.json").exists()


def test_a_checkpoint_that_does_not_fit_this_model_py_is_one_line_in_every_reader(finished, tmp_path, capsys):
    """sample.py, tools/diagnose.py and experiments/rescore.py read a checkpoint through one function
    (common.load_model), with one error for a model this model.py cannot load."""
    import sample
    from tools import diagnose
    ckpt = torch.load(finished / "ckpt.pt", weights_only=True)
    ckpt["model_config"]["n_embd"] = 64  # its weights are of width 32
    (tmp_path / "bad").mkdir()
    torch.save(ckpt, tmp_path / "bad" / "ckpt.pt")
    for main in (rescore.main, lambda args: sample.main(["--ckpt", *args]), lambda args: diagnose.main(["--ckpt", *args])):
        assert main([str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'bad'}: the checkpoint's model does not fit this model.py: ")
        assert err.count("\n") == 1


@pytest.fixture
def copy(finished, tmp_path):
    """A copy of the finished run, to score as each test likes."""
    import shutil
    d = tmp_path / "run"
    shutil.copytree(finished, d)
    (d / "scores.json").unlink(missing_ok=True)
    return d


def never(*args, **kwargs):
    raise AssertionError("scored: the check came after the compute")


def test_data_of_another_tokenizer_is_one_line_before_any_compute(copy, tmp_path, monkeypatch, capsys):
    """gpt2 data for a byte model was an IndexError (and byte data for a gpt2 model a meaningless 10.82)."""
    from prepare_data import prepare
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "Some text to tokenize. " * 200}) + "\n")
    gpt2 = tmp_path / "gpt2"
    prepare(data_files=[str(tmp_path / "c.jsonl")], tokenizer="gpt2", out_dir=gpt2, val_fraction=0.5, test_fraction=0)
    capsys.readouterr()
    monkeypatch.setattr(rescore, "evaluate", never)
    assert rescore.main([str(copy), "--data_dir", str(gpt2)]) == 2
    assert capsys.readouterr().err == (
        f"error: {gpt2} holds gpt2 tokens (50257 ids), but the run's model reads byte tokens (320 ids): pass "
        "--data_dir with data prepared with --tokenizer byte, or leave it out (the run's own data_dir)\n")
    assert not (copy / "scores.json").exists()


def test_scores_of_other_data_are_recorded_and_never_the_run_s(copy, data_dir, tmp_path, capsys):
    """Scores of other data (of the same tokenizer) were written without their data_dir, and a later
    plain rescore called them up to date."""
    import shutil

    from experiments.rundirs import whole_split_scores
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    assert rescore.main([str(copy), "--data_dir", str(other), "--tokens", "64"]) == 0
    scores = json.loads((copy / "scores.json").read_text())
    assert scores["data_dir"] == str(other.resolve()) and scores["own_data"] is False
    assert rescore.main([str(copy), "--tokens", "64"]) == 0  # plain: the run's own data, not up to date
    assert "up to date" not in capsys.readouterr().out
    scores = json.loads((copy / "scores.json").read_text())
    assert scores["data_dir"] == str(data_dir.resolve()) and scores["own_data"] is True
    assert rescore.main([str(copy), "--tokens", "64"]) == 0
    assert capsys.readouterr().out.endswith(": up to date\n")
    rescore.rescore(copy, data_dir=other, force=True)  # whole splits of other data: never the run's in a report
    assert whole_split_scores(copy, 6) == {}


def test_a_missing_data_dir_is_an_error_even_when_the_scores_are_up_to_date(copy, tmp_path, capsys):
    assert rescore.main([str(copy), "--tokens", "64"]) == 0
    assert rescore.main([str(copy), "--tokens", "64"]) == 0 and capsys.readouterr().out.endswith(": up to date\n")
    assert rescore.main([str(copy), "--tokens", "64", "--data_dir", str(tmp_path / "nonexistent")]) == 2
    assert capsys.readouterr().err == (f"error: --data_dir {tmp_path / 'nonexistent'} holds no meta.json: pass the "
                                       "directory prepare_data.py wrote\n")


def test_a_read_only_run_directory_is_said_first_and_the_scores_still_print(copy, read_only, monkeypatch, capsys):
    """It scored both whole splits, then said it could not write, and never printed the numbers."""
    real, said = rescore.evaluate, []

    def scored_after_the_error(*args, **kwargs):
        said.append(capsys.readouterr().err)
        return real(*args, **kwargs)
    monkeypatch.setattr(rescore, "evaluate", scored_after_the_error)
    read_only(copy)
    assert rescore.main([str(copy), "--tokens", "64"]) == 2
    error = (f"error: cannot write {copy / 'scores.json'}: read-only file system: the scores below are printed, "
             "not saved\n")
    assert said[0] == error  # before any compute
    out, err = capsys.readouterr()
    assert out.startswith(f"{copy}: step 6, val ") and "(64 tokens)" in out and err == ""
    assert not (copy / "scores.json").exists()
