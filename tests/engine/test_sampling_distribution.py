"""Speculative sampling is distributed exactly as the target: a chi-square test that can fail."""

import pytest
import torch

from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.engine.sampling import warp_probs
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm
from tests.helpers.sampling import V, chi2_pvalue, sample_counts, target_joint


@pytest.fixture(scope="module")
def setup():
    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    return lm, LayerSkipDrafter(SkipSet(attn=(0, 1, 2), mlp=(0, 1)), 4)


def test_ssd_samples_match_target(setup):
    lm, drafter = setup
    probs = target_joint(lm)
    counts = sample_counts(lm, drafter)
    assert chi2_pvalue(counts, probs) > 1e-3


def test_wrong_acceptance_rule_is_detected(setup):
    """Accepting every draft (greedy-style) yields the draft's distribution, not the target's."""
    lm, drafter = setup

    def accept_all(draft, p_logits, cfg, gen):
        k = len(draft)
        p = warp_probs(p_logits, cfg.temperature)
        return k, draft.tokens.tolist() + [int(torch.multinomial(p[k], 1, generator=gen))]

    probs = target_joint(lm)
    counts = sample_counts(lm, drafter, accept_all)
    assert chi2_pvalue(counts, probs) < 1e-6
