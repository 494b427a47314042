"""Cost arithmetic of speculative decoding, in units of one full-model token step. Pure: no timing,
no model; every formula of the project that turns acceptance and costs into speed lives here.

Terms: ``a`` is the per-token acceptance (each drafted token is accepted with probability ``a``
until the first rejection); ``k`` the draft length; ``draft_cost`` one draft token's cost;
``verify[k]`` the cost of verifying ``k`` drafts, a forward over ``k + 1`` tokens (``verify[0]``
is a plain step, 1 by definition when measured at the same context). A *verify table* is that
list for ``k = 0 .. max_len`` (:func:`verify_table`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

STAT_DRAFT_COST = 0.005  # a statistical draft token (a lookup, ~0.1 ms against a ~30 ms step)


def expected_tokens_per_step(a: float, k: int) -> float:
    """``E = 1 + a + ... + a^k``: mean tokens per step with per-token acceptance ``a``.

    Example: ``a = 0.5, k = 2`` -> ``1 + 0.5 + 0.25 = 1.75``; ``a = 1`` -> ``k + 1``; ``a = 0`` -> 1.
    """
    if not 0.0 <= a <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= a <= 1 and k >= 0, got a={a}, k={k}")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit time against plain decoding (one token per unit): ``E / (k * draft + verify)``.

    Example: ``a = 0.8, k = 2, draft_cost = 0.5, verify_cost = 1.05`` -> ``2.44 / 2.05 = 1.19``.
    ``k = 0`` is plain decoding with cost ``verify_cost``.
    """
    return expected_tokens_per_step(a, k) / (k * draft_cost + verify_cost)


def extrapolate(verify: Sequence[float], k: int) -> float:
    """Cost of verifying ``k`` drafts from costs of forwards over 1, 2, ... tokens, extended linearly
    past the end. Example: ``[1.0, 1.0, 1.1]``, ``k = 4`` -> ``1.1 + 2 * 0.1 = 1.3``."""
    n = k + 1
    if n <= len(verify):
        return float(verify[n - 1])
    if len(verify) == 1:
        return float(verify[0]) * n
    return float(verify[-1]) + max(float(verify[-1]) - float(verify[-2]), 0.0) * (n - len(verify))


def interpolate_points(points: Sequence[tuple[int, float]], x: float) -> float:
    """The value at ``x`` of the piecewise-linear curve through ``points`` (``(x, y)`` by increasing
    ``x``): the line through the origin and the first point below it, the last segment's slope past
    the end (never decreasing). Example: ``((100, 50.0), (400, 170.0))`` at 40 -> 20.0, at 250 ->
    110.0, at 1000 -> 410.0."""
    if not points:
        raise ValueError("no points to interpolate")
    (x0, y0), *_ = points
    if x <= x0:
        return y0 * x / x0
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        if x <= xb:
            return ya + (yb - ya) * (x - xa) / (xb - xa)
    if len(points) == 1:
        return y0 * x / x0
    (xa, ya), (xb, yb) = points[-2], points[-1]
    return yb + max(yb - ya, 0.0) / (xb - xa) * (x - xb)


def verify_table(verify: Sequence[float], max_len: int) -> tuple[float, ...]:
    """Verification costs of ``0 .. max_len`` drafts from forward costs over 1, 2, ... tokens.
    Example: ``verify_table([1.0, 1.0, 1.1], 3)`` -> ``(1.0, 1.0, 1.1, 1.2)``."""
    return tuple(extrapolate(verify, k) for k in range(max_len + 1))


def best_draft_length(a: float, draft_cost: float, verify: Sequence[float], max_len: int,
                      min_len: int = 0) -> tuple[int, float]:
    """The ``k`` in ``min_len .. max_len`` with the highest expected speedup, and that speedup.

    ``verify`` is a verify table (``verify[k]``, at least ``max_len + 1`` entries). Ties go to the
    shorter draft. ``k = 0`` (a plain step) is a candidate unless ``min_len >= 1``.
    Example: ``a = 0.9``, draft cost ``0.5``, verify ``(1, 1, 1.05)``: k = 0 gives 1.0, k = 1 gives
    ``1.9 / 1.5 = 1.27``, k = 2 gives ``2.71 / 2.05 = 1.32``: ``(2, 1.32)``. With ``a = 0.3``:
    k = 1 gives ``1.3 / 1.5 = 0.87`` < 1: ``(0, 1.0)`` (do not draft), or ``(1, 0.87)`` with ``min_len = 1``.
    """
    if len(verify) < max_len + 1 or not 0 <= min_len <= max_len:
        raise ValueError(f"need 0 <= min_len <= max_len and a verify cost for 0 .. {max_len} drafts")
    best_k, best = min_len, -1.0
    for k in range(min_len, max_len + 1):
        v = expected_speedup(a, k, draft_cost, verify[k])
        if v > best:
            best_k, best = k, v
    return best_k, best


