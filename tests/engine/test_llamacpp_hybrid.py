"""The hybrid llama.cpp engine (:mod:`adaptive.engine.llamacpp_hybrid`): prompts prefilled on another file's
context and handed over.

With the decode file itself as the prefill file, a handover that lost or misplaced a cell would show as
different logits; the same weights on both sides must give exactly the plain engine's tokens and logits. With
a BF16 copy of a quantized file, greedy speculative decoding equals the hybrid's own plain decoding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from adaptive.drafters.factory import DrafterSpec, build_drafter  # noqa: E402
from adaptive.engine.config import GenerationConfig  # noqa: E402
from adaptive.engine.llamacpp import LlamaCppBackbone  # noqa: E402
from adaptive.engine.llamacpp_hybrid import MIN_TOKENS  # noqa: E402
from adaptive.engine.loop import GenerationStats  # noqa: E402
from adaptive.engine.prefill_file import derive, resolve_prefill  # noqa: E402
from adaptive.engine.prefix import PrefixStore  # noqa: E402
from adaptive.errors import ConfigError  # noqa: E402
from tests.conftest import char_tokenizer, tiny_model, write_gguf  # noqa: E402
from tests.helpers.decoding import decode_ids  # noqa: E402

PROMPT = [5, 9, 14, 22, 9, 14, 22, 31, 7, 9, 14, 22, 40, 12] * 3  # 42 tokens


@pytest.fixture(scope="module")
def plain_and_same(tiny_gguf):
    """``(plain, hybrid)`` backbones of the tiny file, the hybrid's prefill file the same file."""
    path = tiny_gguf[0]
    return (LlamaCppBackbone(path, threads=2, context=256, sequences=4),
            LlamaCppBackbone(path, threads=2, context=256, sequences=4, prefill=path))


def greedy(bb, prompt, n=16, chunks=None):
    """The last prompt position's logits and ``n`` greedy tokens after it; the prompt in ``chunks``."""
    cache = bb.new_cache(len(prompt) + n + 1)
    a, out = 0, None
    for size in chunks or [len(prompt)]:
        last = a + size >= len(prompt)
        out = bb.forward(prompt[a:a + size], cache, a, logits="last" if last else "none")
        a += size
    logits = out.logits[-1].clone()
    toks, pos = [int(logits.argmax())], len(prompt)
    for _ in range(n):
        toks.append(bb.forward_argmax([toks[-1]], cache, pos)[0])
        pos += 1
    return logits, toks


def test_a_prompt_handed_over_decodes_as_if_prefilled_in_place(plain_and_same):
    plain, hybrid = plain_and_same
    before = hybrid.hybrid.handed
    ref_logits, ref = greedy(plain, PROMPT)
    logits, toks = greedy(hybrid, PROMPT)
    assert toks == ref and torch.equal(logits, ref_logits)
    assert hybrid.hybrid.handed - before == len(PROMPT)  # the prompt went through the prefill context
    # in chunks: staged between them (the prefix is not copied back each time), handed over chunk by chunk
    copied = hybrid.hybrid.copied
    assert greedy(hybrid, PROMPT, chunks=[16, 16, 10])[1] == greedy(plain, PROMPT, chunks=[16, 16, 10])[1]
    assert hybrid.hybrid.copied == copied


def test_steps_verifications_and_short_forwards_stay_on_the_decode_file(plain_and_same):
    plain, hybrid = plain_and_same
    cache = hybrid.new_cache(80)
    hybrid.forward(PROMPT, cache, 0, logits="last")
    handed = hybrid.hybrid.handed
    hybrid.forward(PROMPT[:MIN_TOKENS], cache, len(PROMPT), logits="all")  # a verification: every row's logits
    hybrid.forward(PROMPT[:MIN_TOKENS - 1], cache, len(PROMPT), logits="last")  # a short forward
    hybrid.forward_argmax(PROMPT[:3], cache, len(PROMPT))
    assert hybrid.hybrid.handed == handed
    assert cache.staged is None  # the prompt ended (its last logits asked for): nothing staged


def test_a_restored_prefix_is_staged_from_the_decode_context(plain_and_same):
    """A request starting from a kept prefix: its first ``n`` positions are the decode context's (shared
    cells), copied to the prefill context once; only the new positions are handed back."""
    plain, hybrid = plain_and_same
    outs = []
    for bb in (plain, hybrid):
        bb.prefixes = PrefixStore(1 << 20)
        first = bb.new_cache(60)
        bb.forward(PROMPT[:30], first, 0, logits="last")
        first.length = 30
        assert bb.keep_prefix(first, PROMPT[:30])
        entry = bb.prefixes.lookup(PROMPT).entry
        cache = bb.new_cache(len(PROMPT) + 20, shared=30)
        n = bb.restore_prefix(entry, cache, 30)
        copied = bb.hybrid.copied if bb.hybrid else 0
        logits = bb.forward(PROMPT[n:], cache, n, logits="last").logits[-1]
        toks, pos = [int(logits.argmax())], len(PROMPT)
        for _ in range(10):
            toks.append(bb.forward_argmax([toks[-1]], cache, pos)[0])
            pos += 1
        outs.append((logits, toks))
        if bb.hybrid:
            assert bb.hybrid.copied - copied == 30
        bb.prefixes = PrefixStore(0)
    assert outs[0][1] == outs[1][1] and torch.equal(outs[0][0], outs[1][0])


