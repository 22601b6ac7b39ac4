"""experiments/stats.py on cases computed by hand or read from tables: Student's t, Holm, the exact sign-flip
p-value and the detectable effect (the gated family: experiments/tests/test_report.py)."""

import math

import pytest

from experiments import stats


def test_sign_flip_p_counts_the_sign_patterns():
    # d = (1, -2, 3): the 8 patterns sum to 6, 0, 2, -4, 4, -2, 0, -6; six reach |2|
    assert stats.sign_flip_p([1.0, -2.0, 3.0]) == 0.75
    assert stats.sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 32  # the floor at 5 seeds: 0.0625
    assert stats.sign_flip_p([0.0, 0.0]) == 1.0  # no difference at all
    assert stats.sign_flip_p([-0.1, 0.1]) == 1.0
    assert math.isnan(stats.sign_flip_p([]))


def test_sign_flip_p_counts_ties_whatever_the_rounding():
    d = [0.1, 0.2, 0.3]  # +0.1 +0.2 -0.3 ties 0; the pattern (-0.1, -0.2, +0.3) too, in floats
    assert stats.sign_flip_p(d) == 2 / 8
    assert stats.sign_flip_p([0.3, -0.1, -0.2]) == 1.0  # sum 0: every pattern is as extreme


def test_detectable_effect():
    # (t_0.975 + t_0.8) sd / sqrt(n), 4 degrees of freedom: 2.776445 + 0.940965 (t tables)
    assert stats.detectable(1.0, 5) == pytest.approx((2.776445 + 0.940965) / math.sqrt(5), abs=1e-5)
    assert stats.detectable(0.01, 5) == pytest.approx(0.0166247, abs=1e-6)
    # a stricter level needs a larger effect; in the normal limit it is (1.959964 + 0.841621) sd / sqrt(n)
    assert stats.detectable(1.0, 5, alpha=0.05 / 8) > stats.detectable(1.0, 5)
    assert stats.detectable(1.0, 10**7) * math.sqrt(10**7) == pytest.approx(1.959964 + 0.841621, abs=1e-5)
    assert math.isnan(stats.detectable(1.0, 1))


# --- the t-test and Holm: known answers -----------------------------------------------------------------

def test_student_t_against_closed_forms_and_tables():
    for t in (0.3, 1.0, 2.5, 7.0):
        assert stats.t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert stats.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    # two-sided 5% critical values of the t tables (df 1, 2, 4, 30)
    for df, crit in ((1, 12.706205), (2, 4.302653), (4, 2.776445), (30, 2.042272)):
        assert stats.t_quantile(0.975, df) == pytest.approx(crit, abs=1e-6)
        assert stats.t_two_sided_p(crit, df) == pytest.approx(0.05, abs=1e-7)  # crit has 6 decimals
    assert stats.t_quantile(0.025, 4) == pytest.approx(-2.776445, abs=1e-6)
    assert stats.t_two_sided_p(1.959964, 10**7) == pytest.approx(0.05, abs=1e-6)  # the normal limit


def test_paired_t_on_a_small_fixed_sample():
    r = stats.paired_t([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (r["n"], r["df"], r["mean"]) == (5, 4, 3.0)
    assert r["sd"] == pytest.approx(math.sqrt(2.5)) and r["t"] == pytest.approx(3 * math.sqrt(2))
    assert r["p"] == pytest.approx(0.0132356, abs=1e-7)
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)
    assert (r["lo"], r["hi"]) == (pytest.approx(3 - half, abs=1e-6), pytest.approx(3 + half, abs=1e-6))
    same = stats.paired_t([0.0, 0.0, 0.0])  # a variant trained bit for bit as its reference: no difference
    assert same["t"] == 0 and same["p"] == 1
    assert stats.paired_t([-0.1, -0.1])["p"] == 0  # a constant non-zero difference
    assert math.isnan(stats.paired_t([0.5])["p"])


def test_holm_bonferroni():
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1, kept monotone
    adjusted = stats.holm([0.02, math.nan, 0.04])  # no test: not counted
    assert adjusted[0] == pytest.approx(0.04) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.04)
