"""benchmarks/statistical_ceiling.py's tables, oracle replay and metric on literal token lists."""

import pytest

from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("statistical_ceiling")


def test_context_table_keeps_successors_seen_often_enough(script):
    t = script.ContextTable([[1, 2, 3, 1, 2, 4, 7, 2, 4]], order=2)
    assert t.entries[(2,)] == (4, pytest.approx(2 / 3))
    assert (1, 2) not in t.entries  # followed by 3 once and 4 once
    assert (1,) in t.entries and t.entries[(1,)] == (2, 1.0)
    with pytest.raises(ValueError):
        script.ContextTable([[1, 2]], order=0)


def test_the_longest_known_context_predicts(script):
    # after (5, 1) comes 8 (twice); after 1 alone, 9 is the most frequent (three times)
    t = script.ContextTable([[5, 1, 8, 5, 1, 8, 0, 1, 9, 0, 1, 9, 3, 1, 9]], order=2)
    assert t.next([7, 5, 1]) == (8, 1.0)
    assert t.next([7, 0, 1])[0] == 9
    assert t.next([42]) is None


def test_chain_stops_at_an_unknown_context_or_below_min_prob(script):
    t = script.ContextTable([[1, 2, 3, 1, 2, 3]], order=1)  # 1 -> 2, 2 -> 3, 3 -> 1 (once: dropped)
    assert t.chain([1], 5) == [2, 3]
    t2 = script.ContextTable([[1, 2, 1, 2, 1, 3, 1, 3, 1, 3]], order=1)  # 1 -> 3 (3/5), 3 -> 1, 2 -> 1
    assert t2.chain([1], 3, min_prob=0.3) == [3, 1, 3]  # chances 0.6, 0.6, 0.36
    assert t2.chain([1], 3, min_prob=0.5) == [3, 1]
    assert t2.chain([1], 3, min_prob=0.7) == []


def test_richer_draft_continues_the_lookup_with_the_chain(script):
    t = script.ContextTable([[4, 6, 4, 6, 4]], order=1)  # 4 -> 6, 6 -> 4
    propose = script.richer_draft(t)
    # the suffix [4] occurred at 0, followed by [7, 4]; the chain goes on from 4: 6
    assert propose([4, 7, 4], 3) == [7, 4, 6]
    assert propose([9, 6], 2) == [4, 6]  # nothing repeats: the chain alone


def test_oracle_takes_the_most_accepted_proposal_at_its_own_cost(script):
    replay = load_benchmark("statistical_tables").replay
    pairs = [([1], [5, 6, 7])]
    wrong = lambda context, k: [9]  # noqa: E731
    right = lambda context, k: [6, 7][:k]  # noqa: E731
    verify, text = (1.0, 1.0, 1.5), [1, 5, 6, 7]
    assert replay(pairs, verify, script.oracle_nodes([wrong, right], 2, text)) == pytest.approx(2 / 1.5)
    # no proposal right: the oracle drafts nothing (a plain step), never pays for a wrong draft
    assert replay(pairs, verify, script.oracle_nodes([wrong], 2, text)) == pytest.approx(1.0)


def test_oracle_is_never_below_any_of_its_proposers(script):
    replay = load_benchmark("statistical_tables").replay
    pairs = [([1, 2, 3], [4, 1, 2, 3, 4, 1, 9, 9, 2, 3])]
    verify = (1.0, 1.0, 1.1, 1.2, 1.4)
    a = lambda context, k: [1, 2, 3][:k]  # noqa: E731
    b = lambda context, k: [2, 3, 4][:k]  # noqa: E731
    alone = [replay(pairs, verify, script.chain_nodes(p, 3)) for p in (a, b)]
    text = pairs[0][0] + pairs[0][1]
    assert replay(pairs, verify, script.oracle_nodes([a, b], 3, text)) >= max(alone) - 1e-12


def test_predicted_rate_speeds_up_the_decoding_only(script):
    assert script.predicted_rate(64, 10.0, 2.0, 2.0) == pytest.approx(64 / 6)
    assert script.predicted_rate(64, 10.0, 2.0, 1.0) == pytest.approx(6.4)


def test_decoding_speedup_needed_grows_with_the_prefill_share(script):
    assert script.decoding_speedup_needed(1.5, 0.25) == pytest.approx(1.8)
    assert script.decoding_speedup_needed(1.5, 0.0) == pytest.approx(1.5)
    assert script.decoding_speedup_needed(1.5, 0.7) == float("inf")  # the prefill alone is over 1/1.5 of the time


def test_acceptance_needed_is_the_least_that_reaches_the_speedup(script):
    from adaptive.costs.model import best_draft_length

    verify = (1.0, 1.0, 1.0, 1.0, 1.0)  # free verification of up to 4 drafted tokens
    a = script.acceptance_needed(2.0, 0.1, verify)
    assert best_draft_length(a, 0.1, verify, 4)[1] >= 2.0
    assert best_draft_length(a - 0.01, 0.1, verify, 4)[1] < 2.0
    assert script.acceptance_needed(2.0, 0.9, verify) is None  # a draft nearly a step long never doubles
