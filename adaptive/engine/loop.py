"""The decoding loop on tensors, in gpt-fast's shape: :func:`prefill`, then :func:`decode_steps`.

Plain decoding (``ar``) is the same loop with no drafter: every step verifies zero drafted tokens
and keeps the target's own next token. What to draft with is decided between the two (the runtime
routes on the prefill's pooled embedding). The driver over them is :meth:`Engine.decode
<adaptive.engine.engine.Engine.decode>` (text, EOS and stop strings; :meth:`Engine.step
<adaptive.engine.engine.Engine.step>` for a batch).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from adaptive.engine.backbone import Segment
from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.protocol import DecodeState, Draft, DraftChoice, Drafter, DraftLengthPolicy, FixedDraftLength
from adaptive.engine.sampling import (
    greedy_accept_batch,
    greedy_accept_host,
    greedy_accept_ids,
    greedy_accept_tree,
    sample_token,
    speculative_accept,
    speculative_accept_tree,
    warp_probs,
)
from adaptive.errors import ConfigError

CHAIN_TOKENS = 8  # plain greedy steps replayed on the device between two host reads (batch 1, CUDA graphs)
NO_DRAFT = Draft(torch.empty(0, dtype=torch.long))  # a plain step's (one shared: made once, not per token)

# (draft, p_logits [k+1, V], config, generator) -> (n_accepted, new ids: the n accepted drafts and the next token)
Acceptor = Callable[[Draft, torch.Tensor, GenerationConfig, torch.Generator | None], tuple[int, list[int]]]


def default_acceptor(draft: Draft, p_logits: torch.Tensor, cfg: GenerationConfig, gen) -> tuple[int, list[int]]:
    """Greedy: longest matching prefix (one host read). Sampling: speculative sampling against the warped target."""
    if cfg.greedy:
        return greedy_accept_ids(draft.tokens, p_logits.argmax(-1))
    p = warp_probs(p_logits, cfg.temperature, cfg.top_k, cfg.top_p)
    q = draft.q
    if q is None:  # deterministic proposal: a point mass on each drafted token
        q = torch.zeros(len(draft), p.shape[-1], device=p.device)
        q[torch.arange(len(draft)), draft.tokens] = 1.0
    n, nxt = speculative_accept(draft.tokens, q, p, gen)
    return n, draft.tokens[:n].tolist() + [nxt]


@dataclass
class GenerationStats:
    """Statistics of one generation. Steps are target verification forwards after the prefill."""

    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps whose draft was cut short by a rejected token
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per step -> count
    draft_lengths: Counter = field(default_factory=Counter)  # drafted per step -> count
    prefill_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens a prefix cache held (not prefilled)
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    prompt_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per verification step, counting the target's own token (``ar`` = 1.0)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decoded_tokens(self) -> int:
        """Tokens decoded after the prefill (whose forward gave the first)."""
        return max(self.tokens - 1, 0)

    @property
    def decode_time(self) -> float:
        """Seconds after the prefill: the decoding of :attr:`decoded_tokens`."""
        return max(self.total_time - self.prefill_time, 0.0)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejections": self.rejections,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())},
            "prefill_time_s": round(self.prefill_time, 4),
            "draft_time_s": round(self.draft_time, 4),
            "verify_time_s": round(self.verify_time, 4),
            "total_time_s": round(self.total_time, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass(frozen=True)
class Prefill:
    """What a prefill produced: the ``first`` generated token, the prompt's ``pooled`` embedding
    (``[hidden]``, as its :class:`Pooling` says; a tuple of them for a tuple of poolings; ``None``
    unless asked for) and its wall time (s)."""

    first: int
    pooled: torch.Tensor | None
    time: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def merge_pool_args(args: Sequence[dict]) -> dict:
    """One forward's keyword arguments for several poolings' (each from a backbone's ``pool_args``): the
    union of their ``pool_layers``, any of their flags. Example: ``[{"pool_layers": (10,)},
    {"pool_layers": (6, 10)}, {"pool": True}]`` -> ``{"pool_layers": (6, 10), "pool": True}``."""
    out: dict = {}
    for a in args:
        for key, value in a.items():
            if key == "pool_layers":
                out[key] = tuple(sorted(set(out.get(key, ())) | set(value)))
            else:
                out[key] = bool(out.get(key, False) or value)
    return out


def new_generator(cfg: GenerationConfig, device: torch.device) -> torch.Generator | None:
    """The request's random stream: ``None`` when greedy, else seeded with ``cfg.seed`` (random without one)."""
    if cfg.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def as_poolings(pool: bool | Pooling | tuple[Pooling, ...]) -> tuple[Pooling, ...]:
    """A prefill's ``pool`` argument as a tuple of poolings (``True``: ``Pooling()``, the final mean;
    ``False``: none)."""
    if pool is True:
        return (Pooling(),)
    if not pool:
        return ()
    return tuple(pool) if isinstance(pool, tuple) else (pool,)


def cache_positions(n_prompt: int, max_new_tokens: int, draft_len: int) -> int:
    """Positions a request's KV cache needs: the prompt, its new tokens and the longest draft beyond
    them (verified with the pending token). Example: ``cache_positions(10, 5, 8) == 24``."""
    return n_prompt + max_new_tokens + draft_len + 1


def new_cache(backbone, n_prompt: int, cfg: GenerationConfig, shared: int = 0):
    """A KV cache with room for the prompt, ``cfg.max_new_tokens`` and the longest draft beyond them,
    keeping the feature rows ``cfg.features`` names; ``shared``: its first positions a kept prefix
    will fill (:mod:`adaptive.engine.prefix`)."""
    positions = cache_positions(n_prompt, cfg.max_new_tokens, cfg.draft_len)
    extra = {"shared": shared} if shared else {}
    if cfg.features:
        extra["features"] = cfg.features
    return backbone.new_cache(positions, **extra)


def prefill(backbone, prompt_ids: list[int], cache, cfg: GenerationConfig, generator: torch.Generator | None,
            pool: bool | Pooling = False) -> Prefill:
    """Run the prompt through the model into ``cache`` (positions ``0 .. n-1``) and pick the first token.

    Afterwards ``cache.length == len(prompt_ids)`` and the first token is pending (not cached yet).
    ``pool``: also return the prompt's embedding, as :class:`Pooling` says (``True``: ``Pooling()``,
    the final mean; :mod:`adaptive.index.embedding` computes the same). One forward; a
    :class:`ChunkedPrefill` feeds the same prompt a chunk at a time.
    """
    done = ChunkedPrefill(backbone, prompt_ids, cache, cfg, generator, pool).advance()
    assert done is not None
    return done


@dataclass(eq=False)
class ChunkedPrefill:
    """A prefill fed ``chunk`` prompt tokens per :meth:`advance` (``0``: the whole prompt at once), so
    that a server can run decoding steps of other requests between the chunks.

    Chunks start at multiples of ``chunk`` from position 0 and write the cache by position, as one
    forward would; only the last chunk computes logits. A ``mean`` pooling is the chunks' pooled
    means weighted by their lengths (the mean over all positions); a ``last`` pooling comes from
    the last chunk. Example: a 300-token prompt with ``chunk=128`` is three forwards (128, 128, 44
    tokens); :meth:`advance` returns ``None`` twice, then the :class:`Prefill`. ``pool`` may be a
    tuple of poolings, all taken from the same forwards (calibration compares candidates so);
    ``Prefill.pooled`` is then the tuple of their embeddings.
    """

    backbone: object
    prompt_ids: list[int]
    cache: object
    cfg: GenerationConfig
    generator: torch.Generator | None
    pool: bool | Pooling | tuple[Pooling, ...] = False
    chunk: int = 0
    position: int = 0  # prompt tokens prefilled so far
    elapsed: float = 0.0  # wall time of the forwards so far (s)
    _pools: list = field(default_factory=list, repr=False)  # (tokens, {pooling: [hidden]}) per chunk that pooled

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if self.chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {self.chunk}")

    @property
    def poolings(self) -> tuple[Pooling, ...]:
        """The poolings asked for (``True``: ``Pooling()``, the final mean)."""
        return as_poolings(self.pool)

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.position

    def advance(self, tokens: int | None = None) -> Prefill | None:
        """Prefill the next chunk (``tokens``: this many instead, e.g. all that remain, in one forward):
        ``None`` while prompt tokens remain, then the :class:`Prefill`."""
        bb = self.backbone
        t0 = time.perf_counter()
        a, n = self.position, len(self.prompt_ids)
        size = self.chunk if tokens is None else tokens
        b = min(n, a + size) if size else n
        last = b == n
        wanted = [p for p in self.poolings if last or p.mode == "mean"]
        extra = merge_pool_args([bb.pool_args(p) for p in wanted])
        out = bb.forward(torch.tensor(self.prompt_ids[a:b], device=bb.device), self.cache, a,
                         logits="last" if last else "none", **extra)
        self.cache.length = self.position = b
        if wanted:
            self._pools.append((b - a, {p: bb.pooled(out, p) for p in wanted}))
        first = self._first(out.logits[0]) if last else None  # [V] logits of the prompt's last position
        _sync(bb.device)
        self.elapsed += time.perf_counter() - t0
        return Prefill(first, self._pooled(), self.elapsed) if last else None

    def ride(self) -> Segment | None:
        """The next chunk as a :class:`~adaptive.engine.backbone.Segment` that only writes its keys,
        for a decoding step's forward to carry (:func:`step`'s ``riders``), or ``None`` when that
        chunk must be a forward of its own: the prompt's last (its logits give the first token, and
        it pools the embedding) or a chunk of a ``mean`` pooling (pooled per chunk). After the step,
        :meth:`rode` records it. A chunk computes the same keys carried or alone, as one forward
        over the whole prompt does (attention is per sequence; only the rows' rounding may differ,
        as in any batched forward)."""
        if not self.can_ride:
            return None
        a = self.position
        ids = torch.tensor(self.prompt_ids[a:a + self.chunk], device=self.backbone.device)
        return Segment(ids, self.cache, a, logits=False)

    @property
    def can_ride(self) -> bool:
        """Whether :meth:`ride` gives the next chunk (see there)."""
        return 0 < self.chunk < self.remaining and not any(p.mode == "mean" for p in self.poolings)

    def rode(self, segment: Segment, seconds: float) -> None:
        """Record the chunk :meth:`ride` gave, now fed: the prompt has ``len(segment.ids)`` more
        tokens cached, and ``seconds`` (the chunk's share of the step's forward) count as prefill time."""
        if segment.start != self.position or segment.cache is not self.cache:
            raise ValueError(f"a carried chunk at position {segment.start} of a prefill at {self.position}")
        self.position += int(segment.ids.numel())
        self.cache.length = self.position
        self.elapsed += seconds

    def _first(self, logits: torch.Tensor) -> int:
        """The first generated token: greedy, or sampled from the warped distribution."""
        cfg = self.cfg
        if cfg.greedy:
            return int(logits.argmax())
        return sample_token(warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), self.generator)

    def _pooled(self) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        if not self._pools:
            return None
        out = []
        for p in self.poolings:
            rows = [(k, d[p]) for k, d in self._pools if p in d]
            if p.mode == "last" or len(rows) == 1:
                out.append(rows[-1][1])
            else:
                out.append(sum(k * v for k, v in rows) / sum(k for k, _ in rows))
        return tuple(out) if isinstance(self.pool, tuple) else out[0]


