"""tools/diagnose.py: its measures (JS divergence, CKA, rescue gain) on known values, the records of every
variant family, the command on a checkpoint, and its bad input: one line and exit 2, before any compute."""

import json
import math
import sys

import pytest
import torch

from conftest import randomize_routing, tiny, tokens
from model import GPTConfig
from model_fast import make_model
from tools import diagnose

from runs import run as train_run


def test_diagnose_refuses_a_corrupt_checkpoint_in_one_line(tmp_path, capsys):
    (tmp_path / "ckpt.pt").write_bytes(b"\x00" * 1000)
    assert diagnose.main(["--ckpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'ckpt.pt'} is not a readable checkpoint") and err.count("\n") == 1


# --- the diagnostics' measures --------------------------------------------------------------------

def test_the_measures_on_known_values():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert diagnose.js_divergence(p, p).item() == 0.0
    assert diagnose.js_divergence(q, torch.tensor([0.0, 1.0], dtype=torch.float64)).item() == pytest.approx(math.log(2))
    # m = (0.75, 0.25): KL(p||m) = 0.5 ln(2/3) + 0.5 ln 2, KL(q||m) = ln(4/3)
    expected = 0.5 * (0.5 * math.log(2 / 3) + 0.5 * math.log(2)) + 0.5 * math.log(4 / 3)
    assert diagnose.js_divergence(p, q).item() == pytest.approx(expected, abs=1e-12)
    assert diagnose.js_divergence(q, p).item() == pytest.approx(expected, abs=1e-12)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 8, generator=g, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    assert diagnose.linear_cka(X, X) == pytest.approx(1.0)
    assert diagnose.linear_cka(X, 3 * X @ Q + 1) == pytest.approx(1.0)  # invariant to rotation, scale, shift
    # one feature: CKA is the squared correlation; centred x = (-1, 0, 1), y = (-1, 1, 0): (1 / 2)^2
    x, y = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[1.0], [3.0], [2.0]])
    assert diagnose.linear_cka(x, y) == pytest.approx(0.25)
    assert diagnose.rescue_gain(0.4, 0.1) == pytest.approx(0.75)
    assert diagnose.rescue_gain(0.4, 0.4) == 0.0


@pytest.mark.parametrize("residual, kw, scale", [
    ("rd_attnres", dict(n_layer=2), 1.0), ("dar", dict(n_layer=2), 1.0), ("mhc", dict(hc_streams=2, n_layer=2), 1.0),
    ("denseformer", dict(denseformer_dilation=2), 0.1), ("muddformer", {}, 0.1), ("delta_attnres", {}, 0.1)])
