"""A tensor and a few values of a GGUF file, read directly: what the llama.cpp engine needs that
llama.cpp's API does not give (the final norm's weights and epsilon, for pooling layer inputs
through it), and where a tensor's data lies (:func:`tensor_entry`: the torch engine reads its token
embedding rows from the file, :mod:`adaptive.engine.rows`).

``gguf``'s ``GGUFReader`` parses every field into NumPy views first: 3.4 s for the embedded model's
49,152-token vocabulary on the 2-core EPYC, paid by the first routed request. Here the header's
key-value pairs are skipped by their lengths (one pass, no objects built) and only the tensor
table is read: 0.02 s (0.08 s for Qwen2.5-Coder-1.5B's 151,936 tokens and merges).

The layout (GGUF v2/v3, little-endian): ``GGUF``, version ``u32``, tensor count ``u64``, key-value
count ``u64``; each pair a string key, a ``u32`` value type and the value (a string is a ``u64``
length and its bytes; an array an element type ``u32``, a count ``u64`` and the elements); each
tensor's name, ``u32`` dimension count, ``u64`` dimensions, ``u32`` type and ``u64`` offset into the
data section, which starts at the next multiple of ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# value type -> its struct format (fixed-size types); 8: string, 9: array
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZES = {t: struct.calcsize(f) for t, f in _FORMATS.items()}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {0: np.float32, 1: np.float16}  # ggml types F32 and F16


Values = dict[str, int | float | bool | str]  # a GGUF key -> its value (scalars and strings)


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's data is in its GGUF file: ``ggml_type`` (the ``GGMLQuantizationType`` value),
    ``dims`` in GGUF's order (the innermost, contiguous one first: an embedding table's is
    ``(hidden, vocab)``) and ``start``, the byte its data starts at from the beginning of the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    start: int


def read_gguf(path: str | Path, keys: tuple[str, ...] = (), tensor: str | None = None
              ) -> tuple[Values, np.ndarray | None]:
    """The values of ``keys`` (those the file has and that are not arrays) and tensor ``tensor`` as
    float32 (flat; ``None`` when the file has no tensor of that name or holds it quantized: only F32
    and F16 are read) of the GGUF file at ``path``; :class:`GGUFFormatError` for what is not one.

    Example: ``read_gguf(gguf, ("llama.attention.layer_norm_rms_epsilon",), "output_norm.weight")``
    -> ``({"llama.attention.layer_norm_rms_epsilon": 1e-05}, array([...], dtype=float32))``."""
    return _open(path, lambda buf: _read(buf, keys, tensor))


def tensor_entry(path: str | Path, name: str) -> TensorEntry | None:
    """Tensor ``name``'s :class:`TensorEntry` in the GGUF file at ``path`` (``None``: the file has no
    tensor of that name; :class:`GGUFFormatError` for what is not a GGUF file). Its data is not read.

    Example: ``tensor_entry(gguf, "token_embd.weight")`` -> ``TensorEntry(name="token_embd.weight",
    ggml_type=8, dims=(576, 49152), start=...)`` for the embedded model (type 8: Q8_0)."""
    return _open(path, lambda buf: _entry(buf, (), name)[1])


def _open(path: str | Path, read):
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read(buf)
    except GGUFFormatError as exc:
        raise GGUFFormatError(f"{path}: {exc}") from None
    except (struct.error, ValueError, OverflowError, IndexError) as exc:  # a length or offset past the end
        raise GGUFFormatError(f"{path}: a damaged GGUF file ({exc})") from None


def _read(buf, keys: tuple[str, ...], tensor: str | None) -> tuple[Values, np.ndarray | None]:
    values, found = _entry(buf, keys, tensor)
    if found is None or found.ggml_type not in _FLOAT_TYPES:
        return values, None
    dtype = np.dtype(_FLOAT_TYPES[found.ggml_type]).newbyteorder("<")
    data = np.frombuffer(buf, dtype=dtype, count=int(np.prod(found.dims)), offset=found.start).astype(np.float32)
    return values, data


def _entry(buf, keys: tuple[str, ...], tensor: str | None) -> tuple[Values, TensorEntry | None]:
    """The values of ``keys`` and tensor ``tensor``'s entry (``None``: no such tensor) of a mapped file."""
    if buf[:4] != MAGIC:
        raise GGUFFormatError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):  # a big-endian file reads as a huge version here
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3, little-endian, are)")
    pos, values, wanted = 24, {}, set(keys) | {"general.alignment"}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        name = key.decode("utf-8", "replace")
        if name in wanted and vtype in _FORMATS:
            (values[name],) = struct.unpack_from(_FORMATS[vtype], buf, pos)
        elif name in wanted and vtype == _STRING:
            values[name] = _string(buf, pos)[0].decode("utf-8", "replace")
        pos = _skip_value(buf, pos, vtype)
    alignment = int(values.get("general.alignment", 32))
    if alignment < 1:
        raise GGUFFormatError(f"a damaged GGUF file (general.alignment {alignment})")
    if "general.alignment" not in keys:
        values.pop("general.alignment", None)
    found = None
    for _ in range(n_tensors):
        tname, pos = _string(buf, pos)
        (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if tensor is not None and tname == tensor.encode():
            found = (ttype, tuple(int(d) for d in dims), offset)
    if found is None:
        return values, None
    ttype, dims, offset = found
    return values, TensorEntry(tensor, ttype, dims, pos + (-pos) % alignment + offset)


def _string(buf, pos: int) -> tuple[bytes, int]:
    end = _skip_string(buf, pos)
    return bytes(buf[pos + 8:end]), end


def _skip_string(buf, pos: int) -> int:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if n > len(buf) - pos - 8:
        raise GGUFFormatError(f"a damaged GGUF file (a string of {n} bytes at byte {pos} runs past its end)")
    return pos + 8 + n


def _skip_value(buf, pos: int, vtype: int) -> int:
    if vtype in _SIZES:
        return pos + _SIZES[vtype]
    if vtype == _STRING:
        return _skip_string(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SIZES:
            return pos + _SIZES[etype] * count
        for _ in range(count):
            pos = _skip_value(buf, pos, etype)
        return pos
    raise GGUFFormatError(f"a damaged GGUF file (value type {vtype} at byte {pos})")
