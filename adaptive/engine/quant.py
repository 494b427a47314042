"""How the target's linear layers are stored and multiplied: ``dense``, ``packed``, ``int8`` or ``int4``.

The engine's step multiplies through :class:`Linear`, whatever the storage:

* ``dense``: the model's own weights in its dtype (``F.linear``);
* ``packed``: the same values in the model's dtype, reordered once at load into oneDNN's blocked
  layout and multiplied by its CPU kernel (``mkldnn._linear_pointwise``), with the same results
  as ``F.linear`` where we compared them (see :func:`packing_supported` for where it runs), and
  products of few rows padded to oneDNN's fastest block (:func:`packed_rows`). On a 2-core
  AVX512-BF16 host a bf16 step of the 1.5B model took 113 ms against 221 ms dense: the layout
  streams the weights faster at decoding sizes. The decoder layers' weights live only in that layout (the
  Hugging Face modules' own tensors are released, so memory stays one copy and the module can no
  longer run by itself); the LM head is packed as a second copy, as the embedding lookup (tied
  heads) and the reduced-vocabulary heads read the plain one;
* ``int8``: one int8 per weight, a scale per output row (symmetric), multiplied by PyTorch's own
  CPU kernel ``aten._weight_int8pack_mm`` on bf16 activations;
* ``int4``: 4 bits per weight in groups of :data:`INT4_GROUP` along the input dimension, each group
  with its own scale and offset (asymmetric, ``w = (q - 8) * scale + zero``), multiplied by
  ``aten._weight_int4pack_mm_for_cpu``. Groups of 32 are the embedded GGUF's own Q4_1 blocks (a
  scale and a minimum per 32 weights), so int4 comes close to the file's original numbers.

Decoding is bound by reading the weights on a small CPU (one step streams every weight once), so
fewer bytes per weight are fewer milliseconds per step. Quantizing rounds the model's own weights
in place to the values the packed copy holds (so Hugging Face's ``generate`` on the same model and
our engine share one set of weights), and long inputs (:data:`DENSE_ROWS` tokens or more: prompt
prefills, never a verification) multiply by those rounded dense weights, where the dense product
is faster than the packed kernels. Lossless still holds, against plain decoding *with the same
weights*: ``ar``, every draft and every verification multiply through the same :class:`Linear`
objects. How far each mode's output is from the dense model's is measured, not assumed
(docs/history/2026-11-23-fast-engine-and-weight-modes.md).

Worked example (int8, one row): ``w = [0.5, -1.0, 0.25]`` -> scale ``1.0 / 127``, ``q = [64, -127, 32]``,
dequantized ``[0.504, -1.0, 0.252]``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from adaptive.errors import ConfigError

WEIGHT_MODES = ("dense", "packed", "int8", "int4")
FLOAT_MODES = ("dense", "packed")  # the model's own values in its own dtype (no rounding)
INT4_GROUP = 32  # the GGUF Q4_1 block; every hidden size we support is a multiple of it
_ACT = torch.bfloat16  # activations of the quantized kernels (their CPU implementations take bf16)
# Inputs of this many tokens or more multiply by the dense (rounded) weights: beyond the longest
# verification (1 + the largest draft_len, 64), so every decode step and verification uses the kernel.
DENSE_ROWS = 72


def check_weights(mode: str, device: torch.device) -> str:
    """Validate a weight mode for a device; returns it. Every mode but ``dense`` runs on PyTorch's CPU kernels."""
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"unknown weights {mode!r}; choose {', '.join(WEIGHT_MODES)}")
    if mode != "dense" and device.type != "cpu":
        raise ConfigError(f"weights {mode} use PyTorch's CPU kernels; on {device.type} use dense weights")
    return mode


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether ``packed`` weights run here in ``dtype``: PyTorch built with oneDNN (mkldnn), and for
    bf16 a CPU that oneDNN computes bf16 on (AVX512-BF16 or AMX; an AVX2-only host has not)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_packing(dtype: torch.dtype) -> None:
    """A clear :class:`ConfigError` where ``packed`` weights cannot run in ``dtype`` (:func:`packing_supported`)."""
    if not packing_supported(dtype):
        raise ConfigError(f"packed weights need PyTorch's oneDNN kernels for {str(dtype).replace('torch.', '')} on "
                          "this CPU, which it lacks: use --weights dense")


