"""Text-level behaviour: EOS, stop strings, max_new_tokens, streaming, chat template, config errors."""

import pytest

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine, GenerationResult
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm

SKIP = SkipSet(attn=(1,), mlp=(2,))


@pytest.fixture
def engine():
    return Engine(tiny_lm("llama", seed=3))


def drafter(engine, kind):
    return build_drafter(DrafterSpec(kind, skip=SKIP if kind == "ssd" else None), engine.backbone)


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_max_new_tokens_is_exact(engine, method):
    for n in (1, 2, 7):
        r = engine.generate("abc", GenerationConfig(max_new_tokens=n, ignore_eos=True, draft_len=5),
                            drafter=drafter(engine, method))
        assert len(r.token_ids) == n and r.finish_reason == "length"


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_eos_stops_and_is_kept_in_ids(engine, method):
    long = engine.generate("abc", GenerationConfig(max_new_tokens=30, ignore_eos=True))
    eos = long.token_ids[6]  # pretend the 7th generated token is EOS
    first = long.token_ids.index(eos)
    engine.eos = {eos}
    r = engine.generate("abc", GenerationConfig(max_new_tokens=30, draft_len=4),
                        drafter=drafter(engine, method))
    assert r.finish_reason == "eos"
    assert r.token_ids == long.token_ids[: first + 1]


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_stop_string_cuts_text(engine, method):
    full = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True)).text
    assert len(full) > 10
    stop = full[5:7]
    r = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,), draft_len=4),
                        drafter=drafter(engine, method))
    assert r.finish_reason == "stop"
    assert r.text == full[: full.find(stop)]
    # the ids end with the token that completed the stop string, whatever the method
    ar = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,)))
    assert r.token_ids == ar.token_ids
    assert stop not in engine.text(r.token_ids[:-1]) and stop in engine.text(r.token_ids)


def test_stream_deltas_concatenate_to_text(engine):
    items = list(engine.stream("hello", GenerationConfig(max_new_tokens=25, ignore_eos=True, draft_len=3),
                               drafter=drafter(engine, "ssd")))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    deltas = items[:-1]
    assert all(isinstance(d, str) and d for d in deltas) and len(deltas) > 1
    assert "".join(deltas) == result.text


def test_stream_with_stop_never_emits_the_stop_string(engine):
    full = engine.generate("hello", GenerationConfig(max_new_tokens=40, ignore_eos=True)).text
    stop = full[8:11]
    items = list(engine.stream("hello", GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,))))
    assert "".join(items[:-1]) == items[-1].text == full[: full.find(stop)]


def test_chat_template_and_raw(engine):
    chat = engine.encode("hi")
    raw = engine.encode("hi", chat=False)
    assert engine.tokenizer.decode(chat).startswith("user: hi")
    assert engine.tokenizer.decode(raw) == "hi"
    assert engine.encode([{"role": "user", "content": "hi"}]) == chat
    with pytest.raises(ConfigError):
        engine.encode("   ")
    with pytest.raises(ConfigError):
        engine.encode([{"content": "no role"}])


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": 0}, {"max_new_tokens": -3}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"draft_len": 0}, {"draft_len": 100}, {"confidence_threshold": 1.0}, {"stop": ("",)},
])
def test_impossible_options(kwargs):
    with pytest.raises(ConfigError):
        GenerationConfig(**kwargs)


def test_ssd_without_skip_set_and_unknown_drafter():
    with pytest.raises(ConfigError, match="skip set"):
        DrafterSpec("ssd")
    with pytest.raises(ConfigError, match="unknown drafter"):
        DrafterSpec("nope")


def test_long_stream_deltas_concatenate_to_the_final_text(engine):
    """A long generation (incremental detokenization, held-back tail) streams exactly its final text."""
    cfg = GenerationConfig(max_new_tokens=300, ignore_eos=True, draft_len=4)
    items = list(engine.stream("hello", cfg, drafter=drafter(engine, "ssd")))
    result = items[-1]
    assert len(result.token_ids) == 300 and len(items) > 20
    assert "".join(items[:-1]) == result.text == engine.text(result.token_ids)
    # and with stop strings watched (held-back characters), cut where the first one appears
    stop = result.text[250:253]
    cut = engine.generate("hello", GenerationConfig(max_new_tokens=300, ignore_eos=True, stop=(stop, "@@@@")))
    streamed = list(engine.stream("hello", GenerationConfig(max_new_tokens=300, ignore_eos=True,
                                                            stop=(stop, "@@@@"))))
    assert "".join(streamed[:-1]) == streamed[-1].text == cut.text == result.text[: result.text.find(stop)]


