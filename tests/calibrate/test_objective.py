import math

import pytest

from adaptive.calibrate.objective import matchness
from adaptive.costs import acceptance_needed, best_draft_length, expected_speedup, expected_tokens_per_step
from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 2)


def test_expected_speedup_and_best_length():
    # 1 + 0.8 + 0.64 = 2.44 tokens for 2 * 0.5 + 1.05 = 2.05 units
    assert expected_speedup(0.8, 2, 0.5, 1.05) == pytest.approx(2.44 / 2.05)
    assert expected_speedup(0.3, 0, 0.5) == 1.0  # plain decoding
    flat = (1.0,) * 9  # verifying costs one step whatever the draft length
    k, s = best_draft_length(0.8, 0.5, flat, 8)
    assert k == 2 and s == pytest.approx(2.44 / 2.0)
    # a draft as expensive as the target never pays
    assert best_draft_length(0.9, 1.0, flat, 8, min_len=1)[1] < 1.0


def test_acceptance_needed_inverts_best_draft_length():
    verify = (1.0, 1.0, 1.05)
    assert acceptance_needed(1.0, 0.5, verify, 2) == pytest.approx(0.5)  # k = 1: 1.5 / 1.5
    assert math.isnan(acceptance_needed(1.0, 1.2, verify, 2))  # 2 / 2.2 even at a = 1
    for speedup, cost in [(1.0, 0.3), (1.2, 0.3), (1.3, 0.1)]:
        a = acceptance_needed(speedup, cost, verify, 2)
        assert best_draft_length(a, cost, verify, 2, min_len=1)[1] == pytest.approx(speedup, abs=1e-9)
        assert best_draft_length(a - 1e-3, cost, verify, 2, min_len=1)[1] < speedup
    # a cheaper draft needs less acceptance for the same speedup
    assert acceptance_needed(1.1, 0.2, verify, 2) < acceptance_needed(1.1, 0.4, verify, 2)


def test_matchness_full_model_is_one_and_skips_lower_it():
    lm = tiny_lm("llama", n_layers=6, seed=5)
    eng = Engine(lm)
    seqs = []
    for start in (3, 10, 20):
        prompt = list(range(start, start + 8))
        seqs.append((prompt, eng.generate(prompt, GenerationConfig(max_new_tokens=20, ignore_eos=True)).token_ids))
    bb = lm.backbone
    assert matchness(bb, seqs, None) == 1.0
    light = matchness(bb, seqs, SkipSet(attn=(5,)).masks(6))
    heavy = matchness(bb, seqs, SkipSet(attn=tuple(range(6)), mlp=tuple(range(6))).masks(6))
    assert heavy < light <= 1.0
    # the teacher-forced estimate agrees with what real greedy drafting accepts at k = 1
    skip = SkipSet(attn=(1, 4))
    est = matchness(bb, seqs, skip.masks(6))
    drafter = build_drafter(DrafterSpec("ssd", skip=skip), bb)
    acc = [eng.generate(p, GenerationConfig(max_new_tokens=20, draft_len=1, ignore_eos=True),
                        drafter=drafter).stats.acceptance_rate for p, _ in seqs]
    assert abs(est - sum(acc) / len(acc)) < 0.25
