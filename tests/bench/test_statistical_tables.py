"""benchmarks/statistical_tables.py's replay and trees on literal token lists."""

from collections import Counter

import pytest

from adaptive.drafters.ngram import build_bigram_table
from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("statistical_tables")


def test_lookup_branches_longest_suffix_first_then_latest(script):
    # suffix [1, 2] occurred at 0 (followed by 7) and at 3 (followed by 8); suffix [2] adds nothing new
    assert script.lookup_branches([1, 2, 7, 1, 2, 8, 1, 2], 2) == [[8, 1], [7, 1]]
    assert script.lookup_branches([1, 2, 3], 2) == []


def test_replay_counts_steps_at_their_verification_cost(script):
    # continuation [5, 6, 7, 8]: the oracle drafts the rest each step; from the second token one step of a
    # 2-token draft (cost 1.5) takes 6, 7 and the model's 8: 4 tokens for 1.5 -> 3 tokens after the first
    cont = [5, 6, 7, 8]
    oracle = lambda context, left: {tuple(cont[len(context) - 1:][:j]) for j in range(1, left)}  # noqa: E731
    assert script.replay([([1], cont)], (1.0, 1.2, 1.5, 2.0), oracle) == pytest.approx(3 / 1.5)
    nothing = lambda context, left: set()  # noqa: E731
    assert script.replay([([1], cont)], (1.0, 1.2, 1.5), nothing) == pytest.approx(1.0)


def test_a_tree_holds_the_chain_and_its_alternatives_within_its_size(script):
    table = build_bigram_table([[2, 3, 2, 3]])  # 2 -> 3, 3 -> 2
    successors = {2: Counter({3: 2, 9: 2})}  # 2's other frequent successor: 9 (no entry of its own)
    context = [2, 3, 4, 2]  # the lookup follows [2] at 0 with [3, 4, 2]
    assert script.tree_paths(context, table, successors, 3, 12) == {(3,), (3, 4), (3, 4, 2), (9,)}
    assert script.tree_paths(context, table, successors, 3, 2) == {(3,), (3, 4)}
    assert script.tree_paths(context, table, successors, 1, 12) == {(3,), (9,)}  # one token left to draft