def test_diagnostics_of_every_variant_family(residual, kw, scale):
    """The records each variant exposes are enough for its measures, at any routing. DWA weights land on their
    sources S(i); MUDD maps are [4 ways, n] per attention site and [n] at the readout; Delta's routing weights are
    distributions, their per-token peak between 1/n and 1."""
    model = randomize_routing(tiny(dtype=torch.float32, block_size=12, n_embd=16, residual=residual, **kw), scale=scale,
                              add=True)
    batches = [(tokens(seed=seed),) * 2 for seed in (0, 1)]
    loss, records = diagnose.collect(model, batches)
    if residual == "rd_attnres":
        assert diagnose.route_names(records, model.residual.route_names) == ("QK route", "V route")
        js = diagnose.route_js(records, model.residual.route_names)["QK||V"]
        assert list(js) == ["attn.0", "attn.1"] and js["attn.0"] == 0 and 0 < js["attn.1"] < math.log(2)
        maps = diagnose.routing_maps(records)
        assert maps["attn.1"].shape == (2, 2)  # sources [x0, partial] by 2 routes
        assert torch.allclose(maps["attn.1"].sum(0), torch.ones(2))
    elif residual == "dar":
        cka = diagnose.stream_cka(records, 2)
        state = lambda key, m: torch.cat([r[key][m].flatten(0, 1) for r in records])  # noqa: E731 [2, B, T, d]
        assert cka[0][1] == pytest.approx(diagnose.linear_cka(state("state.1", 0), state("state.3", 1)))
        assert all(0 < c < 1 for row in cka for c in row)
        gains = diagnose.dar_rescue_gains(model, batches, loss)
        assert len(gains) == 2 and "start" not in vars(model.residual)  # the ablation undone
        assert all(g[2] != 0 for g in gains)  # ablating both streams changes the loss
    elif residual == "mhc":
        cka = diagnose.stream_cka(records, 2)  # mHC-2's two streams, H [B, T, n, d]
        state = lambda key, m: torch.cat([r[key][..., m, :].flatten(0, 1) for r in records])  # noqa: E731
        assert cka[1][0] == pytest.approx(diagnose.linear_cka(state("state.3", 0), state("state.1", 1)))
        mix = diagnose.mixing_matrices(records)
        assert mix["mlp.1"].shape == (2, 2)
        assert torch.allclose(mix["mlp.1"].sum(-2), torch.ones(2), atol=1e-5)  # Sinkhorn ends on columns: float32, 4 u
    elif residual == "denseformer":  # k = 2: S(1) = {1}, S(2) = {0, 2}, S(3) = {1, 3}
        dwa = diagnose.dwa_weights(records, 3, 2)
        assert [torch.isnan(v).tolist() for v in dwa.values()] == [
            [True, False, True, True], [False, True, False, True], [True, False, True, False]]
        assert torch.equal(dwa["dwa.3"][[1, 3]], model.residual.alpha["3"].detach())
    elif residual == "muddformer":
        maps = diagnose.routing_maps(records)
        assert list(maps) == ["attn.1", "attn.2", "readout"]
        assert maps["attn.2"].shape == (4, 3) and maps["readout"].shape == (4,)
        ways = diagnose.mudd_way_summary(maps)
        assert list(ways) == list("QKVR") and all(abs(w["newest"] - 1) < 0.5 for w in ways.values())
    else:
        maps = diagnose.routing_maps(records)
        assert maps["mlp.2"].shape == (6,) and torch.allclose(maps["mlp.2"].sum(), torch.tensor(1.0))
        peak = diagnose.max_weight_per_site(records)
        assert "attn.0" not in peak and len(peak) == 5  # sublayer 0 routes over x0 alone
        assert all(1 / 6 <= p <= 1 for p in peak.values())


@pytest.mark.parametrize("residual", ["denseformer", "muddformer", "delta_attnres", "mhc"])
def test_diagnose_command_on_a_checkpoint(residual, tmp_path, data_dir):
    train_run(data_dir, tmp_path, f"--residual={residual}", "--max_steps=2", "--eval_interval=2", "--ckpt_interval=2")
    out = diagnose.diagnose(str(tmp_path / "test"), tokens=256, batch_size=2)
    key = {"denseformer": "dwa_weights", "muddformer": "mudd_ways", "delta_attnres": "max_weight_mean",
           "mhc": "cka_matrix"}[residual]
    assert key in out and json.loads((tmp_path / "test" / "diagnostics.json").read_text())[key] == out[key]
    assert diagnose.summary(out).count("\n") >= 1


# --- diagnose.py, reliability round three: bad input is one line and exit 2, before any compute --------

TINY = dict(vocab_size=260, block_size=16, n_layer=2, n_head=2, n_embd=32, residual="block_attnres")


