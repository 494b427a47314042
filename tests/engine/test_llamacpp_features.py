"""Feature rows on the llama.cpp engine (:attr:`LlamaCache.features`): what an eagle head drafting there reads.

The tiny GGUF holds the tiny torch Llama's weights, so llama.cpp's rows are compared with the torch engine's:
the layers under the top one are the residual stream itself, the top one is scaled to unit RMS ("unit").
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from adaptive.engine.backbone import Segment  # noqa: E402
from adaptive.engine.llamacpp import LlamaCppBackbone  # noqa: E402
from adaptive.errors import ConfigError  # noqa: E402

PROMPT = [5, 9, 14, 22, 9, 14, 22, 31, 7, 9, 14, 22, 40, 12]
LAYERS = (1, 2, 4)  # of the tiny model's 4: two layer inputs and the top one


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    path, lm = tiny_gguf
    return LlamaCppBackbone(path, threads=2, context=512, sequences=6), lm.backbone


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def reference(pt, ids: list[int]) -> torch.Tensor:
    """The torch engine's rows of ``ids`` for :data:`LAYERS`, the top one scaled to unit RMS."""
    cache = pt.new_cache(len(ids) + 1, features=LAYERS)
    pt.forward(torch.tensor(ids), cache, 0, logits="none")
    rows = cache.features[:len(ids)].float().clone()
    rows[:, -1] = unit(rows[:, -1])
    return rows


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> bool:
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def test_every_forward_writes_the_rows_the_torch_engine_computes_and_hands_out_the_same_logits(pair):
    """A prefill (asking for the last row's logits only), a one-token step and a verification
    (forward_argmax) each write their positions' rows; the logits handed out are those of a cache without
    features (to llama.cpp's rounding: a prefill keeping features computes every row's output, so its last
    layer's products take another shape, as a verification's do)."""
    cpp, pt = pair
    assert cpp.feature_top == "unit" and pt.feature_top == "residual" and cpp.keeps_features(LAYERS)
    c, plain = cpp.new_cache(40, features=LAYERS), cpp.new_cache(40)
    assert c.features.shape == (40, 3, cpp.hidden_size) and c.feature_layers == LAYERS
    first = cpp.forward(torch.tensor(PROMPT[:8]), c, 0, logits="last").logits
    assert close(first, cpp.forward(torch.tensor(PROMPT[:8]), plain, 0, logits="last").logits, 1e-5)
    assert first.shape == (1, cpp.vocab_size)
    cpp.forward(torch.tensor([PROMPT[8]]), c, 8)
    ids = cpp.forward_argmax(PROMPT[9:13], c, 9)
    cpp.forward(torch.tensor([PROMPT[8]]), plain, 8)
    assert ids == cpp.forward_argmax(PROMPT[9:13], plain, 9)
    ref = reference(pt, PROMPT[:13])
    assert close(c.features[:13], ref)
    assert torch.allclose(c.features[:13, -1].pow(2).mean(-1), torch.ones(13), atol=1e-4)  # the top at unit RMS
    assert not c.features[13:].any()


def test_a_batch_writes_each_cache_s_rows_and_leaves_the_others_alone(pair):
    cpp, pt = pair
    a, b, none = cpp.new_cache(40, features=LAYERS), cpp.new_cache(40, features=LAYERS), cpp.new_cache(40)
    out = cpp.forward_batch([Segment(torch.tensor(PROMPT[:6]), a, 0), Segment(torch.tensor(PROMPT[:9]), none, 0),
                             Segment(torch.tensor(PROMPT[2:12]), b, 0, logits=False)])
    assert out[0].shape == (6, cpp.vocab_size) and out[1].shape == (9, cpp.vocab_size) and out[2] is None
    alone = cpp.forward(torch.tensor(PROMPT[:9]), cpp.new_cache(40), 0, logits="all").logits
    assert close(out[1], alone, 1e-3)
    assert close(a.features[:6], reference(pt, PROMPT[:6]))
    assert close(b.features[:10], reference(pt, PROMPT[2:12]))


def test_a_rewind_rewrites_the_rows_from_its_position(pair):
    cpp, pt = pair
    c = cpp.new_cache(40, features=LAYERS)
    cpp.forward(torch.tensor(PROMPT[:10]), c, 0)
    cpp.forward(torch.tensor([3, 3, 3]), c, 6, logits="all")  # a rejected draft's rows, overwritten next
    cpp.forward(torch.tensor(PROMPT[6:12]), c, 6, logits="all")
    assert close(c.features[:12], reference(pt, PROMPT[:12]))


