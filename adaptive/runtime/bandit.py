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


def _reach(a, t: int) -> float:
    """``sum_{j<=t} prod_{i<j} a_i``: expected accepted tokens of ``t`` drafts with acceptance ``a``
    (a number, the same at every position, or one per position)."""
    if isinstance(a, (int, float)):
        return expected_tokens_per_step(float(a), t) - 1.0
    total, p = 0.0, 1.0
    for j in range(t):
        p *= a[j]
        total += p
    return total


def cascade_expected_tokens(a_n: float, h: int, a_s, t: int) -> float:
    """Expected tokens per step of a cascade draft: ``h`` layer-skip tokens then ``t`` statistical ones.

    Each layer-skip token is accepted with probability ``a_n`` and statistical token ``j`` of the
    tail with ``a_s`` (or ``a_s[j]``: acceptance by tail position, given the ones before it were
    accepted), until the first rejection; the target's own token counts too:
    ``1 + sum_{i<=h} a_n^i + a_n^h * sum_{j<=t} prod_{i<j} a_s[i]``.
    Example: ``a_n = 0.8, h = 1, a_s = 0.5, t = 2``: ``1 + 0.8 + 0.8 * (0.5 + 0.25) = 2.4``; with
    ``a_s = [0.5, 0.9]``: ``1 + 0.8 + 0.8 * (0.5 + 0.45) = 2.56``.
    """
    return expected_tokens_per_step(a_n, h) + a_n ** h * _reach(a_s, t)


def best_split(a_n: float, a_s, neural_cost: float, stat_cost: float,
               verify: list[float] | tuple[float, ...], max_len: int, max_split: int) -> tuple[int, int]:
    """The ``(split, k)`` maximising expected tokens per unit cost for a cascade draft.

    ``split`` tokens from the layer-skip level (``neural_cost`` each, in full steps), ``k - split``
    from the statistical drafter (``stat_cost`` each; acceptance ``a_s``, a number or one per tail
    position), verified at ``verify[k]``; ``(0, 0)`` is a plain step (cost ``verify[0] = 1``).
    Example: ``a_n = 0.9, a_s = 0.3``, costs 0.5 and 0, verify ``(1, 1, 1.05)``, ``max_len = 2``:
    (0, 1) gives 1.3, (0, 2) 1.39 / 1.05 = 1.32, (1, 1) 1.9 / 1.5 = 1.27, (1, 2) 2.17 / 1.55 = 1.40,
    (2, 2) 2.71 / 2.05 = 1.32: ``(1, 2)``.
    """
    best, best_v = (0, 0), 1.0 / verify[0]
    for h in range(0, min(max_split, max_len) + 1):
        for k in range(max(h, 1), max_len + 1):
            v = cascade_expected_tokens(a_n, h, a_s, k - h) / (h * neural_cost + (k - h) * stat_cost + verify[k])
            if v > best_v:
                best, best_v = (h, k), v
    return best


class BetaPosterior:
    """A Beta posterior on a per-token acceptance, with a bounded memory (``window``).

    When ``alpha + beta`` exceeds ``window`` both are scaled down, keeping their ratio: memory stays
    bounded and the posterior follows drift. Not thread-safe on its own (its owner locks).
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), window: float = 500.0):
        if min(prior) <= 0 or window <= 2:
            raise ValueError("prior counts must be positive and the window above 2")
        self.alpha, self.beta = map(float, prior)
        self.window = float(window)

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.beta(self.alpha, self.beta))

    def update(self, successes: float, failures: float) -> None:
        self.alpha += successes
        self.beta += failures
        total = self.alpha + self.beta
        if total > self.window:
            scale = self.window / total
            self.alpha *= scale
            self.beta *= scale

    def state(self) -> dict:
        return {"alpha": round(self.alpha, 3), "beta": round(self.beta, 3), "mean_acceptance": round(self.mean, 4)}


def _chain_observation(drafted: int, accepted: int) -> tuple[int, int]:
    """Successes and failures of one verification under the until-first-rejection model."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} of {drafted} drafts")
    return accepted, int(accepted < drafted)


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
        self.draft_cost = float(draft_cost)
        self.verify = tuple(float(v) for v in verify)
        self.max_len = int(max_len)
        self.posterior = BetaPosterior(prior, window)
        self.allow_zero = allow_zero
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.chosen: dict[int, int] = {}

    @property
    def alpha(self) -> float:
        return self.posterior.alpha

    @property
    def beta(self) -> float:
        return self.posterior.beta

    @property
    def mean(self) -> float:
        return self.posterior.mean

    def choose(self, max_len: int) -> int:
        with self._lock:
            a = self.posterior.sample(self._rng)
        k = best_length(a, self.draft_cost, self.verify, min(max_len, self.max_len))
        if k == 0 and not self.allow_zero:
            k = 1
        with self._lock:
            self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        ok, bad = _chain_observation(drafted, accepted)
        with self._lock:
            self.posterior.update(ok, bad)

    def state(self) -> dict:
        with self._lock:
            return {**self.posterior.state(), "chosen": dict(sorted(self.chosen.items()))}


