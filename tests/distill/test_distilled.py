"""Distilled drafters in a profile: both kinds trained, then greedy equality with ``ar`` in fp32
through the runtime; a profile without one says so; a draft model needs the target's tokenizer
(the check, and distillation refusing another). The drafters themselves: ``tests/drafters/``."""

import shutil

import pytest
import torch

from adaptive.distill.trainer import DistillConfig, distill
from adaptive.drafters.model import check_same_tokenizer
from adaptive.errors import ConfigError
from adaptive.models import LoadedModel, load_model
from adaptive.runtime import AdaptiveRuntime
from tests.conftest import TINY_DOMAINS, char_tokenizer, tiny_model

PROMPTS = ["what is 3 plus 6? answer:", "hello there friend number 9", "def f7(x): return", "zz top"]
FAST = dict(steps=30, new_tokens=12, eval_every=15, checkpoint_every=15, lr=3e-3, data_source="teacher")


@pytest.fixture(scope="module")
def distilled(lm, tiny_profile, draft_dir, tmp_path_factory):
    """A copy of the tiny profile with both kinds of distilled drafter."""
    dst = tmp_path_factory.mktemp("distilled") / "prof"
    shutil.copytree(tiny_profile, dst)
    distill(lm, dst, TINY_DOMAINS, DistillConfig(**FAST, exit_layer=2), progress=False)
    distill(lm, dst, TINY_DOMAINS, DistillConfig(**{**FAST, "batch_size": 4}),
            draft_lm=load_model(str(draft_dir), dtype="float32"), progress=False)
    return dst


@pytest.mark.parametrize("policy", ["early-exit", "draft-model"])
def test_runtime_greedy_equals_ar(lm, distilled, policy):
    fixed = AdaptiveRuntime.from_profile(distilled, model=lm, bandit=False)  # always drafts
    sampler = AdaptiveRuntime.from_profile(distilled, model=lm)  # may decline to draft where it does not pay
    for prompt in PROMPTS:
        ref = fixed.generate(prompt, max_new_tokens=24, policy="ar")
        got = fixed.generate(prompt, max_new_tokens=24, policy=policy)
        assert got.token_ids == ref.token_ids, prompt
        assert got.decision == policy and got.stats.drafted > 0 and got.draft_policy.startswith("fixed")
        assert sampler.generate(prompt, max_new_tokens=24, policy=policy).token_ids == ref.token_ids
    state = sampler.bandit_state()
    assert any(k.startswith(f"{policy}:") for k in state)  # one Thompson sampler per routed domain


def test_draft_model_was_trained(distilled):
    from adaptive.profile import load_profile

    meta = load_profile(distilled).distilled["draft-model"]
    assert meta.after["greedy"] > meta.before["greedy"]  # the draft model was trained too


def test_a_profile_without_the_drafter_says_so(lm, tiny_profile):
    from adaptive.profile import ProfileError

    rt = AdaptiveRuntime.from_profile(tiny_profile, model=lm)
    with pytest.raises(ProfileError, match="no distilled early-exit drafter"):
        rt.generate("abc", max_new_tokens=4, policy="early-exit")


def test_draft_model_must_share_the_tokenizer(lm, tiny_profile):
    other = tiny_model("llama", n_layers=2, vocab=60)
    tok = char_tokenizer()
    with pytest.raises(ConfigError, match="vocabulary has 60 rows"):
        check_same_tokenizer(lm.tokenizer, tok, lm.backbone.vocab_size, 60)
    gpt_like = {**tok.get_vocab()}
    a, b = list(gpt_like)[5:7]
    gpt_like[a], gpt_like[b] = gpt_like[b], gpt_like[a]  # two ids swapped: same size, other mapping

    class Swapped:
        def get_vocab(self):
            return gpt_like

    with pytest.raises(ConfigError, match="tokenizer differs"):
        check_same_tokenizer(lm.tokenizer, Swapped(), lm.backbone.vocab_size, lm.backbone.vocab_size)
    draft = LoadedModel(other, tok, "other", "in-process", torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        distill(lm, tiny_profile, TINY_DOMAINS, DistillConfig(**FAST), draft_lm=draft, progress=False)