def test_a_prompt_past_the_micro_batch_is_fed_in_micro_batches(long_gguf, tiny_gguf):
    _, lm = tiny_gguf
    cpp = LlamaCppBackbone(long_gguf, threads=2, context=1500, sequences=2)
    ids = (PROMPT * 60)[:700]
    c = cpp.new_cache(720, features=LAYERS)
    last = cpp.forward(torch.tensor(ids), c, 0, logits="last").logits
    assert close(last, cpp.forward(torch.tensor(ids), cpp.new_cache(720), 0, logits="last").logits, 1e-4)
    assert c.features[:700].abs().sum(-1).gt(0).all()
    assert close(c.features[:200], reference(lm.backbone, ids[:200]))


def test_a_kept_prefix_carries_its_rows_and_one_without_them_is_not_restored(pair):
    cpp, _ = pair
    cpp.prefixes.resize(1 << 20)
    try:
        c = cpp.new_cache(40, features=LAYERS)
        cpp.forward(torch.tensor(PROMPT[:10]), c, 0)
        c.length = 10
        assert cpp.keep_prefix(c, PROMPT[:10])
        match = cpp.prefixes.lookup(PROMPT[:10] + [1])
        d = cpp.new_cache(40, features=LAYERS, shared=8)
        assert cpp.restore_prefix(match.entry, d, 8) == 8 and torch.equal(d.features[:8], c.features[:8])
        plain = cpp.new_cache(40)
        cpp.forward(torch.tensor(PROMPT[1:11]), plain, 0)
        plain.length = 10
        assert cpp.keep_prefix(plain, PROMPT[1:11])  # no rows kept with it
        match = cpp.prefixes.lookup(PROMPT[1:11] + [1])
        assert match.entry.handle.features is None
        assert cpp.restore_prefix(match.entry, cpp.new_cache(40, features=LAYERS), 9) == 0
    finally:
        cpp.prefixes.resize(0)


def test_the_layer_inputs_are_asked_for_while_a_cache_keeps_them(pair):
    """llama.cpp copies a layer's input rows while any user wants them (a cache's features, a routing
    pool) and stops when the last goes; a bad layer list is refused."""
    cpp, _ = pair
    c = cpp.new_cache(20, features=LAYERS)
    assert cpp._taps == {1: 1, 2: 1}
    out = cpp.forward(torch.tensor(PROMPT[:6]), cpp.new_cache(20), 0, logits="last", pool_layers=(1,))
    assert 1 in out.layer_pools and cpp._taps == {1: 1, 2: 1}  # the pool's use ended, the cache's stays
    del c
    import gc

    gc.collect()
    assert cpp._taps == {1: 0, 2: 0}
    with pytest.raises(ConfigError):
        cpp.new_cache(20, features=(2, 1))
    with pytest.raises(ConfigError):
        cpp.new_cache(20, features=(5,))


def test_an_eagle_head_s_sizes_and_rows_are_read_from_the_file(pair):
    """A head over llama.cpp's model has the shape one over the torch engine's has (but for its top feature)."""
    from dataclasses import replace

    from adaptive.distill.heads import HeadConfig, head_shape

    cpp, pt = pair
    ours, theirs = head_shape(cpp, HeadConfig(layers=LAYERS)), head_shape(pt, HeadConfig(layers=LAYERS))
    assert (ours.top, theirs.top) == ("unit", "residual")
    assert replace(ours, top="residual", eps=theirs.eps) == theirs and ours.eps == pytest.approx(theirs.eps)
    assert torch.allclose(cpp.final_norm_weight, pt.final_norm_weight.float())
    ids = torch.tensor([3, 7, 7, 11])
    assert torch.allclose(cpp.embed_rows(ids), pt.embed_rows(ids).float(), atol=1e-3)
    assert torch.allclose(cpp.head_rows(ids), pt.head_rows(ids).float(), atol=1e-3)


def test_a_head_beside_llama_cpp_drafts_in_bf16_where_onednn_computes_it(pair):
    from adaptive.drafters.eagle import step_settings
    from adaptive.engine.quant import packing_supported

    cpp, pt = pair
    bf16 = packing_supported(torch.bfloat16)
    assert step_settings(cpp) == ((torch.bfloat16, "packed") if bf16 else (torch.float32, "dense"))
    assert step_settings(pt) == (pt.dtype, pt.weight_mode)