# Entries each of oneDNN's primitive cache and of ideep's (PyTorch's oneDNN wrapper) may hold: a packed product
# is made once per weight shape and row count and kept, ~0.65 MB each on the 2-core AVX512-BF16 host,
# up to 1,024 of each by default. A server meets a new row count with every prompt length and batch.
PRODUCT_CACHE_ENTRIES = 128
PRODUCT_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_product_caches() -> None:
    """Bound the caches of packed products to :data:`PRODUCT_CACHE_ENTRIES` entries each, where the
    environment does not set them (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

    Why: with the defaults (1,024 each) a two-engine server of the embedded model grew from 913 to
    1,140-1,182 MiB over 192 held-out requests and kept growing; bounded, it stayed at 998-999 MiB,
    at the same throughput within the host's noise (docs/history/2026-11-26-two-engines.md, "Fifth
    session"). A product made again costs ~1 ms (a layer's four shapes ~4 ms, a 300-token prefill
    ~170 ms). Both libraries read the variables once, when they first make a product: called before
    the first packing; a process that ran oneDNN products before keeps the capacities it had."""
    for var in PRODUCT_CACHE_VARIABLES:
        os.environ.setdefault(var, str(PRODUCT_CACHE_ENTRIES))


PACKED_ROW_CANDIDATES = (4, 6, 8)  # row counts a packed product of fewer rows may be padded to (probed)


@functools.cache
def packed_rows(dtype: torch.dtype) -> int:
    """How many rows a ``packed`` product of fewer rows is padded to (zero rows, cut off after): the
    candidate whose product with a weight larger than a cache was fastest here, if it beats one row
    by 5%; else 1 (no padding). Probed once per process and dtype (~0.3 s).

    Why: oneDNN computes a block of rows at once, and its kernels for 1-3 rows stream the weights
    slower than its block's. On the 2-core AVX512-BF16 reference host a bf16 step of the 1.5B model
    took 133 ms with one row and 115 ms with 6, so plain decoding padded to 6 rows runs ~1.2x faster
    and a verification of up to 6 tokens costs ~1.09 plain steps; fp32 there: 1 (no padding). Rows
    are computed independently: what fills the padding changes no real row, and every product of a
    process pads alike, so plain decoding and verification share the kernel."""
    bound_product_caches()
    # 126 MB in bf16: larger than a cache, as a model's weights are (a cached weight streams faster)
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.full((40960, 1536), 0.01, dtype=dtype), 1)
    times: dict[int, list[float]] = {m: [] for m in (1, *PACKED_ROW_CANDIDATES)}
    inputs = {m: torch.full((m, 1536), 0.5, dtype=dtype) for m in times}
    with torch.inference_mode():
        for _ in range(11):  # interleaved rounds, medians: robust to a noisy neighbour
            for m, x in inputs.items():
                t = time.perf_counter()
                torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
                times[m].append(time.perf_counter() - t)
    median = {m: statistics.median(ts) for m, ts in times.items()}
    best = min(PACKED_ROW_CANDIDATES, key=median.__getitem__)
    return best if median[best] < 0.95 * median[1] else 1


