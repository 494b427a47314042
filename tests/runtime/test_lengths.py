"""Where answers end (adaptive.runtime.lengths): the Kaplan-Meier expectation on literal lengths, and
the learner's records."""

import random

import pytest

from adaptive.errors import ConfigError
from adaptive.runtime.lengths import LengthLearner, LengthSettings, expected_tokens

EXAMPLE = [(10, True), (30, True), (50, False), (80, True)]  # the module's worked example


def test_the_worked_example():
    assert expected_tokens(EXAMPLE, 64) == pytest.approx(42.0)
    assert expected_tokens(EXAMPLE, 256) == pytest.approx(50.0)
    assert expected_tokens(list(reversed(EXAMPLE)), 64) == pytest.approx(42.0)  # order does not matter
    assert expected_tokens(EXAMPLE, 5) == pytest.approx(5.0)  # every answer runs past 5
    assert expected_tokens(EXAMPLE, 0) == 0.0


def test_without_cuts_it_is_the_mean_of_the_capped_lengths():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(0, 300) for _ in range(rng.randint(1, 30))]
        cap = rng.randint(0, 320)
        want = sum(min(n, cap) for n in lengths) / len(lengths)
        assert expected_tokens([(n, True) for n in lengths], cap) == pytest.approx(want)


def test_cut_answers_are_priced_to_run_on():
    assert expected_tokens([], 64) == 64.0  # nothing seen: the cap
    assert expected_tokens([(100, False)] * 3, 64) == 64.0
    assert expected_tokens([(100, False)] * 3, 300) == 300.0  # past the longest seen: to the cap
    # one stop at 20 of two: S = 1/2 after it; the other, cut at 40, runs on to the cap
    assert expected_tokens([(20, True), (40, False)], 100) == pytest.approx(20 + 80 * 0.5)
    # a cut at the same length as a stop is still at risk of it: at 10, one of three stops
    assert expected_tokens([(10, True), (10, False), (20, True)], 30) == pytest.approx(10 + 10 * 2 / 3)
    assert expected_tokens([(0, True), (10, True)], 5) == pytest.approx(2.5)  # an empty answer
    with pytest.raises(ValueError):
        expected_tokens(EXAMPLE, -1)


def test_a_domain_prices_itself_once_it_has_enough_requests():
    learner = LengthLearner(LengthSettings(window=10, min_requests=3))
    assert learner.expected("qa", 256) == 256.0  # nothing learned: the cap
    for n in (20, 30):
        learner.observe("qa", n, "eos")
    assert learner.expected("qa", 256) == 256.0  # two of three
    learner.observe(None, 40, "stop")  # no domain guessed: only all requests' record
    assert learner.expected("qa", 256) == pytest.approx(30.0)  # qa has 2: all requests' (20, 30, 40)
    assert learner.expected("rag", 256) == pytest.approx(30.0)  # a domain never seen: all requests'
    learner.observe("qa", 10, "eos")
    assert learner.expected("qa", 256) == pytest.approx(20.0)  # its own three
    learner.observe("qa", 100, "length")  # cut at its cap of 100
    assert learner.expected("qa", 256) == pytest.approx(10 + 10 * 3 / 4 + 10 * 2 / 4 + 226 * 1 / 4)
    st = learner.state()
    assert st == {"requests": 5, "stopped": 4, "domains": {"qa": {"requests": 4, "stopped": 3}}}


def test_the_window_keeps_the_latest_requests():
    learner = LengthLearner(LengthSettings(window=4, min_requests=2))
    for _ in range(4):
        learner.observe("code", 200, "eos")
    assert learner.expected("code", 256) == pytest.approx(200.0)
    for _ in range(4):
        learner.observe("code", 8, "eos")
    assert learner.expected("code", 256) == pytest.approx(8.0)  # the long ones aged out
    assert learner.state()["requests"] == 4
    with pytest.raises(ValueError):
        learner.observe("code", -1, "eos")


@pytest.mark.parametrize("fields", [dict(window=0), dict(min_requests=0), dict(window=True), dict(window=2.5),
                                    dict(window=4, min_requests=5)])
def test_settings_are_validated(fields):
    with pytest.raises(ConfigError, match="LengthSettings"):
        LengthSettings(**fields)
