"""Statistical drafting: prompt lookup (CS Drafting's max-gram), at almost no cost per token.

The drafter looks for the longest suffix of the context (prompt + generated tokens) that occurred
earlier in it and proposes the tokens that followed that earlier occurrence. Summaries, answers
over a passage and translations copy a lot of their input, so such drafts are often right, and
proposing them costs a search over token ids, not a forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from adaptive.engine.protocol import DecodeState, Draft, DraftChoice, Drafter

DEFAULT_PLD_DRAFT_LEN = 8  # prompt-lookup drafts cost no forward: long drafts are cheap to try
DEFAULT_BIGRAM_MIN_PROB = 0.2  # a bigram chain stops when its estimated probability falls below this


def ngram_lookup(context, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix.

    Tries suffix lengths ``max_ngram`` down to ``min_ngram``; the first length that occurred
    earlier wins, and among its occurrences the latest one (recent text predicts best).

    Example: context ``[5, 6, 7, 8, 5, 6]``, ``k = 3``: the suffix ``[5, 6]`` occurred at 0, and
    ``[7, 8, 5]`` followed it -> ``[7, 8, 5]``. Context ``[1, 2, 3]``: nothing repeats -> ``[]``.
    """
    if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got {k}, {min_ngram}, {max_ngram}")
    arr = np.asarray(context, dtype=np.int64)
    n_tok = arr.shape[0]
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = arr[n_tok - n:]
        # windows starting at 0 .. n_tok-n-1 (the suffix's own position excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


@dataclass(frozen=True, eq=False)
class BigramTable:
    """The most frequent successor of each token, with its relative frequency.

    ``keys``: ``[n]`` sorted token ids; ``succ``: ``[n]`` the successor of each; ``prob``: ``[n]``
    count(key, succ) / count(key followed by anything). Built by :func:`build_bigram_table`; a few
    thousand entries per domain (tens of kilobytes in a profile).
    """

    keys: np.ndarray
    succ: np.ndarray
    prob: np.ndarray

    def __post_init__(self):
        k, s, p = (np.asarray(a) for a in (self.keys, self.succ, self.prob))
        if not (k.ndim == s.ndim == p.ndim == 1 and k.shape == s.shape == p.shape):
            raise ValueError("a bigram table needs three 1-D arrays of one length")
        if k.size and (np.any(np.diff(k) <= 0) or k.min() < 0 or s.min() < 0):
            raise ValueError("bigram keys must be sorted, unique and non-negative")
        if p.size and (np.any(p <= 0) or np.any(p > 1)):
            raise ValueError("bigram probabilities must be in (0, 1]")
        object.__setattr__(self, "keys", k.astype(np.int64))
        object.__setattr__(self, "succ", s.astype(np.int64))
        object.__setattr__(self, "prob", p.astype(np.float32))

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @cached_property
    def _map(self) -> dict[int, tuple[int, float]]:  # a dict lookup is the fastest from Python
        return {int(k): (int(s), float(p)) for k, s, p in zip(self.keys, self.succ, self.prob)}

    def get(self, token: int) -> tuple[int, float] | None:
        """``(successor, probability)`` of ``token``, or ``None`` if it has no entry."""
        return self._map.get(int(token))