def test_text_decoder_holds_back_incomplete_utf8():
    """Byte-level pieces: a character split over two tokens waits for the second (no U+FFFD shown)."""
    from adaptive.engine.engine import TextDecoder

    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" ok"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    d = TextDecoder(decode)
    d.add([1])
    assert d.text() == "caf" and d.pending == ""
    d.add([2])
    assert d.committed_len == 3 and d.pending == "\ufffd"  # shown only as pending, never committed
    d.add([3])
    assert d.text() == "café" and d.pending == ""
    d.add([4])
    assert d.text() == "café ok" == decode([1, 2, 3, 4]) and d.text_from(3) == "é ok"


def test_stream_never_shows_a_partial_character(engine):
    """Streaming over a byte-level decoder: no delta ends in U+FFFD, the deltas make the text."""
    from adaptive.engine.engine import TextStream

    pieces = {1: b"a", 2: b"\xe2", 3: b"\x82", 4: b"\xac", 5: b"b"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    s = TextStream(decode, set(), GenerationConfig(max_new_tokens=5))
    deltas = [s.push([t]) for t in (1, 2, 3, 4, 5)]
    assert deltas == ["a", "", "", "\u20ac", "b"] and s.finish == "length" and s.final_text() == "a\u20acb"


def test_prefill_and_decode_steps_are_plain_functions():
    """ar through prefill + decode_steps is Engine.generate's output; so is a drafter's."""
    from adaptive.engine.loop import GenerationStats, decode_steps, new_cache, prefill
    from adaptive.engine.protocol import DecodeState

    lm = tiny_lm("llama", seed=3)
    ids = list(range(3, 20))
    cfg = GenerationConfig(max_new_tokens=24, draft_len=3, ignore_eos=True)
    ref = Engine(lm).generate(ids, cfg)
    for d in (None, build_drafter(DrafterSpec("ssd", skip=SKIP), lm.backbone)):
        cache = new_cache(lm.backbone, len(ids), cfg)
        pre = prefill(lm.backbone, ids, cache, cfg, None, pool=True)
        assert cache.length == len(ids) and pre.pooled.shape == (lm.model.config.hidden_size,)
        stats = GenerationStats()
        state = DecodeState(lm.backbone, cache, ids + [pre.first], cfg, None)
        out = [pre.first] + sum(decode_steps(lm.backbone, state, d, None, cfg, stats), [])
        assert out == ref.token_ids and state.tokens == ids + out
        assert stats.steps == (ref.stats.steps if d is None else stats.steps) and (stats.drafted > 0) == (d is not None)


def test_start_then_decode_is_stream(engine):
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    session = engine.start(engine.encode("hello"), cfg, pool=True)
    assert session.pooled is not None
    *deltas, result = list(engine.decode(session, drafter(engine, "ssd")))
    assert result.token_ids == engine.generate("hello", cfg).token_ids and "".join(deltas) == result.text
    assert result.drafter == "ssd" and result.drafter_info["name"] == "ssd"
    with pytest.raises(ConfigError, match="once"):
        list(engine.decode(session))


@pytest.mark.parametrize("kind", [None, "pld", "ssd"])
def test_greedy_steps_read_only_the_argmax_and_decode_what_the_logits_would(kind, monkeypatch):
    """A greedy lane with the default acceptor and a draft on the host (on a CPU backbone every
    draft is) is verified by ``forward_argmax``; any other acceptor by the logits: the tokens and
    statistics are the same either way."""
    from adaptive.engine.loop import GenerationStats, default_acceptor
    from tests.helpers.decoding import decode_ids

    lm = tiny_lm("llama", seed=3)
    bb = lm.backbone
    ids = [3, 4, 5, 6, 3, 4, 5, 6, 7, 3, 4, 5]
    cfg = GenerationConfig(max_new_tokens=30, draft_len=3, ignore_eos=True)
    calls = []
    real = type(bb).forward_argmax
    monkeypatch.setattr(type(bb), "forward_argmax", lambda self, *a: calls.append(1) or real(self, *a))
    runs = {}
    for name, acceptor in (("argmax", default_acceptor), ("logits", lambda *a: default_acceptor(*a))):
        calls.clear()
        stats = GenerationStats()
        d = drafter(Engine(lm), kind) if kind else None
        runs[name] = (decode_ids(bb, ids, cfg, drafter=d, stats=stats, acceptor=acceptor),
                      stats.steps, stats.accepted, len(calls))
    assert runs["argmax"][:3] == runs["logits"][:3]
    assert runs["logits"][3] == 0
    assert runs["argmax"][3] == runs["argmax"][1] > 0  # every step


def test_sampling_steps_never_take_the_argmax_path(monkeypatch):
    from adaptive.engine.loop import GenerationStats
    from tests.helpers.decoding import decode_ids

    lm = tiny_lm("llama", seed=3)
    monkeypatch.setattr(type(lm.backbone), "forward_argmax", lambda *a: pytest.fail("sampling read only argmax"))
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    assert len(decode_ids(lm.backbone, [3, 4, 5, 6], cfg, stats=GenerationStats())) == 12
