"""The per-row formulas the eager step (:mod:`adaptive.engine.backbone`), the static CUDA steps
(:mod:`adaptive.engine.graphs`, :mod:`adaptive.engine.batched`) and the llama.cpp engine's pools
share, and the static steps' pieces between their matrix products: one place for each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

RECOMPILE_LIMIT = 64  # compiled variants of one piece per process (StepOps.compiled)
Masks = tuple[tuple[bool, ...], tuple[bool, ...]]  # (attention skipped, MLP skipped) per layer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it, over the last dimension: in float32, scaled by ``weight``
    in the input's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (``[..., head_dim]``) with a position's ``cos`` and *signed* ``sin``
    (the first half negated, :meth:`Backbone._rope`'s table): Llama's rotate-half as one expression.
    Example, head_dim 2, angle 90 degrees (cos ``[0, 0]``, signed sin ``[-1, 1]``): ``[1, 0]`` -> ``[0, 1]``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def gated(gate_up: torch.Tensor, act) -> torch.Tensor:
    """A gated MLP's hidden rows: ``act(gate) * up`` of ``[T, 2 I]`` (gate and up side by side)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual stream after a sublayer and its RMSNorm for the next one: ``(h + delta, norm(h + delta))``.
    One fused kernel when compiled."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`add_norm` with nothing to add (the first sublayer that runs)."""
    return rms_norm(h, weight, eps)


def split_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, qk_eps: float,
                heads: int, kv_heads: int, dtype: torch.dtype, scaling: float):
    """Queries, keys and values of one projection ``qkv`` (``[Tb, (H + 2 KV) * D]``): Qwen3's per-head norms
    (if any), rotary embedding (``cos``/``sin`` ``[Tb, 1, D]``, :meth:`Backbone.rope_table`'s signed
    layout), queries scaled by ``scaling`` and laid out for grouped attention, ``[KV, G * Tb, D]``; keys
    and values ``[KV, Tb, D]``, all in ``dtype`` (the cache's)."""
    Tb = qkv.shape[0]
    H, KV = heads, kv_heads
    x = qkv.view(Tb, H + 2 * KV, -1)
    D = x.shape[-1]
    q, k, v = x[:, :H], x[:, H:H + KV], x[:, H + KV:]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, qk_eps), rms_norm(k, k_norm, qk_eps)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q, k = rotate(q, cos, sin) * scaling, rotate(k, cos, sin)
    q = q.reshape(Tb, KV, H // KV, D).permute(1, 2, 0, 3).reshape(KV, (H // KV) * Tb, D)
    return q, k.transpose(0, 1), v.transpose(0, 1)


def split_heads_into(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, qk_eps: float,
                     heads: int, kv_heads: int, dtype: torch.dtype, scaling: float, k: torch.Tensor, v: torch.Tensor,
                     pos: torch.Tensor) -> torch.Tensor:
    """:func:`split_heads` that also writes the keys and values into one layer's cache (``k``/``v``
    ``[KV, C, D]``) at ``pos`` (``[Tb]``), returning the queries: one compiled piece instead of the
    split and two cache writes."""
    q, kn, vn = split_heads(qkv, cos, sin, q_norm, k_norm, qk_eps, heads, kv_heads, dtype, scaling)
    k.index_copy_(1, pos, kn)
    v.index_copy_(1, pos, vn)
    return q


def masked_softmax(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Attention weights from ``scores`` (``[KV, G * Tb, C]``), ``banned`` (``[Tb, C]``, True: may not look)."""
    KV, GT, C = scores.shape
    Tb = banned.shape[0]
    return torch.softmax(scores.view(KV, GT // Tb, Tb, C).masked_fill(banned, float("-inf")), dim=-1).view(KV, GT, C)


def merge_heads(out: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``[KV, G * Tb, D]`` attention outputs as ``[Tb, H * D]`` rows in ``dtype`` (the o projection's input)."""
    KV, GT, D = out.shape
    return out.view(KV, GT // tokens, tokens, D).permute(2, 0, 1, 3).reshape(tokens, -1).to(dtype)


def normed(ops, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A static step's residual ``h`` with the pending sublayer output ``delta`` added (``None``: none pending)
    and its norm, ``(h, x)``, by ``ops``' pieces (:class:`StepOps`: one fused add-and-norm where one is pending)."""
    return (h, ops.norm(h, weight, eps)) if delta is None else ops.add_norm(h, delta, weight, eps)


def write_features(rows: torch.Tensor, at: dict[int, int], n: int, index: torch.Tensor, h: torch.Tensor,
                   delta: torch.Tensor | None = None) -> None:
    """A static step's feature rows (an eagle head's): where layer count ``n`` is kept (``at``: layer count ->
    its row of ``rows``, ``[P, len(at), hidden]``), the residual stream after ``n`` layers (``h``, plus the
    pending sublayer output ``delta``, as the eager forward's ``h`` is) written at the rows ``index`` (``[T]``)."""
    if n in at:
        rows[:, at[n]].index_copy_(0, index, (h if delta is None else h + delta).to(rows.dtype))


@dataclass(frozen=True)
class StepOps:
    """The static step's pieces between its matrix products, as functions: plain PyTorch
    (:meth:`plain`), or each compiled by Inductor into one or two fused kernels (:meth:`compiled`; the
    CUDA default), which replaces about forty small kernels a layer by about fifteen. The products stay
    cuBLAS's; compiled pieces are shared by every bucket, skip set and slot (automatic dynamic shapes).
    The split writes the keys and values into the cache itself (:func:`split_heads_into`), so Inductor
    compiles the writes with the rotary embedding that computes them. Measured on an H100 (2026-11-27,
    the embedded model's shape): the captured step took 1.153 ms, against 1.219 ms with the writes as
    two ``index_copy_`` after a compiled split; attention as one ``scaled_dot_product_attention`` kernel
    over the slot (with an additive causal bias) was slower, 1.846 ms, and was removed. Compiled with
    grad recorded, the split is a training graph that mutates a grad-requiring cache (~0.3 ms a token
    slower on an H100): the backbone's weights require no grad, and its steps run in inference mode."""

    add_norm: Callable
    norm: Callable
    split_heads_into: Callable
    masked_softmax: Callable
    merge_heads: Callable
    gated: Callable

    @classmethod
    def plain(cls) -> StepOps:
        return cls(add_norm, norm, split_heads_into, masked_softmax, merge_heads, gated)

    @classmethod
    def compiled(cls) -> StepOps:
        """Each piece compiled (automatic dynamic shapes: a second row count or model size recompiles it
        once, with symbolic sizes). Dynamo's recompile limit is raised to :data:`RECOMPILE_LIMIT`: one
        piece sees one-row and many-row steps, of each model in the process (its default, 8, was hit
        by three models' steps in one process, and the step fell back to plain kernels)."""
        import torch._dynamo

        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # before torch 2.6
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        return cls(*(torch.compile(f, fullgraph=True) for f in (add_norm, norm, split_heads_into, masked_softmax,
                                                                 merge_heads, gated)))