def resolve_weights(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``packed`` on a CPU where :func:`packing_supported` (the fastest float storage
    there), else ``dense``; any other mode is checked (:func:`check_weights`) and returned."""
    if mode == "auto":
        return "packed" if device.type == "cpu" and packing_supported(dtype) else "dense"
    mode = check_weights(mode, device)
    if mode == "packed":
        check_packing(dtype)
    return mode


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight`` ``[N, K]`` -> (``q`` int8 ``[N, K]``, ``scales`` bf16 ``[N]``)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(_ACT)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group`` input columns.

    ``weight`` ``[N, K]`` (``K % group == 0``) -> (``q`` int32 ``[N, K]`` in 0..15, ``scales_zeros``
    bf16 ``[K // group, N, 2]``) with ``w ~= (q - 8) * scale + zero`` as the CPU kernel computes.
    """
    N, K = weight.shape
    if K % group:
        raise ConfigError(f"int4 groups of {group} need an input size divisible by {group}, got {K}")
    w = weight.detach().float().reshape(N, K // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
    zero = lo + 8 * scale  # so that (q - 8) * scale + zero == q * scale + lo
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(_ACT)  # [G, N, 2]
    return q, scales_zeros


def dequantize_int4(q: torch.Tensor, scales_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Inverse of :func:`quantize_int4` (float32 ``[N, K]``): what the kernel multiplies by."""
    N, K = q.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, G, 2]
    w = (q.reshape(N, K // group, group).float() - 8) * sz[..., :1] + sz[..., 1:]
    return w.reshape(N, K)


class Linear:
    """``y = x @ W.T + b`` with ``W`` dense or weight-only quantized; ``x``: ``[T, K]`` -> ``[T, N]``
    in ``x``'s dtype. Built once at load by :meth:`build`; the dense case is ``F.linear`` itself."""

    __slots__ = ("mode", "weight", "bias", "scales", "group", "shape", "dense", "rows")

    def __init__(self, mode: str, weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor | None = None,
                 group: int = 0, shape: tuple[int, int] = (0, 0), dense: torch.Tensor | None = None):
        self.mode, self.weight, self.bias, self.scales, self.group = mode, weight, bias, scales, group
        self.shape = shape or tuple(weight.shape)
        # [N, K] in the model's dtype (packed: None, see plain())
        self.dense = weight if dense is None and mode != "packed" else dense
        self.rows = packed_rows(weight.dtype) if mode == "packed" else 1  # products of fewer rows are padded

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, mode: str = "dense") -> Linear:
        """The engine's linear layer over ``weight`` (``[N, K]``). For ``int8``/``int4``, ``weight``
        itself is overwritten with its rounded values (dequantized packed weights)."""
        shape = tuple(weight.shape)
        if mode == "dense":
            return cls("dense", weight, bias, shape=shape)
        with torch.no_grad():
            if mode == "packed":
                check_packing(weight.dtype)
                bound_product_caches()
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
                return cls("packed", packed, bias, shape=shape)
            if mode == "int8":
                q, scales = quantize_int8(weight)
                weight.copy_(q.float() * scales.float()[:, None])
                return cls("int8", q, bias, scales, shape=shape, dense=weight)
            if mode == "int4":
                pad = -shape[0] % 16  # the kernel packs rows in blocks of 16: pad with zero rows, cut them after
                q, sz = quantize_int4(F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight)
                weight.copy_(dequantize_int4(q, sz)[:shape[0]])
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                return cls("int4", packed, bias, sz, INT4_GROUP, shape=shape, dense=weight)
        raise ConfigError(f"unknown weights {mode!r}; choose {', '.join(WEIGHT_MODES)}")

    def plain(self) -> torch.Tensor:
        """``[N, K]``: the weight this layer multiplies by, in the model's dtype and the ordinary
        layout (packed: unpacked into a new tensor, exactly; the quantized modes: the rounded values)."""
        if self.mode == "packed":
            return self.weight.to_dense()
        return self.dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "packed":
            m = x.shape[0]
            if m < self.rows:
                x = torch.cat([x, x.new_zeros(self.rows - m, x.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return y[:m] if m < self.rows else y
        if self.mode == "dense" or x.shape[0] >= DENSE_ROWS:
            return F.linear(x, self.dense, self.bias)
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x.to(_ACT), self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(_ACT), self.weight, self.group, self.scales)
            if y.shape[-1] != self.shape[0]:
                y = y[..., :self.shape[0]]
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes a step reads for this layer's weight (and scales)."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())
