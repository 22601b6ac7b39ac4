"""gpu_check.py, run at toy size on CPU (gloo), so that the GPU check cannot rot between GPU sessions."""

from tools import gpu_check


def test_the_gpu_check_passes_at_toy_size(tmp_path, capsys):
    assert gpu_check.main(["--toy", "--variants", "block_attnres", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "SIGTERM stopped at step" in out and "tokens/s cached" in out and "block_attnres: " in out
    assert (tmp_path / "runs" / "straight" / "summary.json").exists()


def test_a_failed_check_fails_the_command(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise gpu_check.CheckFailed("resumed losses differ")
    monkeypatch.setattr(gpu_check, "prepare", lambda args, work: work)
    monkeypatch.setattr(gpu_check, "check_bench", lambda args, out: ["fine"])
    monkeypatch.setattr(gpu_check, "check_train", broken)
    monkeypatch.setattr(gpu_check, "check_sample", lambda args, out: ["fine"])
    assert gpu_check.main(["--toy", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "train   FAILED: resumed losses differ" in out and "FAILED: train" in out
