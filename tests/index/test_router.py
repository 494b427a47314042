"""A routed prompt's decision: the applied record's drafter, draft length and skip set."""

from types import SimpleNamespace

from adaptive.engine.skip import SkipSet
from adaptive.index.anchors import Route
from adaptive.index.router import decision_of

ROUTE = Route("maths", "maths", (("maths", 0.125),), {"maths": 1.0}, False)


def _record(skip: SkipSet, drafter: str = "ssd"):
    return SimpleNamespace(name="maths", decision=SimpleNamespace(drafter=drafter, draft_len=4),
                           layer_skip=SimpleNamespace(skip=skip))


def test_the_decision_holds_the_skip_set_and_gives_its_text_in_json():
    d = decision_of(ROUTE, _record(SkipSet((1, 2), (3,))))
    assert d.skip == SkipSet((1, 2), (3,)) and (d.applied, d.drafter, d.draft_len) == ("maths", "ssd", 4)
    assert d.to_dict() == {**ROUTE.to_dict(), "applied": "maths", "skip": "attn=1-2;mlp=3", "draft_len": 4,
                           "decision": "ssd"}
    assert decision_of(ROUTE, _record(SkipSet(), "pld")).to_dict()["skip"] == "none"
