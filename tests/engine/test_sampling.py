import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptive.engine.sampling import (
    greedy_accept,
    greedy_accept_host,
    greedy_accept_tree,
    sample_token,
    speculative_accept,
    speculative_accept_tree,
    warp_probs,
)


def test_sample_token_inverts_the_cumulative_distribution(monkeypatch):
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    for u, token in ((0.0, 0), (0.05, 0), (0.1, 2), (0.6999, 2), (0.7, 3), (0.95, 3), (0.999999, 3)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.tensor([u], dtype=torch.float64))
        assert sample_token(probs) == token, u
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([0.5], dtype=torch.float64))
    assert sample_token(probs * 7.0) == 2  # unnormalised mass: the same token
    assert sample_token(torch.tensor([0.0, 0.0, 1.0])) == 2 and sample_token(torch.tensor([1.0, 0.0])) == 0


def test_sample_token_draws_the_distribution_and_follows_its_generator():
    """Frequencies of 40,000 draws against the probabilities (a chi-square test at p < 1e-4: the 4
    degrees of freedom's quantile is 23.5), zero mass never drawn; one seed, one sequence."""
    probs = torch.tensor([0.05, 0.0, 0.45, 0.2, 0.3, 0.0])
    gen = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([sample_token(probs, gen) for _ in range(40_000)]), minlength=6).double()
    assert counts[1] == 0 and counts[5] == 0
    kept = probs > 0
    expected = 40_000 * probs[kept].double()
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < 23.5
    draws = lambda: [sample_token(probs, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert draws() == draws()


def test_greedy_accept_cases():
    # 5 and 7 agree, 9 is replaced by the target's 2
    assert greedy_accept(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 2, 4])) == (2, 2)
    # all agree: the target's 4 is the bonus token
    assert greedy_accept(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 9, 4])) == (3, 4)
    # first token already wrong
    assert greedy_accept(torch.tensor([1, 7]), torch.tensor([3, 7, 4])) == (0, 3)
    # nothing drafted (plain decoding): the target's own token
    assert greedy_accept(torch.tensor([], dtype=torch.long), torch.tensor([8])) == (0, 8)


@given(st.lists(st.integers(0, 5), min_size=0, max_size=8), st.lists(st.integers(0, 5), min_size=9, max_size=9))
def test_greedy_accept_property(draft, target):
    n, nxt = greedy_accept(torch.tensor(draft, dtype=torch.long), torch.tensor(target[: len(draft) + 1]))
    assert draft[:n] == target[:n]
    assert n == len(draft) or draft[n] != target[n]
    assert nxt == target[n]


def test_warp_probs_examples():
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert torch.allclose(warp_probs(logits, 1.0), torch.tensor([0.6652, 0.2447, 0.0900]), atol=1e-4)
    assert torch.equal(warp_probs(logits, 1.0, top_k=1), torch.tensor([1.0, 0.0, 0.0]))
    # 0.665 < 0.8, so the second token (which crosses 0.8) is kept, the third dropped
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.8), torch.tensor([0.7311, 0.2689, 0.0]), atol=1e-4)
    # a lower temperature sharpens
    assert warp_probs(logits, 0.5)[0] > warp_probs(logits, 1.0)[0]


def test_speculative_accept_always_rejects_impossible_token():
    q = torch.tensor([[0.5, 0.5]])
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # p(1) = 0: token 1 is always rejected, the residual is all on token 0
        assert speculative_accept(torch.tensor([1]), q, p, g) == (0, 0)


def test_speculative_accept_always_accepts_when_p_dominates():
    q = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.3, 0.7]])
    g = torch.Generator().manual_seed(0)
    n, nxt = speculative_accept(torch.tensor([0, 1]), q, p, g)
    assert n == 2 and nxt in (0, 1)  # both drafts accepted (p >= q), bonus from p[2]


def test_speculative_accept_single_position_matches_p():
    """Monte Carlo over the rule itself: draft x ~ q, output distributed as p (V=3)."""
    g = torch.Generator().manual_seed(1)
    q = torch.tensor([0.6, 0.3, 0.1])
    p = torch.tensor([0.2, 0.3, 0.5])
    n = 20_000
    counts = torch.zeros(3)
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)
        acc, nxt = speculative_accept(x, q.unsqueeze(0), torch.stack([p, p]), g)
        counts[int(x) if acc else nxt] += 1
    # 4 standard errors of a binomial proportion
    assert torch.all((counts / n - p).abs() < 4 * torch.sqrt(p * (1 - p) / n))


def test_greedy_accept_ids_gives_the_step_s_new_tokens():
    from adaptive.engine.sampling import greedy_accept_ids

    assert greedy_accept_ids(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 2, 4])) == (2, [5, 7, 2])
    assert greedy_accept_ids(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 9, 4])) == (3, [5, 7, 9, 4])
    assert greedy_accept_ids(torch.tensor([8]), torch.tensor([5, 7])) == (0, [5])
    assert greedy_accept_ids(torch.empty(0, dtype=torch.long), torch.tensor([3])) == (0, [3])


