"""Greedy self-speculative output equals Hugging Face greedy decoding, token for token, in fp32."""

import random

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm


def hf_greedy(model, prompt_ids, n):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def random_skip(rng, n_layers):
    """From none to nearly all sublayers."""
    frac = rng.choice([0.0, 0.25, 0.5, 0.9])
    pick = lambda: tuple(i for i in range(n_layers) if rng.random() < frac)  # noqa: E731
    return SkipSet(pick(), pick())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_equals_hf_generate(family):
    lm = tiny_lm(family, n_layers=6)
    eng = Engine(lm)
    rng = random.Random(1234)
    V = lm.model.config.vocab_size
    n = 24
    checked = 0
    for prompt_len in (1, 5, 33):
        prompt = [rng.randrange(3, V) for _ in range(prompt_len)]
        ref = hf_greedy(lm.model, prompt, n)
        assert len(set(ref)) > 3, "the tiny model should produce varied tokens"
        skips = [SkipSet(), SkipSet(tuple(range(6)), tuple(range(5)))] + [random_skip(rng, 6) for _ in range(4)]
        for skip in skips:
            for k in (1, 2, 3, 5, 8):
                cfg = GenerationConfig(max_new_tokens=n, draft_len=k, ignore_eos=True)
                d = build_drafter(DrafterSpec("ssd", skip=skip), lm.backbone) if skip else None
                r = eng.generate(prompt, cfg, drafter=d)
                assert r.token_ids == ref, (prompt_len, skip.to_text(), k)
                checked += 1
    assert checked == 3 * 6 * 5


def test_confidence_stop_keeps_equality_and_shortens_drafts():
    lm = tiny_lm("llama", n_layers=6)
    eng = Engine(lm)
    prompt = list(range(5, 20))
    ref = hf_greedy(lm.model, prompt, 30)
    skip = SkipSet(attn=(1, 3), mlp=(4,))
    d = build_drafter(DrafterSpec("ssd", skip=skip), lm.backbone)
    plain = eng.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=8, ignore_eos=True), drafter=d)
    conf = eng.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=8, ignore_eos=True,
                                                 confidence_threshold=0.9), drafter=d)
    assert plain.token_ids == ref and conf.token_ids == ref
    assert conf.stats.drafted / conf.stats.steps < plain.stats.drafted / plain.stats.steps


def test_stats_are_consistent():
    lm = tiny_lm("llama", n_layers=6)
    r = Engine(lm).generate(list(range(3, 12)), GenerationConfig(max_new_tokens=40, draft_len=4, ignore_eos=True),
                            drafter=build_drafter(DrafterSpec("ssd", skip=SkipSet(attn=(2,))), lm.backbone))
    s = r.stats
    assert s.tokens == 40 == len(r.token_ids)
    assert sum(s.accept_hist.values()) == s.steps
    assert sum(n * c for n, c in s.accept_hist.items()) == s.accepted
    assert sum(k * c for k, c in s.draft_lengths.items()) == s.drafted
    assert 0 < s.acceptance_rate <= 1 and s.mean_accepted_tokens > 1
    # every step yields accepted + 1 tokens; the first token comes from the prefill
    assert 1 + s.accepted + s.steps >= s.tokens
    ar = Engine(lm).generate(list(range(3, 12)), GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert ar.stats.mean_accepted_tokens == 1.0 and ar.stats.steps == 39 and ar.stats.drafted == 0
