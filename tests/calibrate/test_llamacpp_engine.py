"""Calibration and the runtime on the llama.cpp engine, on the tiny GGUF (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from adaptive.calibrate.runner import calibrate  # noqa: E402
from adaptive.engine.config import GenerationConfig  # noqa: E402
from adaptive.engine.engine import Engine  # noqa: E402
from adaptive.models import LoadedModel  # noqa: E402
from adaptive.profile import ProfileError, load_profile  # noqa: E402
from adaptive.runtime import AdaptiveRuntime  # noqa: E402
from tests.conftest import TINY_DOMAINS, char_tokenizer, tiny_settings  # noqa: E402


@pytest.fixture(scope="module")
def cpp_lm(tiny_gguf):
    return LoadedModel(None, char_tokenizer(), "tiny-gguf", str(tiny_gguf[0]), torch.device("cpu"), torch.float32,
                       engine="llama.cpp", threads=1)


@pytest.fixture(scope="module")
def cpp_profile(cpp_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpp-profile") / "p"
    calibrate(cpp_lm, TINY_DOMAINS, out, tiny_settings(), progress=False)
    return load_profile(out)


def test_calibration_races_only_what_the_engine_runs(cpp_profile):
    p = cpp_profile
    assert p.model.engine == "llama.cpp" and p.model.dtype == ""
    # chosen as on torch, among the candidates (intermediate layers from llama.cpp's own prefill)
    assert p.index.pooling in tiny_settings().pooling_candidates(p.n_layers)
    assert p.calibration["pooling"]["chosen"] in p.calibration["pooling"]["held_out_accuracy"]
    assert p.cost_model.attn == (0.0,) * p.n_layers and p.cost_model.base == 1.0
    for d in [*p.domains.values(), p.global_set]:
        assert d.decision.drafter in ("ar", "pld", "cascade")
        assert not d.layer_skip.skip and d.layer_skip.trials == 0
        assert {m.role for m in d.measurements} == {"lookup", "cascade"}
        assert d.cascade.split == 0


def test_the_runtime_routes_and_decodes_as_plain_decoding(cpp_profile, cpp_lm):
    # no prefix cache: a prompt started from cached keys may part from plain decoding at a near-tie on
    # llama.cpp (its kernels round by batch shape; tests/engine/test_prefix.py audits that), and this
    # test holds routing and drafting to plain decoding token for token
    rt = AdaptiveRuntime(cpp_profile, cpp_lm, online=False, prefix_cache=0)
    plain = Engine(cpp_lm)
    for name, prompts in TINY_DOMAINS.items():
        r = rt.generate(prompts[5], max_new_tokens=20)
        ref = plain.generate(rt.encode(prompts[5]), GenerationConfig(max_new_tokens=20))
        assert r.token_ids == ref.token_ids, name
        assert r.route is not None
    prompt = TINY_DOMAINS["code"][4] * 3
    fixed = AdaptiveRuntime(cpp_profile, cpp_lm, online=False, bandit=False,  # the bandit may choose not to draft
                            prefix_cache=0)
    r = fixed.generate(prompt, max_new_tokens=20, policy="cascade")  # every request drafts with its domain's cascade
    assert r.drafter == "cascade" and r.stats.drafted > 0
    assert r.token_ids == plain.generate(rt.encode(prompt), GenerationConfig(max_new_tokens=20)).token_ids
    assert rt.generate(prompt, max_new_tokens=8, policy="knn-skip").drafter == "ar"  # no skip set on llama.cpp


def test_a_profile_serves_on_its_own_engine_only(cpp_profile, tiny_gguf):
    torch_lm = tiny_gguf[1]
    with pytest.raises(ProfileError, match="calibrated on the llama.cpp engine, not torch"):
        AdaptiveRuntime(cpp_profile, torch_lm, online=False)
