import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptive.engine.backbone import Backbone
from adaptive.engine.skip import SkipSet, format_layer_list, parse_layer_list
from adaptive.errors import SkipSetError
from tests.conftest import tiny_model
from tests.helpers.hf_skip import skipping


def test_parse_layer_list_examples():
    assert parse_layer_list("3,5,10-12") == (3, 5, 10, 11, 12)
    assert parse_layer_list("4-6,1,5") == (1, 4, 5, 6)  # sorted, deduplicated
    assert parse_layer_list("") == ()
    assert parse_layer_list("none") == ()


@pytest.mark.parametrize("bad", ["3,,4", "a", "5-2", "-1", "1-x", "2.5"])
def test_parse_layer_list_rejects(bad):
    with pytest.raises(SkipSetError):
        parse_layer_list(bad)


@given(st.sets(st.integers(0, 63)))
def test_layer_list_round_trip(layers):
    assert parse_layer_list(format_layer_list(layers)) == tuple(sorted(layers))


@given(st.sets(st.integers(0, 29)), st.sets(st.integers(0, 29)))
def test_skipset_text_and_dict_round_trip(attn, mlp):
    s = SkipSet(tuple(attn), tuple(mlp))
    assert SkipSet.from_text(s.to_text()) == s
    assert SkipSet.from_dict(s.to_dict()) == s


def test_skipset_validation():
    assert SkipSet(attn=(0, 29), n_layers=30).size == 2
    with pytest.raises(SkipSetError, match="30 layers"):
        SkipSet(attn=(30,), n_layers=30)
    with pytest.raises(SkipSetError, match="mlp"):
        SkipSet(mlp=(4,)).validate_for(4)
    with pytest.raises(SkipSetError):
        SkipSet(attn=(-1,))
    with pytest.raises(SkipSetError):
        SkipSet.from_text("attn=1;attn=2")
    with pytest.raises(SkipSetError):
        SkipSet.from_text("ffn=1")
    with pytest.raises(SkipSetError):
        SkipSet.from_dict({"attn": [1], "extra": []})


def test_masks():
    assert SkipSet(attn=(1,), mlp=(0, 2)).masks(3) == ((False, True, False), (True, False, True))


def test_skipping_context_manager_matches_backbone_and_restores():
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    skip = SkipSet(attn=(0, 2), mlp=(1,))
    modules_before = [(layer.self_attn, layer.mlp) for layer in model.model.layers]
    with torch.no_grad():
        full = model(ids).logits[0]
        with skipping(model, skip):
            skipped = model(ids).logits[0]
        after = model(ids).logits[0]
    bb = Backbone(model)
    ours = bb.forward(ids, bb.new_cache(16), 0, skip_masks=skip.masks(4), logits="all").logits
    assert torch.equal(after, full)
    assert not torch.allclose(skipped, full)  # skipping changed the output ...
    assert torch.allclose(ours, skipped, atol=1e-5)  # ... exactly as our backbone's skip does
    assert [(layer.self_attn, layer.mlp) for layer in model.model.layers] == modules_before


def test_skipping_restores_after_exception():
    model = tiny_model("qwen2")
    before = [(layer.self_attn, layer.mlp) for layer in model.model.layers]
    with pytest.raises(RuntimeError, match="boom"):
        with skipping(model, SkipSet(attn=(0, 1, 2, 3), mlp=(3,))):
            assert model.model.layers[0].self_attn is not before[0][0]
            raise RuntimeError("boom")
    assert [(layer.self_attn, layer.mlp) for layer in model.model.layers] == before


def test_skipping_validates_before_touching_the_model():
    model = tiny_model("llama")
    before = [layer.self_attn for layer in model.model.layers]
    with pytest.raises(SkipSetError):
        with skipping(model, SkipSet(attn=(1, 9))):
            pass
    assert [layer.self_attn for layer in model.model.layers] == before