class ThompsonCascade(DraftLengthPolicy):
    """Thompson sampling of a cascade's draft length *and* split (EESD's bandit, extended).

    Beta posteriors per level: one on the per-token acceptance of layer-skip tokens, and one per
    tail position on the acceptance of statistical tokens (a copied span tends to go on being
    right once its first token was: calibration measured about 0.5 at the first position and
    0.65-0.7 at later ones, so one shared rate would undervalue long tails). Each step samples
    them all and picks the ``(split, k)`` of :func:`best_split` (the layer-skip cost scaled by the
    drafter's measured forwards per token, below 1 when vertical drafting gets several tokens
    from one forward); the split is handed to ``drafter``. After the verification each drafted
    token up to the first rejection is credited to its level and position (``drafter.last_sources``).
    ``stat_prior`` is one ``(alpha, beta)`` for every tail position or a list, one per position.
    """

    def __init__(self, drafter, neural_cost: float, verify: list[float] | tuple[float, ...], max_len: int,
                 max_split: int, neural_prior: tuple[float, float] = (1.0, 1.0),
                 stat_prior: tuple[float, float] | list[tuple[float, float]] = (1.0, 1.0), stat_cost: float = 0.005,
                 window: float = 500.0, seed: int | None = 0):
        if max_len < 1 or len(verify) < max_len + 1:
            raise ValueError("need max_len >= 1 and a verify cost for 0 .. max_len drafts")
        if max_split < 0:
            raise ValueError(f"max_split must be >= 0, got {max_split}")
        priors = list(stat_prior) if isinstance(stat_prior[0], (tuple, list)) else [stat_prior]
        priors += [priors[-1]] * (max_len - len(priors))  # positions beyond those measured: the last one's
        self.drafter = drafter
        self.neural_cost = float(neural_cost)
        self.stat_cost = float(stat_cost)
        self.verify = tuple(float(v) for v in verify)
        self.max_len = int(max_len)
        self.max_split = int(max_split) if drafter.masks is not None else 0
        self.neural = BetaPosterior(neural_prior, window)
        self.tail = [BetaPosterior(p, window) for p in priors[:max_len]]
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.chosen: dict[str, int] = {}

    def choose(self, max_len: int) -> int:
        with self._lock:
            a_n = self.neural.sample(self._rng)
            a_s = [b.sample(self._rng) for b in self.tail]
        cost = self.neural_cost * min(1.0, self.drafter.forwards_per_token)
        h, k = best_split(a_n, a_s, cost, self.stat_cost, self.verify, min(max_len, self.max_len), self.max_split)
        self.drafter.split = h
        with self._lock:
            key = f"{h}+{k - h}"
            self.chosen[key] = self.chosen.get(key, 0) + 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        _chain_observation(drafted, accepted)
        sources = self.drafter.last_sources[:drafted]
        with self._lock:
            j = 0  # position within the statistical tail
            for i, src in enumerate(sources[: accepted + 1]):
                post = self.neural if src == "n" else self.tail[min(j, len(self.tail) - 1)]
                post.update(*((1.0, 0.0) if i < accepted else (0.0, 1.0)))  # i == accepted: the first rejection
                j += src != "n"

    def state(self) -> dict:
        with self._lock:
            return {"layer_skip": self.neural.state(),
                    "statistical": [round(b.mean, 4) for b in self.tail],
                    "forwards_per_token": round(self.drafter.forwards_per_token, 3),
                    "chosen": dict(sorted(self.chosen.items()))}
