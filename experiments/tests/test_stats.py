"""experiments/stats.py against scipy's own tests and hand-worked cases."""

import math

import pytest
from scipy import stats as scipy_stats

from experiments.stats import gated_holm, holm, paired_t, tost


def test_paired_t_is_scipy_s_paired_test_with_its_interval():
    a, b = [3.0, 3.1, 2.9, 3.05], [2.95, 3.12, 2.8, 3.0]
    d = [x - y for x, y in zip(a, b)]
    t = paired_t(d)
    ref = scipy_stats.ttest_rel(a, b)
    assert t["t"] == pytest.approx(ref.statistic) and t["p"] == pytest.approx(ref.pvalue)
    lo, hi = ref.confidence_interval(0.95)
    assert (t["lo"], t["hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert math.isnan(paired_t([0.1])["p"]) and paired_t([0.1, 0.1])["t"] == math.inf


def test_holm_and_a_gated_family_without_gates_is_holm():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(holm([0.01, math.nan])[1]) and holm([0.01, math.nan])[0] == 0.01
    ps = [0.01, 0.04, 0.03, 0.2]
    assert gated_holm(ps, {})[0]["primary"] == pytest.approx(holm(ps))


def test_a_gate_takes_the_level_its_primary_frees_and_passes_it_on():
    # primary 0 rejects at alpha/2 and hands its level to its control, which rejects at 0.025 and passes it to 1
    adjusted, local = gated_holm([0.001, 0.04], {0: 0.02}, 0.05)
    assert adjusted["gated"][0] == pytest.approx(0.04) and local["gated"][0] == pytest.approx(0.5)
    assert local["primary"][1] == pytest.approx(1.0) and adjusted["primary"][1] == pytest.approx(0.04)
    shut = gated_holm([0.2, 0.01], {0: 0.001}, 0.05)[1]  # primary 0 does not reject: its gate stays shut
    assert shut["gated"][0] == 0


@pytest.mark.parametrize("d", [[0.001, -0.002, 0.0015, 0.0005], [0.004, 0.005, 0.0045, 0.006], [0.01, -0.01, 0.02]])
def test_tost_rejects_exactly_where_the_90_percent_interval_lies_inside_the_margin(d):
    t = paired_t(d, confidence=0.90)
    assert (tost(d, 0.005) <= 0.05) == (-0.005 < t["lo"] and t["hi"] < 0.005)
    assert math.isnan(tost([0.001], 0.005)) and tost([0.001, 0.001], 0.005) == 0.0
