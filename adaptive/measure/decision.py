"""What decodes a domain: a pure function of its raced measurements.

Calibration races up to four drafters against plain decoding (``ar``) in paired blocks
(:mod:`.timing`), each one's speedup with a bootstrap interval and a verdict (:mod:`.interval`):
the best skip set (role ``candidate``, ``ssd``), the same over the domain's reduced vocabulary
(``vocab``), prompt lookup (``lookup``, ``pld``) and the ``cascade``; ``adaptive distill --drafter
eagle`` races the profile's eagle head (``eagle``) and decides again with it. A drafter may decode the
domain only when

* its verdict is ``faster``: the interval's low end is at least ``1 + margin`` (so no drafter whose
  interval includes 1.0 is ever recorded faster than ``ar``), and
* it was measured accepting at least ``floor`` tokens per verification step beyond the target's
  own (``mean_accepted - 1``), the floor scaled by what its drafts cost per step
  (:func:`draft_cost_per_step`): a layer-skip draft costing most of a step that is almost never
  accepted cannot be faster, whatever the clock said; a statistical draft costing 1% of a step
  may accept little and still pay where verification is nearly free.

Of those, the one with the highest speedup wins (ties: :data:`ROLES` order); none: ``ar``.

Example: ``candidate`` 1.30 [1.21, 1.38] accepting 0.9 tokens per step, ``cascade`` 1.35
[1.01, 1.62] (open: its interval reaches below 1.02) and ``lookup`` 1.10 [1.05, 1.15] accepting
0.6: ``Decision("ssd", k, 1.30)``. Had the candidate, drafting one token per step (k = 1) at 0.7 of a
step, accepted 0.1 tokens per step (below a floor of 0.2 x 0.7 = 0.14), ``pld`` would decode at
1.10 (at k >= 2 its draft costs a whole step or more: the floor stays 0.2);
prompt lookup drafting 8 tokens at 0.005 of a step each needs 0.2 x 0.04 = 0.008.
"""

from __future__ import annotations

from collections.abc import Mapping

from adaptive.measure.interval import FASTER
from adaptive.profile import Decision, Measurement

ROLES = ("candidate", "vocab", "lookup", "cascade", "eagle")  # the raced drafters, in tie-break order


def draft_cost_per_step(m: Measurement) -> float:
    """What ``m``'s drafts cost per verification step, in target steps: its estimated cost per draft
    token times its draft length, at most 1; 1 where no cost was estimated (the unscaled floor)."""
    if m.estimated_draft_cost is None:
        return 1.0
    return min(1.0, max(0.0, m.estimated_draft_cost) * m.draft_len)


def eligible(m: Measurement, floor: float) -> bool:
    """Whether ``m`` may decode its domain: verdict ``faster``, and at least ``floor`` accepted
    tokens per step scaled by :func:`draft_cost_per_step`."""
    return m.verdict == FASTER and m.mean_accepted - 1.0 >= floor * draft_cost_per_step(m)


def decide(timed: Mapping[str, Measurement], floor: float) -> Decision:
    """The domain's :class:`Decision` from its raced measurements (``{role: Measurement}``)."""
    unknown = sorted(set(timed) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown measurement role(s) {', '.join(unknown)}; expected {', '.join(ROLES)}")
    best = None
    for role in ROLES:
        m = timed.get(role)
        if m is not None and eligible(m, floor) and (best is None or m.speedup > best.speedup):
            best = m
    if best is None:
        return Decision("ar", 1, 1.0)
    return Decision(best.drafter, best.draft_len, round(float(best.speedup), 4))
