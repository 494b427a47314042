"""The llama.cpp baseline: clear errors without the extra or a GGUF file; a real run when installed."""

import importlib.util

import pytest

from adaptive.bench import llamacpp
from adaptive.bench.llamacpp import LlamaCpp, gguf_path
from adaptive.bench.report import markdown, summarize
from adaptive.engine.audit import common_prefix
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm


def test_a_model_without_a_gguf_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs the model's GGUF file.*in-process"):
        gguf_path(tiny_lm())


def test_missing_extra_is_a_clear_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    with pytest.raises(ConfigError, match=r"adaptive\[llamacpp\]"):
        LlamaCpp(tmp_path / "m.gguf", threads=2, n_ctx=256)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [5]) == 0


def test_other_weights_are_reported_as_agreement_not_equality():
    runs = [{"id": "a", "group": "qa", "method": "ar", "tokens_per_s": 10.0, "steps": 5, "drafted": 0,
             "accepted": 0, "identical": True},
            {"id": "a", "group": "qa", "method": "llama.cpp", "tokens_per_s": 30.0, "steps": None,
             "drafted": None, "accepted": None, "identical": None, "agreement": 12}]
    s = summarize(runs, ["ar", "llama.cpp"])
    assert s["llama.cpp"]["identical_to_ar"] is None and s["llama.cpp"]["agreement_tokens"] == 12
    assert s["llama.cpp"]["speedup"] == 3.0 and s["llama.cpp"]["lossless_violations"] == 0
    assert "| llama.cpp | - | - | - | - | - | other weights: first 12 tokens agree on average | 0 |" in markdown(
        s, ["ar", "llama.cpp"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_decodes_the_embedded_gguf_greedily(embedded_fp32):
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    eng = Engine(embedded_fp32)
    ids = eng.encode("What is the capital of France?")
    base = LlamaCpp(gguf_path(embedded_fp32), threads=2, n_ctx=512)
    out, seconds = base.generate(ids, 16, eng.eos)
    assert 1 <= len(out) <= 16 and seconds > 0
    again, _ = base.generate(ids, 16, eng.eos)
    assert again == out  # greedy and reset between runs: the same tokens
    # other numbers (its Q4_1 kernels against our fp32): agreement is reported, not required. On this
    # prompt it parts from the first token (llama.cpp: "L'Étoile, ..."; ours: "The capital of France is Paris.")
    ours = eng.generate(ids, GenerationConfig(max_new_tokens=16)).token_ids
    assert 0 <= common_prefix(ours, out) <= len(out) and eng.text(out).strip()


def test_the_baseline_loads_without_extra_buffers_only_inside_the_switch():
    low = pytest.importorskip("llama_cpp.llama_cpp")
    default = low.llama_model_default_params
    with llamacpp._extra_buffers(False):
        assert low.llama_model_default_params().use_extra_bufts is False  # what Llama(...) reads while it loads
    assert low.llama_model_default_params is default and default().use_extra_bufts is True
    with llamacpp._extra_buffers(True):
        assert low.llama_model_default_params is default