def acceptance_needed(speedup: float, draft_cost: float, verify: Sequence[float], max_len: int) -> float:
    """The least per-token acceptance at which a draft of ``draft_cost`` reaches ``speedup`` at its best
    length in ``1 .. max_len`` (:func:`best_draft_length`, whose speedup grows with acceptance);
    ``nan`` when even acceptance 1 does not. The frontier a skip set must lie above.
    Example: draft cost ``0.5``, verify ``(1, 1, 1.05)``, ``max_len = 2``: break-even (``speedup = 1``)
    needs ``a = 0.5`` (k = 1: ``1.5 / 1.5``); cost ``1.2`` never breaks even (``2 / 2.2``): ``nan``.
    """
    def best(a: float) -> float:
        return best_draft_length(a, draft_cost, verify, max_len, min_len=1)[1]

    if best(1.0) < speedup:
        return math.nan
    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisection to ~1e-12
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid) < speedup else (lo, mid)
    return hi


def reach(a: float | Sequence[float], t: int) -> float:
    """``sum_{j<=t} prod_{i<j} a_i``: expected accepted tokens of ``t`` drafts with acceptance ``a``
    (one number for every position, or one per position). Example: ``reach([0.5, 0.9], 2) = 0.95``."""
    if isinstance(a, (int, float)):
        return expected_tokens_per_step(float(a), t) - 1.0
    total, p = 0.0, 1.0
    for j in range(t):
        p *= a[j]
        total += p
    return total


def cascade_expected_tokens(a_layer_skip: float, h: int, a_stat: float | Sequence[float], t: int) -> float:
    """Expected tokens per step of a cascade draft: ``h`` layer-skip tokens then ``t`` statistical ones.

    Each layer-skip token is accepted with probability ``a_layer_skip`` and statistical token ``j``
    of the tail with ``a_stat`` (or ``a_stat[j]``, acceptance by tail position), until the first
    rejection; the target's own token counts too:
    ``1 + sum_{i<=h} a_l^i + a_l^h * sum_{j<=t} prod_{i<j} a_s[i]``.
    Example: ``a_l = 0.8, h = 1, a_s = 0.5, t = 2``: ``1 + 0.8 + 0.8 * (0.5 + 0.25) = 2.4``; with
    ``a_s = [0.5, 0.9]``: ``1 + 0.8 + 0.8 * (0.5 + 0.45) = 2.56``.
    """
    return expected_tokens_per_step(a_layer_skip, h) + a_layer_skip ** h * reach(a_stat, t)


def cascade_speedup(a_layer_skip: float, h: int, a_stat: float | Sequence[float], k: int, layer_skip_cost: float,
                    stat_cost: float, verify: Sequence[float]) -> float:
    """Expected tokens per unit cost of a cascade draft of ``k`` tokens, the first ``h`` from the
    layer-skip level: :func:`cascade_expected_tokens` over ``h * layer_skip_cost + (k - h) * stat_cost
    + verify[k]`` (a verify table). Example: ``a_l = 0.9, h = 1, a_s = 0.3, k = 2``, costs 0.5 and 0,
    verify ``(1, 1, 1.05)``: ``2.17 / 1.55 = 1.40``; ``h = 0, k = 0`` is a plain step: ``1 / verify[0]``."""
    return cascade_expected_tokens(a_layer_skip, h, a_stat, k - h) / (h * layer_skip_cost + (k - h) * stat_cost
                                                                       + verify[k])


def best_split(a_layer_skip: float, a_stat: float | Sequence[float], layer_skip_cost: float, stat_cost: float,
               verify: Sequence[float], max_len: int, max_split: int) -> tuple[int, int]:
    """The ``(split, k)`` maximising expected tokens per unit cost for a cascade draft.

    ``split`` tokens from the layer-skip level (``layer_skip_cost`` each), ``k - split`` from the
    statistical drafter (``stat_cost`` each; acceptance ``a_stat``, a number or one per tail
    position), verified at ``verify[k]`` (a verify table); ``(0, 0)`` is a plain step.
    Example: ``a_l = 0.9, a_s = 0.3``, costs 0.5 and 0, verify ``(1, 1, 1.05)``, ``max_len = 2``:
    (0, 1) gives 1.3, (0, 2) 1.39 / 1.05 = 1.32, (1, 1) 1.9 / 1.5 = 1.27, (1, 2) 2.17 / 1.55 = 1.40,
    (2, 2) 2.71 / 2.05 = 1.32: ``(1, 2)``.
    """
    best, best_v = (0, 0), 1.0 / verify[0]
    for h in range(0, min(max_split, max_len) + 1):
        for k in range(max(h, 1), max_len + 1):
            v = cascade_speedup(a_layer_skip, h, a_stat, k, layer_skip_cost, stat_cost, verify)
            if v > best_v:
                best, best_v = (h, k), v
    return best


