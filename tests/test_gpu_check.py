"""gpu_check.py, run at toy size on CPU (gloo), so that the GPU check cannot rot between GPU sessions."""

import pytest

from tools import gpu_check


@pytest.mark.slow
def test_the_gpu_check_passes_at_toy_size(tmp_path, capsys, monkeypatch):
    # the toy's training in 40 steps, not 150: the SIGTERM at the first logged step still stops it far from its end
    monkeypatch.setattr(gpu_check, "TOY_TRAIN", [kv if not kv.startswith("max_steps=") else "max_steps=40"
                                                 for kv in gpu_check.TOY_TRAIN])
    assert gpu_check.main(["--toy", "--variants", "block_attnres", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "SIGTERM stopped at step" in out and "tokens/s cached" in out and "block_attnres: " in out
    assert (tmp_path / "runs" / "straight" / "summary.json").exists()


def test_a_failed_check_fails_the_command(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise gpu_check.UserError("resumed losses differ")
    monkeypatch.setattr(gpu_check, "prepare", lambda args, work: work)
    monkeypatch.setattr(gpu_check, "check_bench", lambda args, out: ["fine"])
    monkeypatch.setattr(gpu_check, "check_train", broken)
    monkeypatch.setattr(gpu_check, "check_sample", lambda args, out: ["fine"])
    assert gpu_check.main(["--toy", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "train   FAILED: resumed losses differ" in out and "FAILED: train" in out
