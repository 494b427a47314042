"""Paired-block speedups, their bootstrap intervals and the sequential race: literal timings in, verdicts out."""

import pytest

from adaptive.measure.interval import FASTER, NOT_FASTER, OPEN, Race, bootstrap_share, bootstrap_speedup, verdict
from adaptive.profile import Interval


def test_docstring_examples():
    point, iv = bootstrap_speedup([1.0, 1.1, 0.9, 1.0], [0.8, 0.85, 0.75, 0.8])
    assert point == pytest.approx(1.25)
    assert 1.2 <= iv.low <= point <= iv.high <= 1.3 and iv.blocks == 4 and iv.level == 0.9
    assert verdict(iv, 0.02) == FASTER
    point, iv = bootstrap_speedup([1.0, 1.1, 0.9, 1.0], [0.9, 1.2, 0.8, 1.05])
    assert point == pytest.approx(4.0 / 3.95)
    assert iv.low < 1.02 < iv.high and verdict(iv, 0.02) == OPEN


def test_interval_is_deterministic_and_narrows_with_more_blocks():
    ar = [1.0, 1.2, 0.9, 1.1, 1.0, 0.95]
    cand = [0.9, 1.0, 0.85, 0.9, 0.95, 0.8]
    assert bootstrap_speedup(ar, cand, seed=3) == bootstrap_speedup(ar, cand, seed=3)
    _, few = bootstrap_speedup(ar, cand)
    _, many = bootstrap_speedup(ar * 8, cand * 8)
    assert many.high - many.low < few.high - few.low
    _, wide = bootstrap_speedup(ar, cand, level=0.99)
    assert wide.low <= few.low and wide.high >= few.high