@dataclass(eq=False)
class Lane:
    """One sequence between verification steps: its :class:`DecodeState`, drafter (``None``: plain
    steps), draft-length policy (``length_policy``), config, statistics, acceptor and how many tokens it has produced
    (the pending first token counts). :func:`step` advances one or several lanes together."""

    state: DecodeState
    drafter: Drafter | None
    length_policy: DraftLengthPolicy
    cfg: GenerationConfig
    stats: GenerationStats
    acceptor: Acceptor = default_acceptor
    produced: int = 1

    @property
    def done(self) -> bool:
        """``cfg.max_new_tokens`` tokens produced (EOS and stop strings are the caller's to watch)."""
        return self.produced >= self.cfg.max_new_tokens

    @property
    def max_draft(self) -> int:
        """The longest draft this step may make (0: none, no drafter or one token left to produce)."""
        remaining = self.cfg.max_new_tokens - self.produced
        return min(self.cfg.draft_len, remaining - 1) if self.drafter is not None and remaining > 1 else 0

    def propose(self, choice: DraftChoice | None = None) -> Draft:
        """This step's draft (empty for a plain step), timed into ``stats.draft_time``. ``choice``:
        the batch's choice for this lane (:func:`step`); ``None``: the lane's length policy chooses."""
        t0 = time.perf_counter()
        draft = None
        if self.max_draft > 0:
            if choice is None:
                choice = self.length_policy.choose(self.max_draft)
            elif max(choice.length, choice.copy or 0) > self.max_draft:
                raise ValueError(f"a draft of {choice.length} (a copy of {choice.copy}) exceeds this step's longest, "
                                 f"{self.max_draft}")
            if choice.length > 0 or choice.copy:  # a copy may pay where the drafter's model does not
                draft = self.drafter.propose(self.state, choice)
        if draft is None or len(draft) == 0:
            draft = NO_DRAFT  # on the host: a plain step sends one id
        else:
            _sync(self.state.backbone.device)  # the draft's own time (a plain step has none to wait for)
        self.stats.draft_time += time.perf_counter() - t0
        return draft

    def segment(self, draft: Draft) -> Segment:
        """What the verification feeds: the pending token, then the draft (``[k + 1]`` ids), at its position."""
        pending, tokens = self.state.tokens[-1], draft.tokens
        if tokens.device.type == "cpu":  # a statistical draft (or a CPU backbone): built here, one copy to the device
            ids = torch.cat([torch.tensor([pending]), tokens])
        else:  # a layer-skip draft stays where it was drafted
            ids = torch.cat([torch.tensor([pending], device=tokens.device), tokens])
        return Segment(ids, self.state.cache, self.state.position)

    def accept(self, draft: Draft, p_logits: torch.Tensor) -> list[int]:
        """Keep what the target's logits ``p_logits`` (``[k + 1, V]``) accept of ``draft``: the accepted
        drafts and the target's own next token, which become the new tokens (the last one pending)."""
        return self._keep(draft, *self.acceptor(draft, p_logits, self.cfg, self.state.generator))

    def argmax_only(self, draft: Draft) -> bool:
        """Whether this step's acceptance reads only the argmax of the target's rows, on the host:
        greedy with the default acceptor and a draft held on the host (a statistical one or none)."""
        return self.cfg.greedy and self.acceptor is default_acceptor and (draft is NO_DRAFT or draft.tokens.is_cpu)

    @staticmethod
    def draft_ids(draft: Draft) -> list[int]:
        """A draft held on the host as ints (read once a step: each torch operation costs)."""
        return [] if draft is NO_DRAFT else draft.tokens.tolist()

    def accept_argmax(self, draft: Draft, proposed: list[int], target_argmax: list[int]) -> list[int]:
        """:meth:`accept` where :meth:`argmax_only`, from the draft's ids (``proposed``,
        :meth:`draft_ids`) and the argmax of the target's ``k + 1`` rows: the same tokens (greedy
        acceptance reads nothing else)."""
        return self._keep(draft, *greedy_accept_host(proposed, target_argmax))

    def verifies_tree(self, draft: Draft, backbone, alone: bool) -> bool:
        """Whether this step verifies ``draft`` as the tree it is: the default acceptor, the
        lane verified ``alone`` (a batch's rows are chains) on a backbone whose forward runs trees, and
        the cache has room for every node (near a request's end it may not: the cache is sized for
        chains, :func:`cache_positions`). Where not, the step verifies the tree's main chain
        (:meth:`Draft.main_chain`)."""
        return (draft.parents is not None and alone and self.acceptor is default_acceptor
                and getattr(backbone, "verifies_trees", False)
                and self.state.position + len(draft) + 1 <= self.state.cache.max_len)

    def accept_tree(self, backbone, draft: Draft) -> list[int]:
        """Verify a tree draft in one forward (:meth:`Backbone.forward_argmax
        <adaptive.engine.backbone.Backbone.forward_argmax>` with its ``tree``), keep the longest path the
        target's argmax follows (:func:`~adaptive.engine.sampling.greedy_accept_tree`; sampling: the path
        :func:`~adaptive.engine.sampling.speculative_accept_tree` keeps, from the warped logits) and move
        that path's keys to the positions after the pending token (:meth:`Backbone.keep_rows
        <adaptive.engine.backbone.Backbone.keep_rows>`): the new tokens, as a chain's step gives them."""
        state, cfg = self.state, self.cfg
        proposed = self.draft_ids(draft)
        rows = [-1, *(p + 1 for p in draft.parents)]  # row 0 the pending token, row i + 1 node i
        ids = [state.tokens[-1], *proposed]
        if cfg.greedy:
            target = backbone.forward_argmax(ids, state.cache, state.position, tree=rows)
            path, new = greedy_accept_tree(proposed, draft.parents, target)
        else:
            logits = backbone.forward(torch.tensor(ids), state.cache, state.position, logits="all", tree=rows).logits
            p = warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            path, new = speculative_accept_tree(proposed, draft.parents, p, state.generator)
        backbone.keep_rows(state.cache, state.position, [0, *(i + 1 for i in path)])
        return self._keep(draft, len(path), new)

    def chains(self, draft: Draft) -> bool:
        """Whether this step may be a chained decode (:meth:`chain`): plain greedy decoding (no drafter),
        the default acceptor, more than one token left."""
        return (self.drafter is None and draft is NO_DRAFT and self.cfg.greedy and self.acceptor is default_acceptor
                and self.cfg.max_new_tokens - self.produced > 1)

    def chain(self, backbone) -> list[int] | None:
        """Up to :data:`CHAIN_TOKENS` plain greedy steps replayed on the device with one host read
        (:meth:`Backbone.decode_chain <adaptive.engine.backbone.Backbone.decode_chain>`, CUDA graphs): the
        tokens they produce, the last one pending, as that many plain steps would; ``None`` where the
        backbone cannot chain (no CUDA graphs, llama.cpp), and the caller steps once. EOS and stop strings
        are found by the caller among the tokens, so a chain may decode a few tokens past them (never
        past ``max_new_tokens``)."""
        decode_chain = getattr(backbone, "decode_chain", None)
        if decode_chain is None:
            return None
        state = self.state
        n = min(CHAIN_TOKENS, self.cfg.max_new_tokens - self.produced)
        new = decode_chain(state.tokens[-1], state.cache, state.position, n)
        if new is None:
            return None
        state.cache.length += n  # the pending token and the first n - 1 of the new ones were fed
        self.stats.steps += n
        self.stats.accept_hist[0] += n
        state.tokens.extend(new)
        self.produced += n
        return new

    def _keep(self, draft: Draft, n: int, new: list[int]) -> list[int]:
        """Record ``n`` accepted drafts and the step's ``new`` tokens (the accepted ones, then the next)."""
        state, stats = self.state, self.stats
        remaining = self.cfg.max_new_tokens - self.produced
        # The verification wrote full keys at pos .. pos+k; keep the accepted ones. Rolling back the
        # rejected drafts is this assignment: their stale keys are overwritten before being read.
        state.cache.length += n + 1
        k = draft.depth  # a chain's length; a tree's longest path (its other nodes were alternatives)
        stats.steps += 1
        stats.drafted += len(draft)
        stats.accepted += n
        stats.rejections += n < k
        stats.accept_hist[n] += 1
        if self.drafter is not None and remaining > 1:
            stats.draft_lengths[k] += 1  # 0 when the policy chose a plain step
            if k:
                self.length_policy.update(draft, n)
        state.tokens.extend(new)
        self.produced += len(new)
        return new


