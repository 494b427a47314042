"""The draft-model drafter: sampling distributed as the target (chi-square), and greedy equality
with ``ar`` across requests from one instance. Its tokenizer check: ``tests/distill/test_distilled.py``."""

import pytest

from adaptive.drafters.model import ModelDrafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.models import load_model
from tests.conftest import tiny_lm
from tests.helpers.sampling import V, chi2_pvalue, sample_counts, target_joint

PROMPTS = ["what is 3 plus 6? answer:", "hello there friend number 9", "def f7(x): return", "zz top"]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def test_draft_model_sampling_matches_the_target():
    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    draft = tiny_lm("llama", vocab=V, n_layers=2, init=0.5, seed=8)
    counts = sample_counts(lm, ModelDrafter(draft.backbone))
    assert chi2_pvalue(counts, target_joint(lm)) > 1e-3


def test_model_drafter_greedy_equals_ar_across_requests(lm, draft_dir):
    draft = load_model(str(draft_dir), dtype="float32")
    engine = Engine(lm)
    drafter = ModelDrafter(draft.backbone)  # one instance over several requests: its cache resyncs
    cfg = GenerationConfig(max_new_tokens=20, draft_len=4, ignore_eos=True)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ref = engine.generate(ids, cfg).token_ids
        assert engine.generate(ids, cfg, drafter=drafter).token_ids == ref
