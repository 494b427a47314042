"""The drafter protocol: what the decode loop asks of a drafter and of a draft-length policy.

Terms, defined once:

* *pending token*: the last token of ``DecodeState.tokens``. It is not in the KV cache yet and
  sits at position ``cache.length``; every step feeds it first.
* *draft*: ``k`` proposed tokens to follow the pending token (:class:`Draft`).
* *verification*: one full-model forward over the pending token and the ``k`` drafts; it yields
  ``k + 1`` rows of target logits. The loop (:mod:`adaptive.engine.loop`) alone owns acceptance
  and KV rollback. A drafter may write draft keys into the cache beyond ``cache.length`` (the
  verification forward overwrites them) but never changes ``cache.length``.
* *tree*: a draft whose tokens branch (:attr:`Draft.parents`): several candidates for a position,
  each following its parent. One verification runs the pending token and every node, each
  attending to the cache and its own ancestors only; the loop keeps the path the target accepts
  (greedy: the one its argmax follows; sampling: speculative sampling of each node's children as
  point masses) and moves that path's keys to consecutive positions.
* *choice*: what a :class:`DraftLengthPolicy` decides before each step (:class:`DraftChoice`):
  how many tokens to draft, and for a cascade how many of them its layer-skip level drafts.
* *plan*: what a policy expects of drafting up to ``n`` tokens this step (:class:`DraftPlan`), so
  that a server can choose the lengths of a whole batch together (:mod:`adaptive.costs.batch`).

A drafter is built once per request (:func:`adaptive.drafters.factory.build_drafter`); a policy
may outlive requests (the runtime keeps one bandit per domain), so a policy never holds a drafter:
what it learns comes from the :class:`Draft` the loop hands back with the accepted count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from adaptive.engine.backbone import Backbone, KVCache
    from adaptive.engine.config import GenerationConfig

LAYER_SKIP, STATISTICAL = "layer_skip", "statistical"  # where a cascade's draft token came from


@dataclass
class DecodeState:
    """What a drafter may read while proposing (the loop updates ``tokens`` and ``cache.length``)."""

    backbone: Backbone
    cache: KVCache
    tokens: list[int]  # prompt + generated; the last one is pending
    config: GenerationConfig
    generator: torch.Generator | None

    @property
    def position(self) -> int:
        """Position of the pending token."""
        return self.cache.length


@dataclass(frozen=True)
class DraftChoice:
    """``length``: tokens to draft this step (0: a plain step). ``split``: of those, how many a
    cascade's layer-skip level drafts (``None``: the drafter's own setting). ``copy``: for a drafter
    that copies from the context where it can and drafts with a model where it cannot (the eagle
    drafter), how many tokens a copy may run to (a copy costs nothing to propose, so it may run
    longer than ``length``, the model's; 0: no copy this step; ``None``: ``length``)."""

    length: int
    split: int | None = None
    copy: int | None = None

    def __post_init__(self):
        if self.length < 0 or (self.split is not None and not 0 <= self.split <= self.length):
            raise ValueError(f"a draft choice needs length >= 0 and 0 <= split <= length, got {self}")
        if self.copy is not None and self.copy < 0:
            raise ValueError(f"a draft choice's copy length must be >= 0, got {self}")


@dataclass(frozen=True)
class DraftPlan:
    """A policy's expectations for this step: ``gains[j]``, the probability that draft token
    ``j + 1`` is accepted (a sample from what the policy believes); ``costs[j]``, its drafting cost
    in one-token steps; ``split``: a cascade's layer-skip tokens at most (``None``: no cascade);
    ``copy``: how long a copy of the context may run (:attr:`DraftChoice.copy`; ``None``: the length
    chosen). The plan prices the drafter's model; a copy costs next to nothing to propose and is chosen apart.

    Example: one per-token acceptance ``a = 0.5`` and a free drafter: ``gains = (0.5, 0.25, 0.125)``."""

    gains: tuple[float, ...]
    costs: tuple[float, ...]
    split: int | None = None
    copy: int | None = None

    def __post_init__(self):
        if len(self.gains) != len(self.costs):
            raise ValueError(f"a draft plan needs one cost per gain ({len(self.gains)} != {len(self.costs)})")

    def choice(self, k: int) -> DraftChoice:
        """The choice of drafting ``k`` of the planned tokens (and its copies as planned)."""
        return DraftChoice(k, None if self.split is None else min(self.split, k), self.copy)


@dataclass(frozen=True)
class Draft:
    """``tokens``: ``[k]`` proposed ids. ``q``: ``[k, V]`` the distributions they were sampled from,
    or ``None`` for a deterministic proposal (greedy drafting, n-gram lookup: a point mass).
    ``sources``: per token, :data:`LAYER_SKIP` or :data:`STATISTICAL` (cascades; empty otherwise).
    ``forwards``: layer-skip forwards spent on this draft (cascades count them for their policy)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    sources: tuple[str, ...] = ()
    forwards: int = 0
    # a tree: each token's parent, an index among the tokens before it (-1: the pending token); None: a chain
    parents: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.parents is not None:
            if len(self.parents) != len(self) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError(f"a tree draft needs one parent per token, each earlier or -1: {self.parents}")
            if self.q is not None:
                raise ValueError("a tree draft's tokens are point masses: it carries no sampling distributions")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The longest path of drafted tokens: ``len(self)`` for a chain."""
        return len(self) if self.parents is None else max(tree_depths(self.parents), default=0)

    def main_chain(self) -> Draft:
        """The chain a tree's first children make (a drafter lists each node's likeliest child first):
        what a verification that cannot run a tree verifies. A chain is its own."""
        if self.parents is None:
            return self
        path = tree_first_path(self.parents)
        return Draft(self.tokens[path], forwards=self.forwards)


def tree_depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Each node's depth (1: a child of the pending token). Example: ``(-1, -1, 0, 2)`` -> ``[1, 1, 2, 3]``."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def tree_first_path(parents: tuple[int, ...] | list[int]) -> list[int]:
    """The nodes of the path that takes each node's first child, from the pending token. Example:
    ``(-1, -1, 0, 0, 3)`` -> ``[0, 2]`` (node 0's first child is 2, which has none)."""
    path, at = [], -1
    for i, p in enumerate(parents):
        if p == at:
            path.append(i)
            at = i
    return path


class Drafter(ABC):
    """Proposes drafts. ``name`` is the drafter kind (:data:`adaptive.drafters.factory.DRAFTERS`)."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        """Propose at most ``choice.length`` tokens to follow ``state.tokens`` (a drafter that copies from the
        context, the eagle drafter: a copy of at most ``choice.copy``, and ``length`` may then be 0; every
        other drafter is asked for ``length >= 1`` and no copy length)."""

    def describe(self) -> dict:
        """A JSON-able description for results and logs."""
        return {"name": self.name}


class DraftLengthPolicy(ABC):
    """Chooses each step's :class:`DraftChoice` and learns from each verification."""

    @abstractmethod
    def choose(self, max_len: int) -> DraftChoice:
        """A choice with ``length`` in ``0 .. max_len`` (0: no draft this step, a plain step)."""

    def update(self, draft: Draft, accepted: int) -> None:  # noqa: B027 - optional hook, a no-op for policies that do not learn
        """Learn from one verification: ``accepted`` of ``draft``'s tokens were kept."""

    def plan(self, max_len: int) -> DraftPlan | None:
        """What drafting up to ``max_len`` tokens is expected to bring (for a batch's controller);
        ``None`` (the default): the policy prices nothing and its own :meth:`choose` stands."""
        return None


class FixedDraftLength(DraftLengthPolicy):
    """Always ``k`` tokens (fewer only near ``max_new_tokens``); a cascade keeps its own split; a copy
    runs to ``copy`` tokens (:attr:`DraftChoice.copy`; ``None``: ``k``)."""

    def __init__(self, k: int, copy: int | None = None):
        if k < 1 or (copy is not None and copy < 0):
            raise ValueError(f"draft length must be >= 1 and a copy's >= 0, got {k} and {copy}")
        self.k, self.copy = k, copy

    def choose(self, max_len: int) -> DraftChoice:
        return DraftChoice(min(self.k, max_len), copy=None if self.copy is None else min(self.copy, max_len))
