"""tools/rescore.py: a finished run's checkpoint scored again equals the run's own evaluation when
asked for the same tokens, and whole splits score every window of the split."""

import json

import pytest

from depthres.token_data import load_meta
from tools import rescore

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
    """sample.py, tools/diagnose.py and tools/rescore.py read a checkpoint through one function
    (depthres.checkpoint.load_model), with one error for a model this model.py cannot load."""
    import sample
    from depthres.checkpoint import load_checkpoint, save_checkpoint
    from tools import diagnose
    ckpt = load_checkpoint(finished)
    ckpt["model_config"]["n_embd"] = 64  # its weights are of width 32
    (tmp_path / "bad").mkdir()
    save_checkpoint(tmp_path / "bad" / "ckpt.pt", {k: v for k, v in ckpt.items() if k != "checksum"})
    for main in (rescore.main, lambda args: sample.main(["--ckpt", *args]), lambda args: diagnose.main(["--ckpt", *args])):
        assert main([str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'bad'}: the checkpoint's model does not fit this model.py: ")
        assert err.count("\n") == 1
