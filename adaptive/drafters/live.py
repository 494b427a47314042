"""A bigram table that keeps learning: calibration's table, updated from the text a server accepts.

The statistical drafter (:mod:`.ngram`) looks up each token's most frequent successor. Calibration
builds that table from 16 prompts per domain; every served request then produces the target
model's own text, which is what the table should predict. :class:`LiveBigramTable` answers the
same :meth:`get` as a :class:`~.ngram.BigramTable` (so drafters take either) while
:meth:`observe` adds the pairs of accepted output:

* a calibrated entry ``a -> (b, p)`` counts as ``prior_weight`` observations of ``a``, ``p`` of
  them followed by ``b``; online pairs add to that. The entry for ``a`` is the successor with the
  most merged counts and its share of ``a``'s total;
* a token calibration never kept enters once its best successor has ``min_count`` observations;
* memory is bounded: past ``max_pairs`` distinct pairs every count is halved and pairs below
  ``1/4`` are dropped, until at most ``max_pairs`` remain (old traffic fades; the calibrated prior
  never does).

An observation updates one entry per token (dictionary operations, about a microsecond), so a
decode step costs what it did: the lookup is the same dictionary ``get``.

Example: calibrated ``{5: (6, 0.5)}``, ``prior_weight = 4`` (two observations of 5 -> 6, two of
5 -> other), then output ``[5, 7, 5, 7, 5, 7]``: 5 -> 7 three times. Merged: 6 has 2, 7 has 3 of a
total 7: ``get(5) == (7, 3/7)``; and ``7 -> 5`` twice reaches ``min_count = 2``: ``get(7) == (5, 1.0)``.

Replicas (issue 45): :meth:`set_others` adds other servers' counts to the answers (their sum, kept
apart): :meth:`counts` and decay are this table's own observations only, which is what a replica saves.

Not locked: one thread observes (the server's decoding worker); lookups from the same or another
thread see each entry either before or after an update (single dictionary operations).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptive.drafters.ngram import BigramTable

DEFAULT_PRIOR_WEIGHT = 4.0
DEFAULT_MAX_PAIRS = 50_000
DECAY = 0.5
DROP_BELOW = 0.25


def accepted_text(prompt: Sequence[int], output: Sequence[int]) -> list[int]:
    """The tokens a finished request teaches a table: the prompt's last token, then the output (the
    pair across the boundary is the model's too). Example: ``([5, 6], [7, 8])`` -> ``[6, 7, 8]``."""
    return [int(t) for t in prompt[-1:]] + [int(t) for t in output]


