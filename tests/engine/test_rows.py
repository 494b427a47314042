"""Token embedding and LM-head rows read from a GGUF file (adaptive.engine.rows): the rows equal the
``gguf`` package's dequantization, a backbone that reads them lets its plain tables go only when every
row equals its table's, and then decodes exactly as one that kept them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from adaptive.costs.measure import measure_head_costs  # noqa: E402
from adaptive.distill.heads import HeadConfig, HeadData, HeadTrainer, decode_with_features, head_shape  # noqa: E402
from adaptive.drafters.head import DraftHead  # noqa: E402
from adaptive.engine.config import GenerationConfig  # noqa: E402
from adaptive.engine.engine import Engine  # noqa: E402
from adaptive.engine.gguf_file import tensor_entry  # noqa: E402
from adaptive.engine.quant import packing_supported  # noqa: E402
from adaptive.engine.rows import FileRows  # noqa: E402
from adaptive.models import LoadedModel  # noqa: E402
from tests.conftest import char_tokenizer, tiny_model  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0
needs_packing = pytest.mark.skipif(not packing_supported(torch.float32), reason="PyTorch without oneDNN")


def _write(path, tensors: dict[str, np.ndarray], quantized: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A GGUF holding ``tensors`` (``[rows, width]`` float32; those named in ``quantized`` as Q8_0);
    returns each tensor's values as the file holds them (dequantized)."""
    w = gguf.GGUFWriter(str(path), "llama")
    held = {}
    for name, t in tensors.items():
        if name in quantized:
            q = gguf.quants.quantize(t, Q8_0)
            w.add_tensor(name, q, raw_dtype=Q8_0)
            held[name] = gguf.quants.dequantize(q, Q8_0)
        else:
            w.add_tensor(name, t)
            held[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def test_rows_are_the_files_dequantized_rows_in_the_asked_order(tmp_path):
    table = np.random.default_rng(0).normal(size=(50, 64)).astype(np.float32)
    held = _write(tmp_path / "t.gguf", {"token_embd.weight": table}, quantized=("token_embd.weight",))
    entry = tensor_entry(tmp_path / "t.gguf", "token_embd.weight")
    assert entry.dims == (64, 50) and entry.ggml_type == int(Q8_0)
    assert tensor_entry(tmp_path / "t.gguf", "output.weight") is None
    rows = FileRows.open(tmp_path / "t.gguf", "token_embd.weight", torch.float32)
    assert (rows.n_rows, rows.width, rows.row_bytes) == (50, 64, 2 * 34)  # two Q8_0 blocks a row
    ids = torch.tensor([[7, 0, 7], [49, 3, 0]])  # repeated ids, any shape, as F.embedding takes them
    got = rows(ids)
    assert got.shape == (2, 3, 64) and got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(held["token_embd.weight"])[ids])
    assert not torch.equal(got[0, 0], torch.from_numpy(table[7]))  # rounded by Q8_0: the file's values, not ours
    assert torch.equal(rows.block(45, 10), torch.from_numpy(held["token_embd.weight"][45:]))  # cut at the end
    assert torch.equal(rows(torch.tensor([3])).to(torch.bfloat16),
                       FileRows.open(tmp_path / "t.gguf", "token_embd.weight", torch.bfloat16)(torch.tensor([3])))
    for bad in (50, -1):
        with pytest.raises(IndexError, match="outside 0 .. 49"):
            rows(torch.tensor([1, bad]))


def test_matches_needs_every_row_equal_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr("adaptive.engine.rows.CHECK_ROWS", 16)  # several blocks over the 50 rows
    table = np.random.default_rng(1).normal(size=(50, 32)).astype(np.float32)
    table[40, 5] = 0.0
    _write(tmp_path / "t.gguf", {"token_embd.weight": table})
    rows = FileRows.open(tmp_path / "t.gguf", "token_embd.weight", torch.float32)
    same = torch.from_numpy(table.copy())
    assert rows.matches(same)
    for change in (lambda t: t[40].__setitem__(5, -0.0),  # equal as a number, not as bits
                   lambda t: t[49].__setitem__(0, t[49, 0] + 1e-6)):
        other = same.clone()
        change(other)
        assert not rows.matches(other)
    assert not rows.matches(same[:49]) and not rows.matches(same.to(torch.bfloat16))


def _tiny_gguf(path, model, quantize: bool):
    """The tiny model's embedding (and untied head) as a GGUF file, the model's tables set to the file's
    values (quantized tables round them, as loading a converted GGUF does)."""
    modules = {"token_embd.weight": model.model.embed_tokens}
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        modules["output.weight"] = model.lm_head
    tensors = {name: m.weight.detach().numpy().copy() for name, m in modules.items()}
    held = _write(path, tensors, quantized=tuple(tensors) if quantize else ())
    with torch.no_grad():
        for name, m in modules.items():
            m.weight.copy_(torch.from_numpy(held[name]))
    return path


