"""The drafter interface: propose a draft from the current context; learn from the verification.

The verifier (the loop in :mod:`adaptive.engine.loop`) alone owns acceptance and KV rollback: a
drafter may write draft keys into the cache beyond ``state.cache.length`` (the verification
forward overwrites them) but must never change ``cache.length``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DecodeState:
    """What a drafter may read while proposing.

    ``tokens``: every token so far (prompt + generated); the last one is *pending*: it is not in the
    cache yet, and sits at position ``cache.length``.
    """

    backbone: object
    cache: object
    tokens: list[int]
    config: object
    generator: torch.Generator | None

    @property
    def position(self) -> int:
        return self.cache.length


@dataclass
class Draft:
    """``tokens``: ``[k]`` proposed ids. ``q``: ``[k, V]`` the distributions they were sampled from,
    or ``None`` for a deterministic proposal (greedy drafting, n-gram lookup: a point mass)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def propose(self, state: DecodeState, max_len: int) -> Draft:
        """Propose at most ``max_len`` (>= 1) tokens to follow ``state.tokens``."""

    def observe(self, drafted: int, accepted: int) -> None:
        """Called after each verification with how many of the drafted tokens were accepted."""

    def describe(self) -> dict:
        return {"name": self.name}


class DraftLengthPolicy(ABC):
    """Chooses how many tokens to draft each step (the seam for the Thompson-sampling bandit)."""

    @abstractmethod
    def choose(self, max_len: int) -> int:
        """A draft length in ``0 .. max_len`` (0: no draft this step, a plain decoding step)."""

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from one verification."""


class FixedDraftLength(DraftLengthPolicy):
    def __init__(self, k: int):
        if k < 1:
            raise ValueError("draft length must be >= 1")
        self.k = k

    def choose(self, max_len: int) -> int:
        return min(self.k, max_len)
