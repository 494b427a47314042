"""Which routing embedding a calibration keeps: each candidate pooling's routing accuracy on the
calibration's own prompts, held out in turn.

Every domain's prompts are split into ``folds`` by position (prompt ``j`` in fold ``j % folds``);
for each fold an :class:`~adaptive.index.anchors.AnchorIndex` is built from the other folds
exactly as calibration builds the profile's (anchors, out-of-domain radii), and routes the fold's
prompts; a prompt counts as right when it is routed to its own domain (out-of-domain is wrong).
The most accurate other candidate (the earliest of a tie) replaces the default (the first,
calibration's) only when it routes clearly more of them right: on the prompts where the two
disagree, it must win ``b`` against the default's ``c`` with ``b - c >= 2 * sqrt(b + c)`` (a sign
test at about 95%, one-sided; one test, of the best, not one per candidate). With a few dozen
prompts per calibration a difference of two or three is noise (measured: a candidate 3 prompts
better held out on 96 calibration prompts routed 2 fewer of 160 new ones), so the default stands
unless the evidence is clear. Example: two domains of 4 prompts each, 2 folds: each index is
fitted on 2 prompts a domain and routes the other 2; 8 routed prompts per candidate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptive.engine.config import Pooling
from adaptive.index.anchors import AnchorIndex


def held_out_accuracy(embeddings: dict[str, np.ndarray], folds: int = 2, per_domain: int = 10, k: int = 5,
                      seed: int = 0) -> tuple[int, int]:
    """``(right, routed)`` over every prompt of every domain (``{domain: [n, d]}``), each routed by an
    index fitted without its fold. Domains of fewer than ``folds`` prompts are fitted on and never routed."""
    hits = held_out_hits(embeddings, folds, per_domain, k, seed)
    return int(hits.sum()), len(hits)


def held_out_hits(embeddings: dict[str, np.ndarray], folds: int = 2, per_domain: int = 10, k: int = 5,
                  seed: int = 0) -> np.ndarray:
    """:func:`held_out_accuracy` prompt by prompt: ``[routed]`` booleans, right or not, in a fixed order
    (fold, then domain name, then prompt), the same for every candidate of one calibration."""
    if folds < 2:
        raise ValueError(f"held-out accuracy needs at least 2 folds, got {folds}")
    hits: list[bool] = []
    for f in range(folds):
        fit, test = {}, {}
        for name, x in embeddings.items():
            x = np.asarray(x, dtype=np.float32)
            held = np.arange(len(x)) % folds == f
            if len(x) < folds:
                fit[name] = x
                continue
            fit[name], test[name] = x[~held], x[held]
        index = AnchorIndex.build(fit, per_domain=per_domain, seed=seed, k=k)
        for name in sorted(test):
            hits += [index.route(v).domain == name for v in test[name]]
    return np.array(hits, dtype=bool)


def clearly_better(hits: np.ndarray, default: np.ndarray) -> bool:
    """Whether ``hits`` beat ``default``'s on the same prompts beyond chance: of the prompts where they
    differ, ``b`` right only here and ``c`` right only there, ``b - c >= 2 * sqrt(b + c)`` and ``b > c``.
    Example: b = 5, c = 2 -> 3 < 5.3: not clearly; b = 9, c = 1 -> 8 >= 6.3: clearly."""
    b = int((hits & ~default).sum())
    c = int((default & ~hits).sum())
    return b > c and b - c >= 2 * np.sqrt(b + c)


def choose_pooling(candidates: Sequence[Pooling], embeddings: Sequence[dict[str, np.ndarray]], folds: int = 2,
                   per_domain: int = 10, k: int = 5, seed: int = 0) -> tuple[Pooling, dict[str, float]]:
    """The candidate kept (``embeddings[i]``: ``{domain: [n, d]}`` of ``candidates[i]``; the first is
    the default): the most accurate other one on the calibration's held-out prompts if it is
    :func:`clearly_better` than the default, else the default; and every candidate's accuracy
    (keyed by :func:`pooling_key`)."""
    if not candidates or len(candidates) != len(embeddings):
        raise ValueError("choose_pooling needs one embedding table per candidate, and at least one")
    hits = [held_out_hits(table, folds, per_domain, k, seed) for table in embeddings]
    scores = {pooling_key(p): round(float(h.mean()) if len(h) else 0.0, 4) for p, h in zip(candidates, hits)}
    if len(candidates) == 1:
        return candidates[0], scores
    best = max(range(1, len(candidates)), key=lambda i: (int(hits[i].sum()), -i))
    return (candidates[best] if clearly_better(hits[best], hits[0]) else candidates[0]), scores


def pooling_key(pooling: Pooling) -> str:
    """A pooling as text: ``"last@10"``, ``"mean@final"``."""
    return f"{pooling.mode}@{'final' if pooling.layer is None else pooling.layer}"