def test_a_prefill_file_of_another_model_is_refused(tiny_gguf, tmp_path):
    other = tmp_path / "other.gguf"
    write_gguf(tiny_model("llama", hidden=32), char_tokenizer(), other)
    with pytest.raises(ConfigError, match="is not a copy of"):
        LlamaCppBackbone(tiny_gguf[0], threads=1, context=64, sequences=1, prefill=other)


@pytest.fixture(scope="module")
def bf16_hybrid(tiny_gguf, tmp_path_factory):
    """A hybrid over a Q8_0 decode file and its derived BF16 prefill file."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ADAPTIVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    q8 = derive(tiny_gguf[0], "q8_0")
    pre = resolve_prefill(q8, "bf16")
    yield LlamaCppBackbone(q8, threads=2, context=256, sequences=4, prefill=pre)
    mp.undo()


@pytest.mark.parametrize("kind", ["pld", "cascade"])
def test_greedy_speculative_decoding_equals_the_hybrid_s_plain_decoding(bf16_hybrid, kind):
    assert bf16_hybrid.prefill_file.kind == "bf16"
    cfg = GenerationConfig(max_new_tokens=40, draft_len=6)
    handed = bf16_hybrid.hybrid.handed
    plain = decode_ids(bf16_hybrid, PROMPT, cfg)
    stats = GenerationStats()
    spec = decode_ids(bf16_hybrid, PROMPT, cfg, drafter=build_drafter(DrafterSpec(kind), bf16_hybrid), stats=stats)
    assert spec == plain
    assert stats.accepted > 0 and stats.steps < len(plain) - 1
    assert bf16_hybrid.hybrid.handed - handed == 2 * len(PROMPT)  # both prompts were prefilled on BF16


def test_without_room_on_the_prefill_context_the_prompt_is_prefilled_on_the_decode_file(tiny_gguf):
    path = tiny_gguf[0]
    plain = LlamaCppBackbone(path, threads=1, context=128, sequences=1)
    hybrid = LlamaCppBackbone(path, threads=1, context=128, sequences=1, prefill=path)
    held = hybrid.hybrid.prefill.new_cache(8)  # the prefill context's one sequence, taken
    assert greedy(hybrid, PROMPT, n=8)[1] == greedy(plain, PROMPT, n=8)[1]
    assert hybrid.hybrid.refused == 1 and hybrid.hybrid.handed == 0
    held.release()
    assert greedy(hybrid, PROMPT, n=8)[1] == greedy(plain, PROMPT, n=8)[1]
    assert hybrid.hybrid.handed == len(PROMPT)


def test_a_server_s_batch_steps_while_a_prompt_is_prefilled_in_chunks_on_the_hybrid(tiny_gguf, tmp_path,
                                                                                   monkeypatch):
    """A request decoding on the decode file while another's prompt is prefilled a chunk at a time on the prefill
    file between its steps, then both in one batch; a prompt sharing a kept prefix after them: each output is
    its lone greedy output on the hybrid."""
    from adaptive.engine.engine import Engine
    from adaptive.engine.prefix import PrefixStore
    from adaptive.models import LoadedModel

    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    q8 = derive(tiny_gguf[0], "q8_0")
    lm = LoadedModel(None, char_tokenizer(), "tiny-q8", str(q8), torch.device("cpu"), torch.float32,
                     engine="llama.cpp", threads=1, prefill="bf16")
    eng = Engine(lm)
    bb = lm.backbone
    assert bb.prefill_file.kind == "bf16"
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    long_prompt, short = PROMPT * 2, PROMPT[:20]
    alone = [eng.generate(p, cfg).token_ids for p in (short, long_prompt)]
    first = eng.begin(eng.start(short, cfg))
    chunked = eng.prefilling(long_prompt, cfg, chunk=16)
    session = None
    while session is None:
        eng.step([first])  # the decode context steps between the prefill context's chunks
        session = chunked.advance()
    second = eng.begin(session)
    while not (first.done and second.done):
        eng.step([d for d in (first, second) if not d.done])
    assert [first.result().token_ids, second.result().token_ids] == alone
    bb.prefixes = PrefixStore(1 << 20)
    try:
        kept = eng.prefilling(long_prompt, cfg, prefix=True)
        run = eng.begin(kept.advance())
        while not run.done:
            eng.step([run])
        copied = bb.hybrid.copied
        again = eng.prefilling(long_prompt[:60] + PROMPT[:30], cfg, prefix=True)
        assert again.cached > 0
        session = again.advance()
        assert bb.hybrid.copied - copied == again.cached  # the kept prefix staged from the decode context
        out = eng.begin(session)
        while not out.done:
            eng.step([out])
    finally:
        bb.prefixes = PrefixStore(0)
    assert out.result().token_ids == eng.generate(long_prompt[:60] + PROMPT[:30], cfg).token_ids


def test_the_decode_file_without_repacking_is_a_prefill_file(tiny_gguf, tmp_path, monkeypatch):
    """``no-repack``: the same file in a context without llama.cpp's repacked layouts prefills, the repacked one
    decodes; greedy speculative output equals the hybrid's plain output."""
    from adaptive.engine.prefill_file import NO_REPACK, PrefillFile

    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    q8 = derive(tiny_gguf[0], "q8_0")
    bb = LlamaCppBackbone(q8, threads=1, context=256, sequences=2, prefill=PrefillFile(q8, NO_REPACK, repack=False))
    cfg = GenerationConfig(max_new_tokens=30, draft_len=6)
    plain = decode_ids(bb, PROMPT, cfg)
    spec = decode_ids(bb, PROMPT, cfg, drafter=build_drafter(DrafterSpec("pld"), bb))
    assert spec == plain and bb.hybrid.handed == 2 * len(PROMPT)
