"""The Thompson-sampling draft-length bandit."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive.costs import best_draft_length
from adaptive.engine.protocol import LAYER_SKIP, STATISTICAL, Draft
from adaptive.runtime.bandit import ThompsonDraftLength, temperature_class

VERIFY = (1.0, 1.0, 1.05, 1.1, 1.15, 1.2)


def best_length(a, cost, verify, max_len):
    return best_draft_length(a, cost, verify, max_len)[0]


def draft(k, sources=(), forwards=0):
    """A draft of ``k`` tokens (their ids do not matter to a policy)."""
    return Draft(torch.zeros(k, dtype=torch.long), None, tuple(sources), forwards)


def observe(b, drafted, accepted):
    b.update(draft(drafted), accepted)


def test_temperature_class_keys_greedy_apart_from_each_sampled_temperature():
    assert temperature_class(0.0) == "" and temperature_class(0) == ""
    assert temperature_class(1.0) == "@t1" and temperature_class(0.7) == "@t0.7"
    assert temperature_class(0.74) == "@t0.7" and temperature_class(0.04) == "@t0"  # to one decimal
    assert temperature_class(1.25) == "@t1.2"  # Python's round: to the even digit
    with pytest.raises(ValueError):
        temperature_class(-0.1)


def test_best_length_worked_examples():
    # a = 0.9: k=1 -> 1.9/1.5 = 1.267, k=2 -> 2.71/2.05 = 1.322, k=3 -> 3.439/2.7 = 1.274
    assert best_length(0.9, 0.5, (1.0, 1.0, 1.05, 1.2), 3) == 2
    # a cheaper 4-token verification tips it to k=3: 3.439/2.6 = 1.323 > 1.322
    assert best_length(0.9, 0.5, (1.0, 1.0, 1.05, 1.1), 3) == 3
    # a = 0.3: k=1 -> 1.3/1.5 = 0.87 < 1: do not draft
    assert best_length(0.3, 0.5, (1.0, 1.0, 1.05), 2) == 0
    # near-free, near-perfect drafts: the longest allowed
    assert best_length(0.99, 0.01, VERIFY, 5) == 5


def test_update_counts_successes_until_the_first_rejection():
    b = ThompsonDraftLength(0.5, VERIFY, 5, prior=(1, 1))
    observe(b, 4, 2)  # two accepted, then one rejection; the fourth draft is unobserved
    assert (b.alpha, b.beta) == (3.0, 2.0)
    observe(b, 3, 3)  # all accepted: no failure observed
    assert (b.alpha, b.beta) == (6.0, 2.0)
    observe(b, 0, 0)  # a plain step teaches nothing
    assert (b.alpha, b.beta) == (6.0, 2.0)
    with pytest.raises(ValueError):
        observe(b, 2, 3)


def test_posterior_is_bounded_by_the_window():
    b = ThompsonDraftLength(0.5, VERIFY, 5, prior=(1, 1), window=50)
    for _ in range(1000):
        observe(b, 3, 2)
    assert b.alpha + b.beta <= 50 + 1e-9
    assert b.mean == pytest.approx(2 / 3, abs=0.02)


def test_bandit_learns_to_stop_drafting_when_drafts_fail_and_to_draft_when_they_pass():
    bad = ThompsonDraftLength(0.9, VERIFY, 5, prior=(5, 5), seed=1)
    for _ in range(200):
        k = bad.choose(5).length
        if k:
            observe(bad, k, 0)  # every draft rejected
    assert sum(bad.choose(5).length == 0 for _ in range(100)) >= 95
    good = ThompsonDraftLength(0.1, VERIFY, 5, prior=(1, 1), seed=1)
    for _ in range(200):
        k = good.choose(5).length
        if k:
            observe(good, k, k)
    assert sum(good.choose(5).length == 5 for _ in range(100)) >= 95
    assert good.choose(2).length <= 2  # respects the step's limit


def test_allow_zero_false_always_drafts():
    b = ThompsonDraftLength(0.99, VERIFY, 5, prior=(1, 50), allow_zero=False)
    assert all(b.choose(5).length >= 1 for _ in range(20))


def test_copies_learn_apart_from_the_model_s_drafts():
    b = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1), copy_prior=(2, 2), copy_cost=0.005)
    b.update(draft(4, (STATISTICAL,) * 4), 4)  # a copy, all kept
    assert (b.alpha, b.beta) == (1.0, 1.0) and (b.copies.alpha, b.copies.beta) == (6.0, 2.0)
    observe(b, 3, 1)  # the model's draft: one kept, then a rejection
    assert (b.alpha, b.beta) == (2.0, 2.0) and (b.copies.alpha, b.copies.beta) == (6.0, 2.0)
    b.update(draft(2, (LAYER_SKIP, STATISTICAL)), 0)  # not every token copied: the model's
    assert (b.alpha, b.beta) == (2.0, 3.0)
    plain = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1))  # no copy posterior: copies count as drafts
    plain.update(draft(4, (STATISTICAL,) * 4), 4)
    assert (plain.alpha, plain.beta) == (5.0, 1.0) and plain.copies is None and plain.choose(5).copy is None


def test_copies_run_as_long_as_their_acceptance_pays_not_as_the_model_s_drafts():
    # the model's drafts kept a tenth of the time at 0.3 of a step a token: no draft; copies nearly always kept
    b = ThompsonDraftLength(0.3, VERIFY, 5, prior=(10, 90), copy_prior=(990, 10), copy_cost=0.005, seed=3)
    choices = [b.choose(5) for _ in range(50)]
    assert all(c.length == 0 and c.copy == 5 for c in choices)
    assert b.choose(3).copy == 3  # within the step's limit
    assert b.state()["copies"]["chosen"] == {5: 50, 3: 1}
    costly = (1.0, 1.1, 1.15, 1.2, 1.25, 1.3)  # where a row verified costs a tenth of a step
    wrong = ThompsonDraftLength(0.3, costly, 5, prior=(10, 90), copy_prior=(1, 99), copy_cost=0.005, seed=3)
    assert all(wrong.choose(5).copy == 0 for _ in range(20))  # copies that are almost never kept: none


def test_copies_posterior_is_saved_restored_and_rebased():
    a = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1), copy_prior=(1, 1))
    a.update(draft(3, (STATISTICAL,) * 3), 3)
    saved = a.posteriors()
    assert saved["copies"] == {"acceptance": [4.0, 1.0], "evidence": [3.0, 0.0]}
    b = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1), copy_prior=(1, 1))
    b.restore(saved)
    assert (b.copies.alpha, b.copies.beta) == (4.0, 1.0) and (b.alpha, b.beta) == (1.0, 1.0)
    c = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1), copy_prior=(1, 1))
    c.rebase([saved, saved])  # two replicas' evidence, each counted once
    assert (c.copies.alpha, c.copies.beta) == (7.0, 1.0)
    # saved before copies had a posterior (their outcomes in the model's): skipped, both start from their priors
    old = {"kind": "length", "acceptance": [9.0, 2.0], "evidence": [8.0, 1.0]}
    d = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1), copy_prior=(2, 3))
    d.restore(old)
    d.rebase([old, saved])
    assert (d.copies.alpha, d.copies.beta) == (5.0, 3.0) and (d.alpha, d.beta) == (1.0, 1.0)
    plain = ThompsonDraftLength(0.05, VERIFY, 5, prior=(1, 1))  # without copies: every state is its own
    plain.restore(old)
    assert (plain.alpha, plain.beta) == (9.0, 2.0)


def test_a_plan_carries_the_copy_length_the_copies_posterior_gives():
    b = ThompsonDraftLength(0.3, VERIFY, 5, prior=(10, 90), copy_prior=(990, 10), copy_cost=0.005, seed=3)
    plan = b.plan(4)
    assert plan.copy == 4 and plan.choice(0).copy == 4 and plan.choice(2).length == 2
    assert ThompsonDraftLength(0.3, VERIFY, 5, prior=(10, 90)).plan(4).copy is None


def test_bandit_is_thread_safe():
    b = ThompsonDraftLength(0.5, VERIFY, 5, prior=(1, 1), window=1e9)

    def work():
        for _ in range(2000):
            b.choose(5)
            observe(b, 2, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.alpha == pytest.approx(1 + 8000) and b.beta == pytest.approx(1 + 8000)
    assert sum(b.state()["chosen"].values()) == 8000


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=50))
def test_updates_keep_a_valid_posterior(steps):
    b = ThompsonDraftLength(0.5, VERIFY + (1.3, 1.4, 1.5), 8, window=40)
    for drafted, accepted in steps:
        accepted = min(accepted, drafted)
        observe(b, drafted, accepted)
        assert b.alpha > 0 and b.beta > 0 and b.alpha + b.beta <= 40 + 1e-9
        assert 0 <= b.choose(8).length <= 8


# -- the cascade's two-level sampler ---------------------------------------------------------------

from adaptive.costs import best_split, cascade_expected_tokens  # noqa: E402
from adaptive.runtime.bandit import ThompsonCascade  # noqa: E402

L, S = LAYER_SKIP, STATISTICAL


def test_cascade_expected_tokens_docstring_case():
    # 1 + 0.8 + 0.8 * (0.5 + 0.25)
    assert cascade_expected_tokens(0.8, 1, 0.5, 2) == pytest.approx(2.4)
    assert cascade_expected_tokens(0.8, 0, 0.5, 0) == 1.0  # a plain step
    # by tail position: the second statistical token is likelier once the first was right
    assert cascade_expected_tokens(0.8, 1, [0.5, 0.9], 2) == pytest.approx(2.56)


def test_best_split_docstring_case():
    # (1, 2): one layer-skip token then one statistical token: 2.17 / 1.55 = 1.40 beats the rest
    assert best_split(0.9, 0.3, 0.5, 0.0, (1, 1, 1.05), 2, 2) == (1, 2)
    # no layer-skip level allowed: the best statistical-only draft
    assert best_split(0.9, 0.3, 0.5, 0.0, (1, 1, 1.05), 2, 0) == (0, 2)
    # nothing is ever accepted and drafting costs: a plain step
    assert best_split(0.0, 0.0, 0.5, 0.01, (1, 1.01, 1.05), 2, 2) == (0, 0)


def test_thompson_cascade_credits_each_level():
    b = ThompsonCascade(0.5, [1.0] * 6, 5, 2, layer_skip_prior=(1, 1), stat_prior=(1, 1))
    # L, L accepted; tail position 0 accepted; tail position 1 rejected; the last says nothing
    b.update(draft(5, (L, L, S, S, S), forwards=2), 3)
    assert (b.layer_skip.alpha, b.layer_skip.beta) == (3.0, 1.0)
    assert [(t.alpha, t.beta) for t in b.tail[:3]] == [(2.0, 1.0), (1.0, 2.0), (1.0, 1.0)]
    b.update(draft(2, (L, S), forwards=1), 2)  # all accepted: one success each, no failure
    assert (b.layer_skip.alpha, b.tail[0].alpha, b.tail[0].beta) == (4.0, 3.0, 1.0)
    b.update(draft(2, (S, S)), 0)  # tail position 0 rejected at once
    assert (b.tail[0].alpha, b.tail[0].beta, b.tail[1].alpha) == (3.0, 2.0, 1.0)
    # layer-skip forwards per layer-skip token, from the drafts' own counts: 3 forwards for 3 tokens
    assert b.forwards_per_token == 1.0
    b.update(draft(3, (L, L, L), forwards=1), 3)  # vertical: three tokens from one forward
    assert b.forwards_per_token == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        b.update(draft(2, (L, S)), 3)


def test_thompson_cascade_chooses_the_split():
    # a near-perfect, cheap layer-skip level and a useless statistical one: layer-skip positions
    b = ThompsonCascade(0.1, [1.0] * 9, 8, 3, layer_skip_prior=(500, 1), stat_prior=(1, 500), seed=0)
    c = b.choose(8)
    assert c.split == 3 and c.length >= 3
    # the reverse: statistical tokens only
    b = ThompsonCascade(0.9, [1.0] * 9, 8, 3, layer_skip_prior=(1, 500), stat_prior=(500, 1), seed=0)
    c = b.choose(8)
    assert c.length == 8 and c.split == 0
    # no layer-skip level at all (max_split 0): never a split
    b = ThompsonCascade(0.1, [1.0] * 9, 8, 0, layer_skip_prior=(500, 1), stat_prior=(1, 500), seed=0)
    assert b.choose(8).split == 0 and b.max_split == 0
    assert set(b.state()) == {"layer_skip", "statistical", "forwards_per_token", "chosen"}
    # priors by tail position: a long tail pays when later positions are likely once reached
    rising = ThompsonCascade(0.5, [1.0, 1.0, 1.02, 1.06, 1.1, 1.14], 5, 0,
                             stat_prior=[(400, 600), (900, 100), (900, 100), (900, 100), (900, 100)], seed=0)
    flat = ThompsonCascade(0.5, [1.0, 1.0, 1.02, 1.06, 1.1, 1.14], 5, 0, stat_prior=(400, 600), seed=0)
    assert rising.choose(5).length == 5 and flat.choose(5).length < 5


def test_plans_price_what_the_bandit_believes():
    b = ThompsonDraftLength(0.01, (1.0,) * 9, 8, prior=(90000.0, 10000.0), seed=1)  # acceptance ~0.9
    plan = b.plan(4)
    assert plan.split is None and plan.costs == (0.01,) * 4
    assert plan.gains == pytest.approx((0.9, 0.81, 0.729, 0.6561), abs=0.01)
    assert len(b.plan(20).gains) == 8  # at most the bandit's own longest draft
    assert ThompsonDraftLength(0.01, (1.0,) * 9, 8, allow_zero=False).plan(4) is None  # it must choose itself


def test_a_cascade_plans_its_split_then_its_tail():
    b = ThompsonCascade(0.5, (1.0,) * 7, 6, 2, layer_skip_prior=(99000.0, 1000.0), stat_prior=(50000.0, 50000.0),
                        stat_cost=0.005, seed=1)
    plan = b.plan(6)
    h = plan.split
    assert 1 <= h <= 2 and plan.costs == (0.5,) * h + (0.005,) * (6 - h)
    assert plan.gains[h - 1] == pytest.approx(0.99 ** h, abs=0.01)
    assert plan.gains[h] == pytest.approx(0.99 ** h * 0.5, abs=0.01)  # the first statistical token
    assert plan.choice(1).split == 1 and plan.choice(0).length == 0
