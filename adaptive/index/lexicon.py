"""A domain guessed from a prompt's token ids alone, before any forward: for pricing, not routing.

The two-engine runtime chooses a request's engine before the prompt is prefilled, so before any
embedding exists (:mod:`adaptive.runtime.engines`); an embedding first would cost a prefill on an
engine that may not decode the request. But the engines' paces differ by domain (on the embedded
model a translation prompt decodes ~1.3x faster on the torch engine's cascade than the average
domain does there), and the request's token ids are already known. A :class:`Lexicon` guesses the
domain from them, in ~0.1 ms, with the oldest text classifier there is: TF-IDF vectors and the
nearest domain centroid by cosine.

Terms, defined once:

- ``N``: the calibration prompts the lexicon was fitted on (every domain's);
- ``df(t)``: how many of them contain token ``t``; ``idf(t) = log((1 + N) / (1 + df(t))) + 1``
  (a token no calibration prompt holds: ``log(1 + N) + 1``);
- a prompt's vector: ``log(1 + count(t)) * idf(t)`` for each token ``t`` it holds, scaled to unit
  length (the chat template's tokens, in every prompt, weigh little);
- a domain's centroid: the mean of its prompts' vectors, scaled to unit length; only the ``U``
  tokens some calibration prompt holds can weigh in one, so centroids are stored over those alone;
- the guess: the domain whose centroid has the largest cosine with the prompt's vector.

Worked example: domains ``a`` (prompts ``[1, 2]`` and ``[1, 3]``) and ``b`` (``[4, 5]``), N = 3;
``df = {1: 2, 2: 1, 3: 1, 4: 1, 5: 1}``, ``idf(1) = log(4/3) + 1 = 1.288``, the others
``log(2) + 1 = 1.693``. The prompt ``[2, 9]``: token 2 weighs ``log(2) * 1.693 = 1.173``, token 9
(unknown) ``log(2) * (log(4) + 1) = 1.654``; its cosine with ``a``'s centroid is 0.28, with ``b``'s 0:
the guess is ``a``.

The guess only prices the choice of engine; the engine chosen then routes the request with its own
prefill's embedding (:class:`~adaptive.index.anchors.AnchorIndex`), as before. On the Spec-Bench
groups (the embedded model's tokenizer and chat template, 16 calibration prompts per group, the 32
after them held out) it named the group of 167 of 192 held-out prompts, every translation, QA and
summarization one; 23 of the 25 misses were MT-bench's mixed prompts
(docs/history/2026-11-26-two-engines.md, "Fifth session").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Lexicon:
    """Each domain's TF-IDF centroid over the calibration prompts' tokens (see the module docstring).

    ``names``: the domains, one per centroid row; ``tokens``: ``[U]`` int64, the token ids some
    calibration prompt holds, ascending; ``idf``: ``[U]`` float32, their ``idf``; ``prompts``: ``N``;
    ``centroids``: ``[D, U]`` float32, unit rows."""

    names: tuple[str, ...]
    tokens: np.ndarray
    idf: np.ndarray
    prompts: int
    centroids: np.ndarray

    def __post_init__(self):
        u = self.tokens.shape
        if self.tokens.ndim != 1 or self.idf.shape != u or self.centroids.shape != (len(self.names), *u):
            raise ValueError(f"lexicon shapes disagree: {len(self.names)} names, tokens {self.tokens.shape}, "
                             f"idf {self.idf.shape}, centroids {self.centroids.shape}")
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"a lexicon needs distinct domain names, got {self.names}")
        if self.prompts < 1:
            raise ValueError(f"a lexicon is fitted on at least one prompt, got {self.prompts}")
        if self.tokens.size and (self.tokens[0] < 0 or np.any(np.diff(self.tokens) <= 0)):
            raise ValueError("a lexicon's tokens are distinct non-negative ids in ascending order")

    @classmethod
    def fit(cls, prompts: Mapping[str, Sequence[Sequence[int]]]) -> Lexicon:
        """The lexicon of ``prompts`` (domain -> its calibration prompts' token ids); a domain
        without prompts is left out. Example: ``Lexicon.fit({"a": [[1, 2], [1, 3]], "b": [[4, 5]]})``."""
        named = {name: [np.asarray(p, dtype=np.int64) for p in ps] for name, ps in prompts.items() if ps}
        if not named:
            raise ValueError("no domain has a prompt to fit a lexicon on")
        every = [p for ps in named.values() for p in ps]
        tokens = np.unique(np.concatenate(every)) if any(p.size for p in every) else np.zeros(0, np.int64)
        df = np.zeros(tokens.size)
        for p in every:
            df[np.searchsorted(tokens, np.unique(p))] += 1
        n = len(every)
        idf = (np.log((1 + n) / (1 + df)) + 1).astype(np.float32)
        rows = []
        for ps in named.values():
            c = np.mean([_unit_vector(p, tokens, idf, n) for p in ps], axis=0)
            rows.append(c / (np.linalg.norm(c) or 1.0))
        return cls(tuple(named), tokens, idf, n, np.asarray(rows, np.float32).reshape(len(named), -1))

    def similarities(self, ids: Sequence[int]) -> dict[str, float]:
        """Each domain's cosine with the prompt ``ids`` (0 for an empty prompt)."""
        vec = _unit_vector(ids, self.tokens, self.idf, self.prompts)
        return dict(zip(self.names, (self.centroids @ vec).tolist()))

    def guess(self, ids: Sequence[int]) -> str | None:
        """The domain whose centroid is nearest the prompt ``ids`` by cosine (the first among equals);
        ``None`` when no calibration token occurs in it (nothing to go on)."""
        vec = _unit_vector(ids, self.tokens, self.idf, self.prompts)
        if not vec.any():
            return None
        return self.names[int(np.argmax(self.centroids @ vec))]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays a profile stores (``lexicon.npz``); :meth:`from_arrays` reads them back."""
        return {"names": np.asarray(self.names, dtype=np.str_), "tokens": self.tokens.astype(np.int64),
                "idf": self.idf.astype(np.float32), "prompts": np.asarray(self.prompts, dtype=np.int64),
                "centroids": self.centroids.astype(np.float32)}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Lexicon:
        """The lexicon :meth:`to_arrays` wrote; ``ValueError`` or ``KeyError`` for inconsistent arrays."""
        return cls(tuple(str(n) for n in arrays["names"].tolist()), np.asarray(arrays["tokens"], np.int64),
                   np.asarray(arrays["idf"], np.float32), int(arrays["prompts"]),
                   np.asarray(arrays["centroids"], np.float32))


def _unit_vector(ids: Sequence[int], tokens: np.ndarray, idf: np.ndarray, prompts: int) -> np.ndarray:
    """A prompt's TF-IDF vector over ``tokens`` (``[U]``), scaled to unit length with the weights of its
    tokens outside ``tokens`` (``idf`` ``log(1 + prompts) + 1``) counted in the length; zeros for an
    empty prompt."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    vec = np.zeros(tokens.size)
    if ids.size == 0:
        return vec
    uniq, counts = np.unique(ids, return_counts=True)
    weights = np.log1p(counts)
    at = np.searchsorted(tokens, uniq).clip(max=max(tokens.size - 1, 0))
    known = tokens[at] == uniq if tokens.size else np.zeros(uniq.size, bool)
    vec[at[known]] = weights[known] * idf[at[known]]
    unknown = weights[~known] * (np.log(1 + prompts) + 1)
    norm = float(np.sqrt(np.sum(vec ** 2) + np.sum(unknown ** 2)))
    return vec / norm if norm else vec
