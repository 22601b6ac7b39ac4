"""The seed-claims study (issue 55): its declaration parses as the sweeps will run it, and experiments/seed_claims.py
computes the declared mechanism tests from stored diagnostics."""

import json
import runpy

import pytest

from experiments import seed_claims, sweep
from experiments.stats import holm, paired_t


def test_the_declaration_runs_as_declared():
    rd, dar = (sweep.load_sweep(f"experiments/configs/seed_claims_{p}.py") for p in ("rd", "dar"))
    for spec in (rd, dar):
        sweep.check_runs(spec)  # every variant and seed parses as train.py reads it
        assert spec["base"] == str(sweep.in_root("configs/exp_cpu.py")) and spec["seeds"] == list(range(1200, 1220))
    earlier = set(range(5)) | {100, 101} | set(range(1000, 1016)) | set(range(1100, 1116))
    assert not earlier & set(rd["seeds"])
    mech = runpy.run_path("experiments/configs/seed_claims_mechanism.py")
    by_dir = {rd["out_dir"]: rd, dar["out_dir"]: dar}
    for out_dir, variant in mech["runs"].values():
        assert variant in by_dir[str(sweep.in_root(out_dir))]["variants"]


def write_design(tmp_path, seeds):
    design = tmp_path / "design.py"
    design.write_text(f"tokens = 64\nseeds = {seeds}\nalpha = 0.05\npaper_js = 0.22\n"
                      f"runs = {{n: ({str(tmp_path / 'runs')!r}, n) for n in ('rd_attnres', 'dar', 'dar_self_kv', 'mhc2')}}\n")
    return design


def diag(tmp_path, name, seed, **d):
    run = tmp_path / "runs" / name / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "diagnostics.json").write_text(json.dumps(dict(tokens=64, **d)))


def matrix(diag_value, off):
    return [[diag_value if i == j else off for j in range(3)] for i in range(3)]


def test_the_mechanism_tests_from_stored_diagnostics(tmp_path, capsys):
    seeds = [1, 2, 3, 4]
    js = [0.30, 0.25, 0.28, 0.27]
    for k, s in enumerate(seeds):
        diag(tmp_path, "rd_attnres", s, js_per_site={"QK||V": {"attn.0": js[k] - 0.01, "attn.1": js[k] + 0.01}})
        diag(tmp_path, "dar", s, cka_matrix=matrix(0.8, 0.3 + 0.01 * k),
             rescue_gain_per_layer=[dict(stream0=0.5, stream1=0.4), dict(stream0=0.6, stream1=0.5)])
        diag(tmp_path, "dar_self_kv", s, cka_matrix=matrix(0.9, 0.5 + 0.02 * k),
             rescue_gain_per_layer=[dict(stream0=0.9, stream1=0.1 * k), dict(stream0=0.8, stream1=0.2)])
        if s != 4:  # one run without diagnostics: its pairs drop out
            diag(tmp_path, "mhc2", s, cka_matrix=matrix(0.95, 0.7 - 0.03 * k))
    assert seed_claims.main([str(write_design(tmp_path, seeds)), "--table_only", "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "mechanism.json").read_text())
    t = result["tests"]
    assert t["M1"]["mean"] == pytest.approx(sum(js) / 4) and t["M2"]["mean"] == pytest.approx(sum(js) / 4 - 0.22)
    imbalance = {"dar": [0.1] * 4, "dar_self_kv": [(abs(0.9 - 0.1 * k) + 0.6) / 2 for k in range(4)]}
    assert t["M3"]["mean"] == pytest.approx(paired_t([a - b for a, b in zip(imbalance["dar_self_kv"], imbalance["dar"])])["mean"])
    assert t["M4"]["mean"] == pytest.approx(0.2 + 0.01 * 1.5) and t["M5"]["n"] == 3
    ps = [t[k]["p"] for k in ("M1", "M2", "M3", "M4", "M5")]
    assert [t[k]["p_holm"] for k in ("M1", "M2", "M3", "M4", "M5")] == pytest.approx(holm(ps))
    assert result["missing"] == ["mhc2 seed 4"]
    assert list(result["means"]["dar"]) == ["cka_diag", "cka_off", "imbalance"]  # not a set's order: the same bytes
    assert "M4" in capsys.readouterr().out and (tmp_path / "out" / "mechanism.md").is_file()
