"""Which routing embedding a calibration keeps: each candidate pooling's routing accuracy on the
calibration's own prompts, held out in turn.

Every domain's prompts are split into ``folds`` by position (prompt ``j`` in fold ``j % folds``);
for each fold an :class:`~adaptive.index.anchors.AnchorIndex` is built from the other folds
exactly as calibration builds the profile's (anchors, out-of-domain radii), and routes the fold's
prompts; a prompt counts as right when it is routed to its own domain (out-of-domain is wrong).
The candidate with the most right wins; a tie keeps the earliest candidate (calibration lists its
default first). Example: two domains of 4 prompts each, 2 folds: each index is fitted on 2
prompts a domain and routes the other 2; 8 routed prompts per candidate.
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
    if folds < 2:
        raise ValueError(f"held-out accuracy needs at least 2 folds, got {folds}")
    right = routed = 0
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
        for name, x in test.items():
            for v in x:
                route = index.route(v)
                right += route.domain == name
                routed += 1
    return right, routed


def choose_pooling(candidates: Sequence[Pooling], embeddings: Sequence[dict[str, np.ndarray]], folds: int = 2,
                   per_domain: int = 10, k: int = 5, seed: int = 0) -> tuple[Pooling, dict[str, float]]:
    """The candidate whose embeddings (``embeddings[i]``: ``{domain: [n, d]}`` of ``candidates[i]``) route
    the calibration's held-out prompts best, and every candidate's accuracy (keyed by
    :func:`pooling_key`); ties keep the earlier candidate."""
    if not candidates or len(candidates) != len(embeddings):
        raise ValueError("choose_pooling needs one embedding table per candidate, and at least one")
    scores: dict[str, float] = {}
    best, best_right = candidates[0], -1
    for pooling, table in zip(candidates, embeddings):
        right, routed = held_out_accuracy(table, folds, per_domain, k, seed)
        scores[pooling_key(pooling)] = round(right / max(routed, 1), 4)
        if right > best_right:
            best, best_right = pooling, right
    return best, scores


def pooling_key(pooling: Pooling) -> str:
    """A pooling as text: ``"last@10"``, ``"mean@final"``."""
    return f"{pooling.mode}@{'final' if pooling.layer is None else pooling.layer}"
