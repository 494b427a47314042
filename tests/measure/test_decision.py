"""The decision, a pure function of raced measurements: verdicts, the cost-scaled acceptance floor, ties."""

import pytest

from adaptive.measure.decision import decide, draft_cost_per_step, eligible
from adaptive.profile import Decision, Interval, Measurement


def _m(drafter, role, speedup, low, mean_accepted, draft_len=1, cost=None):
    return Measurement(drafter, role, draft_len, speedup, mean_accepted=mean_accepted, estimated_draft_cost=cost,
                       interval=Interval(low, speedup + 0.1), verdict="faster" if low >= 1.02 else "open")


def test_draft_cost_per_step_is_the_cost_per_token_times_the_length_at_most_one():
    assert draft_cost_per_step(_m("ssd", "candidate", 1.2, 1.1, 1.5, draft_len=1, cost=0.7)) == pytest.approx(0.7)
    assert draft_cost_per_step(_m("pld", "lookup", 1.2, 1.1, 1.5, draft_len=8, cost=0.005)) == pytest.approx(0.04)
    assert draft_cost_per_step(_m("ssd", "candidate", 1.2, 1.1, 1.5, draft_len=3, cost=0.6)) == 1.0
    assert draft_cost_per_step(_m("pld", "lookup", 1.2, 1.1, 1.5)) == 1.0  # not estimated: the unscaled floor


def test_the_floor_scales_with_what_a_draft_costs():
    # the docstring's case: 0.1 accepted tokens per step is below 0.2 x 0.7 for a layer-skip draft ...
    assert not eligible(_m("ssd", "candidate", 1.3, 1.21, 1.1, cost=0.7), 0.2)
    assert eligible(_m("ssd", "candidate", 1.3, 1.21, 1.15, cost=0.7), 0.2)
    # ... and above 0.2 x 8 x 0.005 for prompt lookup
    assert eligible(_m("pld", "lookup", 1.1, 1.05, 1.1, draft_len=8, cost=0.005), 0.2)
    assert not eligible(_m("pld", "lookup", 1.1, 1.05, 1.005, draft_len=8, cost=0.005), 0.2)
    # without an estimated cost the floor is the whole 0.2, as before costs were recorded
    assert not eligible(_m("pld", "lookup", 1.1, 1.05, 1.1, draft_len=8), 0.2)
    # an open verdict is never eligible, whatever it accepts
    assert not eligible(_m("cascade", "cascade", 1.35, 1.01, 2.5, cost=0.005), 0.2)


def test_decide_picks_the_fastest_eligible_drafter():
    candidate = _m("ssd", "candidate", 1.30, 1.21, 1.9, cost=0.7)
    cascade = _m("cascade", "cascade", 1.35, 1.01, 2.0, draft_len=4, cost=0.005)  # open
    lookup = _m("pld", "lookup", 1.10, 1.05, 1.6, draft_len=8, cost=0.005)
    assert decide({"candidate": candidate, "cascade": cascade, "lookup": lookup}, 0.2) == Decision("ssd", 1, 1.30)
    weak = _m("ssd", "candidate", 1.30, 1.21, 1.1, cost=0.7)
    assert decide({"candidate": weak, "cascade": cascade, "lookup": lookup}, 0.2) == Decision("pld", 8, 1.10)
    # a cascade accepting 0.15 tokens per step at 0.005 a token: eligible once the floor is scaled
    thin = _m("cascade", "cascade", 1.20, 1.11, 1.15, draft_len=4, cost=0.005)
    assert decide({"cascade": thin, "lookup": lookup}, 0.2) == Decision("cascade", 4, 1.20)
    assert decide({}, 0.2) == Decision("ar", 1, 1.0)
    with pytest.raises(ValueError, match="unknown measurement role"):
        decide({"other": lookup}, 0.2)
