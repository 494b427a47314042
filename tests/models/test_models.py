import random

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


# -- a model shipped in pieces (the 1.5B model's 22 data packages), with fake packages ------------------

def _fake_parts(tmp_path, monkeypatch, blob: bytes, parts: int = 3):
    """Install ``parts`` fake data packages holding ``blob`` in order, and a parted model over them."""
    import hashlib
    import sys

    from adaptive import models

    root = tmp_path / "site"
    step = -(-len(blob) // parts)
    for i in range(1, parts + 1):
        pkg = root / f"fakepart{i}" / "data"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("")
        (pkg / f"part{i:02d}.bin").write_bytes(blob[(i - 1) * step: i * step])
    monkeypatch.syspath_prepend(str(root))
    for i in range(1, parts + 1):
        sys.modules.pop(f"fakepart{i}", None)
    spec = models.PartedGGUF("fakepart", "fake-part", parts, "fake.gguf", len(blob),
                             hashlib.sha256(blob).hexdigest(), "fake")
    monkeypatch.setitem(models._PARTED, "fake-model", spec)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    return root


def test_parted_model_is_joined_once_and_checked(tmp_path, monkeypatch):
    from adaptive import models

    blob = bytes(range(256)) * 41 + b"end"
    root = _fake_parts(tmp_path, monkeypatch, blob)
    path = models._assembled_gguf("fake-model")
    assert path.read_bytes() == blob and path.parent == tmp_path / "cache" / "gguf"
    (root / "fakepart2" / "data" / "part02.bin").unlink()  # joined already: the pieces are not read again
    assert models._assembled_gguf("fake-model") == path
    assert list(path.parent.iterdir()) == [path]  # no temporary file left


def test_missing_or_altered_pieces_are_clear_errors_and_leave_nothing(tmp_path, monkeypatch):
    import pytest

    from adaptive import models
    from adaptive.errors import ModelNotFoundError

    blob = b"0123456789" * 100
    root = _fake_parts(tmp_path, monkeypatch, blob)
    (root / "fakepart3" / "data" / "part03.bin").unlink()
    with pytest.raises(ModelNotFoundError, match=r"missing fake-part3: run `pip install 'adaptive\[fake\]'`"):
        models._assembled_gguf("fake-model")
    (root / "fakepart3" / "data" / "part03.bin").write_bytes(b"x" * 10)  # a truncated, altered piece
    with pytest.raises(ModelNotFoundError, match="partial or altered install"):
        models._assembled_gguf("fake-model")
    cache = tmp_path / "cache" / "gguf"
    assert not cache.exists() or not any(cache.iterdir())


def test_the_second_model_is_a_known_name():
    import pytest

    from adaptive.errors import ModelNotFoundError
    from adaptive.models import EMBEDDED_MODELS, _part_files

    assert "qwen2.5-coder-1.5b" in EMBEDDED_MODELS
    try:
        files = _part_files("qwen2.5-coder-1.5b")
    except ModelNotFoundError as exc:  # the extra is not installed (CI): the error says how
        assert "pip install 'adaptive[qwen15]'" in str(exc)
        pytest.skip("the qwen15 extra is not installed")
    assert len(files) == 22 and sum(f.stat().st_size for f in files) == 1_117_320_768


def test_the_engine_is_resolved_from_the_model_and_the_options(monkeypatch, tmp_path):
    from pathlib import Path

    from adaptive.engine import llamacpp_host
    from adaptive.models import resolve_engine

    cpu, gguf = torch.device("cpu"), Path("m.gguf")
    monkeypatch.setattr(llamacpp_host, "available", lambda: True)
    assert resolve_engine("auto", gguf, cpu, "auto", "dense") == "llama.cpp"
    assert resolve_engine("auto", None, cpu, "auto", "dense") == "torch"  # not a GGUF file
    assert resolve_engine("auto", gguf, cpu, "float32", "dense") == "torch"  # a dtype is the torch engine's
    assert resolve_engine("auto", gguf, cpu, "auto", "int4") == "torch"
    assert resolve_engine("auto", gguf, torch.device("cuda"), "auto", "dense") == "torch"
    assert resolve_engine("torch", gguf, cpu, "auto", "dense") == "torch"
    for args, match in [((None, cpu, "auto", "dense"), "runs GGUF files"),
                        ((gguf, torch.device("cuda"), "auto", "dense"), "on the CPU"),
                        ((gguf, cpu, "auto", "int8"), "--weights int8 is the torch engine's"),
                        ((gguf, cpu, "bfloat16", "dense"), "--dtype bfloat16 is the torch engine's")]:
        with pytest.raises(ConfigError, match=match):
            resolve_engine("llama.cpp", *args)
    with pytest.raises(ConfigError, match="unknown engine 'vllm'"):
        resolve_engine("vllm", gguf, cpu, "auto", "dense")
    monkeypatch.setattr(llamacpp_host, "available", lambda: False)
    assert resolve_engine("auto", gguf, cpu, "auto", "dense") == "torch"
    with pytest.raises(ConfigError, match="needs llama-cpp-python"):
        resolve_engine("llama.cpp", gguf, cpu, "auto", "dense")
    with pytest.raises(ConfigError, match="unknown engine"):
        load_model(str(tmp_path), engine="onnx")


def test_auto_calibrates_both_engines_where_llama_cpp_runs_the_model(monkeypatch, tmp_path, tiny_model_dir):
    from adaptive.engine import llamacpp_host
    from adaptive.models import auto_engines

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp_host, "available", lambda: True)
    assert auto_engines(str(gguf), "cpu") == ("llama.cpp", "torch")
    assert auto_engines(str(gguf), "cpu", dtype="float32") == ("torch",)  # a torch dtype: one engine
    assert auto_engines(str(tiny_model_dir), "cpu") == ("torch",)  # not a GGUF model
    monkeypatch.setattr(llamacpp_host, "available", lambda: False)
    assert auto_engines(str(gguf), "cpu") == ("torch",)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        auto_engines(str(tmp_path / "missing.gguf"))


