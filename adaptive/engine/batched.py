"""A server's decoding batch as one static step (issue 64): several requests' plain steps and
verifications in one forward whose every shape and address is fixed, so that on a GPU it is
captured once as a CUDA graph and replayed (:mod:`adaptive.engine.graphs` does so for batch 1).

Terms, defined once (the batch-1 terms, *bucket*, *slot*, *capacity*, are :mod:`.graphs`', which replays these steps):

* *slab*: the keys and values of ``slots`` caches of one capacity in one tensor each,
  ``[n_layers, n_kv_heads, slots + 1, capacity, head_dim]`` (:class:`Slab`). A request's cache is a
  view of one slot (``[n_layers, n_kv_heads, capacity, head_dim]``, what every step already reads), so
  a batched step can address every request's cache through one tensor and a slot index. The last
  slot is the *dummy*: a padding request writes there.
* *batch bucket* ``B``: requests a batched step is built for (:data:`BATCH_BUCKETS`); ``n``
  requests run in the smallest ``B >= n``, the last ``B - n`` padding (dummy slot, position 0).
* *rows* ``R``: tokens fed per request, ``K + 1`` for ``K`` drafts, bucketed as :data:`ROW_BUCKETS`;
  a request with fewer rows pads its own, at positions after its real ones (overwritten before any
  query may see them, as a rejected draft's keys are). ``R = 1`` is the plain decoding step.
* *span* ``A``: keys each request attends, the same for the batch: the smallest power of two (at
  least :data:`MIN_SPAN`) past every request's last fed position, at most the capacity
  (:func:`span_for`). A batch of short requests does not read the whole slot capacity per row.

Inputs of a step are device tensors at fixed addresses: ``ids`` ``[B, R]``, ``slots`` ``[B]`` and
``starts`` ``[B]`` (each request's first fed position). Output: float32 logits ``[B, R, V]``.

Example: two requests in slots 3 and 5 of a slab of capacity 2048, one verifying 3 drafts at
positions 100..103, one decoding at 40: ``B = 2``, ``R = 4``, ``A = 256``; ``ids`` ``[[t, d1, d2,
d3], [u, 0, 0, 0]]``, ``slots [3, 5]``, ``starts [100, 40]``; the second request's padding rows
write keys at 41..43 of slot 5, beyond its length.

Acceptance happens on the device too, for the whole batch (:func:`accept_greedy`,
:func:`accept_sampled`): one host read of a ``[B, R]`` result per step.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptive.engine.formulas import Masks, StepOps, merge_heads, normed, split_heads, write_features

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # requests per batched step
ROW_BUCKETS = (1, 2, 4, 8)  # tokens per request: a plain step (1) or a verification of up to 7 drafts
MIN_SPAN = 256  # the fewest keys a batched step attends per request
NOT_ACCEPTED = -1  # a row of acceptance's [B, R] result past the tokens a request takes
GC_INTERVAL = 1.0  # seconds between the collections a pool of slots or slabs makes before making a new one


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if n <= b), None)


def batch_bucket(n: int) -> int | None:
    """The smallest batch bucket holding ``n`` requests, ``None`` beyond the largest.
    Example: ``batch_bucket(3) == 4``, ``batch_bucket(64) == 64``, ``batch_bucket(65) is None``."""
    return _bucket(n, BATCH_BUCKETS)


def row_bucket(tokens: int) -> int | None:
    """The smallest row bucket holding ``tokens`` rows, ``None`` beyond the largest.
    Example: ``row_bucket(1) == 1``, ``row_bucket(4) == 4``, ``row_bucket(5) == 8``, ``row_bucket(9) is None``."""
    return _bucket(tokens, ROW_BUCKETS)


def span_for(end: int, capacity: int) -> int:
    """Keys attended by a batch whose furthest request feeds positions up to ``end - 1``: a power of two,
    at least :data:`MIN_SPAN`, at most ``capacity``. Example: ``span_for(41, 2048) == 256``,
    ``span_for(300, 2048) == 512``, ``span_for(2000, 2048) == 2048``, ``span_for(100, 128) == 128``."""
    if end > capacity:
        raise ValueError(f"positions up to {end} do not fit a slot of {capacity}")
    return min(capacity, max(MIN_SPAN, 1 << (end - 1).bit_length()))


class Slab:
    """``slots`` caches' keys and values of ``capacity`` positions in one tensor each (plus the dummy
    slot): ``k``, ``v`` ``[n_layers, n_kv_heads, slots + 1, capacity, head_dim]``. :meth:`take` hands out a
    free slot's index, :meth:`give` takes it back; :meth:`view` is that slot's ``(k, v)`` as a cache holds them.
    A slab of caches that keep feature rows (an eagle head's, after the layer counts ``layers``) holds them
    too: ``features`` ``[slots + 1, capacity, len(layers), hidden]`` (``rows(positions, n)`` makes them)."""

    def __init__(self, allocate: Callable[[int], tuple[torch.Tensor, torch.Tensor]], slots: int, capacity: int,
                 layers: tuple[int, ...] = (), rows: Callable[[int, int], torch.Tensor] | None = None):
        if slots < 1:
            raise ValueError(f"a slab holds at least one slot, not {slots}")
        if layers and rows is None:
            raise ValueError("a slab with feature rows needs their maker")
        self.slots, self.capacity, self.layers = slots, capacity, tuple(layers)
        k, v = allocate(capacity * (slots + 1))  # [L, KV, (slots + 1) * C, D]: one allocation, split by slot
        self.k = k.view(k.shape[0], k.shape[1], slots + 1, capacity, k.shape[-1])
        self.v = v.view(self.k.shape)
        self.features = None
        if layers:
            f = rows(capacity * (slots + 1), len(layers))  # [(slots + 1) * C, n, H]
            self.features = f.view(slots + 1, capacity, len(layers), f.shape[-1])
        self._free = list(range(slots - 1, -1, -1))

    @property
    def dummy(self) -> int:
        return self.slots

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot's index (the lowest), ``None`` when all are taken."""
        return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        if not 0 <= index < self.slots or index in self._free:
            raise ValueError(f"slot {index} is not a taken slot of this slab")
        self._free.append(index)
        self._free.sort(reverse=True)

    def view(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``index``'s ``(k, v)``, ``[n_layers, n_kv_heads, capacity, head_dim]`` views of the slab."""
        return self.k[:, :, index], self.v[:, :, index]

    def rows_of(self, index: int) -> torch.Tensor | None:
        """Slot ``index``'s feature rows, ``[capacity, len(layers), hidden]`` (``None``: the slab keeps none)."""
        return None if self.features is None else self.features[index]


@dataclass(frozen=True)
class SlabSlot:
    """Where a cache lives in a slab: what a batched step needs to address it."""

    slab: Slab
    index: int


class SlabPool:
    """The slabs of each capacity (:class:`Slab` of ``slots`` slots each): :meth:`take` a free slot, a
    new slab only when every slab of that capacity is full, even after collecting finished requests'
    caches that a reference cycle still held (their slots go back when a cache object is collected)."""

    def __init__(self, allocate: Callable[[int], tuple[torch.Tensor, torch.Tensor]], slots: int,
                 rows: Callable[[int, int], torch.Tensor] | None = None):
        self._allocate, self.slots, self._rows = allocate, slots, rows
        self.slabs: dict[tuple, list[Slab]] = {}  # (capacity, feature layers) -> its slabs
        self._collected = float("-inf")  # when take() last collected garbage (time.monotonic)

    def take(self, capacity: int, layers: tuple[int, ...] = ()) -> SlabSlot:
        """A free slot of a slab of ``capacity`` (with the feature rows of ``layers``), collecting at most every
        :data:`GC_INTERVAL` seconds."""
        slabs = self.slabs.setdefault((capacity, tuple(layers)), [])
        for attempt in range(2):
            for slab in slabs:
                index = slab.take()
                if index is not None:
                    return SlabSlot(slab, index)
            if attempt == 0 and slabs and time.monotonic() - self._collected > GC_INTERVAL:
                self._collected = time.monotonic()
                gc.collect()
        slab = Slab(self._allocate, self.slots, capacity, layers, self._rows)
        slabs.append(slab)
        return SlabSlot(slab, slab.take())

    def bind(self, cache, at: SlabSlot) -> None:
        """Give ``at`` back to its slab when ``cache`` is collected."""
        weakref.finalize(cache, at.slab.give, at.index)


def pack_inputs(segments, B: int, R: int, dummy: int) -> torch.Tensor:
    """A batched step's inputs on the host, ``[B * R + 2 * B]`` long: the ids ``[B, R]`` (each segment's
    ids, padded with 0), the slot indices ``[B]`` (padding requests: ``dummy``) and the first positions
    ``[B]`` (padding: 0), for one copy to the device (:func:`unpack_inputs` views it there).
    Example: segments ``[7, 8]`` at 40 in slot 3 and ``[9]`` at 5 in slot 0, ``B = 2, R = 2``, dummy 4:
    ``[7, 8, 9, 0, 3, 0, 40, 5]``."""
    host = torch.zeros(B * R + 2 * B, dtype=torch.long)
    ids, slots, starts = unpack_inputs(host, B, R)
    slots.fill_(dummy)
    for b, s in enumerate(segments):
        ids[b, :s.ids.numel()] = s.ids.reshape(-1).cpu()
        slots[b], starts[b] = s.cache.slot.index, s.start
    return host


def unpack_inputs(buf: torch.Tensor, B: int, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of :func:`pack_inputs`' layout: ``(ids [B, R], slots [B], starts [B])``."""
    return buf[:B * R].view(B, R), buf[B * R:B * R + B], buf[B * R + B:]


def per_request(q: torch.Tensor, groups: int, batch: int) -> torch.Tensor:
    """:func:`~.formulas.split_heads`' queries of ``batch * R`` rows, ``[KV, G * B * R, D]`` (row
    ``g * B * R + b * R + r``), as one attention batch per kv head and request: ``[KV * B, G * R, D]``."""
    KV, GBR, D = q.shape
    R = GBR // (groups * batch)
    return q.view(KV, groups, batch, R, D).transpose(1, 2).reshape(KV * batch, groups * R, D)


def per_group(out: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """:func:`per_request` undone: ``[KV * B, G * R, D]`` as ``[KV, G * B * R, D]``, what
    :func:`~.formulas.merge_heads` takes."""
    KVB, GR, D = out.shape
    B, R = KVB // kv_heads, GR // groups
    return out.view(kv_heads, B, groups, R, D).transpose(1, 2).reshape(kv_heads, groups * B * R, D)


def batch_masked_softmax(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Attention weights from ``scores`` (``[KV * B, G * R, A]``) and ``banned`` (``[B, R, A]``, True: may
    not look), each request's rows masked by its own positions."""
    KVB, GR, A = scores.shape
    B, R, _ = banned.shape
    s = scores.view(KVB // B, B, GR // R, R, A).masked_fill(banned.unsqueeze(1), float("-inf"))
    return torch.softmax(s, dim=-1).view(KVB, GR, A)


class BatchedStep:
    """One forward of ``batch`` requests of ``rows`` tokens each over a slab, attending ``span`` keys per
    request, with no shape or value that depends on data (see the module doc for the terms).

    Inputs: ``ids`` ``[B, R]`` long, ``slots`` ``[B]`` long (padding requests: the dummy slot),
    ``starts`` ``[B]`` long (padding: 0), the slab's ``k``/``v`` ``[L, KV, S + 1, C, D]``, and the rotary
    tables ``cos``/``sin`` ``[C, 1, D]``. Returns float32 logits ``[B, R, V]``. Skipped sublayers
    (``masks``) add nothing, as in the eager forward. ``ops``: the pieces between the products shared with
    the batch-1 step (:class:`~.formulas.StepOps`: add_norm, norm, gated; plain when ``None``). ``keep``: the
    layer counts whose residual stream the step writes into the slab's feature rows (``features``, the last
    input, ``[S + 1, C, len(keep), hidden]``) at every fed row's slot and position, as the eager forward does."""

    def __init__(self, backbone, batch: int, rows: int, span: int, masks: Masks, ops=None, keep: tuple[int, ...] = ()):
        if keep and masks != backbone._full:
            raise ValueError("only the full model's steps write feature rows (a draft's are not the target's)")
        self.bb, self.batch, self.rows, self.span, self.masks = backbone, batch, rows, span, masks
        self.keep = tuple(keep)
        self.ops = ops or StepOps.plain()

    def __call__(self, ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 features: torch.Tensor | None = None) -> torch.Tensor:
        if self.keep and features is None:
            raise ValueError("a batched step that keeps feature rows needs the slab's feature rows")
        bb, B, R, A = self.bb, self.batch, self.rows, self.span
        L, KV, S1, C, D = k.shape
        G = bb.n_heads // KV
        dev = ids.device
        pos = starts.unsqueeze(1) + torch.arange(R, device=dev)  # [B, R] absolute positions
        flat = pos.reshape(-1)  # [B * R]
        where = (slots.unsqueeze(1) * C + pos).reshape(-1)  # [B * R] rows of a layer's [KV, S1 * C, D]
        cos_t, sin_t = cos.index_select(0, flat), sin.index_select(0, flat)  # [B * R, 1, D]
        banned = torch.arange(A, device=dev).view(1, 1, A) > pos.unsqueeze(2)  # [B, R, A]: may not look
        skip_attn, skip_mlp = self.masks
        h = F.embedding(ids.reshape(-1), bb.embed_weight)  # [B * R, hidden]
        delta = None  # the last sublayer's output, not yet added to h
        at = {n: j for j, n in enumerate(self.keep)}  # layer count -> its feature row
        rows = None if features is None else features.view(S1 * C, len(self.keep), -1)  # [S1 * C, n, H]
        write_features(rows, at, 0, where, h)

        for i, w in enumerate(bb.weights):
            if not skip_attn[i]:
                h, x = normed(self.ops, h, delta, w.attn_norm, w.attn_eps)
                q, kn, vn = split_heads(w.qkv(x), cos_t, sin_t, w.q_norm, w.k_norm, w.qk_eps, bb.n_heads, KV,
                                        k.dtype, bb.scaling)
                k[i].view(KV, S1 * C, D).index_copy_(1, where, kn)  # every request's keys, into its own slot
                v[i].view(KV, S1 * C, D).index_copy_(1, where, vn)
                keys = k[i, :, :, :A].index_select(1, slots).view(KV * B, A, D)  # [KV * B, A, D]
                values = v[i, :, :, :A].index_select(1, slots).view(KV * B, A, D)
                probs = batch_masked_softmax(torch.bmm(per_request(q, G, B), keys.transpose(1, 2)), banned)
                out = per_group(torch.bmm(probs, values), KV, G)  # [KV, G * B * R, D]
                delta = w.o(merge_heads(out, B * R, h.dtype))
            if not skip_mlp[i]:
                h, x = normed(self.ops, h, delta, w.mlp_norm, w.mlp_eps)
                delta = w.down(self.ops.gated(w.gate_up(x), w.act))
            write_features(rows, at, i + 1, where, h, delta)
        _, x = normed(self.ops, h, delta, bb.final_norm_weight, bb.norm_eps)
        return bb.head(x).float().view(B, R, -1)


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a batch on the device: each request takes its drafts while they equal the
    target's argmax, then the target's own token. ``target``: the argmax at every fed row, ``[B, R]``
    (row ``j`` predicts the token after draft ``j``; row 0 follows the pending token); ``drafts``
    ``[B, R - 1]``; ``n_drafts`` ``[B]`` (drafts past it are padding, never taken). Returns ``[B, R]``:
    the tokens each request emits (its accepted drafts, then the target's token), :data:`NOT_ACCEPTED`
    after them. Example: target ``[[5, 6, 9, 1]]``, drafts ``[[5, 6, 7]]``, n ``[3]`` -> ``[[5, 6, 9, -1]]``
    (5 and 6 accepted, 9 the target's); n ``[1]`` -> ``[[5, 6, -1, -1]]``."""
    B, R = target.shape
    j = torch.arange(R - 1, device=target.device)
    match = (drafts == target[:, :R - 1]) & (j.unsqueeze(0) < n_drafts.unsqueeze(1))  # [B, R - 1]
    accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)  # [B]
    keep = torch.arange(R, device=target.device).unsqueeze(0) <= accepted.unsqueeze(1)  # [B, R]
    return torch.where(keep, target, torch.full_like(target, NOT_ACCEPTED))


def accept_sampled(probs: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor, uniforms: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Speculative sampling of a batch on the device, for drafts proposed deterministically (prompt
    lookup, tables, a greedy head: the draft distribution is one-hot at the draft). ``probs``: the
    target's distribution at every fed row, ``[B, R, V]``; ``drafts`` ``[B, R - 1]``; ``n_drafts`` ``[B]``;
    ``uniforms`` ``[B, R - 1]`` in [0, 1). Draft ``j`` is accepted when ``u_j < p_j(d_j)`` (the ratio
    ``p / q`` with ``q(d_j) = 1``); at the first rejection the token is drawn from the residual
    ``max(p_j - q_j, 0)``, which is ``p_j`` without ``d_j``, renormalized; after all are accepted, from
    the next row's ``p``. The emitted tokens are then distributed as the target samples them. Returns
    ``[B, R]`` as :func:`accept_greedy`. Example: ``p_0 = [0, 0.5, 0.5]``, draft 1, u 0.3 -> 1 accepted;
    u 0.7 -> rejected, and the token drawn from ``[0, 0, 1]``: 2."""
    B, R, V = probs.shape
    dev = probs.device
    j = torch.arange(R - 1, device=dev)
    p_draft = probs[:, :R - 1].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, R - 1]
    ok = (uniforms < p_draft) & (j.unsqueeze(0) < n_drafts.unsqueeze(1))
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # [B]
    rows = probs.gather(1, accepted.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]: p at the first unaccepted
    rejected = accepted < n_drafts  # that row's draft was rejected: its residual
    at = accepted.clamp(max=R - 2).unsqueeze(1) if R > 1 else accepted.unsqueeze(1)
    drop = drafts.gather(1, at) if R > 1 else torch.zeros_like(at)  # [B, 1]
    residual = rows.scatter(1, drop, 0.0)
    rejected &= residual.sum(dim=1) > 0  # p all on the draft cannot reject it; rounding aside, draw from p
    dist = torch.where(rejected.unsqueeze(1), residual, rows)
    dist = dist / dist.sum(dim=1, keepdim=True).clamp_min(torch.finfo(dist.dtype).tiny)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)  # [B]
    out = torch.full((B, R), NOT_ACCEPTED, dtype=torch.long, device=dev)
    if R > 1:
        out[:, :R - 1] = torch.where(j.unsqueeze(0) < accepted.unsqueeze(1), drafts, out[:, :R - 1])
    return out.scatter(1, accepted.unsqueeze(1), last.unsqueeze(1))
