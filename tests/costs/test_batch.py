"""Goodput pricing of a batch's drafts (:func:`adaptive.costs.batch.batch_draft_lengths`), on literal arrays."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive.costs import extrapolate
from adaptive.costs.batch import batch_draft_lengths, padded_draft_lengths

FLAT = (1.0, 1.0, 1.0, 1.0, 1.1)
STEEP = (1.0, 1.7, 2.5, 3.3)


def test_the_worked_examples():
    gains, free = [[0.9, 0.81], [0.3, 0.09]], [[0.0, 0.0], [0.0, 0.0]]
    assert batch_draft_lengths(gains, free, FLAT) == [2, 0]
    assert batch_draft_lengths(gains, free, STEEP) == [0, 0]


def test_a_near_certain_draft_pays_even_where_rows_are_steep():
    assert batch_draft_lengths([[0.99, 0.98], [0.3]], [[0.0, 0.0], [0.0]], STEEP) == [2, 0]


def test_drafting_cost_and_fixed_rows_are_priced():
    # alone on a flat table a 0.6 token pays (1.6 / 1.0); at 0.7 steps of drafting it does not (1.6 / 1.7)
    assert batch_draft_lengths([[0.6]], [[0.0]], (1.0, 1.0)) == [1]
    assert batch_draft_lengths([[0.6]], [[0.7]], (1.0, 1.0)) == [0]
    # three unpriced rows already fill the flat part of the table: the fifth row costs 0.1
    assert batch_draft_lengths([[0.3]], [[0.0]], FLAT, fixed_rows=3) == [0]
    assert batch_draft_lengths([[0.3]], [[0.0]], FLAT, fixed_rows=2) == [1]


def test_degenerate_and_bad_inputs():
    assert batch_draft_lengths([], [], FLAT) == []
    assert batch_draft_lengths([[], []], [[], []], FLAT) == [0, 0]
    with pytest.raises(ValueError):
        batch_draft_lengths([[0.5]], [], FLAT)
    with pytest.raises(ValueError):
        batch_draft_lengths([[0.5]], [[0.0, 0.0]], FLAT)
    with pytest.raises(ValueError):
        batch_draft_lengths([[0.5]], [[0.0]], FLAT, fixed_rows=-1)


def goodput(lengths, gains, costs, verify, fixed_rows=0):
    tokens = len(gains) + fixed_rows + sum(sum(g[:k]) for g, k in zip(gains, lengths))
    rows = len(gains) + fixed_rows + sum(lengths)
    return tokens / (extrapolate(verify, rows - 1) + sum(sum(c[:k]) for c, k in zip(costs, lengths)))


chains = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=6).map(
    lambda a: [float(x) for x in __import__("itertools").accumulate(a, lambda p, q: p * q)])


@settings(max_examples=200, deadline=None)
@given(gains=st.lists(chains, min_size=1, max_size=8), cost=st.floats(0.0, 0.5),
       verify=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=10), fixed=st.integers(0, 3))
def test_never_priced_below_plain_batched_decoding(gains, cost, verify, fixed):
    table = [1.0]
    for d in verify:  # a verify table: non-decreasing in rows, from 1.0
        table.append(table[-1] + d)
    costs = [[cost] * len(g) for g in gains]
    k = batch_draft_lengths(gains, costs, table, fixed)
    assert all(0 <= n <= len(g) for n, g in zip(k, gains))
    assert goodput(k, gains, costs, table, fixed) >= goodput([0] * len(gains), gains, costs, table, fixed) - 1e-12


def test_padded_lengths_worked_example():
    gains, costs = [[0.9, 0.81, 0.73], [0.3, 0.09, 0.03]], [[0.0] * 3, [0.0] * 3]
    assert padded_draft_lengths(gains, costs, {1: 1.0, 2: 1.05, 4: 1.2, 8: 2.0}) == [3, 3]
    assert padded_draft_lengths(gains, costs, {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}) == [0, 0]  # off: nothing pays
    assert padded_draft_lengths(gains, costs, {1: 1.0, 2: 1.05}) == [1, 1]  # only R = 2 measured: one draft each
    # drafting that costs 0.05 a token: the strong request's three pay, and the weak one's first (0.3:
    # 4.74 / 1.4 = 3.39 against 4.44 / 1.35 = 3.29) but not its second (0.09: 4.83 / 1.45 = 3.33)
    assert padded_draft_lengths(gains, [[0.05] * 3, [0.05] * 3], {1: 1.0, 4: 1.2}) == [3, 1]
    # unpriced requests in the step share its cost: with many of them one request's drafts barely move
    # the goodput, but free rows still pay
    assert padded_draft_lengths([[0.5]], [[0.0]], {1: 1.0, 2: 1.1}, fixed_rows=7) == [0]
    assert padded_draft_lengths([[0.5]], [[0.0]], {1: 1.0, 2: 1.01}, fixed_rows=7) == [1]
    with pytest.raises(ValueError, match="plain step"):
        padded_draft_lengths(gains, costs, {2: 1.0})
    with pytest.raises(ValueError, match="one entry per request"):
        padded_draft_lengths(gains, costs[:1], {1: 1.0})


@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=7), min_size=1, max_size=4),
       st.floats(1.0, 3.0), st.floats(1.0, 3.0))
@settings(max_examples=60, deadline=None)
def test_padded_lengths_never_price_below_plain(gains, s4, s8):
    """Whatever the acceptance, the chosen lengths' expected goodput is at least plain decoding's, each
    fits the chosen row bucket, and all requests share one bucket."""
    gains = [sorted(g, reverse=True) for g in gains]
    costs = [[0.01] * len(g) for g in gains]
    steps = {1: 1.0, 2: 1.0 + (s4 - 1.0) / 3, 4: s4, 8: max(s8, s4)}
    k = padded_draft_lengths(gains, costs, steps)
    R = 1 if not any(k) else min(r for r in steps if r >= max(k) + 1)
    tokens = len(gains) + sum(sum(g[:n]) for g, n in zip(gains, k))
    drafting = sum(sum(c[:n]) for c, n in zip(costs, k))
    assert tokens / (steps[R] + drafting) >= len(gains) / steps[1] - 1e-9
    assert all(0 <= n <= len(g) for n, g in zip(k, gains))
