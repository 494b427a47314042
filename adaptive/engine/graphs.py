"""Static-shape decode, draft and verify steps, captured once as CUDA graphs and replayed (gpt-fast's design).

An eager step of a small model on a GPU is bound by launching its kernels (a thousand of them for
30 layers), not by reading its weights. A CUDA graph records a step's kernels once and replays
them with one launch; what it needs is a step whose every shape and address is fixed and that
reads no value back to the host. :class:`StaticStep` is that step and :class:`StepGraphs` captures
and replays it behind :meth:`Backbone.forward <adaptive.engine.backbone.Backbone.forward>`, so the
engine, drafters, runtime and server call what they always called.

Terms, defined once:

* *bucket*: the token count a static step is built for (:data:`BUCKETS`); ``T`` fed tokens run in
  the smallest bucket ``Tb >= T``, the last ``Tb - T`` rows padding. A plain step is bucket 1, a
  verification of ``k`` drafts bucket ``>= k + 1``, a layer-skip draft step bucket 1 with its skip set.
* *prefill bucket*: a bucket of :data:`PREFILL_BUCKETS` (64 to 256 tokens) for a prompt's rows, which
  returns only the last real row's logits; a longer prompt (or one with logits ``"none"``) is fed in
  chunks of at most 256 (:func:`prefill_plan`), each a replay.
* *slot*: a KV cache's tensors of a fixed *capacity* (a power of two, :func:`capacity_for`), kept
  in a :class:`SlotPool` and handed to requests by :meth:`Backbone.new_cache`; a graph is captured
  for one slot and is replayed by every request that gets that slot again.
* *position tensors*: the step's first position ``start`` and its last real row ``last`` live in
  device buffers; the rotary tables, the cache writes (``index_copy_``) and the causal mask are
  indexed by them, so one graph serves every position.
* *tree step*: a verification of a tree draft (:meth:`Backbone.tree_layout
  <adaptive.engine.backbone.Backbone.tree_layout>`): row ``t`` is written at slot ``start + t`` but
  rotated at the position of its depth, and sees the cache before ``start`` and its own ancestors; its
  depths and ancestor mask are position tensors too (:func:`tree_meta`), so one graph serves every tree
  of its bucket.

A padded row writes keys at positions after the real ones; those lie beyond the cache's
``length`` and are overwritten before any query may see them (every forward writes its own
positions' keys before attending), as a rejected draft's are. Padding ids are 0 (for ids drafted
on the device, whatever the buffer last held: valid ids either way). Example: a verification of
3 drafts feeds 4 ids at positions 100..103 in bucket 4; one of 4 drafts feeds 5 ids in bucket 8,
rows 5..7 padding at positions 105..107.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import torch

from adaptive.engine.batched import (
    BATCH_BUCKETS,
    GC_INTERVAL,
    ROW_BUCKETS,
    BatchedStep,
    Slab,
    SlabPool,
    batch_bucket,
    pack_inputs,
    row_bucket,
    span_for,
    unpack_inputs,
)
from adaptive.engine.formulas import Masks, StepOps
from adaptive.engine.static import CHAIN_MAX, ChainedStep, StaticStep, tree_meta

COMPILE_MODES = ("ops", "step", "none")  # StepGraphs.compile
BUCKETS = (1, 2, 4, 8, 16, 32)  # token counts of the static steps (decode, draft, verify)
PREFILL_BUCKETS = (64, 128, 256)  # and of prefill chunks (logits of the last real row only)
# the smallest slot (positions). Every slot's capacity has its own graphs, and on an H100 a capture cost
# ~130 ms of the first request that needed it (the embedded model, 2026-11-26): few, larger slots. Attending
# over 2048 positions instead of 256 reads ~47 MB more a step for the embedded model (~16 us at 3 TB/s)
MIN_CAPACITY = 2048

def bucket_for(tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` rows, ``None`` beyond the largest.
    Example: ``bucket_for(1) == 1``, ``bucket_for(5) == 8``, ``bucket_for(33) is None``."""
    for b in BUCKETS:
        if tokens <= b:
            return b
    return None


