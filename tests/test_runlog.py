"""What a run reports: its log lines and log.jsonl, the `done:` line, Weights & Biases (optional)."""

import json
import re
import sys
import types

from runs import records, run


def test_log_lines_say_how_far_the_run_is_and_wandb_gets_every_record_at_its_step(data_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    logged, started = [], {}

    class Run:
        def log(self, metrics, step):
            logged.append((step, metrics))

        def finish(self, exit_code):
            started["exit_code"] = exit_code
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: started.update(kw) or Run()))
    summary = run(data_dir, tmp_path, "--max_steps=4", "--eval_interval=2", "--ckpt_interval=0", "--wandb_log=true",
                  "--wandb_group=sweep", "--wandb_tags=block,seed0")
    out = capsys.readouterr().out
    clock = r"\d+:\d\d:\d\d"
    assert re.search(rf"^step 2/4 \(50\.0%\) \| loss [\d.]+ \| .* ms/step \| {clock} elapsed, ETA {clock}$", out, re.M)
    assert re.search(rf"^step 4/4 \| val loss [\d.]+ \| ppl [\d.]+ \| 1,024 tokens \| {clock} elapsed$", out, re.M)
    assert re.search(rf"^done: val loss [\d.]+, test loss [\d.]+ after 4 steps in {clock}; {tmp_path / 'test'} holds",
                     out, re.M)
    lines = [json.loads(line) for line in (tmp_path / "test" / "log.jsonl").read_text().splitlines()]
    train_keys = {"kind", "step", "loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step", "elapsed_s", "eta_s"}
    eval_keys = {"kind", "split", "step", "loss", "ppl", "tokens", "elapsed_s"}
    assert [set(r) for r in lines] == [train_keys] * 2 + [eval_keys] + [train_keys] * 2 + [eval_keys, eval_keys | {"final"}]
    assert json.loads((tmp_path / "test" / "summary.json").read_text()) == summary
    assert summary["step"] == 4 and summary["val_loss"] == records(tmp_path / "test", "eval")[-2]["loss"]
    assert (started["group"], started["tags"], started["exit_code"]) == ("sweep", ["block", "seed0"], 0)
    assert started["config"] == json.loads((tmp_path / "test" / "config.json").read_text())
    assert [(s, m["train/loss"]) for s, m in logged if "train/loss" in m] == \
        [(r["step"], r["loss"]) for r in records(tmp_path / "test")]
    assert {"val/loss", "test/loss"} <= {k for _, m in logged for k in m}


def test_cpu_threads_take_the_free_cores_shared_among_ranks_unless_omp_num_threads_says(monkeypatch):
    import common
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for busy, ranks, threads in ((0.2, 1, 8), (3.0, 1, 5), (3.0, 2, 2), (7.9, 1, 1), (20.0, 4, 1)):
        monkeypatch.setattr(common, "busy_cores", lambda cores, busy=busy: busy)
        assert common.cpu_threads(ranks) == threads
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert common.cpu_threads() == common.torch.get_num_threads()
    assert 0 <= common.busy_cores({0}, 0.01) <= 1.01
