"""A domain's race as calibration and the online learner share it: the race configuration from the
settings, the decision, and the record's measured pieces (scripted measurements, no timing)."""

import pytest

from adaptive.costs import STAT_DRAFT_COST
from adaptive.drafters.cascade import CascadePlan
from adaptive.engine.skip import SkipSet
from adaptive.measure import race as measure_race
from adaptive.measure.race import DomainRace, cascade_draft_cost, race_domain, statistical_candidates
from adaptive.measure.timing import RaceConfig
from adaptive.profile import Decision, Interval, Measurement, MeasureSettings, Prior, StatisticalAcceptance

PLAN = CascadePlan(split=0, draft_len=5, max_split=0)
STAT = StatisticalAcceptance(0.6, (0.7, 0.5))


def _measured(drafter, role, speedup, low, mean_accepted=1.5, token_acceptance=0.4):
    return Measurement(drafter, role, 3, speedup, token_acceptance=token_acceptance, mean_accepted=mean_accepted,
                       interval=Interval(low, speedup + 0.1), verdict="faster" if low >= 1.02 else "open")


def test_race_config_of_the_settings():
    assert RaceConfig.of(MeasureSettings(block_tokens=8), prompts=2) == RaceConfig(
        block_tokens=8, max_tokens=64, prompts=2, min_blocks=6, margin=0.02, level=0.9, seed=0, min_prompts=2)
    assert RaceConfig.of(MeasureSettings(confirm_prompts=3, min_gain=0.05, seed=7, min_prompts=3)) == RaceConfig(
        block_tokens=16, max_tokens=64, prompts=3, min_blocks=6, margin=0.05, level=0.9, seed=7, min_prompts=3)


def test_statistical_candidates():
    c = statistical_candidates(4, PLAN, skip=SkipSet((1,)), lookup_estimate=1.1)
    assert list(c) == ["lookup", "cascade"]
    assert (c["lookup"].drafter, c["lookup"].draft_len, c["lookup"].estimated_speedup) == ("pld", 4, 1.1)
    assert (c["cascade"].drafter, c["cascade"].draft_len, c["cascade"].skip, c["cascade"].cascade) == (
        "cascade", 5, SkipSet((1,)), PLAN)
    assert c["cascade"].to_dict()["skip"] == "attn=1"  # as text in the race checkpoint's key
    assert statistical_candidates(4, PLAN)["cascade"].skip == SkipSet()
    # what a draft token costs, for the decision's floor: statistical tokens only at split 0
    assert c["lookup"].estimated_draft_cost == c["cascade"].estimated_draft_cost == STAT_DRAFT_COST


def test_cascade_draft_cost_mixes_its_levels():
    assert cascade_draft_cost(CascadePlan(split=1, draft_len=4, max_split=2), 0.7) == pytest.approx(0.17875)
    assert cascade_draft_cost(CascadePlan(split=0, draft_len=4, max_split=2), 0.7) == STAT_DRAFT_COST
    assert cascade_draft_cost(CascadePlan(split=2, draft_len=2, max_split=2), 0.7) == pytest.approx(0.7)


def test_race_domain_races_as_the_settings_say_and_decides(monkeypatch):
    seen = {}

    def scripted(lm, prompt_ids, candidates, rc, **kw):
        seen.update(rc=rc, prompts=prompt_ids, guard=kw["guard"])
        return {"cascade": _measured("cascade", "cascade", 1.3, 1.1),
                "lookup": _measured("pld", "lookup", 1.5, 1.2, mean_accepted=1.1)}

    monkeypatch.setattr(measure_race, "race_candidates", scripted)
    s = MeasureSettings(block_tokens=4, confirm_tokens=12, acceptance_floor=0.2)
    guard = object()
    raced = race_domain(None, [[1, 2]], statistical_candidates(4, PLAN), s, 1, guard=guard)
    assert seen == {"rc": RaceConfig.of(s, 1), "prompts": [[1, 2]], "guard": guard}
    # lookup is faster but accepts 0.1 tokens per step, below the floor: the cascade decodes
    assert raced.decision == Decision("cascade", 3, 1.3)
    assert [m.role for m in raced.measurements] == ["lookup", "cascade"]  # ROLES order


def test_record_and_priors():
    raced = DomainRace({"lookup": _measured("pld", "lookup", 1.5, 1.2, token_acceptance=0.45)}, Decision("pld", 3, 1.5))
    rec = raced.record("learned-1", STAT, PLAN, (1.0, 1.1), 40, prompts=8, anchors=2)
    assert rec.decision == Decision("pld", 3, 1.5) and rec.measurements == raced.measurements
    assert rec.priors.layer_skip == Prior(0.0, 1.0) and rec.priors.lookup.acceptance == 0.45
    assert rec.priors.statistical.acceptance == 0.6 and rec.priors.statistical.by_position == (0.7, 0.5)
    assert rec.layer_skip.skip.size == 0 and rec.layer_skip.draft_len == 1
    assert (rec.name, rec.prompts, rec.anchors, rec.verify, rec.verify_context) == ("learned-1", 8, 2, (1.0, 1.1), 40)
    assert DomainRace({}, Decision("ar")).priors(STAT).lookup.acceptance == 0.0  # lookup not raced
