"""Text-level behaviour: EOS, stop strings, max_new_tokens, streaming, chat template, config errors."""

import pytest

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine, GenerationResult
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm

SKIP = SkipSet(attn=(1,), mlp=(2,))


@pytest.fixture
def engine():
    return Engine(tiny_lm("llama", seed=3))


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_max_new_tokens_is_exact(engine, method):
    for n in (1, 2, 7):
        r = engine.generate("abc", GenerationConfig(max_new_tokens=n, ignore_eos=True, draft_len=5),
                            method=method, skip=SKIP if method == "ssd" else None)
        assert len(r.token_ids) == n and r.finish_reason == "length"


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_eos_stops_and_is_kept_in_ids(engine, method):
    long = engine.generate("abc", GenerationConfig(max_new_tokens=30, ignore_eos=True))
    eos = long.token_ids[6]  # pretend the 7th generated token is EOS
    first = long.token_ids.index(eos)
    engine.eos = {eos}
    r = engine.generate("abc", GenerationConfig(max_new_tokens=30, draft_len=4), method=method,
                        skip=SKIP if method == "ssd" else None)
    assert r.finish_reason == "eos"
    assert r.token_ids == long.token_ids[: first + 1]


@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_stop_string_cuts_text(engine, method):
    full = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True)).text
    assert len(full) > 10
    stop = full[5:7]
    r = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,), draft_len=4),
                        method=method, skip=SKIP if method == "ssd" else None)
    assert r.finish_reason == "stop"
    assert r.text == full[: full.find(stop)]
    # the ids end with the token that completed the stop string, whatever the method
    ar = engine.generate("abc", GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,)))
    assert r.token_ids == ar.token_ids
    assert stop not in engine._text(r.token_ids[:-1]) and stop in engine._text(r.token_ids)


def test_stream_deltas_concatenate_to_text(engine):
    items = list(engine.stream("hello", GenerationConfig(max_new_tokens=25, ignore_eos=True, draft_len=3),
                               method="ssd", skip=SKIP))
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


def test_ssd_without_skip_set_and_unknown_method(engine):
    with pytest.raises(ConfigError, match="skip set"):
        engine.generate("abc", method="ssd")
    with pytest.raises(ConfigError, match="unknown method"):
        engine.generate("abc", method="nope")
