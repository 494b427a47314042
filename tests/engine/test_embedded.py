"""The embedded SmolLM2-135M model: greedy equality in fp32, audit-clean in bf16."""

import pytest

from adaptive.calibrate.prompts import builtin_domains
from adaptive.drafters.layerskip import LayerSkipDrafter
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
        ssd = eng.generate(prompt, cfg, drafter=LayerSkipDrafter(SKIP, embedded_fp32.n_layers))
        assert ssd.token_ids == ar.token_ids, prompt
        assert ssd.stats.accepted > 0


def test_bf16_divergences_are_near_ties(embedded_bf16):
    eng = Engine(embedded_bf16)
    cfg = GenerationConfig(max_new_tokens=32, draft_len=4)
    for prompt in prompts():
        ids = eng.encode(prompt)
        ar = eng.generate(ids, cfg)
        ssd = eng.generate(ids, cfg, drafter=LayerSkipDrafter(SKIP, embedded_bf16.n_layers))
        audit = audit_divergence(embedded_bf16.backbone, ids, ar.token_ids, ssd.token_ids)
        assert not audit.violation, audit


def test_fp32_cascade_and_reduced_head_equal_plain(embedded_fp32):
    """The cascade (vertical level with the skip set, then a bigram-backed statistical tail) and
    layer-skip drafting over a reduced vocabulary: token for token plain decoding in fp32."""
    import torch

    from adaptive.drafters.cascade import CascadeDrafter
    from adaptive.drafters.head import DraftHead, rank_tokens
    from adaptive.drafters.ngram import NgramDrafter, build_bigram_table

    eng = Engine(embedded_fp32)
    bb = embedded_fp32.backbone
    cfg = GenerationConfig(max_new_tokens=32, draft_len=6)
    encoded = [eng.encode(p) for p in prompts()]
    table = build_bigram_table(encoded)
    subset = torch.as_tensor(rank_tokens(encoded, bb.vocab_size)[:4096])
    for ids in encoded:
        ar = eng.generate(ids, cfg)
        cascade = CascadeDrafter(NgramDrafter(bigram=table), SKIP, bb.n_layers, split=2, vertical=True)
        c = eng.generate(ids, cfg, drafter=cascade)
        head = DraftHead.build(bb, subset, extra=ids)
        r = eng.generate(ids, cfg, drafter=LayerSkipDrafter(SKIP, bb.n_layers, head))
        assert c.token_ids == ar.token_ids and r.token_ids == ar.token_ids
        assert c.stats.accepted > 0 and r.stats.accepted > 0


def test_fp32_early_exit_equals_plain(embedded_fp32):
    """The early-exit drafter (20 of 30 layers and an exit block changed away from the identity):
    token for token plain decoding in fp32."""
    import torch

    from adaptive.drafters.early_exit import EarlyExitDrafter, ExitBlock

    eng = Engine(embedded_fp32)
    bb = embedded_fp32.backbone
    block = ExitBlock.from_backbone(bb, 20)
    torch.manual_seed(0)
    with torch.no_grad():
        block.down.weight.normal_(0, 0.01)
    cfg = GenerationConfig(max_new_tokens=32, draft_len=3)
    drafted = accepted = 0
    for prompt in prompts():
        ids = eng.encode(prompt)
        ar = eng.generate(ids, cfg)
        ee = eng.generate(ids, cfg, drafter=EarlyExitDrafter(20, bb.n_layers, block))
        assert ee.token_ids == ar.token_ids, prompt
        drafted, accepted = drafted + ee.stats.drafted, accepted + ee.stats.accepted
    assert drafted > 0 and accepted > 0


def test_the_embedded_model_is_reloaded_by_its_name(embedded_fp32):
    assert embedded_fp32.spec == "smollm2-135m"  # what a profile records and a worker process loads


def test_packed_weights_read_the_embedding_rows_from_the_gguf_file():
    """With packed weights the torch engine reads the token embedding's rows from the embedded GGUF (its
    Q8_0 table, dequantized as the conversion did) and holds no plain table: it decodes as a backbone
    that kept the table (adaptive.engine.rows)."""
    import dataclasses

    import torch

    from adaptive.engine.quant import packing_supported
    from adaptive.models import load_model

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    lm = load_model("smollm2-135m", device="cpu", dtype="bfloat16", weights="packed")
    kept = load_model("smollm2-135m", device="cpu", dtype="bfloat16", weights="packed")
    kept = dataclasses.replace(kept, source=kept.source + ".elsewhere")  # no file there: the table stays
    assert lm.backbone.rows_from_file and lm.backbone.embed.weight.numel() == 0
    assert not kept.backbone.rows_from_file
    ids = torch.tensor([0, 17, 4000, 49151])
    assert torch.equal(lm.backbone.embed_rows(ids), kept.backbone.embed.weight[ids])
    cfg = GenerationConfig(max_new_tokens=24)
    for prompt in prompts()[:3]:
        assert Engine(lm).generate(prompt, cfg).token_ids == Engine(kept).generate(prompt, cfg).token_ids
