"""A prefill fed a chunk at a time (:class:`~adaptive.engine.loop.ChunkedPrefill`) equals one forward."""

from __future__ import annotations

import pytest
import torch

from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.engine import Engine
from adaptive.engine.loop import ChunkedPrefill, GenerationStats, Lane, prefill, step
from adaptive.engine.protocol import DecodeState, FixedDraftLength
from adaptive.errors import ConfigError
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


def test_several_poolings_come_from_one_prefill_as_each_alone():
    """A tuple of poolings (calibration's candidates) gives each one's embedding, in order, from the same
    forwards, equal to a prefill pooling it alone, whole or in chunks (which cannot ride a step while
    one of them is a mean)."""
    lm = tiny_lm("llama")
    eng, cfg = Engine(lm), GenerationConfig(max_new_tokens=4, ignore_eos=True)
    pools = (Pooling(2, "last"), Pooling(1, "mean"), Pooling(None, "mean"), Pooling(None, "last"), Pooling(0, "last"))
    for chunk in (0, 128):
        task = eng.prefilling(PROMPT, cfg, pool=pools, chunk=chunk)
        assert task.can_ride is False or chunk == 0
        session = None
        while session is None:
            session = task.advance()
        assert isinstance(session.pooled, tuple) and len(session.pooled) == len(pools)
        for p, v in zip(pools, session.pooled):
            assert torch.allclose(v, eng.start(PROMPT, cfg, pool=p).pooled, atol=1e-5, rtol=1e-5), (chunk, p)


def test_merged_pool_args():
    from adaptive.engine.loop import merge_pool_args

    assert merge_pool_args([{"pool_layers": (10,)}, {"pool_layers": (6, 10)}, {"pool": True}]) == {
        "pool_layers": (6, 10), "pool": True}
    assert merge_pool_args([]) == {}


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


def test_llama_cpp_chunks_are_bit_identical(long_gguf):
    """Each prefill in a context of its own: the chunks leave the same cache and embedding as one call."""
    pytest.importorskip("llama_cpp")
    from adaptive.engine.llamacpp import LlamaCppBackbone

    path = long_gguf
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


@pytest.mark.parametrize("pool", [Pooling(2, "last"), False])
def test_chunks_carried_by_steps_give_the_outputs_of_decoding_alone_fp32(pool):
    """A long prompt's chunks ride in another request's verification steps (one forward for both):
    both requests decode exactly as each alone, and only the prompt's last chunk is a forward of its own."""
    lm = tiny_lm("llama")
    eng, cfg = Engine(lm), GenerationConfig(max_new_tokens=24, ignore_eos=True)
    alone = [list(eng.decode(eng.start(p, cfg, pool=pool)))[-1].token_ids for p in (PROMPT[:9], PROMPT)]
    decoding = eng.begin(eng.start(PROMPT[:9], cfg, pool=pool))
    task = eng.prefilling(PROMPT, cfg, pool=pool, chunk=128)
    carried = 0
    while task.can_ride:
        eng.step([decoding], riders=[task])
        carried += 1
    assert carried == 2 and task.remaining == 44  # 128 + 128 carried, the last 44 alone
    session = task.advance()
    assert session is not None and session.stats.prefill_time > 0
    while not decoding.done:
        eng.step([decoding])
    assert decoding.result().token_ids == alone[0]
    assert list(eng.decode(session))[-1].token_ids == alone[1]


def test_a_chunk_that_cannot_ride_is_refused():
    """The prompt's last chunk and the chunks of a mean pooling are forwards of their own."""
    lm = tiny_lm("llama")
    eng, cfg = Engine(lm), GenerationConfig(max_new_tokens=4, ignore_eos=True)
    decoding = eng.begin(eng.start(PROMPT[:9], cfg))
    assert not eng.prefilling(PROMPT, cfg, pool=Pooling(2, "mean"), chunk=128).can_ride
    assert not eng.prefilling(PROMPT[:100], cfg, chunk=128).can_ride
    assert not eng.prefilling(PROMPT, cfg, chunk=0).can_ride
    with pytest.raises(ConfigError):
        eng.step([decoding], riders=[eng.prefilling(PROMPT[:100], cfg, chunk=128)])


def test_llama_cpp_chunks_carried_by_steps(long_gguf):
    """On llama.cpp a carried chunk's rows are multiplied with a step's: the request decodes as alone,
    and the prefilled one gives the same first token and next logits as one call (rounding aside)."""
    pytest.importorskip("llama_cpp")
    from adaptive.engine.llamacpp import LlamaCppBackbone

    path = long_gguf
    ids = (PROMPT * 4)[:600]
    cfg = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    bb = LlamaCppBackbone(path, threads=2, context=1500, sequences=3)  # the three caches' 700 + 20 + 700
    pool = Pooling(None, "last")
    ref = ChunkedPrefill(bb, ids, bb.new_cache(700), cfg, None, pool, chunk=0)
    whole = ref.advance()
    other = ChunkedPrefill(bb, PROMPT[:9], bb.new_cache(20), cfg, None, chunk=0)
    first = other.advance().first
    lane = Lane(DecodeState(bb, other.cache, PROMPT[:9] + [first], cfg, None), None, FixedDraftLength(1), cfg,
                GenerationStats())
    task = ChunkedPrefill(bb, ids, bb.new_cache(700), cfg, None, pool, chunk=128)
    while task.can_ride:
        step(bb, [lane], riders=[task])
    assert task.remaining == 600 - 4 * 128
    pre = task.advance()
    assert pre.first == whole.first
    nxt = [bb.forward(torch.tensor([whole.first]), c, 600).logits for c in (ref.cache, task.cache)]
    # the keys differ by the quantized kernels' rounding of a 129-row product against a 600-row one
    # (about 3e-3 on this model), as any batched forward's do: the audit's bf16-like tolerance
    assert torch.allclose(nxt[0], nxt[1], atol=0.02, rtol=0.01)
