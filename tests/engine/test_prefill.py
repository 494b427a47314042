"""A prefill fed a chunk at a time (:class:`~adaptive.engine.loop.ChunkedPrefill`) equals one forward."""

from __future__ import annotations

import pytest
import torch

from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.engine import Engine
from adaptive.engine.loop import ChunkedPrefill, prefill
from tests.conftest import tiny_lm

PROMPT = [(7 * i + 3) % 40 + 4 for i in range(300)]


@pytest.mark.parametrize("pool", [True, Pooling(2, "mean"), Pooling(2, "last"), False])
def test_chunks_give_the_prefill_of_one_forward_fp32(pool):
    lm = tiny_lm("llama")
    eng, cfg = Engine(lm), GenerationConfig(max_new_tokens=24, ignore_eos=True)
    whole = eng.start(PROMPT, cfg, pool=pool)
    task = eng.prefilling(PROMPT, cfg, pool=pool, chunk=128)
    advances, session = 1, task.advance()
    while session is None:
        advances, session = advances + 1, task.advance()
    assert advances == 3 and task.remaining == 0  # 128 + 128 + 44 tokens
    assert session.prefill.first == whole.prefill.first
    if pool:
        assert torch.allclose(session.pooled, whole.pooled, atol=1e-5, rtol=1e-5)
    else:
        assert session.pooled is None
    decoded = [list(eng.decode(s))[-1].token_ids for s in (whole, session)]
    assert decoded[0] == decoded[1] and len(decoded[0]) == 24


def test_chunk_zero_is_one_forward_and_bad_chunks_are_refused():
    lm = tiny_lm("llama")
    bb, cfg = lm.backbone, GenerationConfig(max_new_tokens=4)
    task = ChunkedPrefill(bb, PROMPT[:20], bb.new_cache(32), cfg, None, chunk=0)
    assert task.advance() is not None and task.remaining == 0
    ref = prefill(bb, PROMPT[:20], bb.new_cache(32), cfg, None)
    assert ChunkedPrefill(bb, PROMPT[:20], bb.new_cache(32), cfg, None, chunk=7).advance() is None
    assert ref.first == prefill(bb, PROMPT[:20], bb.new_cache(32), cfg, None).first
    with pytest.raises(ValueError):
        ChunkedPrefill(bb, PROMPT, bb.new_cache(400), cfg, None, chunk=-1)
    with pytest.raises(ValueError):
        ChunkedPrefill(bb, [], bb.new_cache(4), cfg, None)


def test_llama_cpp_chunks_are_bit_identical(tiny_gguf):
    """Each prefill in a context of its own: the chunks leave the same cache and embedding as one call."""
    pytest.importorskip("llama_cpp")
    from adaptive.engine.llamacpp import LlamaCppBackbone

    path, _ = tiny_gguf
    ids = (PROMPT * 4)[:1100]
    cfg = GenerationConfig(max_new_tokens=4)

    def run(chunk: int):
        bb = LlamaCppBackbone(path, threads=2, context=1200, sequences=1)
        task = ChunkedPrefill(bb, ids, bb.new_cache(1200), cfg, None, Pooling(None, "last"), chunk=chunk)
        pre = None
        while pre is None:
            pre = task.advance()
        return pre, bb.forward(torch.tensor([pre.first]), task.cache, len(ids)).logits

    (ref, ref_next), (pre, nxt) = run(0), run(128)
    assert ref.first == pre.first and torch.equal(ref.pooled, pre.pooled)
    assert torch.equal(ref_next, nxt)  # the caches hold the same keys: the next step is equal bit for bit
