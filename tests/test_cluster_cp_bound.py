"""The bound on torchtitan's context-parallel rows (`benchmarks.cp_bound`): the least worst error any
per-token time ``a + b x cp`` (a above a floor, b >= 0, plus up to ``g (cp - 1)``) leaves on a series."""

from __future__ import annotations

import math

import pytest

from benchmarks.cp_bound import largest_floor, least_spread, smallest_error


def rates(*times):
    """(x, rate) points from per-token times at x = 1, 2, ..."""
    return [(x, 1.0 / t) for x, t in times]


def test_points_on_an_allowed_line_are_met_exactly():
    bound = smallest_error(rates((1, 5.0), (2, 7.0), (4, 11.0), (8, 19.0)), floor=1.0)
    assert bound.error == pytest.approx(0.0, abs=1e-9)
    assert (bound.a, bound.b) == pytest.approx((3.0, 2.0), rel=1e-6)


def test_a_floor_above_the_best_intercept_leaves_the_error_worked_by_hand():
    # times 1 and 4 at x = 1, 2 want a = -2, b = 3; held at a >= 1 the best line has a = 1 and b with
    # b / (1 + b) = 4 / (1 + 2b) - 1, b = sqrt(3) / 2: both rows off by sqrt(3) / (2 + sqrt(3))
    bound = smallest_error(rates((1, 1.0), (2, 4.0)), floor=1.0)
    assert bound.error == pytest.approx(math.sqrt(3) / (2 + math.sqrt(3)), rel=1e-6)
    assert (bound.a, bound.b) == pytest.approx((1.0, math.sqrt(3) / 2), rel=1e-5)


def test_a_spread_lets_a_point_sit_above_the_line_by_up_to_g_per_added_x():
    points = rates((1, 1.0), (3, 3.0))
    # without it: a = 1, 3b^2 + b - 1 = 0, error b / (1 + b)
    b = (math.sqrt(13) - 1) / 6
    assert smallest_error(points, floor=1.0).error == pytest.approx(b / (1 + b), rel=1e-6)
    assert smallest_error(points, floor=1.0, spread=1.0).error == pytest.approx(0.0, abs=1e-9)


def test_the_largest_floor_within_ten_percent():
    # a + b <= 1 / 0.9 and a + 2b >= 1.5 / 1.1 bind: a <= 2 / 0.9 - 1.5 / 1.1
    points = rates((1, 1.0), (2, 1.5))
    assert largest_floor(points) == pytest.approx(2 / 0.9 - 1.5 / 1.1, rel=1e-6)
    assert math.isnan(largest_floor(rates((1, 1.0), (2, 4.0))))


def test_torchtitan_table_2_fits_no_line_with_a_non_negative_intercept():
    # arXiv 2410.06511 Table 2: 3,890, 2,540, 1,071, 548 tokens/s a GPU at cp 1, 2, 4, 8
    published = [(1, 3890), (2, 2540), (4, 1071), (8, 548)]
    assert smallest_error(published, floor=0.0).error > 0.10
    assert smallest_error(published[:2] + published[3:], floor=0.0).error < 0.10  # cp 4 is what breaks it


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="points"):
        smallest_error([(0, 1.0)], floor=0.0)


def test_the_least_spread_that_meets_the_points():
    # times 1 at x = 1 and 3 at x = 3 with a >= 1: b = 0 and a spread of 1 a unit past the first meets
    # both exactly; within 10 %, the line climbs most with a = 1, b = 1 / 0.9 - 1, and the spread makes
    # up the rest of 3 / 1.1 at x = 3 over the 2 units past the first
    points = rates((1, 1.0), (3, 3.0))
    assert least_spread(points, floor=1.0, error=1e-9) == pytest.approx(1.0, rel=1e-6)
    highest = 1 + 3 * (1 / 0.9 - 1)
    assert least_spread(points, floor=1.0) == pytest.approx((3 / 1.1 - highest) / 2, rel=1e-6)
