"""An eagle head trained on and drafting on the llama.cpp engine (the tiny GGUF's two-engine profile's
llama.cpp member): its features are llama.cpp's own, its drafts decode exactly what plain decoding on
llama.cpp does, the race measures it there, and a head trained on the other engine is refused."""

import shutil
from dataclasses import replace

import pytest

pytest.importorskip("llama_cpp")

from adaptive.distill.heads import HeadConfig  # noqa: E402
from adaptive.distill.trainer import distill_head  # noqa: E402
from adaptive.drafters.eagle import HeadShape  # noqa: E402
from adaptive.profile import load_profile, save_profile  # noqa: E402
from adaptive.runtime import AdaptiveRuntime  # noqa: E402
from tests.conftest import TINY_DOMAINS  # noqa: E402
from tests.distill.test_heads import FAST  # noqa: E402


@pytest.fixture
def member(two_engine_profile, tmp_path):
    """A copy of the pair's members and their models: ``(llama.cpp dir, torch dir, lms)``."""
    src, lms = two_engine_profile
    shutil.copytree(src, tmp_path / "pair")
    return tmp_path / "pair" / "llama.cpp", tmp_path / "pair" / "torch", lms


def test_a_head_trained_on_llama_cpp_drafts_there_exactly_as_plain_decoding(member):
    cpp_dir, _, lms = member
    cpp = lms["llama.cpp"]
    r = distill_head(cpp, cpp_dir, TINY_DOMAINS, HeadConfig(**FAST), progress=False)
    profile = load_profile(cpp_dir)
    shape = HeadShape.from_dict(profile.distilled["eagle"].shape)
    assert shape.top == "unit" and shape.layers == (1, 2, 4)
    assert 0.0 <= r.record.acceptance <= 1.0 and r.record.draft_cost > 0
    assert any(m.role == "eagle" for m in profile.global_set.measurements)  # raced on llama.cpp
    rt = AdaptiveRuntime.from_profile(cpp_dir, model=cpp, online=False, bandit=False)
    assert rt.features == (1, 2, 4) and rt.refusal("eagle") is None
    drafted = 0
    for prompt in ("what is 3 plus 6? answer:", "hello there friend number 2", "def f2(x): return x * 2 + 3"):
        plain = rt.generate(prompt, max_new_tokens=24, policy="ar")
        eagle = rt.generate(prompt, max_new_tokens=24, policy="eagle")
        assert eagle.decision == "eagle" and eagle.text == plain.text
        assert "tree" not in eagle.drafter_info  # llama.cpp verifies chains
        drafted += eagle.stats.drafted
    assert drafted > 0


def test_only_a_request_that_may_draft_with_the_head_keeps_its_rows(member):
    """Rows cost every llama.cpp forward: a routed request keeps them only while some record decides for the
    head; the eagle policy always; and a domain decided for the head drafts with it, as plain decoding."""
    cpp_dir, _, lms = member
    cpp = lms["llama.cpp"]
    distill_head(cpp, cpp_dir, TINY_DOMAINS, HeadConfig(**{**FAST, "steps": 20}), progress=False, race=False)
    rt = AdaptiveRuntime.from_profile(cpp_dir, model=cpp, online=False, bandit=False)
    assert rt.features == (1, 2, 4) and not rt._head_decided()
    assert rt.config().features == () and rt.config(policy="ar").features == ()
    assert rt.config(policy="eagle").features == (1, 2, 4)
    profile = load_profile(cpp_dir)
    for name, dp in [(None, profile.global_set), *profile.domains.items()]:
        new = replace(dp, decision=replace(dp.decision, drafter="eagle", draft_len=2))
        if name is None:
            profile.global_set = new
        else:
            profile.domains[name] = new
    save_profile(profile, cpp_dir)
    rt = AdaptiveRuntime.from_profile(cpp_dir, model=cpp, online=False, bandit=False)
    assert rt.config().features == (1, 2, 4) and rt.config(policy="cascade").features == ()
    prompt = "what is 3 plus 6? answer:"
    routed, plain = rt.generate(prompt, max_new_tokens=24), rt.generate(prompt, max_new_tokens=24, policy="ar")
    assert routed.decision == "eagle" and routed.stats.drafted > 0 and routed.text == plain.text


def test_a_head_is_refused_on_an_engine_that_keeps_its_features_otherwise(member):
    """A torch-trained head (the residual top) in the llama.cpp member: the eagle policy is refused there
    before any prefill, with the engine named; the routed policies decode as before."""
    cpp_dir, torch_dir, lms = member
    distill_head(lms["torch"], torch_dir, TINY_DOMAINS, HeadConfig(**{**FAST, "steps": 2}), progress=False,
                 race=False)
    profile, trained = load_profile(cpp_dir), load_profile(torch_dir)
    rec = trained.distilled["eagle"]
    profile.distilled["eagle"] = replace(rec, model=profile.model)  # as if trained for the GGUF's model
    profile.distilled_weights["eagle"] = trained.distilled_weights["eagle"]
    save_profile(profile, cpp_dir)
    rt = AdaptiveRuntime.from_profile(cpp_dir, model=lms["llama.cpp"], online=False, bandit=False)
    assert rt.features == ()
    refused = rt.refusal("eagle")
    assert refused is not None and "llama.cpp" in str(refused)
    assert rt.generate("hello there friend number 2", max_new_tokens=8).text