class LiveBigramTable:
    """Calibration's ``base`` table (or none) plus decayed pair counts from accepted output."""

    def __init__(self, base: BigramTable | None = None, prior_weight: float = DEFAULT_PRIOR_WEIGHT,
                 min_count: float = 2.0, max_pairs: int = DEFAULT_MAX_PAIRS):
        if prior_weight < 0 or min_count <= 0 or max_pairs < 1:
            raise ValueError("need prior_weight >= 0, min_count > 0 and max_pairs >= 1")
        self.base = base
        self.prior_weight = float(prior_weight)
        self.min_count = float(min_count)
        self.max_pairs = int(max_pairs)
        self._base = dict(base._map) if base is not None else {}  # token -> (successor, probability)
        self._map = dict(self._base)  # what get() answers
        self._counts: dict[int, dict[int, float]] = {}  # token -> successor -> observed count (decayed)
        self._others: dict[int, dict[int, float]] = {}  # the same, other replicas' (set_others)
        self._pairs = 0
        self.observed = 0.0  # pairs observed (decayed like the counts)
        self.decays = 0

    def __len__(self) -> int:
        return len(self._map)

    @property
    def pairs(self) -> int:
        """Distinct observed pairs held (at most ``max_pairs``)."""
        return self._pairs

    def get(self, token: int) -> tuple[int, float] | None:
        """``(successor, probability)`` of ``token``, or ``None`` (as :meth:`BigramTable.get`)."""
        return self._map.get(int(token))

    def observe(self, tokens: Sequence[int]) -> int:
        """Count the adjacent pairs of ``tokens`` (accepted output, with the token before it); their number."""
        toks = [int(t) for t in tokens]
        for a, b in zip(toks, toks[1:]):
            succ = self._counts.get(a)
            if succ is None:
                succ = self._counts[a] = {}
            if b not in succ:
                succ[b] = 0.0
                self._pairs += 1
            succ[b] += 1.0
            self._refresh(a, succ)
        n = max(len(toks) - 1, 0)
        self.observed += n
        while self._pairs > self.max_pairs:  # each halving drops the pairs seen about once; a few at most
            self._decay()
        return n

    def _refresh(self, a: int, succ: dict[int, float]) -> None:
        """Recompute ``a``'s entry from its merged counts (``succ``: its own; other replicas' added)."""
        theirs = self._others.get(a)
        if theirs:
            succ = dict(succ)
            for b, c in theirs.items():
                succ[b] = succ.get(b, 0.0) + c
        base = self._base.get(a)
        total = sum(succ.values())
        best, best_count = None, 0.0
        for b, c in succ.items():
            if c > best_count or (c == best_count and best is not None and b < best):
                best, best_count = b, c
        if base is not None:
            b0, p0 = base
            total += self.prior_weight
            c0 = succ.get(b0, 0.0) + self.prior_weight * p0
            if c0 > best_count or (c0 == best_count and (best is None or b0 < best)):
                best, best_count = b0, c0
        if best is None or best_count <= 0 or (base is None and best_count < self.min_count):
            self._map.pop(a, None)
            if base is not None:
                self._map[a] = base
            return
        self._map[a] = (best, min(best_count / total, 1.0))

    def _decay(self) -> None:
        """Halve every count, drop pairs that fall below 1/4, and recompute the entries."""
        self.decays += 1
        self.observed *= DECAY
        for a in list(self._counts):
            succ = {b: c * DECAY for b, c in self._counts[a].items() if c * DECAY >= DROP_BELOW}
            if succ:
                self._counts[a] = succ
            else:
                del self._counts[a]
            self._map.pop(a, None)
            if a in self._base:
                self._map[a] = self._base[a]
            if succ or a in self._others:
                self._refresh(a, succ)
        self._pairs = sum(len(s) for s in self._counts.values())

    # -- state ---------------------------------------------------------------------------------

    def counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The observed counts as ``(prev [n], succ [n], count [n])`` arrays, sorted by ``(prev, succ)``."""
        rows = sorted((a, b, c) for a, succ in self._counts.items() for b, c in succ.items())
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        a, b, c = zip(*rows)
        return np.array(a, np.int64), np.array(b, np.int64), np.array(c, np.float32)

    def load(self, prev: np.ndarray, succ: np.ndarray, count: np.ndarray, observed: float | None = None) -> None:
        """Replace the observed counts with saved ones (:meth:`counts`)."""
        self._counts = {}
        self._map = dict(self._base)
        for a, b, c in zip(np.asarray(prev).tolist(), np.asarray(succ).tolist(), np.asarray(count).tolist()):
            self._counts.setdefault(int(a), {})[int(b)] = float(c)
        self._pairs = sum(len(s) for s in self._counts.values())
        for a, s in self._counts.items():
            self._refresh(a, s)
        for a in self._others.keys() - self._counts.keys():
            self._refresh(a, {})
        self.observed = float(sum(count)) if observed is None else float(observed)
        while self._pairs > self.max_pairs:
            self._decay()

    def set_others(self, prev: np.ndarray, succ: np.ndarray, count: np.ndarray) -> None:
        """Other replicas' counts (summed), in place of the ones set before: :meth:`get` answers from
        the base, this table's counts and theirs; :meth:`counts` stays this table's own."""
        new: dict[int, dict[int, float]] = {}
        for a, b, c in zip(np.asarray(prev).tolist(), np.asarray(succ).tolist(), np.asarray(count).tolist()):
            new.setdefault(int(a), {})[int(b)] = float(c)
        touched = set(self._others) | set(new)
        self._others = new
        for a in touched:  # _refresh sets each entry whole (the base's where no count wins)
            self._refresh(a, self._counts.get(a, {}))

    def others(self) -> float:
        """Pairs other replicas observed (the sum of :meth:`set_others`' counts)."""
        return float(sum(sum(s.values()) for s in self._others.values()))

    def snapshot(self, without: Sequence[int] = ()) -> BigramTable:
        """A frozen :class:`BigramTable` of what :meth:`get` answers now; with ``without``, what it
        would answer had it not observed that text: each of its pairs is taken off the counts (down to
        zero where decay has already halved it). A race times a member's prompt on a table without
        the member's own output, which would otherwise hold the very pairs decoding is timed on.

        Example: no base, ``observe([1, 2, 1, 2, 1, 3])`` (1 -> 2 twice, 1 -> 3 once): ``get(1) == (2, 2/3)``;
        ``snapshot(without=[1, 2])``: 1 -> 2 once, 1 -> 3 once, below ``min_count = 2``: no entry for 1.
        """
        if without:
            held = {a: dict(succ) for a, succ in self._counts.items()}
            toks = [int(t) for t in without]
            for a, b in zip(toks, toks[1:]):
                if b in held.get(a, {}):
                    held[a][b] = max(0.0, held[a][b] - 1.0)
            rows = [(a, b, c) for a, succ in held.items() for b, c in succ.items() if c > 0]
            other = LiveBigramTable(self.base, self.prior_weight, self.min_count, self.max_pairs)
            other._others = self._others
            other.load(*(np.array(col) for col in zip(*rows)) if rows else (np.zeros(0), np.zeros(0), np.zeros(0)))
            return other.snapshot()
        keys = sorted(self._map)
        return BigramTable(np.array(keys, np.int64), np.array([self._map[k][0] for k in keys], np.int64),
                           np.array([self._map[k][1] for k in keys], np.float32))
