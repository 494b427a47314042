"""The bound on layer skipping's speedup over the ranked space, with scripted acceptances and costs."""

import pytest

from adaptive.calibrate.bound import Bound, cell_bound, grid, layer_skip_bound

VERIFY = (1.0, 1.0, 1.0)


def _cost(na, nm):
    return 1 - 0.2 * (na + nm)


def test_grid():
    assert grid(30) == [0, 2, 4, 8, 16]
    assert grid(4) == [0, 1, 2]
    assert grid(2) == [0, 1]
    assert grid(1) == [0]
    with pytest.raises(ValueError):
        grid(0)


def test_docstring_example():
    calls = []
    scores = {(0, 1): 0.5, (1, 0): 0.4, (1, 1): 0.9}

    def score(na, nm):
        calls.append((na, nm))
        return scores[(na, nm)]

    b = layer_skip_bound(2, score, _cost, VERIFY, 2, floor=0.2, reference=1.5)
    assert b.speedup == pytest.approx(3 / 2.2, abs=1e-4) and b.cell == (0, 0) and not b.pays
    assert sorted(calls) == [(0, 1), (1, 0)] and b.scored == 2  # (1, 1) was bounded by (1, 0): never scored
    assert cell_bound(0.4, 0.2, VERIFY, 2) < 1.5


def test_a_low_reference_scores_and_finds_the_paying_cell():
    scores = {(0, 1): 0.95, (1, 0): 0.9, (1, 1): 0.85}
    b = layer_skip_bound(2, lambda na, nm: scores[(na, nm)], _cost, VERIFY, 2, floor=0.2, reference=1.0)
    assert b.pays and b.scored == 3
    # the best cell is (1, 1): acceptance 0.85 at the far corner's cost 0.2
    assert b.cell == (1, 1) and b.speedup == pytest.approx(cell_bound(0.85, 0.2, VERIFY, 2), abs=1e-4)


def test_corners_below_the_floor_prune_everything_beyond_them():
    calls = []

    def score(na, nm):
        calls.append((na, nm))
        return 0.1  # every skip below the floor

    b = layer_skip_bound(30, score, lambda na, nm: 1 - (na + nm) / 70, (1.0,) * 9, 8, floor=0.2, reference=1.0)
    # only the corners next to the full model are scored: everything beyond them is below the floor too
    assert sorted(calls) == [(0, 2), (2, 0)]
    assert b.cell == (0, 0) and b.speedup == pytest.approx(cell_bound(1.0, 1 - 4 / 70, (1.0,) * 9, 8), abs=1e-4)


def test_the_bound_is_never_below_any_point_it_covers():
    """Monotone acceptance (falling with what is skipped): every point's true estimate is within the bound."""
    n = 6

    def acc(na, nm):
        return max(0.0, 1 - 0.08 * na - 0.12 * nm)

    def cost(na, nm):
        return 1 - 0.06 * na - 0.09 * nm

    verify = (1.0, 1.05, 1.1, 1.15, 1.2)
    b = layer_skip_bound(n, acc, cost, verify, 4, floor=0.0, reference=0.0)
    truth = max(cell_bound(acc(i, j), cost(i, j), verify, 4) for i in range(n + 1) for j in range(n + 1)
                if (i, j) != (0, 0))
    assert b.speedup >= truth - 1e-9


def test_bound_record():
    assert Bound(1.2, 1.1, (0, 0), 3).pays and not Bound(1.0, 1.1, None, 0).pays
