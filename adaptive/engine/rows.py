"""Rows of a GGUF file's embedding table read from the file when asked for, not held in memory.

With ``packed`` weights the torch engine multiplies by the LM head's packed copy
(:class:`~adaptive.engine.quant.Linear`); the plain ``[vocab, hidden]`` tables stayed only for what
looks up rows: the token embedding of each step's input ids (the same table as the head's where
the model ties them, as the embedded SmolLM2 does) and the rows of a reduced draft head. For a model
converted from a GGUF file those rows are in the file: :class:`FileRows` reads the rows asked for
with ``os.pread`` (no mapping, so nothing it reads joins the process's resident set; the kernel's
page cache keeps what was read) and dequantizes them with ``gguf``'s own kernels, the ones the
conversion used, then rounds them to the model's dtype, as loading the converted model did.
The tables' bytes go: 54 MiB for the embedded model in bf16, 2 x 445 MiB for Qwen2.5-Coder-1.5B
(its GGUF file holds a head of its own beside the embedding).

A step reads one row per input token (the embedded model's Q8_0 row: 612 bytes, one ``pread``);
a 1,000-token prompt ~1,000 reads. :meth:`FileRows.matches` compares every row with a table
before the table is let go (:meth:`Backbone <adaptive.engine.backbone.Backbone>`), so the rows
the engine computes with are the ones it loaded, bit for bit, or the table stays.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np
import torch

from adaptive.engine.gguf_file import TensorEntry, tensor_entry

TOKEN_TABLE = "token_embd.weight"  # GGUF's token embedding
HEAD_TABLE = "output.weight"  # GGUF's LM head, absent where the model ties it to the embedding
CHECK_ROWS = 4096  # rows compared at a time by matches() (the 1.5B's: 24 MiB of float32)


class FileRows:
    """Rows of the 2-D tensor ``entry`` of the GGUF file at ``path``, as ``dtype``: ``rows(ids)``
    (``[T]`` int64) -> ``[T, width]``, like ``F.embedding(ids, table)``; an id outside
    ``0 .. n_rows - 1`` raises ``IndexError`` as it does. Safe to share between threads (positional
    reads of one descriptor). :meth:`open` finds the tensor by name."""

    def __init__(self, path: str | Path, entry: TensorEntry, dtype: torch.dtype):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if len(entry.dims) != 2:
            raise ValueError(f"{entry.name} has {len(entry.dims)} dimensions, not 2")
        self.qtype = GGMLQuantizationType(entry.ggml_type)
        block, size = GGML_QUANT_SIZES[self.qtype]
        self.width, self.n_rows = entry.dims
        if self.width % block:
            raise ValueError(f"{entry.name}'s rows of {self.width} are not whole blocks of {block}")
        self.row_bytes = self.width // block * size
        self.path, self.entry, self.dtype = Path(path), entry, dtype
        self._fd = os.open(path, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)

    @classmethod
    def open(cls, path: str | Path, name: str, dtype: torch.dtype) -> FileRows | None:
        """The rows of tensor ``name`` (``None``: the file has none of that name)."""
        entry = tensor_entry(path, name)
        return None if entry is None else cls(path, entry, dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.n_rows):
            raise IndexError(f"a token id outside 0 .. {self.n_rows - 1}")
        unique, inverse = np.unique(flat, return_inverse=True)
        out = self._read(unique)[torch.from_numpy(inverse.reshape(-1))]
        return out.reshape(*ids.shape, self.width).to(ids.device)

    def _read(self, rows: np.ndarray) -> torch.Tensor:
        """``[len(rows), width]`` in ``dtype``: the rows at the (distinct) indices ``rows``, a read each."""
        start, n = self.entry.start, self.row_bytes
        raw = b"".join(os.pread(self._fd, n, start + int(r) * n) for r in rows)
        return self._decode(raw, len(rows), f"row {int(rows[-1]) if len(rows) else 0}")

    def block(self, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count - 1`` (cut at the table's end) in one read: ``[count, width]`` in
        ``dtype`` (keep ``count`` moderate: :meth:`table` reads :data:`CHECK_ROWS` at a time)."""
        count = max(0, min(count, self.n_rows - first))
        raw = os.pread(self._fd, count * self.row_bytes, self.entry.start + first * self.row_bytes)
        return self._decode(raw, count, f"rows {first} .. {first + count - 1}")

    def _decode(self, raw: bytes, count: int, what: str) -> torch.Tensor:
        """``count`` rows' bytes -> ``[count, width]`` in ``dtype``; an ``OSError`` naming ``what`` where the
        file ended before them."""
        from gguf.quants import dequantize

        if len(raw) != count * self.row_bytes:
            raise OSError(f"{self.path} ends inside {what} of {self.entry.name}")
        values = dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(count, self.row_bytes), self.qtype)
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(self.dtype)  # a copy: the bytes are read-only

    def table(self) -> torch.Tensor:
        """Every row: ``[n_rows, width]`` in ``dtype`` (read :data:`CHECK_ROWS` rows at a time)."""
        return torch.cat([self.block(first, CHECK_ROWS) for first in range(0, self.n_rows, CHECK_ROWS)])

    def matches(self, table: torch.Tensor) -> bool:
        """Whether every row equals ``table``'s (``[n_rows, width]``), bit for bit: what letting the table
        go needs. A type ``gguf`` cannot dequantize, or a file that changed, is ``False``."""
        if tuple(table.shape) != (self.n_rows, self.width) or table.dtype != self.dtype:
            return False
        try:
            for first in range(0, self.n_rows, CHECK_ROWS):
                rows = self.block(first, CHECK_ROWS)
                if not _same_bits(rows, table[first:first + rows.shape[0]].cpu()):
                    return False
        except (NotImplementedError, ValueError, OSError):
            return False
        return True

    def close(self) -> None:
        """Close the file; a read after it is an ``OSError``."""
        self._closer()
        self._fd = -1


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes ``-0.0`` for ``0.0``)."""
    bits = _BITS[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
