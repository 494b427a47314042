import torch

from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.engine.audit import audit_divergence, first_difference
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.sampling import greedy_accept
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 5]) == 2  # one ended where the other went on
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([], []) is None


def broken_greedy(draft, p_logits, cfg, gen):
    """Deliberately wrong: accepts one more draft token than the target agrees with."""
    n, nxt = greedy_accept(draft.tokens, p_logits.argmax(-1))
    if n < len(draft):
        return n + 1, draft.tokens[:n + 1].tolist() + [int(p_logits[n + 1].argmax())]
    return n, draft.tokens.tolist() + [nxt]


def test_audit_passes_correct_rule_and_catches_broken_rule():
    lm = tiny_lm("llama", n_layers=6, seed=11)
    eng = Engine(lm)
    skip = SkipSet(attn=(0, 2, 4), mlp=(1, 3))
    cfg = GenerationConfig(max_new_tokens=40, draft_len=4, ignore_eos=True)
    violations = 0
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, lm.model.config.vocab_size, (8,), generator=gen).tolist()
        ar = eng.generate(prompt, cfg).token_ids
        good = eng.generate(prompt, cfg, drafter=LayerSkipDrafter(skip, lm.n_layers)).token_ids
        bad = eng.generate(prompt, cfg, drafter=LayerSkipDrafter(skip, lm.n_layers), acceptor=broken_greedy).token_ids
        ok = audit_divergence(lm.backbone, prompt, ar, good)
        assert ok.identical and not ok.violation
        res = audit_divergence(lm.backbone, prompt, ar, bad)
        if not res.identical:
            assert res.margin is not None and res.tolerance == 1e-3
            # the recomputed logits prefer ar's token: the other token is a real error
            violations += res.violation
    assert violations >= 4
