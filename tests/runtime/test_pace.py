"""Each engine's pace learned from its requests (adaptive.runtime.pace): the posterior on literal log ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaptive.errors import ConfigError
from adaptive.runtime.pace import PaceLearner, PaceSettings


def _learner(**kw) -> PaceLearner:
    return PaceLearner(PaceSettings(**{"explore": False, **kw}))


def _observe_ratio(p: PaceLearner, engine: str, domain: str | None, ratio: float, tokens: int = 32) -> bool:
    return p.observe(engine, domain, expected_s=1.0, actual_s=ratio, tokens=tokens)


def test_no_request_leaves_the_calibrated_price():
    p = _learner()
    assert p.factor("torch") == 1.0 and p.factor("torch", "qa") == 1.0
    assert p.state() == {}


def test_the_module_docs_worked_example():
    p = _learner(memory=math.inf)
    for x in (-0.3, -0.2, -0.25):
        assert _observe_ratio(p, "torch", "qa", math.exp(x))
    assert p.factor("torch", "qa") == pytest.approx(math.exp(-0.1875 - 0.1875 / 7), rel=1e-9)
    assert p.factor("torch", "qa") == pytest.approx(0.807, abs=5e-4)
    assert p.factor("torch", "maths") == pytest.approx(math.exp(-0.1875)) == p.factor("torch")
    assert p.factor("llama.cpp", "qa") == 1.0  # another engine learned nothing
    st = p.state()
    assert st["torch"]["requests"] == 3 and st["torch"]["domains"]["qa"]["requests"] == 3
    assert st["torch"]["factor"] == pytest.approx(0.829, abs=5e-4)


def test_many_requests_converge_on_their_ratio_and_a_domain_on_its_own():
    p = _learner(memory=math.inf)
    rng = np.random.default_rng(1)
    for _ in range(400):
        _observe_ratio(p, "torch", "translation", 0.6 * math.exp(rng.normal(0, 0.3)))
        _observe_ratio(p, "torch", "rag", 0.9 * math.exp(rng.normal(0, 0.3)))
    assert p.factor("torch", "translation") == pytest.approx(0.6, rel=0.06)
    assert p.factor("torch", "rag") == pytest.approx(0.9, rel=0.06)


def test_old_requests_weigh_less_and_one_outlier_moves_a_factor_by_little():
    p = _learner(memory=50)
    for _ in range(1000):
        _observe_ratio(p, "torch", None, 1.0)
    for _ in range(100):  # the host got faster
        _observe_ratio(p, "torch", None, 0.5)
    assert p.factor("torch") == pytest.approx(0.5 * math.exp(math.log(2) * math.exp(-2)), rel=0.03)  # ~0.55
    assert p.state()["torch"]["requests"] == 1100  # requests counted whole
    forever = _learner(memory=math.inf)
    for _ in range(1000):
        _observe_ratio(forever, "torch", None, 1.0)
    for _ in range(100):
        _observe_ratio(forever, "torch", None, 0.5)
    assert forever.factor("torch") > 0.93  # without forgetting the old pace holds on
    one = _learner(memory=math.inf)
    _observe_ratio(one, "torch", None, 50.0)  # a request slowed 50x by something else: clipped to exp(0.9)
    assert one.factor("torch") == pytest.approx(math.exp(0.9 / 2))


def test_short_requests_and_unmeasured_times_teach_nothing():
    p = _learner(min_tokens=8)
    assert not _observe_ratio(p, "torch", None, 0.5, tokens=7)
    assert not p.observe("torch", None, expected_s=0.0, actual_s=1.0, tokens=32)
    assert not p.observe("torch", None, expected_s=1.0, actual_s=0.0, tokens=32)
    assert not p.observe("torch", None, expected_s=1.0, actual_s=math.inf, tokens=32)
    assert not p.observe("torch", None, expected_s=math.nan, actual_s=1.0, tokens=32)
    assert p.state() == {}
    assert _observe_ratio(p, "torch", None, 0.5, tokens=8)
    assert p.state()["torch"]["domains"] == {}  # priced without a domain: the engine's term only


def test_draws_spread_as_the_posterior_and_narrow_with_requests():
    p = PaceLearner(PaceSettings(explore=True, memory=math.inf), seed=3)
    draws = np.log([p.factor("torch", "qa") for _ in range(4000)])
    # prior: m = 0, variance engine_sd^2 + domain_sd^2
    assert abs(draws.mean()) < 0.02 and draws.std() == pytest.approx(math.hypot(0.3, 0.15), rel=0.05)
    for _ in range(100):
        _observe_ratio(p, "torch", "qa", 0.7)
    draws = np.log([p.factor("torch", "qa") for _ in range(4000)])
    assert draws.mean() == pytest.approx(math.log(p.factor("torch", "qa", draw=False)), abs=0.01)
    assert draws.std() < 0.06
    assert p.factor("torch", "qa", draw=False) == p.factor("torch", "qa", draw=False)  # the mean: no draw
    assert PaceLearner().factor("torch") == PaceLearner().factor("torch") == 1.0  # default: the mean


@pytest.mark.parametrize("field,value", [("noise_sd", 0), ("engine_sd", -1.0), ("domain_sd", "x"),
                                         ("engine_sd", math.inf), ("min_tokens", 0), ("min_tokens", True),
                                         ("memory", 0.5), ("memory", "x")])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=field.replace("_", "-")):
        PaceSettings(**{field: value})


def test_prefill_times_are_measured_again_where_the_engine_prefills_on_another_file(two_engine_profile, capsys):
    """A profile calibrated without a prefill file, loaded on a hybrid llama.cpp engine: the runtime prices
    prompts by the hybrid's prefill, measured at load, and says so; the same engine again measures nothing."""
    import shutil

    import torch

    from adaptive.models import LoadedModel
    from adaptive.profile import load_profile
    from adaptive.runtime import AdaptiveRuntime
    from tests.conftest import char_tokenizer

    directory, lms = two_engine_profile
    profile = load_profile(directory, "llama.cpp")
    assert profile.model.prefill == "" and profile.cost_model.prefill
    source = lms["llama.cpp"].source
    copy = directory.parent / "prefill-copy.gguf"
    shutil.copyfile(source, copy)
    lm = LoadedModel(None, char_tokenizer(), "tiny-gguf", source, torch.device("cpu"), torch.float32,
                     engine="llama.cpp", threads=1, prefill=str(copy))
    rt = AdaptiveRuntime(profile, lm, online=False)
    assert rt.profile.model.prefill == "file" and rt.profile.cost_model.prefill != profile.cost_model.prefill
    assert [n for n, _ in rt.profile.cost_model.prefill] == [n for n, _ in profile.cost_model.prefill]
    assert "measuring them again" in capsys.readouterr().err
    again = AdaptiveRuntime(rt.profile, lm, online=False)
    assert again.profile is rt.profile and "measuring" not in capsys.readouterr().err