def _decode(model, source, weights="packed"):
    lm = LoadedModel(copy.deepcopy(model), char_tokenizer(), "tiny", str(source), torch.device("cpu"), torch.float32,
                     weights)
    out = Engine(lm).generate("hello there friend, what is 3 plus 4?", GenerationConfig(max_new_tokens=24))
    return lm.backbone, out.token_ids


@needs_packing
@pytest.mark.parametrize("tied,quantize", [(False, False), (False, True), (True, True)])
def test_a_backbone_reading_rows_from_the_file_decodes_as_one_holding_the_tables(tmp_path, tied, quantize):
    model = tiny_model("llama", vocab=None) if not tied else _tied_model()
    path = _tiny_gguf(tmp_path / "tiny.gguf", model, quantize)
    bb, ids = _decode(model, path)
    kept, ref = _decode(model, tmp_path / "none.gguf")  # no such file: the tables stay
    assert bb.rows_from_file and not kept.rows_from_file
    assert bb.embed.weight.numel() == 0 and bb.lm_head.weight.numel() == 0  # both tables let go
    assert kept.embed.weight.numel() > 0
    assert ids == ref and len(ids) >= 8
    some = torch.tensor([5, 0, 9])
    assert torch.equal(bb.head_rows(some), kept.lm_head.weight[some])
    assert torch.equal(bb.head_weight(), kept.lm_head.weight)
    head = DraftHead.build(bb, torch.tensor([4, 1]), extra=[1, 7, 7])  # a reduced draft head's rows
    assert head.ids.tolist() == [4, 1, 7] and torch.equal(head.weight, kept.lm_head.weight[head.ids])
    costs = measure_head_costs(bb, None, (8, bb.vocab_size), context=8, repeats=1)  # builds heads of the first rows
    assert set(costs) == {8, bb.vocab_size}
    with bb.module_weights():  # the Hugging Face model runs by itself within: its tables are back
        assert torch.equal(bb.model.model.embed_tokens.weight, kept.embed.weight)
        assert torch.equal(bb.model.lm_head.weight, kept.lm_head.weight)
    assert bb.embed.weight.numel() == 0 and bb.lm_head.weight.numel() == 0
    with pytest.raises(RuntimeError, match="read from the GGUF file"):
        bb.embed_weight  # noqa: B018 - the CUDA step's table: never asked for on the CPU
    # an eagle head trains over such a backbone too (a server refining its head on the traffic): the
    # target's embeddings of its tokens are the file's rows, the table's values
    cfg = HeadConfig(layers=(1, bb.n_layers), steps=2, batch=1, window=8, warmup=1)
    run = HeadTrainer(bb, head_shape(bb, cfg), torch.arange(16), cfg)
    some = torch.tensor([[5, 0], [9, -1]])
    assert torch.equal(run._emb(some), kept.embed.weight[some.clamp(min=0)].float())
    decoded = decode_with_features(bb, [ids[:6]], 6, set(), cfg.layers)
    assert 0 < run.train_step(HeadData.build(decoded, [6], ["d"], cfg.lookup)) < float("inf")


@needs_packing
@pytest.mark.parametrize("table", ["embed_tokens", "lm_head"])
def test_a_table_unlike_the_files_rows_is_kept(tmp_path, table):
    model = tiny_model("llama")
    path = _tiny_gguf(tmp_path / "tiny.gguf", model, quantize=False)
    with torch.no_grad():  # the loaded model is not the file's, in one of its two tables
        (model.model.embed_tokens if table == "embed_tokens" else model.lm_head).weight[7, 3] += 0.5
    bb, ids = _decode(model, path)
    assert not bb.rows_from_file and bb.embed.weight.numel() > 0 and bb.lm_head.weight.numel() > 0
    _, dense = _decode(model, path, weights="dense")  # dense weights: the tables are multiplied by, always kept
    assert ids == dense


@needs_packing
def test_a_source_the_reader_cannot_take_keeps_the_tables(tmp_path):
    model = tiny_model("llama")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    bb, _ = _decode(model, bad)
    assert not bb.rows_from_file and bb.embed.weight.numel() > 0


def test_what_rows_cannot_be_read_from_is_a_clear_error(tmp_path):
    _write(tmp_path / "t.gguf", {"norm.weight": np.ones(32, dtype=np.float32),
                                 "token_embd.weight": np.ones((3, 32), dtype=np.float32)})
    with pytest.raises(ValueError, match="1 dimensions, not 2"):
        FileRows.open(tmp_path / "t.gguf", "norm.weight", torch.float32)
    rows = FileRows.open(tmp_path / "t.gguf", "token_embd.weight", torch.float32)
    assert torch.equal(rows.table(), torch.ones(3, 32))
    rows.close()
    with pytest.raises(OSError):
        rows(torch.tensor([0]))


def _tied_model():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model
