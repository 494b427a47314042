"""Calibration of the cascade: teacher-forced statistical acceptance, the starting split."""

import pytest

from adaptive.measure.statistical import accepted_prefix, choose_cascade, statistical_acceptance


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 9]) == 2
    assert accepted_prefix([], [1]) == 0
    assert accepted_prefix([1, 2], [1]) == 1  # scored only as far as the actual text goes


def test_statistical_acceptance_on_literal_sequences():
    # One sequence, prompt [1, 2, 3], continuation [1, 2, 3, 1]. At t = 1 (context [1, 2, 3, 1]) the lookup
    # proposes [2, 3, 1] (after the earlier 1), and the text goes on [2, 3, 1]: 3 accepted, no rejection.
    # At t = 2 (... 1, 2) it proposes [3, 1] against [3, 1]: 2 more. At t = 3 it proposes [1] against [1].
    s = statistical_acceptance([([1, 2, 3], [1, 2, 3, 1])], k=3, bigram=False)
    assert s.positions == 3 and s.available == 1.0
    assert s.token_acceptance == 1.0 and s.position_acceptance == (1.0, 1.0, 1.0)
    # A continuation that does not repeat its context: proposals are wrong at position 0.
    # t = 1: context [5, 6, 5] proposes [6, 5] (k = 2), the text goes [7, 8]: rejected at 0.
    s = statistical_acceptance([([5, 6], [5, 7, 8])], k=2, bigram=False)
    assert s.token_acceptance == 0.0 and s.position_acceptance[0] == 0.0


def test_bigram_table_is_left_out_of_its_own_sequence():
    # Sequence 0 alone contains the pair (8, 9). Scoring sequence 0, its table comes from sequence 1 only,
    # which never has 8: no proposal at the position after 8.
    seqs = [([8], [9]), ([1, 2], [1, 2])]
    with_table = statistical_acceptance(seqs, k=1, min_count=1)
    assert with_table.positions == 1  # only sequence 1 has a position to score (t = 1)
    s = statistical_acceptance([([8, 9], [8, 9, 8])], k=1, min_count=1)  # a single sequence: an empty table
    assert s == statistical_acceptance([([8, 9], [8, 9, 8])], k=1, bigram=False)


def test_choose_cascade_docstring_cases():
    c = choose_cascade(0.3, 0.9, 0.5, (1, 1, 1.05), 2, 2)
    assert (c.split, c.draft_len) == (1, 2)
    c = choose_cascade(0.3, 0.9, 0.95, (1, 1, 1.05), 2, 2)
    assert (c.split, c.draft_len) == (0, 2)
    with pytest.raises(ValueError):
        choose_cascade(0.3, 0.9, 0.5, (1, 1, 1.05), 2, 2, lenience=0.5)


def test_replay_speedup_docstring_example():
    from adaptive.measure.statistical import replay_speedup

    got = replay_speedup([([1, 2, 3, 4], [7, 1, 2, 3, 9])], 3, (1.0, 1.0, 1.0, 1.0), bigram=False)
    assert got == pytest.approx(4 / 2.015)


def test_replay_counts_a_copied_span_once():
    """A long copy is one step in decoding: the replay's tokens per step follow that, where a mean over
    positions counts the span once per position it covers."""
    from adaptive.measure.statistical import replay_speedup, statistical_acceptance

    span = list(range(10, 22))
    seqs = [([5] + span + [6], [5] + span + [8, 9, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39])]
    flat = (1.0,) * 13
    replay = replay_speedup(seqs, 12, flat, bigram=False)
    # 24 tokens after the first: one step copies the span (12 drafted and accepted, then the model's 8),
    # then 11 plain steps: 24 tokens for 12 verifications and 12 drafted tokens
    assert replay == pytest.approx(24 / (12 + 12 * 0.005))
    per_position = statistical_acceptance(seqs, 12, bigram=False)
    assert per_position.positions == 24
    # the mean over positions sees the span from each of its 12 positions: twice the tokens per step
    assert 1 + per_position.accepted_per_step > 2 * (24 / 12)


def test_race_tables_leave_out_each_raced_prompts_own_text():
    from adaptive.measure.statistical import race_tables

    seqs = [([1], [2, 3]), ([4], [5, 6])]
    (t,) = race_tables(seqs, [[4]], min_count=1)  # the docstring's example
    assert (t.get(1), t.get(2), t.get(4), t.get(5)) == ((2, 1.0), (3, 1.0), None, None)
    # background text is in every table, even when it holds the raced prompt
    t_bg, t_none = race_tables(seqs, [[4], [9]], min_count=1, background=[([4], [5, 7])])
    assert t_bg.get(4) == (5, 1.0) and t_bg.get(5) == (7, 1.0)
    assert t_none.get(5) == (6, 0.5) and t_none.get(4) == (5, 1.0)  # a prompt not among the sequences: all of them


def test_background_text_is_in_every_leave_one_out_table():
    from adaptive.measure.statistical import leave_one_out_table

    seqs = [([8], [9]), ([1, 2], [1, 2])]
    assert leave_one_out_table(seqs, 0, 1).get(8) is None
    assert leave_one_out_table(seqs, 0, 1, background=[([8, 9], [])]).get(8) == (9, 1.0)
    assert leave_one_out_table(seqs, -1, 1).get(8) == (9, 1.0)  # -1: every sequence
    # one sequence, prompt [3], continuation [4, 2, 5]; alone, its leave-one-out table is empty and nothing
    # repeats: no proposal. With the background's 4 -> 2 -> 5: at t = 1 (context [3, 4]) the chain proposes
    # [2, 5], both right; at t = 2, [5], right: 3 accepted over 2 positions.
    plain = statistical_acceptance([([3], [4, 2, 5])], k=2, min_count=1)
    with_bg = statistical_acceptance([([3], [4, 2, 5])], k=2, min_count=1, background=[([4], [2, 5])])
    assert plain.available == 0.0 and plain.accepted_per_step == 0.0
    assert with_bg.available == 1.0 and with_bg.accepted_per_step == 1.5


def test_sequences_without_a_prompt():
    from adaptive.measure.statistical import sequences_without

    seqs = [([1], [2]), ([4], [5]), ([4], [6])]
    assert sequences_without(seqs, [4]) == [([1], [2])]  # every sequence of that prompt
    assert sequences_without(seqs, (1,)) == [([4], [5]), ([4], [6])]