def test_one_block_is_its_own_interval_and_bad_input_is_refused():
    point, iv = bootstrap_speedup([2.0], [1.0])
    assert point == 2.0 and (iv.low, iv.high, iv.blocks) == (2.0, 2.0, 1)
    with pytest.raises(ValueError, match="same positive number"):
        bootstrap_speedup([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        bootstrap_speedup([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="level"):
        bootstrap_speedup([1.0], [1.0], level=1.0)


@pytest.mark.parametrize("low,high,want", [
    (1.03, 1.2, FASTER), (1.02, 1.02, FASTER), (0.8, 1.019, NOT_FASTER), (1.0, 1.05, OPEN), (0.9, 1.02, OPEN),
])
def test_verdict_against_the_margin(low, high, want):
    assert verdict(Interval(low, high), 0.02) == want


def test_an_interval_that_includes_one_is_never_faster():
    # whatever the point estimate, an interval reaching below 1 + margin cannot be declared faster
    for low in (0.5, 0.99, 1.0, 1.019):
        assert verdict(Interval(low, 3.0), 0.02) != FASTER


def test_race_docstring_example():
    race = Race(["a", "b"], margin=0.02, min_blocks=2)
    race.add(1.0, {"a": 0.5, "b": 0.9})
    assert race.active == ["a", "b"]  # too few blocks to settle anything
    race.add(1.0, {"a": 0.5, "b": 1.1})
    assert race.verdict("a") == FASTER and race.active == ["b"]
    assert race.result("a")[0] == pytest.approx(2.0)
    point, iv = race.result("b")
    assert point == pytest.approx(1.0) and iv.low < 1.0 < iv.high and race.verdict("b") == OPEN
    race.add(1.0, {"b": 1.0})  # a left the race: its time is no longer needed
    assert race.active == ["b"] and len(race.blocks["a"]) == 2 and len(race.blocks["b"]) == 3


def test_race_settles_a_slower_candidate_and_refuses_missing_times():
    race = Race(["slow"], margin=0.02, min_blocks=3)
    for _ in range(3):
        race.add(1.0, {"slow": 1.25})
    assert race.verdict("slow") == NOT_FASTER and race.active == []
    race = Race(["x", "y"], margin=0.0)
    with pytest.raises(ValueError, match="missing y"):
        race.add(1.0, {"x": 1.0})
    with pytest.raises(ValueError, match="distinct names"):
        Race(["ar"], margin=0.0)
    with pytest.raises(ValueError, match="no timed blocks"):
        Race(["x"], margin=0.0).result("x")


def test_race_with_noisy_timings_of_equal_methods_does_not_declare_a_winner():
    # ar and the candidate are the same speed; the block times carry +-15% noise
    import numpy as np

    rng = np.random.default_rng(0)
    race = Race(["same"], margin=0.02, min_blocks=4)
    for _ in range(24):
        if not race.active:
            break
        race.add(float(rng.uniform(0.85, 1.15)), {"same": float(rng.uniform(0.85, 1.15))})
    assert race.verdict("same") != FASTER


def test_the_interval_resamples_prompts_not_blocks():
    # the module docstring's example: two prompts of four blocks, the candidate 0.8 then 0.5 a block
    ar, cand, prompts = [1.0] * 8, [0.8] * 4 + [0.5] * 4, [0] * 4 + [1] * 4
    point, by_block = bootstrap_speedup(ar, cand)
    _, by_prompt = bootstrap_speedup(ar, cand, prompts=prompts)
    assert point == pytest.approx(8.0 / 5.2)
    assert (by_prompt.low, by_prompt.high) == (1.25, 2.0) and by_prompt.blocks == 8  # each prompt alone
    assert 1.3 < by_block.low and by_block.high < 1.8  # blocks alone: far narrower
    # one prompt: nothing to resample between prompts, so its blocks are resampled
    assert bootstrap_speedup(ar[:4], [0.8, 0.7, 0.9, 0.8], prompts=[3] * 4) == bootstrap_speedup(
        ar[:4], [0.8, 0.7, 0.9, 0.8])
    with pytest.raises(ValueError, match="3 prompt ids for 8 blocks"):
        bootstrap_speedup(ar, cand, prompts=[0, 1, 2])


def test_a_race_settles_only_on_enough_prompts():
    race = Race(["a"], margin=0.02, min_blocks=2, min_prompts=2)
    for _ in range(5):
        race.add(1.0, {"a": 0.5}, prompt=0)
    assert race.active == ["a"]  # five blocks of one prompt: not yet
    race.add(1.0, {"a": 0.5}, prompt=1)
    assert race.verdict("a") == FASTER and race.prompts["a"] == [0] * 5 + [1]
    # two prompts that disagree keep a candidate open where their blocks alone would settle it
    race = Race(["b"], margin=0.02, min_blocks=6, min_prompts=2)
    for p, t in ((0, 1.05), (1, 0.7)):
        for _ in range(4):
            race.add(1.0, {"b": t}, prompt=p)
    assert race.verdict("b") == OPEN
    assert verdict(bootstrap_speedup([1.0] * 8, [1.05] * 4 + [0.7] * 4)[1], 0.02) == FASTER
    with pytest.raises(ValueError, match="min_prompts"):
        Race(["c"], margin=0.0, min_prompts=0)


def test_share_docstring_example():
    point, iv = bootstrap_share([30, 50, 20], [60, 60, 60])
    assert point == pytest.approx(100 / 180)
    assert (iv.low, iv.high) == (pytest.approx(0.3889), pytest.approx(0.7222)) and iv.blocks == 3 and iv.level == 0.9
    assert 60 / 180 <= iv.low < point < iv.high <= 150 / 180  # within the extremes a resample can reach


def test_share_resamples_sequences_not_drafts():
    # the same 180 drafts in one sequence have nothing to resample; spread over sequences that differ, a wide interval
    point, one = bootstrap_share([100], [180])
    assert point == pytest.approx(100 / 180) and one.low == one.high == pytest.approx(0.5556) and one.blocks == 1
    _, alike = bootstrap_share([10] * 18, [18] * 18)
    _, unlike = bootstrap_share([18, 2] * 9, [18] * 18)
    assert alike.low == alike.high == pytest.approx(10 / 18, abs=1e-4)
    assert unlike.high - unlike.low > 0.2 and unlike.low < 10 / 18 < unlike.high
    assert bootstrap_share([3, 0, 5], [4, 0, 9], seed=1) == bootstrap_share([3, 5], [4, 9], seed=1)


def test_share_refuses_impossible_counts():
    with pytest.raises(ValueError, match="as many"):
        bootstrap_share([1, 2], [3])
    with pytest.raises(ValueError, match="between 0"):
        bootstrap_share([4], [3])
    with pytest.raises(ValueError, match="between 0"):
        bootstrap_share([-1], [3])
    with pytest.raises(ValueError, match="no unit"):
        bootstrap_share([0], [0])
    with pytest.raises(ValueError, match="level"):
        bootstrap_share([1], [2], level=0.3)
