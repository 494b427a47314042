"""What decodes a domain: a pure function of its timed measurements and ``min_gain``.

Calibration times three drafters against plain decoding (``ar``): the best skip set (``ssd``, over
the reduced vocabulary where that measured faster), prompt lookup (``pld``) and the ``cascade``.
The fastest is timed once more when it beats ``ar`` by ``min_gain`` (the best of several noisy
measurements is biased upwards), and the decision uses the mean of its two timings:

1. :func:`to_recheck` names the drafter to time again (or ``None``);
2. :func:`decide` returns the :class:`~adaptive.profile.Decision` and the speedup used per drafter.

Example: speedups ``ssd 1.30, pld 1.10, cascade 1.20``, ``min_gain 0.02``: ``ssd`` is timed again;
a recheck of 1.14 gives ``ssd`` (1.30 + 1.14) / 2 = 1.22, more than the cascade's 1.20:
``Decision("ssd", draft_len, 1.22)``. A recheck of 1.00 gives 1.15 and the cascade wins (ties go to
the first in ``ssd, pld, cascade`` order). Nothing at least 1.02: ``Decision("ar", 1, 1.0)``.
"""

from __future__ import annotations

from adaptive.profile import Decision, Measurement

TIMED = ("ssd", "pld", "cascade")  # the drafters a domain's decision compares, in tie-break order


def _speeds(timed: dict[str, Measurement]) -> dict[str, float]:
    missing = [m for m in TIMED if m not in timed]
    if missing:
        raise ValueError(f"a decision needs timings of {', '.join(TIMED)}; missing {', '.join(missing)}")
    return {m: timed[m].speedup for m in TIMED}


def to_recheck(timed: dict[str, Measurement], min_gain: float) -> str | None:
    """The fastest drafter when it beats ``ar`` by ``min_gain`` (to be timed again), else ``None``."""
    speed = _speeds(timed)
    winner = max(speed, key=speed.get)
    return winner if speed[winner] >= 1.0 + min_gain else None


def decide(timed: dict[str, Measurement], min_gain: float,
           recheck: Measurement | None = None) -> tuple[Decision, dict[str, float]]:
    """The domain's decision from the ``timed`` measurements (``ssd``, ``pld``, ``cascade``) and the
    ``recheck`` of the drafter :func:`to_recheck` named (its speedup becomes the mean of both).

    Returns the decision (the fastest drafter at least ``1 + min_gain`` times ``ar``'s speed, at the
    draft length it was timed with, else ``ar``) and the speedup used for each drafter.
    """
    speed = _speeds(timed)
    if recheck is not None:
        if recheck.drafter != to_recheck(timed, min_gain):
            raise ValueError(f"a recheck of {recheck.drafter} where {to_recheck(timed, min_gain)} was to be rechecked")
        speed[recheck.drafter] = (speed[recheck.drafter] + recheck.speedup) / 2
    paying = {m: v for m, v in speed.items() if v >= 1.0 + min_gain}
    if not paying:
        return Decision("ar", 1, 1.0), speed
    best = max(paying, key=paying.get)
    return Decision(best, timed[best].draft_len, round(float(speed[best]), 4)), speed
