"""The hybrid engine's prefill file (:mod:`adaptive.engine.prefill_file`): modes, the memory budget,
derivation by llama.cpp's quantizer into the cache, atomically and once."""

from __future__ import annotations

import json

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


def rates(decode_file, copy: float = 300.0, no_repack: float = 90.0):
    """A prefill rate (tokens/s) of ``rate(path, repack)``: the decode file 100, derived copies ``copy``, the decode
    file without repacking ``no_repack``; its calls counted in ``calls``."""
    calls = []

    def rate(path, repack=True):
        calls.append((path, repack))
        if path == decode_file:
            return 100.0 if repack else no_repack
        return copy

    return rate, calls


def test_auto_takes_bf16_then_q8_0_then_none_by_the_memory_budget(quantized, monkeypatch):
    assert pf.file_type(quantized) == pf.PREFILL_KINDS["q8_0"][0]
    n = pf.weights_count(quantized)
    assert pf.derived_bytes(quantized, "bf16") == 2 * n
    budget = {"now": 10 * n}
    monkeypatch.setattr(pf, "available_memory", lambda: budget["now"])
    rate, _ = rates(quantized)
    got = pf.resolve_prefill(quantized, "auto", rate=rate)
    assert got.kind == "bf16" and got.repack and pf.file_type(got.path) == 32
    budget["now"] = 3 * n  # half of it holds a Q8_0 copy (~1.06 bytes a weight), not a BF16 one
    assert pf.resolve_prefill(quantized, "auto", rate=rate).kind == "q8_0"
    budget["now"] = n  # no copy fits, and the file without repacking prefills slower than with it
    assert pf.resolve_prefill(quantized, "auto", rate=rate) is None
    with pytest.raises(ValueError, match="auto needs rate"):
        pf.resolve_prefill(quantized, "auto")
    assert pf.resolve_prefill(quantized, "bf16").kind == "bf16"  # a kind asked for is derived whatever the budget
    named = pf.resolve_prefill(quantized, str(got.path))
    assert named == pf.PrefillFile(got.path.resolve(), "file")
    with pytest.raises(ValueError, match="kind"):
        pf.PrefillFile(got.path, "q4")
    with pytest.raises(ValueError, match="repacked layouts off exactly when"):
        pf.PrefillFile(got.path, "bf16", repack=False)


def test_auto_takes_the_fastest_prefill_that_pays_measured_once_per_machine(quantized, cache):
    """The rates are measured once per machine and file, kept beside the copies; a candidate must prefill PAYS
    times faster than the decode file, the fastest of those is taken, and a copy that does not pay is deleted."""
    rate, calls = rates(quantized)
    assert pf.resolve_prefill(quantized, "auto", rate=rate).kind == "bf16"
    assert len(calls) == 3 and (cache / pf.RATES_FILE).is_file()  # the decode file, with and without repacking, BF16
    assert pf.resolve_prefill(quantized, "auto", rate=rate).kind == "bf16" and len(calls) == 3  # kept: not again
    (cache / pf.RATES_FILE).unlink()
    rate, _ = rates(quantized, copy=110.0, no_repack=160.0)  # as Qwen2.5-Coder-1.5B's Q4_K_M measured
    got = pf.resolve_prefill(quantized, "auto", rate=rate)
    assert got == pf.PrefillFile(quantized.resolve(), pf.NO_REPACK, repack=False)
    assert not pf.derived_path(quantized, "bf16").exists()  # derived to be measured, then deleted
    (cache / pf.RATES_FILE).unlink()
    rate, _ = rates(quantized, copy=110.0, no_repack=110.0)
    assert pf.resolve_prefill(quantized, "auto", rate=rate) is None
    stored = json.loads((cache / pf.RATES_FILE).read_text())
    assert list(stored.values()) == [{"decode": 100.0, "bf16": 110.0, "no-repack": 110.0}]
    assert pf.resolve_prefill(quantized, "no-repack").repack is False  # asked for by name: taken as it is


def test_a_prefill_rate_is_measured_on_llama_cpp(tiny_gguf):
    from adaptive.engine.llamacpp import prefill_rate

    assert prefill_rate(tiny_gguf[0], tokens=32, repeats=1) > 0
    assert prefill_rate(tiny_gguf[0], repack=False, tokens=32, repeats=1) > 0


def test_without_room_for_a_copy_the_file_without_repacking_is_still_measured_and_kept(tiny_gguf, tmp_path,
                                                                                        monkeypatch):
    """No copy fits the memory budget and nothing was derived yet (no prefill cache directory): the decode file
    without repacking is measured, taken where it pays, and its rates written (the directory made for them)."""
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setattr(pf, "available_memory", lambda: 0)
    monkeypatch.setattr(pf, "file_type", lambda path: 7)  # a quantized file, as far as auto asks
    rate, calls = rates(tiny_gguf[0], no_repack=200.0)
    got = pf.resolve_prefill(tiny_gguf[0], "auto", rate=rate)
    assert got == pf.PrefillFile(tiny_gguf[0].resolve(), pf.NO_REPACK, repack=False) and len(calls) == 2
    stored = json.loads((tmp_path / "fresh" / "prefill" / pf.RATES_FILE).read_text())
    assert list(stored.values()) == [{"decode": 100.0, "no-repack": 200.0}]
