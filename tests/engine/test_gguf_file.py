"""Reading a tensor and values straight from a GGUF file (adaptive.engine.gguf_file), checked against
the ``gguf`` package's own reader on files it writes."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from adaptive.engine.gguf_file import GGUFFormatError, read_gguf  # noqa: E402


def _write(path, alignment: int | None = None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.block_count", 3)
    w.add_string("general.name", "tiny")
    w.add_token_list([f"tok{i}" for i in range(300)])  # an array of strings, skipped by length
    w.add_array("some.ints", [1, 2, 3])
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("output_norm.weight", np.array([0.5, 1.5, -2.0, 4.0], dtype=np.float32))
    w.add_tensor("half.weight", np.array([1.0, 2.5], dtype=np.float16))
    w.add_tensor("quant.weight", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_values_and_float_tensors_match_the_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    values, norm = read_gguf(path, ("llama.attention.layer_norm_rms_epsilon", "llama.block_count", "general.name",
                                    "missing.key", "some.ints"), "output_norm.weight")
    reader = gguf.GGUFReader(str(path))
    eps = reader.fields["llama.attention.layer_norm_rms_epsilon"]
    assert values == {"llama.attention.layer_norm_rms_epsilon": float(eps.parts[eps.data[0]][0]),
                      "llama.block_count": 3, "general.name": "tiny"}  # an array is not a value
    assert norm.dtype == np.float32 and norm.tolist() == [0.5, 1.5, -2.0, 4.0]
    assert read_gguf(path, (), "half.weight")[1].tolist() == [1.0, 2.5]
    assert read_gguf(path, (), "token_embd.weight")[1].tolist() == list(range(12))
    assert read_gguf(path, (), "quant.weight")[1] is None  # quantized: not read
    assert read_gguf(path, (), "no.such.tensor") == ({}, None)


def test_what_is_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf(bad)
    good = _write(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:200])  # inside the token list
    with pytest.raises(GGUFFormatError, match="cut.gguf: a damaged GGUF file"):
        read_gguf(cut, (), "output_norm.weight")
    huge = bytearray(good)
    huge[24:32] = (1 << 40).to_bytes(8, "little")  # the first key's length, far past the end
    cut.write_bytes(bytes(huge))
    with pytest.raises(GGUFFormatError, match="runs past its end"):
        read_gguf(cut)
    big_endian = bytearray(good)
    big_endian[4:8] = (3).to_bytes(4, "big")
    cut.write_bytes(bytes(big_endian))
    with pytest.raises(GGUFFormatError, match="version 50331648 is not supported"):
        read_gguf(cut)