def step(backbone, lanes: Sequence[Lane], choices: Sequence[DraftChoice | None] | None = None,
         riders: Sequence[ChunkedPrefill] = ()) -> list[list[int]]:
    """One verification step of each lane (none of them done); returns each lane's new tokens.
    ``choices``: each lane's draft choice, made for the batch (``None`` for a lane, or for all: its
    policy chooses). ``riders``: prefills whose next chunk the same forward carries
    (:meth:`ChunkedPrefill.ride`; each must give one): their keys are written beside the
    verifications, so a server's prefills cost no forward of their own and the decoding rows are
    multiplied with the chunk's, as one wider product.

    Every lane drafts (one after another), then one full-model forward verifies them all: a lone
    lane without riders through :meth:`~adaptive.engine.backbone.Backbone.forward`, otherwise
    through :meth:`~adaptive.engine.backbone.Backbone.forward_batch` (ragged: each its own cache,
    position and draft length, so nothing is padded and nothing padded can be accepted). Then each
    lane accepts from its own logits: the greedy ones together, counted on the device with one host
    read for all (:func:`~adaptive.engine.sampling.greedy_accept_batch`), the sampling ones each with
    its own random stream. The verification's time counts in every lane's
    ``verify_time``; a rider's share of it (by rows) in its prefill time.
    """
    carried = [r.ride() for r in riders]
    if any(c is None for c in carried):
        raise ConfigError("a step carries a prefill's chunk only when it is not the prompt's last nor a mean "
                          "pooling's (can_ride)")
    drafts = [lane.propose(c) for lane, c in zip(lanes, choices or [None] * len(lanes))]
    alone = len(lanes) == 1 and not carried
    drafts = [d if d.parents is None or lane.verifies_tree(d, backbone, alone) else d.main_chain()
              for lane, d in zip(lanes, drafts)]
    t0 = time.perf_counter()
    chained = lanes[0].chain(backbone) if alone and lanes[0].chains(drafts[0]) else None
    if chained is not None:  # plain greedy decoding replayed on the device, one host read for several tokens
        new, rows = [chained], len(chained)
    elif drafts[0].parents is not None:  # a tree, verified alone (verifies_tree)
        new, rows = [lanes[0].accept_tree(backbone, drafts[0])], len(drafts[0]) + 1
    elif len(lanes) == 1 and not carried and lanes[0].argmax_only(drafts[0]):
        # greedy on a host draft reads only the target's argmax: ints all the way, no rows copied
        lane, draft = lanes[0], drafts[0]
        proposed = lane.draft_ids(draft)
        target = backbone.forward_argmax([lane.state.tokens[-1], *proposed], lane.state.cache, lane.state.position)
        new, rows = [lane.accept_argmax(draft, proposed, target)], len(proposed) + 1
    else:
        segments = [lane.segment(d) for lane, d in zip(lanes, drafts)]
        if len(segments) == 1 and not carried:
            s = segments[0]
            logits = [backbone.forward(s.ids, s.cache, s.start, logits="all").logits]  # [k + 1, V]
        else:
            logits = backbone.forward_batch(segments + carried)[:len(segments)]
        # greedy lanes accept together on the device: one host read for the batch (issue 64)
        greedy = [i for i, lane in enumerate(lanes) if lane.cfg.greedy and lane.acceptor is default_acceptor]
        counted = {}
        if len(greedy) > 1:
            counted = dict(zip(greedy, greedy_accept_batch([drafts[i].tokens for i in greedy],
                                                           [logits[i].argmax(-1) for i in greedy])))
        new = [lane._keep(d, *counted[i]) if i in counted else lane.accept(d, p)
               for i, (lane, d, p) in enumerate(zip(lanes, drafts, logits))]
        rows = sum(int(s.ids.numel()) for s in segments + carried)
    elapsed = time.perf_counter() - t0
    for lane in lanes:
        lane.stats.verify_time += elapsed
    for r, c in zip(riders, carried):
        r.rode(c, elapsed * int(c.ids.numel()) / rows)
    return new


def decode_steps(
    backbone,
    state: DecodeState,
    drafter: Drafter | None = None,
    policy: DraftLengthPolicy | None = None,
    cfg: GenerationConfig | None = None,
    stats: GenerationStats | None = None,
    acceptor: Acceptor = default_acceptor,
) -> Iterator[list[int]]:
    """Yield each verification step's new tokens (accepted drafts, then the target's own token).

    ``state`` is as :func:`prefill` left it: ``state.tokens`` is the prompt and the first token
    (pending), which counts as one of ``cfg.max_new_tokens`` (default ``state.config``). Steps run
    until that many tokens have been produced or the caller stops iterating (EOS and stop strings
    are the caller's to watch). ``drafter`` drafts with ``policy`` choosing each step's
    :class:`DraftChoice` (default: ``cfg.draft_len`` every step); ``None`` decodes plainly. This
    loop owns acceptance and KV rollback: :func:`step` on one :class:`Lane`.
    """
    cfg = cfg or state.config
    lane = Lane(state, drafter, policy or FixedDraftLength(cfg.draft_len), cfg,
                stats if stats is not None else GenerationStats(), acceptor)
    while not lane.done:
        yield step(backbone, [lane])[0]

