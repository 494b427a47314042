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
