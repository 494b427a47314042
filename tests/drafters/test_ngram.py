"""Prompt lookup: literal arrays, one commented case each, and lossless decoding with it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptive.drafters.ngram import NgramDrafter, ngram_lookup
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from tests.conftest import tiny_lm


def test_longest_suffix_wins():
    # suffix [5, 6] occurred at 0; [7, 8, 5] followed it
    assert ngram_lookup([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]


def test_latest_occurrence_wins():
    # [1] occurred at 0 (then 2) and at 2 (then 3): the later one proposes 3
    assert ngram_lookup([1, 2, 1, 3, 1], 1, max_ngram=1) == [3]


def test_falls_back_to_shorter_ngrams():
    # [9, 4] never occurred before, but [4] did (at 1, followed by 7)
    assert ngram_lookup([3, 4, 7, 9, 4], 2, max_ngram=2) == [7, 9]


def test_nothing_repeats():
    assert ngram_lookup([1, 2, 3], 4) == []
    assert ngram_lookup([1], 4) == []


def test_proposal_is_cut_at_k_and_at_the_end():
    # [1, 2] at 0 is followed by [3, 1, 2]; k = 2 keeps [3, 1]
    assert ngram_lookup([1, 2, 3, 1, 2], 2) == [3, 1]
    # the continuation runs into the end of the context: only what exists
    assert ngram_lookup([7, 7], 5) == [7]


def test_min_ngram_is_respected_and_arguments_checked():
    # only a 1-gram ([2]) repeats; with min_ngram 2 nothing qualifies
    assert ngram_lookup([2, 5, 2], 3, max_ngram=3, min_ngram=2) == []
    with pytest.raises(ValueError):
        ngram_lookup([1, 2], 0)
    with pytest.raises(ValueError):
        ngram_lookup([1, 2], 2, max_ngram=1, min_ngram=2)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_proposals_really_followed_a_matching_occurrence(ctx, k, max_ngram):
    out = ngram_lookup(ctx, k, max_ngram)
    assert len(out) <= k
    if out:  # some earlier window equal to a suffix of length n is followed by exactly `out`
        ok = any(ctx[i:i + n] == ctx[-n:] and ctx[i + n:i + n + len(out)] == out
                 for n in range(1, max_ngram + 1) for i in range(len(ctx) - n))
        assert ok


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pld_decoding_equals_plain_greedy(family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    for prompt in ["abc abc abc abc", "the cat sat on the mat. the cat sat on", "xyz 123 xyz 12"]:
        for k in (1, 3, 8):
            cfg = GenerationConfig(max_new_tokens=30, draft_len=k)
            ar = engine.generate(prompt, cfg)
            pld = engine.generate(prompt, cfg, drafter=NgramDrafter())
            assert pld.token_ids == ar.token_ids, (prompt, k)
            assert pld.drafter == pld.drafter_info["name"] == "pld"


def test_pld_sampling_runs_and_drafts():
    lm = tiny_lm("llama")
    r = Engine(lm).generate("ab ab ab ab ab", GenerationConfig(max_new_tokens=20, temperature=0.9, seed=1,
                                                             draft_len=4), drafter=NgramDrafter())
    assert 1 <= len(r.token_ids) <= 20
    assert r.stats.drafted > 0  # the repeated prompt gives the lookup something to propose


def test_ngram_drafter_validates():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=0)
    assert NgramDrafter(4, 2).describe() == {"name": "pld", "max_ngram": 4, "min_ngram": 2}


# -- the bigram table ------------------------------------------------------------------------------

from adaptive.drafters.ngram import BigramTable, bigram_chain, build_bigram_table, statistical_draft  # noqa: E402


def test_build_bigram_table_docstring_case():
    # 1 -> 2 three times out of three; 2 -> 3 once and 2 -> 4 once; 3 -> 1 and 4 -> 1 once: below min_count 2
    t = build_bigram_table([[1, 2, 3, 1, 2, 4, 1, 2]])
    assert t.keys.tolist() == [1] and t.succ.tolist() == [2] and t.prob.tolist() == [1.0]
    # with min_count 1 every token is kept; ties (2 -> 3, 2 -> 4) go to the smaller id at probability 1/2
    t = build_bigram_table([[1, 2, 3, 1, 2, 4, 1, 2]], min_count=1)
    assert t.get(2) == (3, 0.5) and t.get(4) == (1, 1.0) and t.get(9) is None


def test_build_bigram_table_counts_across_sequences_only():
    # the pair (5, 6) never occurs inside one sequence: it must not be counted across the boundary
    t = build_bigram_table([[7, 5], [6, 7, 5], [7]], min_count=1)
    assert t.get(7) == (5, 1.0) and t.get(5) is None
    assert len(build_bigram_table([[1], []])) == 0


def test_bigram_chain_docstring_case():
    t = BigramTable([1, 2, 3], [2, 3, 1], [1.0, 0.6, 0.5])
    # chances 1.0, 0.6, 0.3, 0.3; the next would be 0.15 < 0.25
    assert bigram_chain(t, 1, 5, min_prob=0.25) == [2, 3, 1, 2]
    assert bigram_chain(t, 1, 2, min_prob=0.0) == [2, 3]  # cut at k
    assert bigram_chain(t, 7, 3) == []  # no entry for 7


def test_statistical_draft_docstring_cases():
    t = BigramTable([2, 9], [9, 7], [0.9, 0.5])
    # prompt lookup finds [2, 9, 1] after the earlier 1; the table has nothing after 1
    assert statistical_draft([4, 1, 2, 9, 1], 4, t) == [2, 9, 1]
    # no repeat: the chain from 2 (0.9, then 0.45)
    assert statistical_draft([8, 2], 4, t) == [9, 7]
    assert statistical_draft([8, 2], 4, None) == []  # prompt lookup alone


def test_bigram_table_validation():
    with pytest.raises(ValueError):
        BigramTable([2, 1], [0, 0], [0.5, 0.5])  # unsorted
    with pytest.raises(ValueError):
        BigramTable([1], [2], [1.5])
    with pytest.raises(ValueError):
        BigramTable([1, 2], [2], [1.0])
    with pytest.raises(ValueError):
        build_bigram_table([[1, 2]], min_count=0)


@given(st.lists(st.lists(st.integers(0, 6), max_size=15), max_size=5), st.integers(1, 3))
def test_bigram_table_entries_are_real_majority_successors(seqs, min_count):
    t = build_bigram_table(seqs, min_count)
    for a, s, p in zip(t.keys.tolist(), t.succ.tolist(), t.prob.tolist()):
        follow = [seq[i + 1] for seq in seqs for i in range(len(seq) - 1) if seq[i] == a]
        assert follow.count(s) >= min_count and follow.count(s) == max(follow.count(x) for x in set(follow))
        assert p == pytest.approx(follow.count(s) / len(follow), rel=1e-6)