def build_bigram_table(sequences: Iterable[Sequence[int]], min_count: int = 2) -> BigramTable:
    """Count adjacent pairs over ``sequences`` and keep each token's most frequent successor.

    A token is kept when that successor followed it at least ``min_count`` times; ties go to the
    smaller id. Example: ``[[1, 2, 3, 1, 2, 4, 1, 2]]``: 1 was followed by 2 three times out of
    three -> ``1: (2, 1.0)``; 2 by 3 once and 4 once, 3 and 4 by 1 once: below ``min_count = 2``,
    dropped. The table is ``{1: (2, 1.0)}``.
    """
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    pairs = [np.stack([a[:-1], a[1:]], axis=1) for seq in sequences
             if (a := np.asarray(list(seq), dtype=np.int64)).shape[0] > 1]
    if not pairs:
        return BigramTable(np.zeros(0), np.zeros(0), np.zeros(0))
    uniq, counts = np.unique(np.concatenate(pairs), axis=0, return_counts=True)  # sorted by (a, b)
    firsts, starts, totals = np.unique(uniq[:, 0], return_index=True, return_counts=True)
    keys, succ, prob = [], [], []
    for a, start, n_succ in zip(firsts, starts, totals):
        c = counts[start:start + n_succ]
        best = int(np.argmax(c))  # the first maximum: the smallest successor id among ties
        if c[best] >= min_count:
            keys.append(a)
            succ.append(uniq[start + best, 1])
            prob.append(c[best] / c.sum())
    return BigramTable(np.array(keys, dtype=np.int64), np.array(succ, dtype=np.int64), np.array(prob))


def bigram_chain(table: BigramTable, last: int, k: int, min_prob: float = DEFAULT_BIGRAM_MIN_PROB) -> list[int]:
    """Up to ``k`` tokens following ``last``, each the table's successor of the one before.

    The chain stops at a token without an entry, or before the product of the probabilities
    along it would fall below ``min_prob`` (the chain's estimated chance of being right).
    Example: table ``{1: (2, 1.0), 2: (3, 0.6), 3: (1, 0.5)}``, ``last = 1``, ``k = 5``,
    ``min_prob = 0.25``: 2 (1.0), 3 (0.6), 1 (0.3), 2 (0.3), then 3 would be 0.18: ``[2, 3, 1, 2]``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out: list[int] = []
    chance = 1.0
    tok = int(last)
    while len(out) < k:
        entry = table.get(tok)
        if entry is None:
            break
        tok, p = entry
        chance *= p
        if chance < min_prob:
            break
        out.append(tok)
    return out


def statistical_draft(context: Sequence[int], k: int, table: BigramTable | None = None, max_ngram: int = 3,
                      min_ngram: int = 1, min_prob: float = DEFAULT_BIGRAM_MIN_PROB) -> list[int]:
    """CS Drafting's statistical drafter: prompt lookup, continued (or replaced) by a bigram chain.

    Example: context ``[4, 1, 2, 9, 1]``, table ``{2: (9, 0.9), 9: (7, 0.5)}``, ``k = 4``: the
    suffix ``[1]`` occurred at 1, followed by ``[2, 9, 1]``; the chain would go on from ``1``, which
    has no entry: ``[2, 9, 1]``. Context ``[8, 2]`` (no repeat): the chain from 2 gives ``[9, 7]``
    (chances 0.9, then 0.45).
    """
    out = ngram_lookup(context, k, max_ngram, min_ngram)
    if table is not None and len(out) < k:
        out += bigram_chain(table, out[-1] if out else context[-1], k - len(out), min_prob)
    return out


class NgramDrafter(Drafter):
    """Statistical drafts (a point mass on each proposed token; ``q`` is ``None``).

    Without a bigram table this is prompt lookup (``pld``); with one (a :class:`BigramTable`, or
    anything with its ``get`` and ``len``, such as :class:`~adaptive.drafters.live.LiveBigramTable`),
    :func:`statistical_draft`.
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, bigram=None,
                 min_prob: float = DEFAULT_BIGRAM_MIN_PROB):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.bigram, self.min_prob = bigram, min_prob

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        return statistical_draft(context, k, self.bigram, self.max_ngram, self.min_ngram, self.min_prob)

    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        max_len = choice.length
        return Draft(torch.tensor(self.lookup(state.tokens, max_len), dtype=torch.long, device=state.backbone.device))

    def describe(self) -> dict:
        d = {"name": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        if self.bigram is not None:
            d.update(bigram_entries=len(self.bigram), bigram_min_prob=self.min_prob)
        return d