def fake_run(run_dir, data_dir):
    """A run directory holding a checkpoint of a tiny random model whose run read `data_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model_config": TINY, "model": make_model(GPTConfig(**TINY)).state_dict(), "tokenizer": "byte", "step": 2,
                "train_config": {"data_dir": str(data_dir)}}, run_dir / "ckpt.pt")
    return run_dir


def diagnose_cli(capsys, *args):
    rc = diagnose.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_compute(monkeypatch):
    monkeypatch.setattr(diagnose, "collect", None)  # never reached


@pytest.mark.parametrize("case", ["tokens", "batch_size", "device", "cuda", "out_file", "curves_missing",
                                  "curves_out_dir", "read_only_out"])
def test_diagnose_bad_flags_are_one_line_and_exit_2_before_any_compute(case, tmp_path, data_dir, capsys,
                                                                     monkeypatch, no_compute, read_only):
    run = fake_run(tmp_path / "run", data_dir)
    (tmp_path / "a_file").write_text("mine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args, message = {
        "tokens": (["--ckpt", run, "--tokens", -5], "--tokens must be at least 1, got -5"),
        "batch_size": (["--ckpt", run, "--batch_size", 0], "--batch_size must be at least 1, got 0"),
        "device": (["--ckpt", run, "--device", "tpu"], "--device tpu is not a device: use cpu, cuda or cuda:N"),
        "cuda": (["--ckpt", run, "--device", "cuda"], "--device cuda: no CUDA device is available"),
        "out_file": (["--ckpt", run, "--out", tmp_path / "a_file"],
                     f"--out {tmp_path / 'a_file'} is a file: diagnose writes diagnostics.json and routing.png into "
                     "a directory"),
        "curves_missing": (["--curves", run, tmp_path / "nowhere"],
                           f"--curves {tmp_path / 'nowhere'}: no log.jsonl there (not a train.py run directory)"),
        "curves_out_dir": (["--curves", run, "--out", tmp_path],
                           f"--out {tmp_path} is a directory: with --curves alone, --out is the PNG file to write"),
        "read_only_out": (["--ckpt", run], f"cannot write the diagnostics into {run}: read-only file system: pass --out "
                          "with a writable directory"),  # checked before computing
    }[case]
    (run / "log.jsonl").write_text("")  # a run directory for --curves
    if case == "read_only_out":
        read_only(run)
    rc, out, err = diagnose_cli(capsys, *args)
    assert (rc, out) == (2, "") and err == f"error: {message}\n", err
    assert (tmp_path / "a_file").read_text() == "mine" and not (run / "diagnostics.json").exists()


def test_diagnose_says_what_it_wrote_into_the_run_and_draws_a_lone_evaluation(tmp_path, data_dir, capsys,
                                                                              monkeypatch):
    """A new user's first diagnose: every file goes into the run's directory (curves.png too, never the
    current directory) and is named on the last line; a run evaluated once still shows its point; without
    matplotlib, the numbers alone and the command that gets the plots."""
    run = fake_run(tmp_path / "run", data_dir)
    (run / "log.jsonl").write_text(json.dumps(dict(kind="eval", split="val", step=2, loss=3.5)) + "\n")
    monkeypatch.chdir(tmp_path)
    lines, write = [], diagnose.write_figure
    monkeypatch.setattr(diagnose, "write_figure", lambda path, fig: lines.extend(fig.axes[0].lines) or write(path, fig))
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--curves", run, "--tokens", 64, "--batch_size", 2)
    assert rc == 0, err
    assert out.splitlines()[-1] == f"wrote {run / 'curves.png'}, {run / 'routing.png'}, {run / 'diagnostics.json'}"
    assert list(tmp_path.iterdir()) == [run] and (run / "curves.png").is_file()
    assert list(lines[0].get_xdata()) == [2] and lines[0].get_marker() == "o"
    rc, out, err = diagnose_cli(capsys, "--curves", run)  # alone: into the run too
    assert (rc, out) == (0, f"wrote {run / 'curves.png'}\n")
    (run / "routing.png").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--tokens", 64, "--batch_size", 2)
    assert rc == 0 and "pip install matplotlib" in err
    assert out.splitlines()[-1] == f"wrote {run / 'diagnostics.json'}" and not (run / "routing.png").exists()


def test_diagnose_finds_the_data_of_a_run_from_anywhere_or_is_told_where(tmp_path, data_dir, capsys, monkeypatch):
    import shutil
    repo = tmp_path / "repo"
    shutil.copytree(data_dir, repo / "data" / "bytes")
    run = fake_run(tmp_path / "run", "data/bytes")  # recorded relative to the directory train.py ran in
    monkeypatch.setattr(diagnose, "ROOT", repo)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--tokens", 64, "--batch_size", 2)
    assert rc == 0, err
    assert f"data_dir data/bytes (from the checkpoint) is {repo / 'data' / 'bytes'}" in out
    (repo / "data" / "bytes").rename(repo / "moved")  # the data moved: say where it looked, and what to pass
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--tokens", 64, "--batch_size", 2)
    assert (rc, out) == (2, "")
    assert err == (f"error: the checkpoint's data_dir data/bytes holds no prepared data: looked in "
                   f"{elsewhere / 'data' / 'bytes'} and {repo / 'data' / 'bytes'}; pass --data_dir with the "
                   "directory prepare_data.py wrote for this run\n"), err
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--tokens", 64, "--batch_size", 2, "--data_dir",
                                repo / "moved")
    assert rc == 0 and json.loads((run / "diagnostics.json").read_text())["data_dir"] == str(repo / "moved")
    rc, out, err = diagnose_cli(capsys, "--ckpt", run, "--data_dir", tmp_path / "nothing")
    assert (rc, out) == (2, "") and err.startswith(f"error: --data_dir {tmp_path / 'nothing'} holds no meta.json")