def test_greedy_accept_host_works_on_ints():
    from adaptive.engine.sampling import greedy_accept_host

    assert greedy_accept_host([5, 7, 9], [5, 7, 2, 4]) == (2, [5, 7, 2])
    assert greedy_accept_host([5, 7, 9], [5, 7, 9, 4]) == (3, [5, 7, 9, 4])
    assert greedy_accept_host([8], [5, 7]) == (0, [5])
    assert greedy_accept_host([], [3]) == (0, [3])
    with pytest.raises(ValueError, match="2 drafts need 3 target rows, got 2"):
        greedy_accept_host([1, 2], [1, 2])


@given(st.lists(st.integers(0, 5), min_size=0, max_size=8), st.lists(st.integers(0, 5), min_size=9, max_size=9))
def test_greedy_accept_host_keeps_the_longest_matching_prefix(draft, target):
    from adaptive.engine.sampling import greedy_accept_host

    target = target[: len(draft) + 1]
    n = 0
    while n < len(draft) and draft[n] == target[n]:  # the rule, spelled out
        n += 1
    assert greedy_accept_host(draft, target) == (n, target[: n + 1])


def test_greedy_accept_batch_counts_every_request_in_one_read():
    from adaptive.engine.sampling import greedy_accept_batch

    t = torch.tensor
    drafts = [t([5, 7, 9]), t([], dtype=torch.long), t([4, 4]), t([1])]
    targets = [t([5, 7, 2, 4]), t([3]), t([4, 4, 8]), t([2, 6])]
    assert greedy_accept_batch(drafts, targets) == [(2, [5, 7, 2]), (0, [3]), (2, [4, 4, 8]), (0, [2])]
    assert greedy_accept_batch([t([], dtype=torch.long)] * 2, [t([3]), t([9])]) == [(0, [3]), (0, [9])]  # plain
    with pytest.raises(ValueError, match="drafts for"):
        greedy_accept_batch(drafts[:1], targets)


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=6), st.integers(0, 3)), min_size=1, max_size=5))
def test_greedy_accept_batch_is_each_alone(cases):
    """Whatever the draft lengths, the batch's answer is each request's own (ids drawn from 4 values:
    matches are common)."""
    from adaptive.engine.sampling import greedy_accept_batch, greedy_accept_host

    drafts = [torch.tensor(d, dtype=torch.long) for d, _ in cases]
    targets = [torch.tensor([(x + s) % 4 for x in d] + [s], dtype=torch.long) if s % 2 else
               torch.tensor(d + [s], dtype=torch.long) for d, s in cases]
    want = [greedy_accept_host(d.tolist(), tg.tolist()) for d, tg in zip(drafts, targets)]
    assert greedy_accept_batch(drafts, targets) == want


def test_greedy_accept_tree_worked_example():
    # 5 and 6 both follow the pending token, 7 follows 5, 8 follows 6; the target wants 6, then 2
    assert greedy_accept_tree([5, 6, 7, 8], [-1, -1, 0, 1], [6, 1, 2, 9, 4]) == ([1], [6, 2])
    # ... or 6, then 8, then 4: the whole second branch
    assert greedy_accept_tree([5, 6, 7, 8], [-1, -1, 0, 1], [6, 1, 8, 9, 4]) == ([1, 3], [6, 8, 4])
    assert greedy_accept_tree([5, 6], [-1, -1], [3, 0, 0]) == ([], [3])  # no first token kept
    assert greedy_accept_tree([], [], [3]) == ([], [3])
    assert greedy_accept_tree([5, 5], [-1, -1], [5, 1, 2]) == ([0], [5, 1])  # a repeated token: the first stands
    with pytest.raises(ValueError, match="tree drafts"):
        greedy_accept_tree([5, 6], [-1, 0], [5, 6])


@given(st.lists(st.integers(0, 4), max_size=6), st.lists(st.integers(0, 4), min_size=7, max_size=7))
def test_greedy_accept_tree_of_a_chain_is_the_chain_s(draft, target):
    parents = list(range(-1, len(draft) - 1))
    path, new = greedy_accept_tree(draft, parents, target[:len(draft) + 1])
    n, ids = greedy_accept_host(draft, target[:len(draft) + 1])
    assert path == list(range(n)) and new == ids


def test_speculative_accept_tree_literal_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    # children 0 (token 0) and 1 (token 1) of the pending token; node 2 (token 2) under node 1. Row 0 (the
    # pending token's) is all on token 1: child 0 is always rejected and child 1 always kept; row 2 (node
    # 1's) is all on token 2: node 2 is kept; row 3 (node 2's) draws the next token, 0 or 1
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        path, new = speculative_accept_tree([0, 1, 2], [-1, -1, 1], p, gen)
        assert path == [1, 2] and new[:2] == [1, 2] and new[2] in (0, 1)
    with pytest.raises(ValueError, match="tree drafts"):
        speculative_accept_tree([0, 1], [-1, -1], p, gen)


def test_speculative_accept_tree_keeps_the_target_s_distribution():
    """The docstring's example: children 0 and 1 of the pending token under ``p_0 = [0.5, 0.25, 0.25]``;
    the first token is 0, 1 or 2 a half, a quarter and a quarter of the time (chi-square over 4,000 draws)."""
    from scipy.stats import chisquare

    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(1)
    counts = [0, 0, 0]
    for _ in range(4000):
        counts[speculative_accept_tree([0, 1], [-1, -1], p, gen)[1][0]] += 1
    assert chisquare(counts, [2000, 1000, 1000]).pvalue > 1e-3
