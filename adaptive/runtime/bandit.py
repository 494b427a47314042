"""Thompson sampling of the draft length (EESD's mechanism) over a Beta posterior on acceptance.

Model: each drafted token is accepted with probability ``a`` until the first rejection, so a
verification that accepted ``n`` of ``k`` drafts observed ``n`` successes and, if ``n < k``, one
failure (tokens after the first rejection say nothing). With ``a ~ Beta(alpha, beta)``, each step
samples ``a`` and drafts the ``k`` in ``0 .. max_len`` with the highest expected tokens per unit
cost, ``E(a, k) / (k * draft_cost + verify_cost(k))`` (``k = 0`` is a plain step of cost 1), so a
domain whose drafts stop paying falls back to plain decoding on its own and keeps exploring.
"""

from __future__ import annotations

import threading

import numpy as np

from adaptive.calibrate.objective import expected_tokens_per_step
from adaptive.drafters.base import DraftLengthPolicy


def best_length(a: float, draft_cost: float, verify: list[float] | tuple[float, ...], max_len: int) -> int:
    """The ``k`` in ``0 .. max_len`` maximising ``E(a, k) / (k * draft_cost + verify[k])``.

    ``verify[k]`` is the cost of verifying ``k`` drafts (``verify[0] == 1``: a plain step).
    Example: ``a = 0.9``, draft cost ``0.5``, verify ``(1, 1, 1.05)``: k = 0 gives 1.0, k = 1 gives
    ``1.9 / 1.5 = 1.27``, k = 2 gives ``2.71 / 2.05 = 1.32``: 2. With ``a = 0.3``: k = 1 gives
    ``1.3 / 1.5 = 0.87`` < 1: 0 (do not draft).
    """
    best_k, best = 0, 1.0 / verify[0]
    for k in range(1, max_len + 1):
        v = expected_tokens_per_step(a, k) / (k * draft_cost + verify[k])
        if v > best:
            best_k, best = k, v
    return best_k


class ThompsonDraftLength(DraftLengthPolicy):
    """A thread-safe bandit for one domain; plugs into the engine as its draft-length policy.

    ``prior``: Beta pseudo-counts (from the calibration's measured acceptance). ``window`` bounds
    memory and lets the posterior follow drift: when ``alpha + beta`` exceeds it, both are
    scaled down to keep their ratio.
    """

    def __init__(self, draft_cost: float, verify: list[float] | tuple[float, ...], max_len: int,
                 prior: tuple[float, float] = (1.0, 1.0), window: float = 500.0, seed: int | None = 0,
                 allow_zero: bool = True):
        if max_len < 1 or len(verify) < max_len + 1:
            raise ValueError("need max_len >= 1 and a verify cost for 0 .. max_len drafts")
        if min(prior) <= 0 or window <= 2:
            raise ValueError("prior counts must be positive and the window above 2")
        self.draft_cost = float(draft_cost)
        self.verify = tuple(float(v) for v in verify)
        self.max_len = int(max_len)
        self.alpha, self.beta = map(float, prior)
        self.window = float(window)
        self.allow_zero = allow_zero
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.chosen: dict[int, int] = {}

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def choose(self, max_len: int) -> int:
        with self._lock:
            a = float(self._rng.beta(self.alpha, self.beta))
        k = best_length(a, self.draft_cost, self.verify, min(max_len, self.max_len))
        if k == 0 and not self.allow_zero:
            k = 1
        with self._lock:
            self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafts")
        with self._lock:
            self.alpha += accepted
            self.beta += 1.0 if accepted < drafted else 0.0
            total = self.alpha + self.beta
            if total > self.window:
                scale = self.window / total
                self.alpha *= scale
                self.beta *= scale

    def state(self) -> dict:
        with self._lock:
            return {"alpha": round(self.alpha, 3), "beta": round(self.beta, 3), "mean_acceptance": round(self.mean, 4),
                    "chosen": dict(sorted(self.chosen.items()))}
