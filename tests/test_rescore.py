"""tools/rescore.py: a finished run's checkpoint scored again equals the run's own evaluation when
asked for the same tokens, and whole splits score every window of the split."""

import json

import pytest

from depthres.shards import load_meta
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