@dataclass(frozen=True)
class CostModel:
    """Relative costs. ``attn``/``mlp``: per sublayer (``[n_layers]`` each); ``base``: the rest.

    ``verify``: ``verify[n-1]`` is the cost of a full forward over ``n`` tokens (``verify[0] == 1``).
    ``step_ms``: the measured time of one full one-token step; ``context``: the cached positions it
    was measured at. ``prefill``: measured prefills, ``((prompt_tokens, ms), ...)`` by increasing
    length (empty in profiles calibrated before it was measured); :meth:`prefill_seconds` reads it.
    ``others_share``: the share of the machine's CPU other work took while these were timed
    (:mod:`adaptive.costs.busy`; ``None``: not measured); above :data:`~adaptive.costs.busy.BUSY_SHARE`
    they read slow.
    """

    attn: tuple[float, ...]
    mlp: tuple[float, ...]
    base: float
    verify: tuple[float, ...]
    step_ms: float = 0.0
    context: int = 0
    prefill: tuple[tuple[int, float], ...] = ()
    others_share: float | None = None

    def __post_init__(self):
        if self.others_share is not None and not 0.0 <= self.others_share <= 1.0:
            raise ValueError(f"others_share is a share of the machine in [0, 1], got {self.others_share}")
        lengths = [n for n, _ in self.prefill]
        if any(n <= 0 or ms <= 0 for n, ms in self.prefill) or lengths != sorted(set(lengths)):
            raise ValueError(f"prefill points need increasing positive lengths and positive times, got {self.prefill}")
        if len(self.attn) != len(self.mlp) or not self.attn:
            raise ValueError("attn and mlp costs need one value per layer")
        if not self.verify or any(v <= 0 for v in self.verify):
            raise ValueError("verify costs must be positive, one per token count from 1")
        if self.base < 0 or any(c < 0 for c in self.attn + self.mlp):
            raise ValueError("costs must be non-negative")

    @property
    def n_layers(self) -> int:
        return len(self.attn)

    def draft_cost(self, skip_masks) -> float:
        """Cost of one draft token with ``skip_masks`` (``SkipSet.masks``), relative to a full step.

        Example: 2 layers, attn ``(0.3, 0.3)``, mlp ``(0.15, 0.15)``, base ``0.1``; skipping
        attention 0 costs ``0.1 + 0.3 + 0.15 + 0.15 = 0.7``.
        """
        sa, sm = skip_masks
        return (self.base + sum(c for c, s in zip(self.attn, sa) if not s)
                + sum(c for c, s in zip(self.mlp, sm) if not s))

    def verify_cost(self, k: int) -> float:
        """Cost of verifying ``k`` drafted tokens (a forward over ``k + 1`` tokens)."""
        return extrapolate(self.verify, k)

    def verify_table(self, max_len: int) -> tuple[float, ...]:
        return verify_table(self.verify, max_len)

    def prefill_seconds(self, tokens: int) -> float:
        """Seconds to prefill a prompt of ``tokens`` tokens: :func:`interpolate_points` over the
        measured :attr:`prefill` points. Raises ``ValueError`` when none were measured."""
        if not self.prefill:
            raise ValueError("this cost model has no measured prefill times (calibrated before they were measured)")
        return interpolate_points(self.prefill, tokens) / 1e3

    def to_dict(self) -> dict:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        d["prefill"] = [[n, ms] for n, ms in self.prefill]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(attn=tuple(map(float, d["attn"])), mlp=tuple(map(float, d["mlp"])), base=float(d["base"]),
                   verify=tuple(map(float, d["verify"])), step_ms=float(d.get("step_ms", 0.0)),
                   context=int(d.get("context", 0)),
                   prefill=tuple((int(n), float(ms)) for n, ms in d.get("prefill", ())),
                   others_share=None if d.get("others_share") is None else float(d["others_share"]))

    @classmethod
    def uniform(cls, n_layers: int, attn_share: float = 0.48, mlp_share: float = 0.32,
                verify: tuple[float, ...] = (1.0,)) -> CostModel:
        """A model from shares of a step (defaults: the bf16 split measured on the 2-core CPU)."""
        base = 1.0 - attn_share - mlp_share
        return cls((attn_share / n_layers,) * n_layers, (mlp_share / n_layers,) * n_layers, base, verify)
