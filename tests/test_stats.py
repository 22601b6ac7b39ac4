"""tools/stats.py beyond the t-test: the exact sign-flip p-value and the detectable effect, on cases
computed by hand."""

import math

import pytest

from tools import stats


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
