"""Routing a prompt with a profile: embedding -> nearest anchors -> domain -> what to decode with."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.index.anchors import Route
from adaptive.index.embedding import embed_prompt


@dataclass(frozen=True)
class Decision:
    """A routed request: the :class:`Route`, the domain profile it selects, and the decoding choice."""

    route: Route
    profile_domain: str  # the domain whose settings apply ("global" when out-of-domain)
    skip_text: str
    draft_len: int
    method: str  # the domain's calibrated choice: "ssd", "pld", "cascade" or "ar"

    def to_dict(self) -> dict:
        return {**self.route.to_dict(), "applied": self.profile_domain, "skip": self.skip_text,
                "draft_len": self.draft_len, "method": self.method}


def decide(profile, vector, k: int | None = None) -> Decision:
    """Route a raw pooled embedding ``[hidden]`` with ``profile`` (a :class:`adaptive.profile.Profile`)."""
    route = profile.index.route(vector, k)
    dp = profile.domain(route.domain)
    lengths = {"pld": dp.pld_draft_len, "cascade": dp.cascade.draft_len if dp.cascade else dp.pld_draft_len}
    return Decision(route, dp.name, dp.skip.to_text(), lengths.get(dp.decision, dp.draft_len), dp.decision)


def route_prompt(profile, engine, prompt, k: int | None = None) -> Decision:
    """Encode ``prompt`` as calibration did (its chat setting), embed it, and decide."""
    ids = engine.encode(prompt, chat=profile.settings.get("chat"))
    return decide(profile, embed_prompt(engine.backbone, ids), k)