def test_weights_auto_loads_packed_on_the_torch_engine_and_dense_on_llama_cpp(tiny_model_dir):
    from adaptive.engine.quant import packing_supported

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32", weights="auto")
    assert lm.weights == ("packed" if packing_supported(torch.float32) else "dense")
    assert lm.backbone.weight_mode == lm.weights
    assert load_model(str(tiny_model_dir), device="cpu", dtype="float32").weights == "dense"  # the library's default


def test_quantized_weights_take_the_cpu_when_the_device_is_auto(tiny_model_dir, monkeypatch):
    """On a machine with a GPU, ``device="auto"`` means CUDA, but int8/int4 weights run on PyTorch's CPU
    kernels: auto takes the CPU for them (found on an H100 run), and CUDA asked for explicitly is an error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lm = load_model(str(tiny_model_dir), dtype="float32", weights="int4")
    assert lm.device.type == "cpu" and lm.weights == "int4"
    with pytest.raises(ConfigError, match="cpu|CPU"):
        load_model(str(tiny_model_dir), device="cuda", dtype="float32", weights="int4")


def test_text_decoder_is_the_tokenizer_s_decode():
    """The Rust backend's decode where it is the same function (transformers' fast tokenizer, its
    decode not overridden, no space clean-up), the tokenizer's own otherwise; special tokens left
    out either way."""
    from tests.conftest import char_tokenizer, tiny_lm

    lm = tiny_lm()
    ids = lm.tokenizer.encode("a , b ?") + [2, 1]  # text a clean-up would change, and two special tokens
    calls = []

    class Counting(type(lm.tokenizer)):  # overrides decode: its own is always used
        def decode(self, *a, **kw):
            calls.append(1)
            return super().decode(*a, **kw)

    for clean in (False, True):
        lm.tokenizer.clean_up_tokenization_spaces = clean
        assert lm.text_decoder()(ids) == lm.tokenizer.decode(ids, skip_special_tokens=True)
    lm.tokenizer.clean_up_tokenization_spaces = False
    assert lm.text_decoder()(ids) == "a , b ?"
    lm.tokenizer.__class__ = Counting
    for clean in (False, True):
        lm.tokenizer.clean_up_tokenization_spaces = clean
        calls.clear()
        assert lm.text_decoder()(ids) == lm.tokenizer.decode(ids, skip_special_tokens=True)
        assert len(calls) == 2  # ours went through the override, as the reference did
    seen = []

    class Slow:  # a tokenizer with no Rust backend
        def decode(self, ids, skip_special_tokens=False):
            seen.append(skip_special_tokens)
            return char_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    lm.tokenizer = Slow()
    assert lm.text_decoder()(ids) == "a , b ?" and seen == [True]


def test_a_conversion_is_keyed_by_the_file_s_contents_not_its_path(tmp_path, monkeypatch):
    """The same GGUF file at another path (a new environment) reuses its conversion; other bytes do not."""
    from adaptive.models import _converted_dir, sampled_digest

    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    data = random.Random(0).randbytes(1 << 20)
    a, b, c = (tmp_path / d / "model.gguf" for d in ("venv1", "venv2", "other"))
    for f in (a, b, c):
        f.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data)
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1  # a byte four of the samples read
    c.write_bytes(bytes(changed))
    key = sampled_digest(a)[:12]
    assert _converted_dir(a, "m") == _converted_dir(b, "m") == tmp_path / "cache" / "models" / f"m-{key}"
    assert _converted_dir(c, "m") != _converted_dir(a, "m")


def test_a_saved_tokenizer_loads_by_its_class_without_the_model_s_configuration(tmp_path):
    """``saved_tokenizer`` gives the class ``AutoTokenizer`` resolves to, with the same ids and chat
    template, and in a fresh process imports none of what the model's configuration pulls in."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from adaptive.models import saved_tokenizer
    from tests.conftest import char_tokenizer

    char_tokenizer().save_pretrained(tmp_path)
    auto, ours = AutoTokenizer.from_pretrained(str(tmp_path)), saved_tokenizer(tmp_path)
    assert type(ours) is type(auto)
    assert ours("a cab, abc!")["input_ids"] == auto("a cab, abc!")["input_ids"]
    assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids
    code = ("import json, sys; from pathlib import Path; from adaptive.models import saved_tokenizer; "
            f"t = saved_tokenizer(Path({str(tmp_path)!r})); "
            "print(json.dumps([type(t).__name__, t('abc')['input_ids'], "
            "[m for m in ('torch._dynamo', 'torch.distributed.tensor', 'transformers.modeling_rope_utils') "
            "if m in sys.modules]]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    name, ids, heavy = json.loads(run.stdout.splitlines()[-1])
    assert (name, ids, heavy) == (type(auto).__name__, auto("abc")["input_ids"], [])

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for cls in (None, "NoSuchTokenizer"):  # none named or an unknown one: AutoTokenizer's
        if cls is None:
            config.pop("tokenizer_class", None)
        else:
            config["tokenizer_class"] = cls
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        fallback = saved_tokenizer(tmp_path)
        assert type(fallback) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
        assert fallback("abc")["input_ids"] == auto("abc")["input_ids"]


def test_models_of_one_gguf_file_share_its_tokenizer_while_in_use(tmp_path, monkeypatch):
    """Both engines' models of one GGUF file (a two-engine runtime's members) hold one tokenizer
    object; it is not kept once no model holds it."""
    import gc
    import weakref

    from tests.conftest import char_tokenizer, tiny_model, write_gguf

    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    path = str(tmp_path / "own.gguf")  # a file of its own: no other test's model holds its tokenizer
    write_gguf(tiny_model("llama", seed=11), char_tokenizer(), path)
    a = load_model(path, engine="llama.cpp")
    b = load_model(path, engine="llama.cpp")
    c = load_model(path, engine="torch", dtype="float32")
    assert a.tokenizer is b.tokenizer is c.tokenizer
    from transformers import AutoTokenizer

    read = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="own.gguf")  # the file's own
    assert a.tokenizer("a cab, abc!")["input_ids"] == read("a cab, abc!")["input_ids"]
    held = weakref.ref(a.tokenizer)
    del a, b, c
    gc.collect()
    assert held() is None
