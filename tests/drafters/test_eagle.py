"""The eagle head: its lookup tokens (worked examples), the target's feature rows in the cache, and the
training function equal to decoding's steps. The drafter (lossless greedy decoding, sampling distributed
as the target): ``tests/drafters/test_eagle_drafter.py``. Trained through a profile:
``tests/distill/test_heads.py``."""

import pytest
import torch

from adaptive.drafters.eagle import (
    EagleHead,
    HeadCache,
    HeadShape,
    NgramIndex,
    default_layers,
    lookup_tokens,
)
from adaptive.engine.backbone import Segment
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm

LAYERS = (0, 2, 4)


def test_lookup_tokens_worked_example():
    # [5, 7, 9, 5, 7]: rows 0 and 1 (7 and 9 at positions 1, 2) occur nowhere before; row 2 (5 at
    # position 3) matches 5 at 0 -> 7; row 3 ([5, 7] ending at 4) matches [5, 7] ending at 1 -> 9
    assert lookup_tokens([5, 7, 9, 5, 7], n=2) == [-1, -1, 7, 9]
    # the longest n-gram wins over a later shorter one: [1, 2] ending at 5 matches [1, 2] at 1 -> 3,
    # not [2] ending at 3 (which would give 4)
    assert lookup_tokens([1, 2, 3, 2, 4, 1, 2], n=2)[-1] == 3
    index = NgramIndex(2)
    index.register([5, 7, 9, 5, 7], 4)
    assert index.lookup([5, 7, 9, 5, 7], 3) == 9
    with pytest.raises(ValueError):
        NgramIndex(0)


def test_default_layers_are_the_middle_and_the_top():
    assert default_layers(30) == (15, 30) and default_layers(28) == (14, 28) and default_layers(1) == (1,)


def test_head_shape_is_validated():
    with pytest.raises(ConfigError, match="ascending"):
        HeadShape(64, 4, 2, 16, 128, (4, 2))
    with pytest.raises(ConfigError, match="key-value"):
        HeadShape(64, 4, 3, 16, 128, (2, 4))
    s = HeadShape(64, 4, 2, 16, 128, (2, 4))
    assert HeadShape.from_dict(s.to_dict()) == s


def test_the_cache_keeps_the_full_models_feature_rows():
    lm = tiny_lm("llama")
    bb = lm.backbone
    ids = torch.tensor([5, 9, 12, 7, 3, 22, 8])
    whole = bb.new_cache(16, features=LAYERS)
    out = bb.forward(ids, whole, 0, logits="all", hidden=True)
    assert torch.equal(whole.features[:7, 0], bb.embed_rows(ids).float())
    assert torch.allclose(whole.features[:7, 2], out.hidden.float())
    parts = bb.new_cache(16, features=LAYERS)  # prefill then steps, as decoding writes them
    bb.forward(ids[:4], parts, 0)
    bb.forward(ids[4:], parts, 4)
    assert torch.allclose(parts.features[:7], whole.features[:7], atol=1e-5)
    kept = parts.features.clone()
    bb.forward(ids[:1], parts, 7, skip_masks=((True,) * 4, (False,) * 4))  # a layer-skip draft: no rows
    bb.forward(ids[:2], parts, 7, read_only=True)
    assert torch.equal(parts.features, kept)
    batched, other = bb.new_cache(16, features=LAYERS), bb.new_cache(16)
    bb.forward_batch([Segment(ids, batched, 0), Segment(ids[:3], other, 0)])
    assert torch.allclose(batched.features[:7], whole.features[:7], rtol=1e-4, atol=1e-4)  # another product order
    with pytest.raises(ConfigError, match="feature layers"):
        bb.new_cache(16, features=(5,))


def random_head(lm, seed: int = 0, vocab_ids=None, scale: float = 0.3) -> EagleHead:
    """An untrained head with random weights (so that its drafts vary and are sometimes right)."""
    bb = lm.backbone
    shape = HeadShape(bb.hidden_size, bb.n_heads, bb.n_kv_heads, bb.head_dim, 2 * bb.hidden_size, LAYERS)
    ids = torch.arange(bb.vocab_size) if vocab_ids is None else vocab_ids
    head = EagleHead(shape, ids, bb.head_rows(ids).float(), bb.final_norm_weight)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in (head.o.weight, head.down.weight, head.fc.weight):
            p.add_(torch.randn_like(p) * scale / p.shape[1] ** 0.5)
    return head.eval()


def test_the_draft_step_computes_what_training_does():
    """Step s of ``unrolled`` at row j is what decoding's s-th draft computes from the cache's rows
    (:class:`EagleStep` in float32: equal; in bf16 as drafting runs on such a CPU: close), and its logits
    are the module's over the head's rows and a request's extra rows."""
    lm = tiny_lm("llama")
    bb = lm.backbone
    head = random_head(lm, vocab_ids=torch.arange(0, bb.vocab_size, 2))
    ids = [5, 9, 12, 7, 3, 22, 8, 5, 9, 14, 6]
    cache = bb.new_cache(len(ids), features=LAYERS)
    bb.forward(torch.tensor(ids), cache, 0)
    T = len(ids) - 1  # rows 0 .. T-1 (row j reads the token at j + 1)
    looks = torch.tensor(lookup_tokens(ids, head.shape.lookup))
    emb, lk = bb.embed_rows(torch.tensor(ids[1:])).float(), bb.embed_rows(looks.clamp(min=0)).float()
    has, index = looks >= 0, torch.where(looks >= 0, looks // 2, -1)  # even ids: row id // 2
    extra = bb.head_rows(torch.tensor([1, 3]))  # two rows beyond the head's own
    n = 7  # decoding: the target's rows 0 .. n-1, then drafts at rows n-1 (step 1), n (2), n+1 (3)
    with torch.no_grad():
        outs = head.unrolled(cache.features[:T].unsqueeze(0), emb[None], lk[None], has[None],
                             torch.ones(1, T, dtype=torch.bool), 3)
        want = head.logits(outs[0][0], index, torch.cat([head.lm, extra]))
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
            step, hc = head.step(dtype), HeadCache(head.shape, 4, bb.device)  # grown as rows arrive
            g = step.rows(step.fuse(cache.features[:n]), emb[:n], lk[:n], has[:n], hc, 0)
            assert torch.allclose(g.float(), outs[0][0, :n], atol=tol, rtol=tol)
            g2 = step.rows(g[-1:], emb[n:n + 1], lk[n:n + 1], has[n:n + 1], hc, n)
            assert torch.allclose(g2[0].float(), outs[1][0, n], atol=tol, rtol=tol)
            g3 = step.rows(g2, emb[n + 1:n + 2], lk[n + 1:n + 2], has[n + 1:n + 2], hc, n + 1)
            assert torch.allclose(g3[0].float(), outs[2][0, n + 1], atol=tol, rtol=tol)
            whole = step.rows(step.fuse(cache.features[:T]), emb, lk, has, HeadCache(head.shape, 4, bb.device), 0)
            assert torch.allclose(step.logits(whole, index, extra), want, atol=tol * 10, rtol=tol)
    assert head.step(torch.float32) is head.step(torch.float32)  # built once
