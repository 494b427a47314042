import pytest
import torch

from adaptive.errors import ConfigError, ModelNotFoundError
from adaptive.models import load_model, resolve_dtype


def test_load_local_directory(tiny_model_dir):
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    assert lm.n_layers == 4 and lm.dtype == torch.float32
    assert lm.backbone.n_layers == 4


def test_fingerprint_is_dtype_independent_and_model_specific(tiny_model_dir, tmp_path):
    a = load_model(str(tiny_model_dir), device="cpu", dtype="float32").fingerprint()
    b = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16").fingerprint()
    assert a == b
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp_path / "other"
    tiny_model("llama", seed=99).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    c = load_model(str(other), device="cpu", dtype="float32").fingerprint()
    assert c.config_hash == a.config_hash and c.weights_hash != a.weights_hash
    assert not c.same_model(a) and a.same_model(b)


def test_missing_model_names_what_was_tried(tmp_path):
    with pytest.raises(ModelNotFoundError, match="tried: local directory"):
        load_model(str(tmp_path / "missing-model"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "x.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"))


def test_dtype_resolution():
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    with pytest.raises(ConfigError):
        resolve_dtype("int8")


def test_spec_loads_the_model_again(tiny_model_dir):
    from tests.conftest import tiny_lm

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    assert lm.spec == str(tiny_model_dir.resolve())
    assert load_model(lm.spec, device="cpu", dtype="float32").fingerprint() == lm.fingerprint()
    assert tiny_lm().spec is None  # built in memory: nothing to load it from
