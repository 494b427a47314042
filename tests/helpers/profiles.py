"""Profiles whose domains draft on the tiny random model, whatever its tiny calibration decided."""

import dataclasses

from adaptive.costs import STAT_DRAFT_COST
from adaptive.engine.skip import SkipSet
from adaptive.profile import Decision, Prior, Priors


def drafting(d, drafter: str | None = None, **changes):
    """Domain record ``d`` deciding ``drafter`` (default: its own decision), with a skip set to draft
    with (layer 1's attention where the search found none), optimistic priors (0.9 per token, a
    layer-skip draft token at 0.1 of a step) and flat verification costs, so that the bandits
    start out drafting on this random model whatever the tiny calibration's timings were."""
    skip = d.layer_skip.skip if d.layer_skip.skip else SkipSet((1,), ())
    drafter = drafter or d.decision.drafter
    length = {"ssd": d.layer_skip.draft_len, "pld": 4, "cascade": d.cascade.draft_len, "ar": 1}[drafter]
    priors = Priors(layer_skip=Prior(0.9, 0.1), lookup=Prior(0.9, STAT_DRAFT_COST),
                    statistical=Prior(0.9, STAT_DRAFT_COST), reduced_head_cost=0.05)
    return dataclasses.replace(d, decision=Decision(drafter, length),
                               layer_skip=dataclasses.replace(d.layer_skip, skip=skip),
                               priors=priors, verify=(1.0,) * 16, **changes)


def with_domains(profile, drafter=None, **changes):
    """A copy of ``profile`` whose domains and global record are :func:`drafting` (``drafter``: a
    drafter name, or a function of the domain's name giving one)."""
    pick = drafter if callable(drafter) else (lambda name: drafter)
    p = dataclasses.replace(profile)
    p.domains = {n: drafting(d, pick(n), **changes) for n, d in profile.domains.items()}
    p.global_set = drafting(profile.global_set, pick(None) or "ssd", **changes)
    return p
