"""Reduced-vocabulary draft heads: the pure functions with literal arrays, then lossless decoding."""

from dataclasses import replace

import pytest
import torch

from adaptive.drafters.head import DraftHead, coverage_curve, rank_tokens
from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm


def test_rank_tokens_docstring_case():
    # 5 three times, 3 twice, 9 once
    assert rank_tokens([[5, 3, 5], [3, 5, 9]]).tolist() == [5, 3, 9]
    # a tie (2 and 7 once each) goes to the smaller id
    assert rank_tokens([[7, 2]]).tolist() == [2, 7]
    assert rank_tokens([]).tolist() == []
    # filled with the rest of the vocabulary in id order (BPE merge order: a corpus-frequency prior)
    assert rank_tokens([[5, 3, 5], [3, 5, 9]], vocab_size=8).tolist() == [5, 3, 9, 0, 1, 2, 4, 6, 7]
    assert rank_tokens([], vocab_size=3).tolist() == [0, 1, 2]


def test_coverage_curve_docstring_case():
    # for 0, the ranking of [1, 3] is [1, 3]: V=1 covers 1 of [1, 2]; for 1, the ranking of [1, 1, 2] is
    # [1, 2]: V=1 covers none of [3]; V=2 adds 2 (for 0) but not 3 -> 2 of 3
    cov = coverage_curve([[1, 1, 2], [1, 3]], [[1, 2], [3]], [1, 2, 3])
    assert cov == {1: pytest.approx(0.3333, abs=1e-4), 2: pytest.approx(0.3333, abs=1e-4),
                   3: pytest.approx(0.3333, abs=1e-4)}
    # the text a target is scored on is left out: in-sample it would be 100%
    cov = coverage_curve([[4, 4], [5, 5]], [[4], [5]], [1])
    assert cov == {1: 0.0}
    # with the vocabulary filled in id order, V=5 holds the other sequence's token, then ids 0..3: 4 is in
    # for target [4] (ranking [5, 0, 1, 2, 3]: no), 5 for target [5] (ranking [4, 0, 1, 2, 3]: no); V=6: both
    cov = coverage_curve([[4, 4], [5, 5]], [[4], [5]], [5, 6], vocab_size=6)
    assert cov == {5: 0.0, 6: 1.0}
    with pytest.raises(ValueError):
        coverage_curve([[1]], [], [1])


def test_draft_head_build_and_expand():
    w = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # 6 tokens, hidden 2
    h = DraftHead.build(w, torch.tensor([4, 1]), extra=[1, 5, 5, 0])
    # the domain's ids first, then the prompt's tokens not already there, deduplicated
    assert h.ids.tolist() == [4, 1, 0, 5] and len(h) == 4
    assert torch.equal(h.weight, w[[4, 1, 0, 5]])
    full = h.expand_logits(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert full.shape == (1, 6)
    assert full[0].tolist() == [3.0, 2.0, float("-inf"), float("-inf"), 1.0, 4.0]
    # precomputed domain rows are used as given
    rows = w[[4, 1]] * 0
    assert torch.equal(DraftHead.build(w, torch.tensor([4, 1]), rows).weight, rows)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_reduced_head_greedy_equals_plain_in_fp32(family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    bb = lm.backbone
    skip = SkipSet(attn=(1, 2), mlp=(2,))
    for prompt in ["the cat sat on the mat. the cat sat on", "xyz 123 xyz 12"]:
        cfg = GenerationConfig(max_new_tokens=24, draft_len=4)
        ids = engine.encode(prompt)
        ar = engine.generate(ids, cfg)
        full = engine.generate(ids, cfg, drafter=LayerSkipDrafter(skip, lm.n_layers))
        # a small subset: many of the target's tokens cannot be drafted, none may change the output
        half = torch.arange(0, bb.vocab_size, 2)
        head = DraftHead.build(bb.lm_head.weight, half, extra=ids)
        d = LayerSkipDrafter(skip, lm.n_layers, head)
        r = engine.generate(ids, cfg, drafter=d)
        assert r.token_ids == ar.token_ids == full.token_ids, prompt
        assert d.describe()["draft_vocab"] == len(head)
        drafted = set()
        spy = _Spy(LayerSkipDrafter(skip, lm.n_layers, head), drafted)
        engine.generate(ids, replace(cfg, ignore_eos=True), drafter=spy)  # all 24 tokens, EOS or not
        assert drafted and drafted <= set(head.ids.tolist())  # never a token outside the subset


class _Spy:
    """Records every drafted token of the wrapped drafter."""

    name = "spy"

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def propose(self, state, choice):
        d = self.inner.propose(state, choice)
        self.seen.update(d.tokens.tolist())
        return d

    def describe(self):
        return {}


def test_reduced_head_sampling_matches_target():
    """q over the subset (zero elsewhere) keeps speculative sampling exact: chi-square against the target."""
    from tests.helpers.sampling import V, chi2_pvalue, sample_counts, target_joint

    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    head = DraftHead.build(lm.backbone.lm_head.weight, torch.tensor([0, 2, 3]))  # tokens 1, 4, 5 never drafted
    d = LayerSkipDrafter(SkipSet(attn=(0, 1, 2), mlp=(0, 1)), 4, head)
    assert chi2_pvalue(sample_counts(lm, d), target_joint(lm)) > 1e-3
