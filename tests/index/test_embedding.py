"""The calibration embedding and the runtime's prefill embedding are the same vector."""

import numpy as np
import torch

from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import new_cache, prefill
from adaptive.index.embedding import embed_prompt
from tests.conftest import tiny_lm


def test_embed_prompt_equals_the_prefill_pooling():
    lm = tiny_lm("llama")
    ids = list(range(3, 40))
    cfg = GenerationConfig(max_new_tokens=3)
    pooled = prefill(lm.backbone, ids, new_cache(lm.backbone, len(ids), cfg), cfg, None, pool=True).pooled
    vec = embed_prompt(lm.backbone, ids)
    assert vec.shape == (lm.model.config.hidden_size,) and vec.dtype == np.float32
    np.testing.assert_array_equal(vec, pooled.numpy())
    # it depends on the prompt
    assert not np.allclose(vec, embed_prompt(lm.backbone, list(range(5, 42))))


def test_embed_prompt_is_the_mean_final_hidden_state():
    lm = tiny_lm("qwen2")
    ids = [4, 9, 12, 7, 30]
    with torch.inference_mode():
        out = lm.model(torch.tensor([ids]), output_hidden_states=True)
    expected = out.hidden_states[-1][0].mean(0).numpy()  # HF applies the final norm to the last state
    np.testing.assert_allclose(embed_prompt(lm.backbone, ids), expected, atol=1e-5)


def test_any_pooling_is_the_same_from_the_prefill_and_embed_prompt():
    from adaptive.engine.config import Pooling

    lm = tiny_lm("llama")
    ids = list(range(3, 40))
    cfg = GenerationConfig(max_new_tokens=3)
    for pooling in (Pooling(1, "last"), Pooling(2, "mean"), Pooling(None, "last"), Pooling(0, "mean")):
        pre = prefill(lm.backbone, ids, new_cache(lm.backbone, len(ids), cfg), cfg, None, pool=pooling)
        np.testing.assert_array_equal(embed_prompt(lm.backbone, ids, pooling), pre.pooled.numpy())
    # the last position after layer 1 is that layer's hidden state, through the final norm
    with torch.inference_mode():
        out = lm.model(torch.tensor([ids]), output_hidden_states=True)
        h = out.hidden_states[1][0, -1]
        normed = lm.model.model.norm(h)
    np.testing.assert_allclose(embed_prompt(lm.backbone, ids, Pooling(1, "last")), normed.numpy(), atol=1e-5)
    assert not np.allclose(embed_prompt(lm.backbone, ids, Pooling(1, "last")), embed_prompt(lm.backbone, ids))


def test_pooling_is_validated():
    import pytest

    from adaptive.engine.config import Pooling
    from adaptive.errors import ConfigError

    with pytest.raises(ConfigError, match="mode"):
        Pooling(1, "max")
    with pytest.raises(ConfigError, match="layer"):
        Pooling(-1)
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="after layer 9"):
        embed_prompt(lm.backbone, [3, 4, 5], Pooling(9, "last"))
    assert Pooling.from_dict(Pooling(3, "last").to_dict()) == Pooling(3, "last") and Pooling.from_dict({}) == Pooling()
