"""An eagle head's draft step at static shapes, captured as CUDA graphs beside the target's steps.

On a GPU the head's eager step is a few dozen kernel launches a level, each longer than its arithmetic
for a head this small; the target's own steps are replayed graphs (:mod:`adaptive.engine.graphs`, whose
terms *bucket*, *slot* and *position tensors* this module uses). A *head level* is one call of the head
on a block of rows: :meth:`EagleStep.rows <adaptive.drafters.eagle.EagleStep.rows>` then
:meth:`EagleStep.logits <adaptive.drafters.eagle.EagleStep.logits>`. :class:`StaticHeadStep` is a head
level with no shape or value that depends on data, and :class:`HeadGraphs` captures it once per bucket
on a pooled *head slot* (the head's keys and values and a request's extra vocabulary rows at fixed
addresses) and replays it for :class:`~adaptive.drafters.eagle_drafter.EagleDrafter`.

Terms, defined once:

* *committed*: the head-cache rows every row of a level sees (those computed from the target's features,
  and for a chain's draft rows the drafts before them).
* *window*: the :data:`HEAD_WINDOW` head-cache rows from ``committed`` on, which a row sees only where its
  mask says (a tree's ancestors; a block's earlier rows). A level writes its rows from ``at`` on, inside
  the window; rows past the window are never seen.

What a graph cannot do stays on the host: the lookup tokens (prompt lookup over the drafted context) and
the choice of the next level's tokens, one read of each level's logits, as the eager drafter reads them.
A level the static steps cannot serve (more rows than the largest bucket, rows past the window, more
extra rows than the slot holds) runs eagerly over the same head cache.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from adaptive.drafters.eagle import NO_LOOKUP, EagleHead, EagleStep, HeadCache, TreeShape, step_settings
from adaptive.engine.graphs import BUCKETS, SlotPool, StepGraphs, bucket_for, capacity_for, zeros_kv

HEAD_WINDOW = 64  # rows after the committed ones a level sees by mask: a tree's drafted levels (width x depth)


def head_meta(committed: int, at: int, rows: int, bucket: int, positions: list[int] | None = None,
              seen: list[list[int]] | None = None, window: int = HEAD_WINDOW) -> list[int]:
    """A head level's position tensors, ``3 + bucket + bucket * window`` ints: ``committed``, ``at``, the last
    real row, each row's rotary position (``positions``; default its slot ``at + r``), then row by row whether
    it sees each window column (``seen[r]``: the columns relative to ``committed``; default: every column up
    to its own slot). Padding rows sit at the slots after the real ones and see only themselves.
    Example: ``head_meta(10, 11, 1, 2, window=4)`` -> ``[10, 11, 0, 11, 12, 1, 1, 0, 0, 0, 0, 1, 0]`` (row 0
    at slot 11 sees columns 10 and 11; the padding row at slot 12 sees itself)."""
    if not 0 < rows <= bucket:
        raise ValueError(f"a level of {rows} rows does not fit a bucket of {bucket}")
    if at < committed or at - committed + bucket > window:
        raise ValueError(f"rows {at} .. {at + bucket - 1} are not inside the window of {window} after {committed}")
    own = at - committed  # the first row's column
    positions = list(range(at, at + rows)) if positions is None else list(positions)
    seen = [list(range(own + r + 1)) for r in range(rows)] if seen is None else seen
    if len(positions) != rows or len(seen) != rows:
        raise ValueError(f"a level of {rows} rows needs {rows} positions and {rows} masks")
    mask = [[0] * window for _ in range(bucket)]
    for r, cols in enumerate(seen):
        for c in cols:
            if not 0 <= c <= own + r:
                raise ValueError(f"row {r} at column {own + r} cannot see column {c}")
            mask[r][c] = 1
    for r in range(rows, bucket):
        mask[r][own + r] = 1
    return [committed, at, rows - 1, *positions, *(at + r for r in range(rows, bucket)),
            *(x for row in mask for x in row)]


def level_banned(committed: int, at: int, seen: list[list[int]], device=None) -> torch.Tensor:
    """An eager head level's mask (:meth:`EagleStep.rows <adaptive.drafters.eagle.EagleStep.rows>`'s ``banned``),
    ``[T, at + T]`` bool, True: may not look, for the rows :func:`head_meta` describes by ``committed``, ``at`` and
    ``seen``. Example: ``level_banned(1, 2, [[0, 1]])`` -> ``[[False, False, False]]`` and
    ``level_banned(1, 2, [[1]])`` -> ``[[False, True, False]]``."""
    T = len(seen)
    banned = torch.ones(T, at + T, dtype=torch.bool, device=device)
    banned[:, :committed] = False
    for r, cols in enumerate(seen):
        banned[r, [committed + c for c in cols]] = False
    return banned


def level_inputs(tokens: list[int], lookups: list[int], index: list[int], n_extra: int, meta: list[int],
                 bucket: int) -> torch.Tensor:
    """A :class:`StaticHeadStep`'s ``ints`` (long, on the host): the rows' ``tokens``, their ``lookups``
    (:data:`~adaptive.drafters.eagle.NO_LOOKUP`: none) and the lookups' vocabulary ``index`` (-1: none), each
    padded to ``bucket`` (token 0, no lookup), then ``n_extra`` and ``meta`` (:func:`head_meta`). Example:
    ``level_inputs([7], [3], [-1], 2, meta, 2)`` -> ``[7, 0, 3, -1, -1, -1, 2, *meta]``."""
    pad = bucket - len(tokens)
    return torch.tensor([*tokens, *[0] * pad, *lookups, *[NO_LOOKUP] * pad, *index, *[-1] * pad, n_extra, *meta])


class StaticHeadStep:
    """A head level over ``bucket`` rows with every shape fixed (:mod:`adaptive.engine.static`'s rules: nothing
    read back to the host), the formulas :class:`~adaptive.drafters.eagle.EagleStep`'s.

    Inputs (device tensors, fixed addresses when captured): ``ints`` ``[4 + 4 * bucket + bucket * window]``
    long: the rows' tokens, their lookup tokens (:data:`~adaptive.drafters.eagle.NO_LOOKUP`: none), their lookup
    tokens' vocabulary index (-1: none), the request's extra row count, then :func:`head_meta`; ``u``
    ``[bucket, H]`` the rows' fused inputs (the step's dtype); ``k``/``v`` the head slot ``[kv_heads, C, D]``;
    ``cos``/``sin`` ``[C, D]``; ``extra`` ``[X, H]`` the slot's extra rows. Returns ``(g [bucket, H], logits)``,
    float32 logits ``[bucket, V' + X]`` (``logits="all"``) or ``[1, V' + X]`` of the last real row
    (``"last"``), ``-inf`` past the request's extra rows. ``embed``: the target's token embedding."""

    def __init__(self, step: EagleStep, embed, bucket: int, logits: str, window: int = HEAD_WINDOW):
        if logits not in ("all", "last"):
            raise ValueError(f"a head level returns 'all' or 'last' logits, not {logits!r}")
        self.step, self.embed, self.bucket, self.logits, self.window = step, embed, bucket, logits, window

    def __call__(self, ints: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Tb, W, C = self.bucket, self.window, k.shape[1]
        tokens, looks, index = ints[:Tb], ints[Tb:2 * Tb], ints[2 * Tb:3 * Tb]
        n_extra, meta = ints[3 * Tb], ints[3 * Tb + 1:]
        committed, at = meta[0], meta[1]
        emb = self.embed(torch.cat([tokens, looks.clamp(min=0)]))  # [2 * Tb, H]
        positions = meta[3:3 + Tb]
        q, keys, values = self.step.project(u, emb[:Tb], emb[Tb:], looks != NO_LOOKUP, cos.index_select(0, positions),
                                            sin.index_select(0, positions))
        slots = at + torch.arange(Tb, device=u.device)
        k.index_copy_(1, slots, keys)
        v.index_copy_(1, slots, values)
        seen = meta[3 + Tb:].view(Tb, W) > 0  # [Tb, W]
        rel = torch.arange(C, device=u.device) - committed  # [C]: a column's window column, when 0 <= rel < W
        inside = (rel >= 0) & (rel < W)
        banned = (rel >= W).unsqueeze(0) | (inside.unsqueeze(0) & ~seen.index_select(1, rel.clamp(0, W - 1)))
        g = self.step.attend(u, q, k, v, banned)  # [Tb, H]
        if self.logits == "last":
            return g, self.step.logits(g.index_select(0, meta[2:3]), index.index_select(0, meta[2:3]), extra, n_extra)
        return g, self.step.logits(g, index, extra, n_extra)


class HeadGraphs:
    """One head step's (:class:`~adaptive.drafters.eagle.EagleStep`) captured levels on one backbone's graphs
    (:class:`~adaptive.engine.graphs.StepGraphs`, which captures them into its memory pool), and the pool of
    head slots they replay over. A head slot of capacity ``C`` (a target slot's capacity plus the window) holds
    the head's keys and values and ``C - HEAD_WINDOW`` extra vocabulary rows (a request's prompt tokens' LM-head
    rows, at most one per prompt position). Get it with :func:`head_graphs`."""

    _serials = itertools.count()  # each HeadGraphs' own number, in its graphs' keys (an id() may be reused)

    def __init__(self, step: EagleStep, graphs: StepGraphs, embed, device):
        self.step, self.device = step, device
        self.serial = next(HeadGraphs._serials)
        # the graphs hold this object, so neither they nor the backbone whose embedding this is are held back
        self._graphs = weakref.ref(graphs)
        self._embed = weakref.WeakMethod(embed) if hasattr(embed, "__self__") else (lambda: embed)
        self.pool = SlotPool(self._allocate)
        self._ints: dict[int, torch.Tensor] = {}  # bucket -> its ints buffer
        self._u: dict[int, torch.Tensor] = {}  # bucket -> its fused inputs' buffer
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # capacity -> (cos, sin)
        self.replays = 0
        self.released = False  # its head was replaced (release_head): its levels run eagerly from then on
        self.failed = False  # a capture of its levels failed (said once on stderr): they run eagerly

    def release(self) -> None:
        """Drop this head's captured levels (:func:`release_head`); requests still drafting with it run eagerly."""
        self.released = True
        graphs = self._graphs()
        if graphs is not None:
            graphs.drop(lambda key: key[:2] == ("eagle", self.serial))

    def _allocate(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.step.shape
        k, v = zeros_kv((s.kv_heads,), s.head_dim, torch.float32, self.device, capacity)
        return k, v, torch.zeros(capacity - HEAD_WINDOW, s.hidden, dtype=self.step.dtype, device=self.device)

    @torch.inference_mode()  # a slot made while warming holds inference tensors, which only inference mode writes
    def cache(self, target_capacity: int, extra: torch.Tensor) -> HeadCache:
        """A head cache over a pooled head slot for a target slot of ``target_capacity`` positions, with the
        request's ``extra`` rows (``[E, H]``, at most ``target_capacity``) copied in; the slot returns to the pool
        when the cache is collected."""
        if extra.shape[0] > target_capacity:
            raise ValueError(f"{extra.shape[0]} extra rows do not fit a head slot of {target_capacity}")
        capacity = target_capacity + HEAD_WINDOW
        slot = self.pool.take(capacity)
        slot[2][:extra.shape[0]].copy_(extra)
        cache = HeadCache(self.step.shape, capacity, self.device, slot=slot)
        weakref.finalize(cache, self.pool.give, capacity, *slot)
        return cache

    def run(self, cache: HeadCache, u: torch.Tensor, tokens: list[int], lookups: list[int], index: list[int],
            n_extra: int, committed: int, at: int, positions: list[int] | None = None,
            seen: list[list[int]] | None = None, last: bool = False):
        """One head level by replaying its graph (captured now if it was not): ``(g [T, H], logits)`` as
        :class:`StaticHeadStep` returns them for the ``T`` real rows (``[1, ...]`` with ``last``), the logits cut
        to the request's vocabulary (``V' + n_extra``); ``NotImplemented`` where no static step serves it (graphs
        off, a failed capture, ``T`` past the largest bucket, rows past the window or the slot, a cache that is
        not a slot's)."""
        T = len(tokens)
        Tb = bucket_for(T)
        graphs = self._graphs()
        if (graphs is None or not graphs.enabled or self.released or self.failed or Tb is None or cache.slot is None
                or cache.k is not cache.slot[0] or at - committed + Tb > HEAD_WINDOW or at + Tb > cache.k.shape[1]):
            return NotImplemented
        buf = self._buffers(Tb)
        meta = head_meta(committed, at, T, Tb, positions, seen)
        buf[0].copy_(level_inputs(tokens, lookups, index, n_extra, meta, Tb), non_blocking=True)
        buf[1][:T].copy_(u)
        cap = self._capture(graphs, cache, Tb, "last" if last else "all")
        if cap is None:
            return NotImplemented
        cap.graph.replay()
        self.replays += 1
        width = len(self.step.ids) + n_extra
        g, logits = cap.out
        return g[:T].clone(), logits[:, :width].clone() if last else logits[:T, :width].clone()

    @torch.inference_mode()  # as drafting writes the slots (made in inference mode)
    def warm(self, target_capacity: int, tree_width: int | None) -> int:
        """Capture the levels a request on a target slot of ``target_capacity`` replays first: every bucket's
        ``"last"`` logits (a block of the target's rows, a chain's drafts) and, for trees of ``tree_width``, the
        ``"all"`` logits of the buckets their levels take. Returns the graphs captured now."""
        graphs = self._graphs()
        if graphs is None or not graphs.enabled or self.released:
            return 0
        before = graphs.captures
        cache = self.cache(target_capacity, torch.zeros(0, self.step.shape.hidden, device=self.device))
        steps = [(Tb, "last") for Tb in BUCKETS]
        if tree_width is not None:
            steps += [(Tb, "all") for Tb in BUCKETS if Tb <= bucket_for(min(tree_width, BUCKETS[-1]))]
        for Tb, logits in steps:
            buf = self._buffers(Tb)
            buf[0].copy_(level_inputs([0] * Tb, [NO_LOOKUP] * Tb, [-1] * Tb, 0, head_meta(0, 0, Tb, Tb), Tb))
            if self._capture(graphs, cache, Tb, logits) is None:
                break
        return graphs.captures - before

    def _buffers(self, Tb: int) -> tuple[torch.Tensor, torch.Tensor]:
        if Tb not in self._ints:
            self._ints[Tb] = torch.zeros(4 + 4 * Tb + Tb * HEAD_WINDOW, dtype=torch.long, device=self.device)
            self._u[Tb] = torch.zeros(Tb, self.step.shape.hidden, dtype=self.step.dtype, device=self.device)
        return self._ints[Tb], self._u[Tb]

    def _capture(self, graphs: StepGraphs, cache: HeadCache, Tb: int, logits: str):
        embed = self._embed()
        if self.released or embed is None:
            return None
        capacity = cache.k.shape[1]
        if capacity not in self._tables:
            cos, sin = self.step.rope(0, capacity, self.device)
            self._tables[capacity] = (cos.clone(), sin.clone())
        k, v, extra = cache.slot
        args = (*self._buffers(Tb), k, v, *self._tables[capacity], extra)
        key = ("eagle", self.serial, k.data_ptr(), Tb, logits)
        cap = graphs.capture(key, lambda ops: StaticHeadStep(self.step, embed, Tb, logits), args, turns_off=False)
        self.failed = cap is None  # the head's levels run eagerly from now on; the target's graphs stay on
        return cap


def head_graphs(step: EagleStep, backbone, embed) -> HeadGraphs | None:
    """The :class:`HeadGraphs` of ``step`` on ``backbone``'s CUDA graphs (made on first use, kept with them);
    ``None`` where the backbone has none or they are off (an eager backbone, llama.cpp)."""
    graphs = getattr(backbone, "graphs", None)
    if graphs is None or not graphs.enabled or not step.capturable:
        return None
    kept = graphs.attached.setdefault("eagle", {})
    found = kept.get(id(step))
    if found is None or found.step is not step:
        found = kept[id(step)] = HeadGraphs(step, graphs, embed, backbone.device)
    return found


def release_head(head: EagleHead, backbone) -> int:
    """Forget ``head``'s captured levels on ``backbone`` (a head replaced by a refined one, whose graphs would
    otherwise stay with the backbone's for good); its levels are never captured again (a request planned with it
    before runs them eagerly). Call it where no request drafts at the same time (the runtime holds its model
    lock). Returns how many :class:`HeadGraphs` were released."""
    for step in head.built_steps():
        step.capturable = False
    graphs = getattr(backbone, "graphs", None)
    if graphs is None:
        return 0
    kept = graphs.attached.get("eagle", {})
    released = 0
    for step in head.built_steps():
        found = kept.get(id(step))
        if found is not None and found.step is step:
            del kept[id(step)]
            found.release()
            released += 1
    return released


def warm_head(head: EagleHead, backbone, tree: TreeShape | None, max_len: int = 1) -> int:
    """With CUDA graphs: capture ``head``'s levels, as the backbone's eagle drafters run it (its step in the
    backbone's dtype and weight mode, :func:`~adaptive.drafters.factory.build_drafter`), for requests of up to
    ``max_len`` positions now (a server's startup, :meth:`AdaptiveRuntime.warm
    <adaptive.runtime.runtime.AdaptiveRuntime.warm>`), on the head slot such a request takes; ``tree``: how its
    drafts branch (``None``: chains). Returns the graphs captured (0 without graphs)."""
    step = head.step(*step_settings(backbone))
    found = head_graphs(step, backbone, backbone.embed_rows)
    if found is None:
        return 0
    return found.warm(capacity_for(max_len, backbone.max_positions), None if tree is None else tree.width)
