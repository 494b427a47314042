"""The live bigram table: calibration's table plus counts from accepted output, bounded."""

import numpy as np
import pytest

from adaptive.drafters.live import LiveBigramTable
from adaptive.drafters.ngram import BigramTable, NgramDrafter, bigram_chain, build_bigram_table


def table(entries: dict) -> BigramTable:
    keys = sorted(entries)
    return BigramTable(np.array(keys), np.array([entries[k][0] for k in keys]),
                       np.array([entries[k][1] for k in keys]))


def test_docstring_example():
    t = LiveBigramTable(table({5: (6, 0.5)}), prior_weight=4.0, min_count=2)
    assert t.get(5) == (6, 0.5) and t.get(7) is None
    assert t.observe([5, 7, 5, 7, 5, 7]) == 5
    succ, p = t.get(5)
    assert succ == 7 and p == pytest.approx(3 / 7)
    assert t.get(7) == (5, 1.0)
    assert t.pairs == 2 and len(t) == 2


def test_calibrated_entries_stay_until_outweighed():
    t = LiveBigramTable(table({1: (2, 0.9), 3: (4, 0.3)}), prior_weight=4.0, min_count=2)
    t.observe([1, 9])  # one observation of 1 -> 9 against 3.6 pseudo-counts of 1 -> 2
    assert t.get(1)[0] == 2 and t.get(1)[1] == pytest.approx(3.6 / 5)
    assert t.get(3) == (4, pytest.approx(0.3))  # never observed: calibration's entry, below min_count or not
    t.observe([1, 9, 1, 9, 1, 9, 1, 9])
    assert t.get(1)[0] == 9


def test_new_tokens_need_min_count():
    t = LiveBigramTable(None, min_count=3)
    t.observe([8, 9, 0, 8, 9])
    assert t.get(8) is None  # twice
    t.observe([8, 9])
    assert t.get(8) == (9, 1.0)


def test_memory_is_bounded_by_decay():
    t = LiveBigramTable(table({0: (1, 1.0)}), max_pairs=50, min_count=2)
    rng = np.random.default_rng(0)
    for _ in range(40):
        t.observe(rng.integers(0, 400, size=64).tolist())
        assert t.pairs <= 50
    assert t.decays > 0
    assert t.get(0) is not None  # the calibrated prior never fades
    t.observe([7, 3] * 20)  # recent, frequent pairs survive decay
    assert t.get(7) == (3, pytest.approx(1.0, abs=0.2))


def test_counts_round_trip_and_snapshot():
    t = LiveBigramTable(table({1: (2, 0.5)}))
    t.observe([1, 5, 1, 5, 1, 5, 6, 6, 6])
    prev, succ, count = t.counts()
    assert list(zip(prev.tolist(), succ.tolist(), count.tolist())) == [(1, 5, 3.0), (5, 1, 2.0), (5, 6, 1.0),
                                                                        (6, 6, 2.0)]
    u = LiveBigramTable(table({1: (2, 0.5)}))
    u.load(prev, succ, count)
    assert {k: u.get(k) for k in range(8)} == {k: t.get(k) for k in range(8)}
    snap = t.snapshot()  # float32 probabilities
    for k in range(8):
        assert snap.get(k) == (None if t.get(k) is None else (t.get(k)[0], pytest.approx(t.get(k)[1])))


def test_drafters_take_a_live_table():
    t = LiveBigramTable(None, min_count=1)
    t.observe([3, 4, 5, 6])
    assert bigram_chain(t, 3, 5) == [4, 5, 6]
    assert NgramDrafter(bigram=t).lookup([9, 3], 3) == [4, 5, 6]


def test_bad_settings():
    with pytest.raises(ValueError):
        LiveBigramTable(None, max_pairs=0)
    with pytest.raises(ValueError):
        LiveBigramTable(None, min_count=0)


def test_snapshot_without_a_text_answers_as_if_it_was_never_observed():
    t = LiveBigramTable()
    t.observe([1, 2, 1, 2, 1, 3])  # 1 -> 2 twice, 1 -> 3 once, 2 -> 1 twice
    assert t.get(1) == (2, pytest.approx(2 / 3))
    s = t.snapshot(without=[1, 2])  # the docstring's example: 1 -> 2 once, 1 -> 3 once, below min_count
    assert s.get(1) is None and s.get(2) == (1, 1.0)
    assert t.get(1) == (2, pytest.approx(2 / 3))  # the live table is unchanged
    full = t.snapshot(without=[1, 2, 1, 2, 1, 3])
    assert len(full) == 0
    # a calibrated entry stays: only observed counts are taken off
    base = LiveBigramTable(build_bigram_table([[7, 8, 7, 8]]))
    base.observe([7, 9] * 5)  # 5 observations of 7 -> 9 outweigh the prior's 4 of 7 -> 8
    assert base.get(7)[0] == 9 and base.snapshot(without=[7, 9] * 5).get(7) == (8, 1.0)
