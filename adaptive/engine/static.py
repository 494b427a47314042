"""The static-shape steps that :mod:`adaptive.engine.graphs` captures as CUDA graphs and replays (the terms,
*bucket*, *slot*, *position tensors* and *tree step*, are defined there): :class:`StaticStep`, one forward of
a bucket's rows over a cache slot; :class:`ChainedStep`, plain greedy decoding's step that feeds itself; and
:func:`tree_meta`, a tree step's position tensors. Every shape and address is fixed and nothing reads a value
back to the host, so each runs the same eagerly (the CPU tests) and replayed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaptive.engine.formulas import Masks, StepOps, normed, rms_norm, write_features

CHAIN_MAX = 64  # the most tokens one chained decode (StepGraphs.chain) writes before the host reads them


def tree_meta(tree: list[int], start: int, bucket: int) -> list[int]:
    """A tree step's ``meta`` (:class:`StaticStep` with ``tree=True``), ``2 + bucket + bucket * bucket`` ints:
    the first position, the last real row, each row's depth, then row by row whether it sees each row
    (itself and its ancestors: 1). ``tree``: each fed row's parent row, ``-1`` for row 0. Padding rows see
    only themselves, at depth 0. Example: ``tree_meta([-1, 0, 0], 5, 4)`` -> ``[5, 2, 0, 1, 1, 0,
    1, 0, 0, 0,  1, 1, 0, 0,  1, 0, 1, 0,  0, 0, 0, 1]``."""
    T = len(tree)
    if T > bucket:
        raise ValueError(f"a tree of {T} rows does not fit a bucket of {bucket}")
    depth = [0] * bucket
    seen = [[int(i == j) for j in range(bucket)] for i in range(bucket)]
    for i in range(1, T):
        p = tree[i]
        if not 0 <= p < i:
            raise ValueError(f"a tree's rows need each parent before its child: {tree}")
        depth[i] = depth[p] + 1
        seen[i] = [a | (j == i) for j, a in enumerate(seen[p])]
    return [start, T - 1, *depth, *(x for row in seen for x in row)]


class StaticStep:
    """One forward of ``bucket`` tokens over a cache slot, with no shape or value that depends on data.

    Inputs (device tensors, fixed addresses when captured): ``ids`` ``[bucket]`` long; ``meta``
    ``[2]`` long, the first position and the index of the last real row; ``k``/``v`` the slot
    ``[n_layers, n_kv_heads, capacity, head_dim]``; ``cos``/``sin`` the rotary tables
    ``[capacity, 1, head_dim]`` (:meth:`Backbone.rope_table`). Returns float32 logits: ``[bucket, V]``
    (``logits="all"``) or ``[1, V]`` at the last real row (``"last"``). Skipped sublayers (``masks``)
    add nothing, as in the eager forward; attention runs over the whole slot, masked by position.
    ``ops``: the pieces between the products (:class:`StepOps`; plain by default). ``pool_layer``: also
    return the routing pool of the residual stream after that many layers (a prefill that routes):
    ``(logits, [2, hidden])``, the final-normed rows' float32 sum over the real rows (row 0; the caller
    divides by the prompt's length, summed over chunks) and the last real row (row 1), as
    :meth:`Backbone._pool <adaptive.engine.backbone.Backbone>` computes them eagerly (plain kernels).
    ``keep``: the layer counts whose residual stream the step writes into the slot's feature rows
    ``features`` (``[capacity, len(keep), hidden]``, the last input; an eagle head's cache, as the eager
    forward writes :attr:`KVCache.features <adaptive.engine.backbone.KVCache.features>`), at every fed
    row's position: padding rows write past the real ones, as their keys are.
    """

    def __init__(self, backbone, bucket: int, masks: Masks, logits: str, ops: StepOps | None = None,
                 pool_layer: int | None = None, keep: tuple[int, ...] = (), tree: bool = False):
        if logits not in ("all", "last"):
            raise ValueError(f"a static step returns 'all' or 'last' logits, not {logits!r}")
        if tree and (logits != "all" or pool_layer is not None):
            raise ValueError("a tree step is a verification: 'all' logits, no routing pool")
        if keep and masks != backbone._full:
            raise ValueError("only the full model's steps write feature rows (a draft's are not the target's)")
        self.bb, self.bucket, self.masks, self.logits = backbone, bucket, masks, logits
        self.ops = ops or StepOps.plain()
        self.pool_layer = pool_layer
        self.keep = tuple(keep)
        self.tree = tree

    def __call__(self, ids: torch.Tensor, meta: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        if self.keep and features is None:
            raise ValueError("a step that keeps feature rows needs the slot's feature rows")
        bb, ops = self.bb, self.ops
        Tb, C = self.bucket, k.shape[2]
        pos = meta[0] + torch.arange(Tb, device=ids.device)  # [Tb] absolute positions (a tree's: its rows' slots)
        if self.tree:  # rotated at their depths; each row sees the cache before start, itself and its ancestors
            at = meta[0] + meta[2:2 + Tb]  # [Tb]
            seen = meta[2 + Tb:].view(Tb, Tb) > 0  # [Tb, Tb]
            rel = torch.arange(C, device=ids.device) - meta[0]  # [C]: a column's row, when 0 <= rel < Tb
            inside = (rel >= 0) & (rel < Tb)
            banned = (rel >= Tb).unsqueeze(0) | (inside.unsqueeze(0) & ~seen.index_select(1, rel.clamp(0, Tb - 1)))
        else:
            at = pos
            banned = torch.arange(C, device=ids.device).unsqueeze(0) > pos.unsqueeze(1)  # [Tb, C]: may not look
        cos_t, sin_t = cos.index_select(0, at), sin.index_select(0, at)  # [Tb, 1, D]
        skip_attn, skip_mlp = self.masks
        h = F.embedding(ids, bb.embed_weight)  # [Tb, hidden]
        delta = None  # the last sublayer's output, not yet added to h (added with the next norm)
        pooled = self._pool(h, meta) if self.pool_layer == 0 else None
        at_row = {n: j for j, n in enumerate(self.keep)}  # layer count -> its row in the slot's feature rows
        write_features(features, at_row, 0, pos, h)

        for i, w in enumerate(bb.weights):
            if not skip_attn[i]:
                h, x = normed(ops, h, delta, w.attn_norm, w.attn_eps)
                q = ops.split_heads_into(w.qkv(x), cos_t, sin_t, w.q_norm, w.k_norm, w.qk_eps, bb.n_heads,
                                         bb.n_kv_heads, k.dtype, bb.scaling, k[i], v[i], pos)
                probs = ops.masked_softmax(torch.bmm(q, k[i].transpose(1, 2)), banned)  # [KV, G * Tb, C]
                delta = w.o(ops.merge_heads(torch.bmm(probs, v[i]), Tb, h.dtype))
            if not skip_mlp[i]:
                h, x = normed(ops, h, delta, w.mlp_norm, w.mlp_eps)
                delta = w.down(ops.gated(w.gate_up(x), w.act))
            if self.pool_layer == i + 1:
                pooled = self._pool(h if delta is None else h + delta, meta)
            write_features(features, at_row, i + 1, pos, h, delta)
        if self.logits == "last":
            h = h.index_select(0, meta[1:2])
            delta = None if delta is None else delta.index_select(0, meta[1:2])
        _, x = normed(ops, h, delta, bb.final_norm_weight, bb.norm_eps)
        out = bb.head(x).float()
        return out if self.pool_layer is None else (out, pooled)

    def _pool(self, h: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """``[2, hidden]`` float32: the final-normed rows of ``h`` summed over the real ones, and the last real one."""
        x = rms_norm(h, self.bb.final_norm_weight, self.bb.norm_eps).float()
        real = (torch.arange(self.bucket, device=h.device) <= meta[1]).unsqueeze(1)  # [Tb, 1]
        return torch.stack([(x * real).sum(dim=0), x.index_select(0, meta[1:2])[0]])


class ChainedStep:
    """Plain greedy decoding's step that feeds itself, so that steps replay back to back with no host
    read between them (gpt-fast keeps its decoding loop off the host this way): the full model's
    one-token step (``step``: a :class:`StaticStep` of bucket 1, ``"all"`` logits, as plain decoding
    replays), whose argmax becomes the next step's token at the next position and is written to ``out``.

    Inputs (device tensors): ``state`` ``[4]`` long: the token to feed, its position, 0 (the last real
    row) and how many tokens were written so far; ``out`` ``[CHAIN_MAX]`` long; the slot and rotary
    tables as :class:`StaticStep`'s. Each call writes the token's keys, sets ``out[state[3]]`` and
    ``state[0]`` to its argmax, and advances ``state[1]`` and ``state[3]`` by one. Returns the argmax
    (``[1]``). Example: ``state [17, 40, 0, 0]``, three calls whose argmaxes are 5, 9, 2: ``out[:3]``
    ``[5, 9, 2]``, ``state [2, 43, 0, 3]``; plain decoding fed 17 at 40, 5 at 41 and 9 at 42."""

    def __init__(self, step: StaticStep):
        if step.bucket != 1 or step.logits != "all" or step.pool_layer is not None:
            raise ValueError("a chained step is a one-token step with 'all' logits and no routing pool")
        self.step = step

    def __call__(self, state: torch.Tensor, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        nxt = self.step(state[0:1], state[1:3], k, v, cos, sin, features).argmax(-1)  # [1]
        out.index_copy_(0, state[3:4], nxt)
        state[0:1].copy_(nxt)
        state[1:2].add_(1)
        state[3:4].add_(1)
        return nxt
