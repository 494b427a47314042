"""The embedded SmolLM2-135M model: greedy equality in fp32, audit-clean in bf16."""

import pytest

from adaptive.calibrate.prompts import builtin_domains
from adaptive.engine.audit import audit_divergence
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet

pytestmark = pytest.mark.embedded
SKIP = SkipSet(attn=(4, 7, 9, 20, 25), mlp=(12,))


def prompts():
    d = builtin_domains()
    return [d[name][i] for name, i in (("math", 1), ("code", 0), ("translation", 2), ("qa", 3), ("writing", 4))]


def test_fp32_greedy_equality_on_real_prompts(embedded_fp32):
    eng = Engine(embedded_fp32)
    cfg = GenerationConfig(max_new_tokens=32, draft_len=4)
    for prompt in prompts():
        ar = eng.generate(prompt, cfg)
        ssd = eng.generate(prompt, cfg, method="ssd", skip=SKIP)
        assert ssd.token_ids == ar.token_ids, prompt
        assert ssd.stats.accepted > 0


def test_bf16_divergences_are_near_ties(embedded_bf16):
    eng = Engine(embedded_bf16)
    cfg = GenerationConfig(max_new_tokens=32, draft_len=4)
    for prompt in prompts():
        ids = eng.encode(prompt)
        ar = eng.generate(ids, cfg)
        ssd = eng.generate(ids, cfg, method="ssd", skip=SKIP)
        audit = audit_divergence(embedded_bf16.backbone, ids, ar.token_ids, ssd.token_ids)
        assert not audit.violation, audit
