"""Cascade drafting: the pure acceptance rules with literal arrays, then lossless decoding with it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive.drafters.cascade import CascadeDrafter, CascadePlan, lenient_greedy_accept, lenient_point_mass
from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.drafters.ngram import BigramTable, NgramDrafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.protocol import LAYER_SKIP, STATISTICAL, FixedDraftLength
from adaptive.engine.sampling import greedy_accept
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm
from tests.helpers.decoding import decode_ids

Q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])


def test_lenient_greedy_accept_docstring_case():
    logits = Q.log()
    # lenience 1: proposal 1 is not the argmax (0) of row 0: nothing kept, the skipped model says 0
    assert lenient_greedy_accept(torch.tensor([1, 1]), logits, 1.0) == (0, 0)
    # lenience 2: 2 * 0.3 >= 0.6 and 2 * 0.5 >= 0.5: both kept, then row 2's argmax 2
    assert lenient_greedy_accept(torch.tensor([1, 1]), logits, 2.0) == (2, 2)
    # an empty proposal: just the skipped model's own next token
    assert lenient_greedy_accept(torch.tensor([], dtype=torch.long), logits[:1], 1.0) == (0, 0)


@given(st.lists(st.integers(0, 4), min_size=0, max_size=5), st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_lenience_one_is_greedy_acceptance(proposal, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(proposal) + 1, 5, generator=g)
    prop = torch.tensor(proposal, dtype=torch.long)
    assert lenient_greedy_accept(prop, logits, 1.0) == greedy_accept(prop, logits.argmax(-1))


def test_lenient_point_mass_docstring_case():
    q = torch.tensor([0.5, 0.3, 0.2])
    a, q_eff, rest = lenient_point_mass(q, 1, 1.0)
    assert a == pytest.approx(0.3)
    assert torch.allclose(rest, torch.tensor([5 / 7, 0.0, 2 / 7]))
    assert torch.allclose(q_eff, q)  # lenience 1: the token is distributed as q itself
    a, q_eff, _ = lenient_point_mass(q, 1, 2.0)
    assert a == pytest.approx(0.6)
    assert torch.allclose(q_eff, torch.tensor([0.4 / 0.7 * 0.5, 0.6, 0.4 / 0.7 * 0.2]))
    # a certain token: always kept, nothing to draw otherwise
    assert lenient_point_mass(torch.tensor([0.0, 1.0]), 1, 3.0)[0] == 1.0


def test_lenient_point_mass_produces_q_eff_empirically():
    """Keep-or-redraw, done many times, yields tokens distributed as q_eff (the verifier relies on it)."""
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(0)
    a, q_eff, rest = lenient_point_mass(q, 0, 3.0)
    n = 20000
    keep = torch.rand(n, generator=g) < a
    redraw = torch.multinomial(rest, n, replacement=True, generator=g)
    toks = torch.where(keep, torch.zeros_like(redraw), redraw)
    freq = torch.bincount(toks, minlength=4).float() / n
    assert torch.allclose(freq, q_eff, atol=0.01)
    assert not torch.allclose(q_eff, q, atol=0.05)  # and q_eff really differs from q here


def test_config_validation_and_round_trip():
    c = CascadePlan(split=1, draft_len=6, lenience=1.5, max_split=2)
    assert CascadePlan.from_dict(c.to_dict()) == c
    for bad in (dict(draft_len=0), dict(split=9, draft_len=8), dict(lenience=0.5), dict(min_prob=2.0)):
        with pytest.raises(ValueError):
            CascadePlan(**bad)


def test_drafter_validation():
    with pytest.raises(ValueError):
        CascadeDrafter(NgramDrafter(), SkipSet((), ()), 4)  # an empty skip set drafts nothing
    with pytest.raises(ValueError):
        CascadeDrafter(NgramDrafter(), SkipSet((1,), ()), None)
    with pytest.raises(ValueError):
        CascadeDrafter(NgramDrafter(), None, 4, lenience=0.9)
    # without a skip set there is no layer-skip level, whatever split is asked for
    assert CascadeDrafter(NgramDrafter(), None, 4, split=3).split == 0


class _Recorder(FixedDraftLength):
    """A fixed draft length that keeps every draft it is told about."""

    def __init__(self, k, drafts):
        super().__init__(k)
        self.drafts = drafts

    def update(self, draft, accepted):
        self.drafts.append(draft)


def _chain_table(vocab):
    """Every token predicts its successor modulo the vocabulary: the statistical drafter always proposes."""
    keys = np.arange(vocab)
    return BigramTable(keys, (keys + 1) % vocab, np.full(vocab, 0.9))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cascade_greedy_equals_plain_in_fp32(family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    skip = SkipSet(attn=(1, 2), mlp=(2,))
    table = _chain_table(lm.backbone.vocab_size)
    for prompt in ["the cat sat on the mat. the cat sat on", "xyz 123 xyz 12"]:
        cfg = GenerationConfig(max_new_tokens=24, draft_len=5)
        ar = engine.generate(prompt, cfg)
        for split, vertical, lenience, bigram in [(0, True, 1.0, table), (1, True, 1.0, None), (2, True, 3.0, table),
                                                  (3, False, 1.0, table), (5, True, 1.0, table)]:
            d = CascadeDrafter(NgramDrafter(bigram=bigram), skip, lm.n_layers, split, vertical, lenience)
            drafts = []
            r = engine.generate(prompt, cfg, drafter=d, policy=_Recorder(5, drafts))
            assert r.token_ids == ar.token_ids, (prompt, split, vertical, lenience)
            assert r.stats.drafted > 0
            if split:
                forwards = sum(x.forwards for x in drafts)
                layer_skip = sum(s == LAYER_SKIP for x in drafts for s in x.sources)
                assert forwards > 0 and layer_skip >= forwards  # vertical: >= 1 token per forward


def test_sources_say_where_tokens_came_from():
    lm = tiny_lm("llama")
    d = CascadeDrafter(NgramDrafter(bigram=_chain_table(lm.backbone.vocab_size)), SkipSet((1,), ()), lm.n_layers,
                       split=2, vertical=False)
    drafts = []
    Engine(lm).generate([3, 4, 5], GenerationConfig(max_new_tokens=12, draft_len=5, ignore_eos=True), drafter=d,
                        policy=_Recorder(5, drafts))
    # token by token (not vertical): 2 layer-skip tokens, then the bigram tail fills the draft of 5
    assert drafts[0].sources == (LAYER_SKIP, LAYER_SKIP, STATISTICAL, STATISTICAL, STATISTICAL)
    assert drafts[0].forwards == 2


def test_factory_cascade_with_and_without_skip():
    lm = tiny_lm("llama")
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=20, draft_len=4)
    ar = engine.generate("ab ab ab ab", cfg)
    plain = engine.generate("ab ab ab ab", cfg, drafter=build_drafter(DrafterSpec("cascade"), lm.backbone))
    assert plain.token_ids == ar.token_ids and plain.drafter_info["split"] == 0 and plain.drafter == "cascade"
    skipped = engine.generate("ab ab ab ab", cfg,
                              drafter=build_drafter(DrafterSpec("cascade", skip=SkipSet((1,), (2,))), lm.backbone))
    assert skipped.token_ids == ar.token_ids and skipped.drafter_info["split"] == 1


def _cascade_counts(lm, drafter, n):
    """(t2, t3) counts over ``n`` seeded generations of 4 tokens: t2 and t3 come from one step
    drafting 2 tokens (vertical level: one statistical proposal checked, then its own token)."""
    from tests.helpers.sampling import CFG, PROMPT, V

    counts = torch.zeros(V, V)
    for seed in range(n):
        cfg = GenerationConfig(**{**CFG.__dict__, "seed": seed, "max_new_tokens": 4})
        toks = decode_ids(lm.backbone, PROMPT, cfg, drafter)
        counts[toks[1], toks[2]] += 1
    return counts


@pytest.mark.parametrize("split,lenience,wrong", [(1, 3.0, False), (0, 1.0, False), (1, 3.0, True)])
def test_cascade_sampling_matches_target(split, lenience, wrong, monkeypatch):
    """Chi-square against the exact target joint: the vertical level with lenience (q' != q) and the
    statistical tail (point masses) keep speculative sampling exact; telling the verifier q instead
    of q' is detected (the test can fail)."""
    import adaptive.drafters.cascade as cascade
    from tests.helpers.sampling import N, V, chi2_pvalue, target_joint

    if wrong:
        right = cascade.lenient_point_mass

        def tell_q(q, x, lenience_):  # the right acceptance, but q instead of q' for the verifier
            a, _q_eff, rest = right(q, x, lenience_)
            return a, q, rest

        monkeypatch.setattr(cascade, "lenient_point_mass", tell_q)
    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    d = CascadeDrafter(NgramDrafter(bigram=_chain_table(V), min_prob=0.0), SkipSet(attn=(0, 1, 2), mlp=(0, 1)), 4,
                       split=split, vertical=True, lenience=lenience)
    p = chi2_pvalue(_cascade_counts(lm, d, N), target_joint(lm))
    assert (p < 1e-6) if wrong else (p > 1e-3)
