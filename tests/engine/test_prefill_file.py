"""The hybrid engine's prefill file (:mod:`adaptive.engine.prefill_file`): modes, the memory budget,
derivation by llama.cpp's quantizer into the cache, atomically and once."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from adaptive.engine import prefill_file as pf  # noqa: E402
from adaptive.errors import ConfigError, ModelNotFoundError  # noqa: E402


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prefill"


@pytest.fixture()
def quantized(tiny_gguf, cache):
    """A Q8_0 copy of the tiny float32 GGUF: a quantized decode file."""
    return pf.derive(tiny_gguf[0], "q8_0")


def test_modes_are_checked_and_an_unquantized_file_needs_no_prefill_file(tiny_gguf, cache):
    path = tiny_gguf[0]
    assert pf.file_type(path) == 0  # float32
    assert pf.resolve_prefill(path, "auto") is None
    assert pf.resolve_prefill(path, "off") is None
    assert pf.resolve_prefill(path, str(path)) is None  # the decode file itself
    for bad in ("bf8", "/no/such.gguf"):
        with pytest.raises(ConfigError, match="neither one of auto, off"):
            pf.check_mode(bad)
    assert not cache.exists()  # nothing derived


def test_a_kind_is_derived_once_into_the_cache_atomically(tiny_gguf, cache):
    out = pf.derive(tiny_gguf[0], "bf16")
    assert out.parent == cache and out.name.endswith(".bf16.gguf")
    assert pf.file_type(out) == pf.PREFILL_KINDS["bf16"][0]
    assert pf.weights_count(out) == pf.weights_count(tiny_gguf[0])
    mtime = out.stat().st_mtime_ns
    assert pf.derive(tiny_gguf[0], "bf16") == out and out.stat().st_mtime_ns == mtime  # cached: not derived again
    assert [p.name for p in cache.iterdir()] == [out.name]  # no temporary file left
    with pytest.raises(ConfigError, match="is derived as one of"):
        pf.derive(tiny_gguf[0], "q2_k")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        pf.derive(cache / "missing.gguf", "bf16")


def test_auto_takes_bf16_then_q8_0_then_none_by_the_memory_budget(quantized, monkeypatch):
    assert pf.file_type(quantized) == pf.PREFILL_KINDS["q8_0"][0]
    n = pf.weights_count(quantized)
    assert pf.derived_bytes(quantized, "bf16") == 2 * n
    budget = {"now": 10 * n}
    monkeypatch.setattr(pf, "available_memory", lambda: budget["now"])
    got = pf.resolve_prefill(quantized, "auto")
    assert got.kind == "bf16" and pf.file_type(got.path) == 32
    budget["now"] = 3 * n  # half of it holds a Q8_0 copy (~1.06 bytes a weight), not a BF16 one
    assert pf.resolve_prefill(quantized, "auto").kind == "q8_0"
    budget["now"] = n
    assert pf.resolve_prefill(quantized, "auto") is None
    assert pf.resolve_prefill(quantized, "bf16").kind == "bf16"  # a kind asked for is derived whatever the budget
    named = pf.resolve_prefill(quantized, str(got.path))
    assert named == pf.PrefillFile(got.path.resolve(), "file")
    with pytest.raises(ValueError, match="kind"):
        pf.PrefillFile(got.path, "q4")