def prefill_plan(tokens: int, start: int, capacity: int) -> list[tuple[int, int, int]]:
    """How a prefill of ``tokens`` rows at ``start`` runs as static steps in a slot of ``capacity``
    positions: ``(offset, rows, bucket)`` chunks of at most 256 rows (the largest prefill bucket), each
    in the smallest bucket holding it whose padding stays inside the slot (a slot keeps room for the
    largest decoding bucket's padding only: near its end a chunk is cut to 32 rows).
    Example: ``prefill_plan(300, 0, 512) == [(0, 256, 256), (256, 44, 64)]``;
    ``prefill_plan(100, 400, 512) == [(0, 32, 32), (32, 32, 32), (64, 32, 32), (96, 4, 4)]``."""
    plan, done = [], 0
    while done < tokens:
        rows = min(tokens - done, PREFILL_BUCKETS[-1])
        bucket = bucket_for(rows) or next(b for b in PREFILL_BUCKETS if rows <= b)
        if start + done + bucket > capacity:  # padding would pass the slot's end: 32 rows at most
            rows = min(rows, BUCKETS[-1])
            bucket = bucket_for(rows)
        plan.append((done, rows, bucket))
        done += rows
    return plan


def zeros_kv(lead: tuple[int, ...], head_dim: int, dtype: torch.dtype, device: torch.device,
             positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed keys and values of a cache, ``[*lead, positions, head_dim]`` (``lead``: layers, kv heads; an
    eagle head's slot: its kv heads)."""
    shape = (*lead, positions, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _zeros_rows(hidden: int, dtype: torch.dtype, device: torch.device, positions: int, n: int) -> torch.Tensor:
    """Zeroed feature rows of a slot, ``[positions, n, hidden]``."""
    return torch.zeros(positions, n, hidden, dtype=dtype, device=device)


def capacity_for(max_len: int, context: int | None = None) -> int:
    """The slot capacity for a cache of ``max_len`` positions: a power of two (at least
    :data:`MIN_CAPACITY`) with room for the largest bucket's padding after the last position, at
    most the model's ``context`` with that room, in whole 256s (no slot twice a long context).
    Example: ``capacity_for(100) == 2048``, ``capacity_for(2100) == 4096``,
    ``capacity_for(8190, 8192) == 8448`` (not 16384), ``capacity_for(100, 512) == 768``."""
    need = max_len + BUCKETS[-1]
    capacity = 1 << (max(need, MIN_CAPACITY) - 1).bit_length()
    if context is not None:
        capacity = min(capacity, -(-(context + BUCKETS[-1]) // 256) * 256)
    return max(capacity, need)


class SlotPool:
    """KV tensors of fixed capacities, reused across requests: a freed slot (its cache object gone)
    is handed to the next request of its capacity, whose steps then replay the graphs captured for it.
    A slot for a cache that keeps feature rows (an eagle head's, :attr:`KVCache.features
    <adaptive.engine.backbone.KVCache.features>`) holds them too, ``[capacity, len(layers), hidden]``
    (``features``: their maker), so that the graphs captured for it write them."""

    def __init__(self, allocate: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 features: Callable[[int, int], torch.Tensor] | None = None):
        self._allocate, self._features = allocate, features
        self._free: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}  # (capacity, layers) -> free slots
        self._made: set[tuple] = set()  # the (capacity, layers) of the slots made
        self._collected = float("-inf")  # when take() last collected garbage (time.monotonic)
        self.allocated = 0  # slots made so far (tests and the device check read it)

    def take(self, capacity: int, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
        """A free slot of ``capacity`` (``(k, v)``, and its feature rows for ``layers``: ``(k, v, rows)``); a new
        one (and new graphs for it) only when none is free, even after collecting finished requests' caches
        that a reference cycle still held (at most once every :data:`GC_INTERVAL` seconds: a busy server's
        admissions do not each pay a collection)."""
        key = (capacity, tuple(layers))
        free = self._free.setdefault(key, [])
        if not free and key in self._made and time.monotonic() - self._collected > GC_INTERVAL:
            self._collected = time.monotonic()
            gc.collect()
        if free:
            return free.pop()
        if layers and self._features is None:
            raise ValueError("this slot pool makes no feature rows")
        self.allocated += 1
        self._made.add(key)
        kv = self._allocate(capacity)
        return (*kv, self._features(capacity, len(layers))) if layers else kv

    def give(self, capacity: int, *tensors: torch.Tensor, layers: tuple[int, ...] = ()) -> None:
        self._free.setdefault((capacity, tuple(layers)), []).append(tensors)

    def bind(self, cache, capacity: int) -> None:
        """Return ``cache``'s tensors to the pool when the cache object is collected."""
        tensors = (cache.k, cache.v) if cache.features is None else (cache.k, cache.v, cache.features)
        weakref.finalize(cache, functools.partial(self.give, layers=tuple(cache.feature_layers)), capacity, *tensors)


@dataclass(eq=False)
class Captured:
    """A captured step: replaying ``graph`` runs it again over the buffers it was captured with."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # the graph's output buffers, rewritten by each replay


@dataclass(eq=False)
class StepGraphs:
    """The CUDA graphs of a backbone's static steps, captured lazily (per slot, bucket, skip set and
    logits mode) and replayed by :meth:`forward`. A failed capture turns graphs off for the backbone,
    which then runs eagerly, and says so once on stderr."""

    owner: InitVar[object]  # the backbone, held weakly (it holds its graphs: no cycle, they go together)
    pool: SlotPool = field(init=False)
    enabled: bool = True
    # what Inductor compiles before capture: "ops" (the pieces between the products, StepOps.compiled: the
    # default), "step" (each whole step: fewer kernels, but ~50 s of compiling per bucket and skip set on an
    # H100) or "none" (every piece a plain PyTorch kernel)
    compile: str = "ops"
    replays: int = 0
    batched_replays: int = 0
    # batch bucket -> {rows R: seconds of one replay}: the batched steps timed when warmed (warm_batches),
    # what a server's draft lengths are priced by (Backbone.batch_step_costs)
    batch_seconds: dict = field(default_factory=dict, repr=False)
    _graphs: dict = field(default_factory=dict, repr=False)
    # (bucket, tree step) -> [bucket + 2] long: ids, start, last row (a tree step's: and tree_meta's depths and mask)
    _inputs: dict = field(default_factory=dict, repr=False)
    _rope: dict = field(default_factory=dict, repr=False)  # capacity -> (cos, sin)
    _chain: tuple | None = field(default=None, repr=False)  # (state [4], out [CHAIN_MAX]): ChainedStep's buffers
    _mempool: object = field(default=None, repr=False)
    _ops: StepOps | None = field(default=None, repr=False)
    _batch_inputs: dict = field(default_factory=dict, repr=False)  # (B, R) -> [B * R + 2 * B] long
    # what the drafters keep with these graphs, by their own key (an eagle head's HeadGraphs), dropped with them
    attached: dict = field(default_factory=dict, repr=False)

    def __post_init__(self, owner):
        self._owner = weakref.ref(owner)
        self._allocate = functools.partial(zeros_kv, (owner.n_layers, owner.n_kv_heads), owner.head_dim,
                                           owner.cache_dtype, owner.device)
        rows = functools.partial(_zeros_rows, owner.hidden_size, owner.cache_dtype, owner.device)
        self.pool = SlotPool(self._allocate, rows)
        self.slabs = SlabPool(self._allocate, 0, rows)  # no slabs until reserve_batch sets their slots

    @property
    def slab_slots(self) -> int:
        """Slots per slab (> 0: caches are slots of slabs, :mod:`adaptive.engine.batched`, so that a server's
        batch of steps and verifications replays one batched graph, :meth:`forward_batch`); 0: a slot each."""
        return self.slabs.slots

    @slab_slots.setter
    def slab_slots(self, slots: int) -> None:
        self.slabs.slots = slots

    @property
    def backbone(self):
        return self._owner()

    @property
    def captures(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def new_cache(self, max_len: int, cache_type, layers: tuple[int, ...] = ()):
        """A cache of ``max_len`` positions over a pooled slot (a slab's, with :attr:`slab_slots`), with its
        feature rows for a cache that keeps the residual stream after ``layers``."""
        capacity = capacity_for(max_len, self.backbone.max_positions)
        layers = tuple(layers)
        if self.slab_slots > 0:
            at = self.slabs.take(capacity, layers)
            k, v = at.slab.view(at.index)
            cache = cache_type(k=k, v=v, limit=max_len, slot=at, features=at.slab.rows_of(at.index),
                               feature_layers=layers)
            self.slabs.bind(cache, at)
            return cache
        if layers:
            k, v, rows = self.pool.take(capacity, layers)
            cache = cache_type(k=k, v=v, limit=max_len, features=rows, feature_layers=layers)
            self.pool.bind(cache, capacity)
            return cache
        k, v = self.pool.take(capacity)
        cache = cache_type(k=k, v=v, limit=max_len)
        self.pool.bind(cache, capacity)
        return cache

    def forward_batch(self, segments, masks: Masks) -> list[torch.Tensor | None] | object:
        """:meth:`Backbone.forward_batch <adaptive.engine.backbone.Backbone.forward_batch>` by replaying
        graphs: the segments that want logits (decoding steps and verifications) as batched steps, one per
        slab and :data:`~adaptive.engine.batched.BATCH_BUCKETS`' largest group, the others (prompt chunks)
        as :meth:`forward`'s prefill chunks. ``NotImplemented`` where no static step serves the call
        (graphs off, no slabs, a cache that is not a slab's slot, a segment of more rows than
        :data:`~adaptive.engine.batched.ROW_BUCKETS`' largest or past its cache); the caller runs eagerly.
        Caches that keep feature rows are slots of slabs that hold them: their batched steps write them."""
        if not self.enabled or self.slab_slots < 1:
            return NotImplemented
        wanted = [s for s in segments if s.logits]
        sizes = [int(s.ids.numel()) for s in segments]
        if not wanted or any(getattr(s.cache, "slot", None) is None or s.start + t > s.cache.max_len
                             for s, t in zip(segments, sizes)):
            return NotImplemented
        R = row_bucket(max(int(s.ids.numel()) for s in wanted))
        if R is None:
            return NotImplemented
        for s in segments:
            if not s.logits and self.forward(s.ids.reshape(-1), s.cache, s.start, masks, "none") is NotImplemented:
                return NotImplemented
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(segments):
            if s.logits:
                groups.setdefault(id(s.cache.slot.slab), []).append(i)
        out: list = [None] * len(segments)
        for members in groups.values():
            for a in range(0, len(members), BATCH_BUCKETS[-1]):
                part = members[a:a + BATCH_BUCKETS[-1]]
                logits = self._replay_batch([segments[i] for i in part], R, masks)
                if logits is NotImplemented:
                    return NotImplemented
                for i, rows in zip(part, logits):
                    out[i] = rows
        return out

    def _replay_batch(self, segments, R: int, masks: Masks):
        """One batched step of ``segments`` (all in one slab, at most the largest batch bucket)."""
        n, slab = len(segments), segments[0].cache.slot.slab
        B = batch_bucket(n)
        A = span_for(max(s.start for s in segments) + R, slab.capacity)
        host = pack_inputs(segments, B, R, slab.dummy)  # one copy to the device
        cap = self._batch_graph(slab, B, R, A, masks)
        if cap is None:
            return NotImplemented
        self._batch_inputs[(B, R)].copy_(host, non_blocking=True)
        cap.graph.replay()
        self.batched_replays += 1
        return [cap.out[b, :int(s.ids.numel())].clone() for b, s in enumerate(segments)]

    def _batch_graph(self, slab: Slab, B: int, R: int, A: int, masks: Masks) -> Captured | None:
        """The batched step's graph for ``slab`` and ``(B, R, A, masks)``, captured now if it was not
        (over the dummy slot: the inputs' values are not part of a graph); ``None`` when capturing failed."""
        keep = slab.layers if masks == self.backbone._full else ()  # a draft's residual stream is not the target's
        key = ("batch", slab.k.data_ptr(), B, R, A, masks, keep)
        cap = self._graphs.get(key)
        if cap is not None:
            return cap
        buf = self._batch_inputs.get((B, R))
        if buf is None:
            buf = self._batch_inputs[(B, R)] = torch.zeros(B * R + 2 * B, dtype=torch.long,
                                                          device=self.backbone.device)
        ids, slots, starts = unpack_inputs(buf, B, R)
        slots.fill_(slab.dummy)
        starts.zero_()
        cos, sin = self._tables(slab.capacity)
        args = (ids, slots, starts, slab.k, slab.v, cos, sin, *((slab.features,) if keep else ()))
        return self.capture(key, lambda ops: BatchedStep(self.backbone, B, R, A, masks, ops, keep), args)

    def warm_batches(self, requests: int, masks: Masks, max_len: int = 1, repeats: int = 10,
                     layers: tuple[int, ...] = ()) -> int:
        """Capture the batched steps a server of up to ``requests`` decoding together replays first (every
        batch bucket up to ``requests``' and every row bucket, attending :data:`~adaptive.engine.batched.MIN_SPAN`
        keys) on the slab of caches of ``max_len`` positions; longer spans are captured when a batch reaches
        them. Each is then timed over ``repeats`` replays (:attr:`batch_seconds`, the median of three
        blocks). ``layers``: on the slab whose caches keep those feature rows (a runtime with an eagle head).
        Returns the graphs captured now (0 without slabs)."""
        if not self.enabled or self.slab_slots < 1:
            return 0
        before = self.captures
        at = self.slabs.take(capacity_for(max_len, self.backbone.max_positions), tuple(layers))
        at.slab.give(at.index)
        span = span_for(1, at.slab.capacity)
        for B in BATCH_BUCKETS[:BATCH_BUCKETS.index(batch_bucket(min(requests, BATCH_BUCKETS[-1]))) + 1]:
            for R in ROW_BUCKETS:
                cap = self._batch_graph(at.slab, B, R, span, masks)
                if cap is None:
                    return self.captures - before
                if repeats > 0:
                    self.batch_seconds.setdefault(B, {})[R] = self._timed(cap, repeats)
        return self.captures - before

    def _timed(self, cap: Captured, repeats: int) -> float:
        """Seconds of one replay of ``cap``: the median of three blocks of ``repeats`` replays."""
        dev = self.backbone.device
        blocks = []
        for _ in range(3):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(repeats):
                cap.graph.replay()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            blocks.append((time.perf_counter() - t0) / repeats)
        return sorted(blocks)[1]

    def forward(self, ids: torch.Tensor, cache, start: int, masks: Masks, logits: str,
                pool_layer: int | None = None, tree: list[int] | None = None):
        """The logits of feeding ``ids`` (``[T]``) at ``start`` by replaying graphs (``[T, V]`` for
        ``"all"``, ``[1, V]`` for ``"last"``, ``None`` for ``"none"``), or ``NotImplemented`` when no
        static step serves the call (graphs off, ``"all"`` logits of more rows than the largest bucket,
        a cache that is not a slot); the caller runs eagerly. More than 32 rows, ``"none"`` logits or a
        ``pool_layer`` (a prefill) run in chunks (:func:`prefill_plan`). With ``pool_layer``: ``(logits,
        [2, hidden])``, the routing pool after that many layers (mean over the rows, last row; float32).
        A full-model step over a cache that keeps feature rows writes them as the eager forward does (its
        slot holds them: :meth:`new_cache`). ``tree``: the fed rows' parent rows, a tree draft's verification
        (``"all"`` logits, at most the largest bucket's rows: a *tree step*)."""
        T = int(ids.shape[0])
        if not self.enabled or logits not in ("all", "last", "none") or cache.limit == 0:
            return NotImplemented
        if tree is not None:
            if logits != "all" or pool_layer is not None or T > BUCKETS[-1] or len(tree) != T:
                return NotImplemented
            return self._replay(ids, cache, start, masks, logits, bucket_for(T), tree=tree)
        if T <= BUCKETS[-1] and logits != "none" and pool_layer is None:
            return self._replay(ids, cache, start, masks, logits, bucket_for(T))
        if logits == "all":
            return NotImplemented
        out, total = None, None
        for offset, rows, bucket in prefill_plan(T, start, cache.k.shape[2]):
            out = self._replay(ids[offset:offset + rows], cache, start + offset, masks, "last", bucket, pool_layer)
            if out is NotImplemented:  # a failed capture turned graphs off: the caller runs the whole prefill
                return out               # eagerly, rewriting the keys of the chunks replayed so far
            if pool_layer is not None:
                total = out[1][0] if total is None else total + out[1][0]
        if pool_layer is None:
            return out if logits == "last" else None
        return (out[0] if logits == "last" else None), torch.stack([total / T, out[1][1]])

    def _replay(self, ids: torch.Tensor, cache, start: int, masks: Masks, logits: str, Tb: int,
                pool_layer: int | None = None, tree: list[int] | None = None):
        T = int(ids.shape[0])
        meta = [start, T - 1] if tree is None else tree_meta(tree, start, Tb)
        buf = self._inputs.get((Tb, tree is not None))
        if buf is None:
            buf = self._inputs[(Tb, tree is not None)] = torch.zeros(Tb + len(meta), dtype=torch.long,
                                                                    device=self.backbone.device)
        if ids.device.type == "cpu":  # the ids, padding and position tensors in one copy to the device
            buf.copy_(torch.tensor(ids.tolist() + [0] * (Tb - T) + meta), non_blocking=True)
        else:  # drafted on the device: stays there
            buf[:T].copy_(ids, non_blocking=True)
            buf[Tb:].copy_(torch.tensor(meta), non_blocking=True)
        key = (cache.k.data_ptr(), Tb, masks, logits, pool_layer, "tree" if tree is not None else "causal",
               self._keep(cache, masks))
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._capture(key, cache, Tb, masks, logits, pool_layer, tree=tree is not None)
            if cap is None:
                return NotImplemented
        cap.graph.replay()
        self.replays += 1
        if pool_layer is not None:
            return cap.out[0].clone(), cap.out[1].clone()
        return cap.out.clone() if logits == "last" else cap.out[:T].clone()

    def chain(self, token: int, cache, start: int, n: int, masks: Masks) -> list[int]:
        """Plain greedy decoding of ``n`` tokens (at most :data:`CHAIN_MAX`) on the device: ``token`` fed
        at ``start``, then each argmax at the next position, by replaying one captured
        :class:`ChainedStep` ``n`` times with a single read of the ``n`` tokens at the end (the caller
        stops at an end token it finds among them; keys are written up to ``start + n - 1``). ``masks``:
        the full model's. ``NotImplemented`` where a graph cannot serve (graphs off, not a slot)."""
        if not self.enabled or cache.limit == 0:
            return NotImplemented
        if not 1 <= n <= CHAIN_MAX or start + n > cache.k.shape[2]:
            raise ValueError(f"a chained decode of {n} tokens at {start} (1 .. {CHAIN_MAX}, within the slot's "
                             f"{cache.k.shape[2]} positions)")
        dev = self.backbone.device
        if self._chain is None:
            self._chain = (torch.zeros(4, dtype=torch.long, device=dev),
                           torch.zeros(CHAIN_MAX, dtype=torch.long, device=dev))
        state, out = self._chain
        key = (cache.k.data_ptr(), "chain", masks, self._keep(cache, masks))
        cap = self._graphs.get(key)
        if cap is None:
            state.copy_(torch.tensor([token, start, 0, 0]))
            cap = self._capture(key, cache, 1, masks, "all", chained=True)
            if cap is None:
                return NotImplemented
        state.copy_(torch.tensor([token, start, 0, 0]), non_blocking=True)  # the capture's warm-up moved it
        for _ in range(n):
            cap.graph.replay()
        self.replays += n
        return out[:n].tolist()

    def warm(self, cache, masks: Masks, pool_layer: int | None = None, drafting: bool = False,
             trees: bool = False) -> int:
        """Capture, before any request needs them, the steps of ``masks`` on ``cache``'s slot (a fresh one,
        as :meth:`new_cache` gives). The full model's (``drafting=False``): decoding and verification
        (``"all"`` logits, every bucket) and prefill chunks (``"last"``, every bucket and prefill bucket, with
        ``pool_layer``'s routing pool if given). A skip set's (``drafting=True``): what its drafters replay, one
        token's ``"last"`` logits (layer skip) and ``"all"`` logits of every bucket (a cascade's check of a
        statistical proposal). The full model's also captures plain greedy decoding's chain (:meth:`chain`), and
        with ``trees`` the tree steps of every bucket (a head that drafts trees verifies them there).
        Writes keys the next request overwrites. Returns the graphs captured now."""
        before = self.captures
        ids = torch.zeros(PREFILL_BUCKETS[-1], dtype=torch.long)
        if drafting:
            steps = [(1, "last", None, None)] + [(Tb, "all", None, None) for Tb in BUCKETS]
        else:
            steps = [(Tb, "all", None, None) for Tb in BUCKETS] + [(Tb, "last", pool_layer, None)
                                                                   for Tb in BUCKETS + PREFILL_BUCKETS]
            if trees:  # any tree of a bucket replays the same graph: a root and its children
                steps += [(Tb, "all", None, [-1] + [0] * (Tb - 1)) for Tb in BUCKETS[1:]]
        for Tb, logits, layer, tree in steps:
            if self._replay(ids[:Tb], cache, 0, masks, logits, Tb, layer, tree) is NotImplemented:
                break  # a failed capture turned graphs off
        if not drafting and self.enabled:
            self.chain(0, cache, 0, 1, masks)  # plain greedy decoding's chain (Lane.chain)
        return self.captures - before

    def _keep(self, cache, masks: Masks) -> tuple[int, ...]:
        """The layer counts whose feature rows a step of ``masks`` over ``cache`` writes: the cache's own for
        the full model's steps (a draft's residual stream is not the target's), none otherwise."""
        return tuple(cache.feature_layers) if cache.features is not None and masks == self.backbone._full else ()

    def _tables(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._rope.get(capacity)
        if t is None:
            t = self._rope[capacity] = self.backbone.rope_table(capacity)
        return t

    def _capture(self, key, cache, Tb: int, masks: Masks, logits: str, pool_layer: int | None = None,
                 chained: bool = False, tree: bool = False) -> Captured | None:
        """Capture the static step of ``key`` (with ``chained``: its :class:`ChainedStep`, over :meth:`chain`'s
        buffers; with ``tree``: a tree step), after compiling its pieces and a warm-up run on a side stream."""
        cos, sin = self._tables(cache.k.shape[2])
        keep = self._keep(cache, masks)
        rows = (cache.features,) if keep else ()  # the slot's feature rows, written by the step
        if chained:
            args = (*self._chain, cache.k, cache.v, cos, sin, *rows)
        else:
            buf = self._inputs[(Tb, tree)]
            args = (buf[:Tb], buf[Tb:], cache.k, cache.v, cos, sin, *rows)

        def build(ops):
            step = StaticStep(self.backbone, Tb, masks, logits, ops, pool_layer, keep, tree)
            return ChainedStep(step) if chained else step

        return self.capture(key, build, args)

    def drop(self, owned: Callable[[object], bool]) -> int:
        """Forget the captured graphs whose key ``owned`` says yes to (a replaced eagle head's levels); their
        memory goes back to the graphs' shared pool, for later captures. Call it where nothing captures or
        replays at the same time. Returns how many."""
        keys = [key for key in self._graphs if owned(key)]
        for key in keys:
            del self._graphs[key]
        return len(keys)

    def capture(self, key, build: Callable, args: tuple, turns_off: bool = True) -> Captured | None:
        """The graph of ``build(ops)(*args)`` under ``key`` (any hashable that names the step, its shapes and its
        buffers' addresses), captured now if it was not: its pieces compiled as :attr:`compile` says (``ops``
        a :class:`StepOps`, or ``None``: plain kernels), a warm-up run on a side stream, then the capture. The
        drafters' own static steps (an eagle head's) are captured here too, in the same memory pool. ``None``
        when capturing fails, and graphs off (said once) unless ``turns_off`` is false (a drafter's own step:
        the caller runs it eagerly, and the target's graphs stay on; such a step is captured with plain kernels,
        so that its failing never changes how the target's steps compile). Its ``graph.replay()`` rewrites
        ``out``."""
        cap = self._graphs.get(key)
        if cap is not None:
            return cap
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, not {self.compile!r}")
        compile = self.compile if turns_off else "none"
        if compile == "ops":
            try:  # compiled here, outside any capture (a compilation cannot run inside one)
                if self._ops is None:
                    self._ops = StepOps.compiled()
                build(self._ops)(*args)
            except Exception as exc:  # noqa: BLE001 - no compiler (Triton) or a failed compilation: plain kernels
                self.compile = "none"
                print(f"adaptive: compiling the step's pieces failed ({type(exc).__name__}: {exc}); capturing plain "
                      "kernels", file=sys.stderr)
        compile = self.compile if turns_off else "none"  # (changed above if compiling the pieces failed)
        step = build(self._ops if compile == "ops" else None)
        if compile == "step":
            step = torch.compile(step, fullgraph=True, dynamic=False)
        try:
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device=self.backbone.device)
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):  # warm-up (cuBLAS workspaces, compiling); the same step: writes are right
                    for _ in range(2 if compile == "step" else 1):
                        step(*args)
            finally:  # the eager fallback must not race the warm-up's kernels
                torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                out = step(*args)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly from now on
            self.enabled = self.enabled and not turns_off
            what = "decoding eagerly" if turns_off else "this step runs eagerly"
            print(f"adaptive: CUDA graph capture failed ({type(exc).__name__}: {exc}); {what}", file=sys.stderr)
            return None
        cap = self._graphs[key] = Captured(graph, out)
        return cap
