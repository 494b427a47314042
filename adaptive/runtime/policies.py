"""The routing policies: how the runtime picks what decodes a request, defined once.

A *policy* (``knn-ssd``, ``knn-skip``, ...) says which profile record applies to a request and
which drafter kind decodes it; the *drafter* (:data:`adaptive.drafters.factory.DRAFTERS`: ``ar``,
``ssd``, ``pld``, ``cascade``, ``early-exit``, ``draft-model``) is what actually decodes. The CLI's
choices, help texts and the benchmark's method table all come from :data:`POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.drafters.factory import DRAFTERS
from adaptive.errors import ConfigError
from adaptive.profile.records import DISTILLED_KINDS


@dataclass(frozen=True)
class Policy:
    """``routed``: the KNN index picks the domain whose record applies (``False``: the global record
    for every request). ``drafter``: a fixed drafter kind (``None``: the record's calibrated
    decision). For ``ssd`` the record's skip set drafts, and where it has none the request is
    decoded plainly (``ar``)."""

    name: str
    description: str
    routed: bool
    drafter: str | None

    def __post_init__(self):
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise ValueError(f"policy {self.name!r}: unknown drafter {self.drafter!r}")


ROUTED_POLICY = "knn-ssd"  # each request decoded as its routed domain's calibrated decision: what the profile prices
POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy(ROUTED_POLICY, "KNN routing to the domain's calibrated decision (layer-skip drafting, prompt lookup, the "
                      "cascade or plain decoding)", True, None),
    Policy("knn-skip", "KNN routing to the domain's skip set for every request (KNN-SSD as published: layer "
                       "skipping only; plain decoding where the domain has none)", True, "ssd"),
    Policy("ssd-static", "the global record's skip set for every request (the Self-SD baseline)", False, "ssd"),
    Policy("cascade", "KNN routing to the domain's cascade (prompt lookup and its bigram table, under and after "
                      "the domain's layer-skip drafter)",
           True, "cascade"),
    Policy("early-exit", "the early-exit drafter `adaptive distill` stored in the profile (EESD), with the "
                         "routed domain's verify costs", True, "early-exit"),
    Policy("draft-model", "the draft model `adaptive distill` stored in the profile, with the routed domain's "
                          "verify costs", True, "draft-model"),
    Policy("eagle", "the eagle head `adaptive distill --drafter eagle` stored in the profile (a trained head over "
                    "the target's hidden states), with the routed domain's verify costs", True, "eagle"),
    Policy("ar", "plain autoregressive decoding (routed, for the record)", True, "ar"),
)}
DISTILLED = DISTILLED_KINDS  # drafter kinds trained by `adaptive distill`, stored in the profile


def get_policy(name: str) -> Policy:
    """The policy called ``name``, or a :class:`ConfigError` listing them."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
