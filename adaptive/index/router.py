"""Routing a prompt with a profile: embedding -> nearest anchors -> domain -> its calibrated decision.

The profile is read through its typed records (:class:`adaptive.profile.Profile`; not imported:
the index sits below the profile). What a serving request decodes with also depends on the
routing policy: that is the runtime's :class:`~adaptive.runtime.runtime.RoutedPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.engine.skip import SkipSet
from adaptive.index.anchors import Route
from adaptive.index.embedding import embed_prompt


@dataclass(frozen=True)
class RouteDecision:
    """A routed prompt: the :class:`Route`, the record that applies (``applied``: the domain, or
    ``"global"`` when out-of-domain) and that record's calibrated decision (``drafter``, one of
    ``ar``, ``ssd``, ``pld``, ``cascade``, at fixed length ``draft_len``) and its ``skip`` set (empty
    when it has none; :meth:`to_dict` gives its text form)."""

    route: Route
    applied: str
    drafter: str
    draft_len: int
    skip: SkipSet

    def to_dict(self) -> dict:
        return {**self.route.to_dict(), "applied": self.applied, "skip": self.skip.to_text(),
                "draft_len": self.draft_len, "decision": self.drafter}


def route_vector(profile, vector, k: int | None = None) -> RouteDecision:
    """Route a raw pooled embedding ``[hidden]`` with ``profile`` (a :class:`adaptive.profile.Profile`)."""
    route = profile.index.route(vector, k)
    return decision_of(route, profile.domain(route.domain))


def decision_of(route: Route, record) -> RouteDecision:
    """The :class:`RouteDecision` of ``route`` applying ``record`` (a profile's ``DomainRecord``, or a
    domain the runtime learned online)."""
    return RouteDecision(route, record.name, record.decision.drafter, record.decision.draft_len,
                         record.layer_skip.skip)


def route_prompt(profile, engine, prompt, k: int | None = None) -> RouteDecision:
    """Encode ``prompt`` as calibration did (the profile's chat setting), embed it, and route the vector."""
    ids = engine.encode(prompt, chat=profile.runtime.chat)
    return route_vector(profile, embed_prompt(engine.backbone, ids, profile.index.pooling), k)
