"""The whole calibration on a tiny model: profile contents, checkpoints, resume, locks, backends, and the
per-domain decision (a pure function of scripted timings, then end to end with scripted timings)."""

import json
import os

import pytest

from adaptive.calibrate import domain, vocab
from adaptive.calibrate.runner import CalibrationError, CalibrationSettings, calibrate, check_domains
from adaptive.calibrate.settings import GLOBAL_TASK, calibration_workdir
from adaptive.calibrate.vocab import size_estimates
from adaptive.costs import CostModel
from adaptive.errors import ConfigError
from adaptive.measure import race as measure_race
from adaptive.measure import timing
from adaptive.measure.decision import decide
from adaptive.measure.interval import verdict as _verdict
from adaptive.models import load_model
from adaptive.profile import GLOBAL, Decision, Interval, Measurement, ProfileError, load_profile
from adaptive.workdir import slug
from tests.conftest import TINY_DOMAINS, tiny_lm, tiny_settings

COSTS = CostModel.uniform(4, verify=(1.0, 1.02, 1.04, 1.06, 1.08))  # fixed: timing noise cannot change the search
# skipped sublayers nearly free and verification flat: layer skipping can pay, so the bound lets the search run
CHEAP = CostModel((0.15,) * 4, (0.1,) * 4, 0.0, (1.0,) * 5)


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="trials"):
        CalibrationSettings(trials=0)
    with pytest.raises(ConfigError, match="prompts-per-domain"):
        CalibrationSettings(prompts_per_domain=2)
    with pytest.raises(ConfigError, match="init-trials"):
        CalibrationSettings(trials=3, init_trials=5)
    with pytest.raises(ConfigError, match="space"):
        CalibrationSettings(space="grid")
    with pytest.raises(ConfigError, match="min-gain"):
        CalibrationSettings(min_gain=-0.1)
    with pytest.raises(ConfigError, match="confirm-tokens"):
        CalibrationSettings(confirm_tokens=1)
    with pytest.raises(ConfigError, match="cascade-max-split"):
        CalibrationSettings(cascade_max_split=13)
    with pytest.raises(ConfigError, match="vocab-sizes"):
        CalibrationSettings(vocab_sizes=(8,))
    with pytest.raises(ConfigError, match="pool choices"):
        CalibrationSettings(pool_choices=(0.5, 1.0))
    q = CalibrationSettings.quick()
    assert q.trials < CalibrationSettings().trials


def test_pooling_candidates_start_with_the_default():
    from adaptive.engine.config import Pooling

    keys = [f"{p.mode}@{p.layer}" for p in CalibrationSettings().pooling_candidates(30)]
    assert keys == ["last@10", "mean@10", "last@6", "mean@6", "last@15", "mean@15", "last@20", "mean@20", "last@26",
                    "mean@26"]
    assert CalibrationSettings(pool_choices=()).pooling_candidates(30) == (Pooling(10, "last"),)
    assert CalibrationSettings(pool_choices=[0.5]).to_dict()["pool_choices"] == [0.5]  # JSON's form
    tiny = CalibrationSettings().pooling_candidates(4)  # depths meet on few layers: no repeats
    assert len(set(tiny)) == len(tiny) and all(1 <= p.layer <= 3 for p in tiny)


def test_global_task_name_is_on_disk():
    # the global task's name names its files in calibration work dirs and seeds its search:
    # changing it would stop earlier runs resuming, so it stays apart from the record's name
    assert GLOBAL_TASK == "__global__" and GLOBAL == "global"


def test_domain_checks():
    with pytest.raises(ConfigError, match="at least 3"):
        check_domains({"a": ["x", "y"]}, CalibrationSettings())
    with pytest.raises(ConfigError, match="reserved"):
        check_domains({"__global__": ["x"] * 5}, CalibrationSettings())
    with pytest.raises(ConfigError, match="reserved"):
        check_domains({"global": ["x"] * 5}, CalibrationSettings())
    with pytest.raises(ConfigError, match="no domains"):
        check_domains({}, CalibrationSettings())
    used = check_domains({"a": [f"p{i}" for i in range(30)]}, CalibrationSettings(prompts_per_domain=5))
    assert used == {"a": ["p0", "p1", "p2", "p3", "p4"]}  # the first N, in file order


def test_slug_is_safe_and_distinct():
    assert slug("a b/c").startswith("a_b_c-")
    assert slug("a b") != slug("a_b")


# -- the decision: a pure function of raced measurements ---------------------------------------------

def _m(drafter, speedup, role="candidate", draft_len=3, low=None, high=None, verdict=None, mean_accepted=1.9):
    low = speedup - 0.05 if low is None else low
    high = speedup + 0.05 if high is None else high
    iv = Interval(low, high)
    return Measurement(drafter, role, draft_len, speedup, mean_accepted=mean_accepted, interval=iv,
                       verdict=verdict or _verdict(iv, 0.02))


def test_decision_docstring_example():
    timed = {"candidate": _m("ssd", 1.30, low=1.21, high=1.38, draft_len=4),
             "cascade": _m("cascade", 1.35, "cascade", 9, low=1.01, high=1.62),
             "lookup": _m("pld", 1.10, "lookup", 5, low=1.05, high=1.15, mean_accepted=1.6)}
    assert timed["cascade"].verdict == "open"
    assert decide(timed, 0.2) == Decision("ssd", 4, 1.30)
    timed["candidate"] = _m("ssd", 1.30, low=1.21, high=1.38, draft_len=4, mean_accepted=1.1)
    assert decide(timed, 0.2) == Decision("pld", 5, 1.10)


def test_decision_nothing_settled_faster_is_ar():
    timed = {"candidate": _m("ssd", 1.01), "lookup": _m("pld", 0.6, "lookup"),
             "cascade": _m("cascade", 1.019, "cascade")}
    assert decide(timed, 0.2) == Decision("ar", 1, 1.0)
    assert decide({}, 0.2) == Decision("ar", 1, 1.0)


def test_decision_never_takes_an_interval_that_includes_one():
    # a high point estimate whose interval reaches below 1 (noise) is not faster
    timed = {"cascade": _m("cascade", 1.29, "cascade", 9, low=0.98, high=1.6)}
    assert decide(timed, 0.2) == Decision("ar", 1, 1.0)


def test_decision_below_the_acceptance_floor_is_never_faster():
    # skip-everything drafts: measured 1.08x by the clock, 0.01 accepted tokens per step
    timed = {"candidate": _m("ssd", 1.08, low=1.04, high=1.12, mean_accepted=1.01)}
    assert timed["candidate"].verdict == "faster"
    assert decide(timed, 0.2) == Decision("ar", 1, 1.0)
    assert decide(timed, 0.0) == Decision("ssd", 3, 1.08)


def test_decision_ties_and_unknown_roles():
    timed = {"lookup": _m("pld", 1.2, "lookup", 5), "cascade": _m("cascade", 1.2, "cascade", 9)}
    assert decide(timed, 0.2) == Decision("pld", 5, 1.2)  # ROLES order
    with pytest.raises(ValueError, match="unknown measurement role"):
        decide({"recheck": _m("pld", 1.2)}, 0.2)


def test_vocab_size_estimates_docstring_case():
    size, ests, full = size_estimates(0.5, 2, (1.0, 1.0, 1.0), {16: 1.0}, {16: 0.25, 48: 0.5}, 48)
    assert size == 16 and ests == {16: pytest.approx(1.1667, abs=1e-4)} and full == pytest.approx(0.875)


# -- end to end with scripted races: the decision recorded is exactly the scripted one ------------------

def _scripted(script: dict, calls: list):
    """A stand-in for race_candidates: each candidate's speedup, interval and verdict from ``script[role]``
    (``(speedup, low, high)``), mean accepted tokens 1.5."""

    def race(lm, prompt_ids, candidates, rc, *, done=(), on_prompt=None, bigram=None, vocab=None, eagle=None,
             on_block=None, guard=None):
        out = {}
        for role, c in candidates.items():
            calls.append((role, c.drafter))
            speed, low, high = script[role]
            iv = Interval(low, high, rc.level, 6)
            out[role] = Measurement(c.drafter, role, c.draft_len, speed, acceptance=0.5, token_acceptance=0.4,
                                    mean_accepted=1.5, prompts=len(prompt_ids), skip=c.skip,
                                    estimated_acceptance=c.estimated_acceptance,
                                    estimated_draft_cost=c.estimated_draft_cost, estimated_speedup=c.estimated_speedup,
                                    cascade=c.cascade, draft_vocab=c.draft_vocab, interval=iv,
                                    verdict=_verdict(iv, rc.margin))
        return out

    return race


@pytest.mark.parametrize("script,expect", [
    # prompt lookup settles fastest
    ({"candidate": (1.10, 1.05, 1.15), "lookup": (1.30, 1.2, 1.4), "cascade": (1.05, 1.03, 1.07),
      "vocab": (1.0, 0.9, 1.1)}, ("pld", 1.3)),
    # layer skipping has the higher point estimate but its interval includes 1: the cascade decodes
    ({"candidate": (1.30, 0.95, 1.6), "lookup": (0.90, 0.85, 0.95), "cascade": (1.20, 1.1, 1.3),
      "vocab": (0.5, 0.4, 0.6)}, ("cascade", 1.2)),
    # nothing settles faster than ar by the margin
    ({"candidate": (0.80, 0.7, 0.9), "lookup": (1.01, 0.99, 1.03), "cascade": (0.95, 0.9, 1.0),
      "vocab": (0.7, 0.6, 0.8)}, ("ar", 1.0)),
])
def test_calibration_records_the_decision_of_scripted_races(tiny_model_dir, tmp_path, monkeypatch, script, expect):
    calls = []
    monkeypatch.setattr(measure_race, "race_candidates", _scripted(script, calls))
    s = tiny_settings(trials=4, init_trials=2, time_gate=0.0)
    p = load_profile(calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", s, dtype="float32", progress=False,
                               cost_model=COSTS).path)
    drafter, speedup = expect
    lens = {"pld": s.pld_draft_len, "ar": 1}
    for d in [*p.domains.values(), p.global_set]:
        want_len = lens.get(drafter, d.cascade.draft_len)
        assert d.decision == Decision(drafter, want_len, speedup), d.name
        assert d.priors.lookup.acceptance == 0.4
        assert d.vocab is None or not d.vocab.use  # scripted: the reduced head is never faster
        assert all(m.interval is not None and m.verdict for m in d.measurements)
    records = len(p.domains) + 1  # the domains and the global record: each raced once
    roles = [role for role, _ in calls]
    assert roles.count("lookup") == records and roles.count("cascade") == records


def test_calibration_writes_a_complete_profile(tiny_profile):
    p = load_profile(tiny_profile)
    assert not calibration_workdir(tiny_profile).path.exists()  # checkpoints removed after success
    assert p.calibration["trials"] == 6 and p.calibration["space"] == "ranked"
    cm = p.cost_model
    assert cm.n_layers == 4 and cm.verify[0] == 1.0
    floor = p.settings.acceptance_floor
    for d in [*p.domains.values(), p.global_set]:
        timed = {m.role: m for m in d.measurements}
        assert len(timed) == len(d.measurements) and {"lookup", "cascade"} <= set(timed)
        assert set(timed) <= {"candidate", "vocab", "lookup", "cascade"}
        for m in d.measurements:
            assert m.interval is not None and m.interval.low <= m.speedup <= m.interval.high
            assert m.interval.blocks == m.repeats >= 1 and m.verdict in ("faster", "not faster", "open")
            assert m.prompts >= 1 and 0 <= m.identical_outputs <= m.repeats
        # the decision is the pure function's, and never a drafter whose interval includes 1
        assert decide(timed, floor) == d.decision
        if d.decision.drafter != "ar":
            chosen = next(m for m in d.measurements if m.drafter == d.decision.drafter and m.verdict == "faster")
            assert chosen.interval.low >= 1 + p.settings.min_gain
        # the bound (ranked space) was computed against the reference
        ls = d.layer_skip
        assert ls.bound is not None and ls.reference is not None and ls.reference >= 1.0
        if ls.skip.size:  # only above the floor, and searched only where the bound allowed it, else seeded
            assert ls.estimated_acceptance >= floor and (ls.may_pay or ls.seeded)
        if "candidate" in timed:
            c = timed["candidate"]
            assert c.drafter == "ssd" and c.skip == ls.skip
            assert c.estimated_speedup == ls.estimated_speedup >= p.calibration["time_gate"]
        assert timed["cascade"].drafter == "cascade" and timed["cascade"].cascade == d.cascade
        assert d.statistical.positions > 0 and d.priors.statistical.by_position == d.statistical.position_acceptance
        assert d.cascade.max_split in (0, 2) and d.cascade.split <= d.cascade.max_split
        assert d.priors.lookup.acceptance == timed["lookup"].token_acceptance
        # the reduced draft vocabulary: estimated where a skip set is raced, used only where measured faster
        v = d.vocab
        assert (v is None) == ("candidate" not in timed)
        assert bool(v and v.use) == ("vocab" in timed and timed["vocab"].speedup > timed["candidate"].speedup)
        assert (d.draft_vocab is not None) == (v is not None) and d.reduced_vocab == bool(v and v.use)


def test_each_domain_scores_the_global_set_and_its_neighbours(tiny_model_dir, tmp_path, monkeypatch):
    """The global set is calibrated first; every domain scores it and its neighbours on its own text
    (seeded trials), so a domain's recorded set is at least as good as the global one by that estimate."""
    from adaptive.calibrate.search import neighbours

    histories, order = {}, []
    real = domain.search_skip_sets

    def capture(worker, lm, task, reference):
        order.append(task.name)
        history, bound = real(worker, lm, task, reference)
        histories[task.name] = (task, history, bound)
        return history, bound

    monkeypatch.setattr(domain, "search_skip_sets", capture)
    settings = tiny_settings(trials=4, init_trials=2, acceptance_floor=0.0)
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "prof", settings, dtype="float32", progress=False,
                  cost_model=CHEAP)
    assert order == [GLOBAL_TASK, *sorted(TINY_DOMAINS)]
    glob = p.global_set.layer_skip.skip
    assert glob, "the tiny model's global search found no skip set: the seeds are not exercised"
    for name in TINY_DOMAINS:
        task, history, bound = histories[name]
        assert task.seed == glob
        seeded = [h for h in history if h.get("seed")]
        assert [h["skip"] for h in seeded] == [s.to_text() for s in neighbours(glob, domain.make_space(
            "ranked", 4, task.influence))]
        assert all(h["params"] == {} for h in seeded) and history[-len(seeded):] == seeded
        ls = p.domains[name].layer_skip
        assert ls.estimated_speedup >= seeded[0]["target"]  # never below the global set, by the same estimate
        assert ls.seeded == any(h["skip"] == ls.skip.to_text() and h.get("seed") for h in history)
    assert not p.global_set.layer_skip.seeded


def test_the_global_set_is_searched_where_the_bound_rules_the_domains_out(tiny_model_dir, tmp_path, monkeypatch):
    """A reference no skip set can reach (the statistical drafters estimated at 10x): no domain searches
    past the bound's corners, the global task searches all its trials anyway, and each domain's set
    can only be a seeded one."""
    monkeypatch.setattr(domain, "replay_speedup", lambda *a, **k: 10.0)
    settings = tiny_settings(trials=5, init_trials=2, acceptance_floor=0.0)
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "prof", settings, dtype="float32", progress=False,
                  cost_model=CHEAP)
    g = p.global_set.layer_skip
    assert not g.may_pay and g.trials >= settings.trials and g.skip
    for name in TINY_DOMAINS:
        ls = p.domains[name].layer_skip
        assert not ls.may_pay
        assert not ls.skip or ls.seeded
        assert "candidate" not in {m.role for m in p.domains[name].measurements}  # below the reference: not timed


def test_interrupted_calibration_resumes_without_redoing_trials(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    settings = tiny_settings(trials=5, init_trials=2, acceptance_floor=0.0)
    kw = dict(dtype="float32", progress=False, cost_model=CHEAP)
    scored = []
    real_estimate = domain.estimate

    def counting(*a, **k):
        scored.append(1)
        return real_estimate(*a, **k)

    monkeypatch.setattr(domain, "estimate", counting)
    per_task = {}  # skip sets scored per task (a seed the search had scored is not scored again)
    real_search = domain.search_skip_sets

    def counted_search(worker, lm, task, reference):
        before = len(scored)
        out = real_search(worker, lm, task, reference)
        per_task[task.name] = len(scored) - before
        return out

    monkeypatch.setattr(domain, "search_skip_sets", counted_search)
    reference = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "ref", settings, **kw)
    monkeypatch.setattr(domain, "search_skip_sets", real_search)
    full_run = len(scored)
    first, second = sorted(TINY_DOMAINS)[:2]  # jobs=1: the global set, then domains in name order
    n_global, n_first = per_task[GLOBAL_TASK], per_task[first]
    n_trials = reference.domains[second].layer_skip.trials
    assert n_trials >= 5 and reference.domains[second].layer_skip.may_pay

    real_race = measure_race.race_candidates
    races = []

    def killed(*a, **kw):
        races.append(1)
        if len(races) == 3:
            raise KeyboardInterrupt  # as if killed after the second domain's search (the global set's race is first)
        return real_race(*a, **kw)

    monkeypatch.setattr(measure_race, "race_candidates", killed)
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)
    work = calibration_workdir(out)
    assert not out.exists() and work.path.exists()
    trials = work.file("trials", second, "jsonl").read_text().splitlines()
    assert len(trials) == n_trials and json.loads(trials[-1])["trial"] == n_trials - 1
    assert work.file("race", first, "jsonl").exists()  # the first domain was raced: its timings are kept

    # without --resume the leftover checkpoint is not silently discarded
    monkeypatch.setattr(measure_race, "race_candidates", real_race)
    with pytest.raises(CalibrationError, match="--resume"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)

    # as if killed while writing trial 2: two complete lines, then a torn one
    tfile = work.file("trials", second, "jsonl")
    tfile.write_text("".join(line + "\n" for line in trials[:2]) + '{"trial": 2, "par')
    scored.clear()
    lines = [json.loads(x) for x in work.file("race", first, "jsonl").read_text().splitlines()]
    replayed = {}  # each raced candidate's speedup over the checkpoint's blocks
    for rec in lines:
        for ar, secs in rec["blocks"]:
            for name, t in secs.items():
                a, c = replayed.get(name, (0.0, 0.0))
                replayed[name] = (a + ar, c + t)
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert not work.path.exists()
    # neither the global set's nor the first domain's trials nor the second's two complete ones were scored again
    assert len(scored) == full_run - n_global - n_first - 2
    # same seed, same candidates: the same skip sets and bounds as an uninterrupted run
    for name in TINY_DOMAINS:
        assert resumed.domains[name].layer_skip == reference.domains[name].layer_skip
    assert resumed.global_set.layer_skip == reference.global_set.layer_skip
    # the first domain's race was replayed from its checkpoint, not timed again
    got = {m.role: m.speedup for m in resumed.domains[first].measurements}
    assert got == {name: round(a / c, 4) for name, (a, c) in replayed.items()}


def test_a_search_killed_during_its_random_trials_resumes_as_it_would_have_run(tiny_model_dir, tmp_path, monkeypatch):
    """Self-SD's space has no bound: its first ``init_trials`` are random by trial index, and a search
    killed after two of them suggests the third as the uninterrupted run did (not from the model)."""
    settings = _no_bound(trials=5, init_trials=4, acceptance_floor=0.0)
    kw = dict(dtype="float32", progress=False, cost_model=CHEAP)
    reference = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "ref", settings, **kw)
    real, calls = domain.estimate, []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the global search's third trial: two are checkpointed
        return real(*a, **k)

    monkeypatch.setattr(domain, "estimate", killed)
    out = tmp_path / "prof"
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)
    assert len(calibration_workdir(out).file("trials", GLOBAL_TASK, "jsonl").read_text().splitlines()) == 2
    monkeypatch.setattr(domain, "estimate", real)
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert resumed.global_set.layer_skip == reference.global_set.layer_skip
    for name in TINY_DOMAINS:
        assert resumed.domains[name].layer_skip == reference.domains[name].layer_skip


def test_resume_after_the_last_phase_redoes_nothing_and_gives_the_same_profile(tiny_model_dir, tmp_path, monkeypatch):
    """Killed while saving the profile: every phase resumes from its checkpoint (no timing at all) and
    the profile equals the one the killed run had computed."""
    from adaptive.calibrate import runner

    out = tmp_path / "prof"
    settings = tiny_settings(trials=3, init_trials=2)
    kw = dict(dtype="float32", progress=False, cost_model=COSTS)
    saved = []

    def killed_save(profile, path):
        saved.append(profile)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_profile", killed_save)
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)
    monkeypatch.undo()
    monkeypatch.setattr(timing, "time_prompt", lambda *a, **k: pytest.fail("timed again on resume"))
    monkeypatch.setattr(domain, "measure_verify_costs", lambda *a, **k: pytest.fail("verify timed again"))
    monkeypatch.setattr(vocab, "measure_head_costs", lambda *a, **k: pytest.fail("head costs timed again"))
    monkeypatch.setattr(domain, "MatchnessScorer", lambda *a, **k: pytest.fail("searched again"))
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert resumed.domains == saved[0].domains and resumed.global_set == saved[0].global_set
    for name, d in resumed.domains.items():
        assert d.bigram.keys.tolist() == saved[0].domains[name].bigram.keys.tolist()


def test_resume_with_other_settings_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setattr(measure_race, "race_candidates", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(trials=3, init_trials=2),
                  dtype="float32", progress=False)
    with pytest.raises(CalibrationError, match="different settings; rerun with the same model"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(trials=4, init_trials=2),
                  dtype="float32", progress=False, resume=True)


def test_a_live_lock_refuses_a_second_calibration(tiny_model_dir, tmp_path):
    out = tmp_path / "prof"
    holder = calibration_workdir(out)
    holder.acquire()  # as another live calibration would hold it
    with pytest.raises(CalibrationError, match=f"another calibration .*{os.getpid()}.* or choose another --out"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(), dtype="float32", progress=False)
    assert not out.exists()
    holder.release()  # its process ending (even by SIGKILL) releases it: the next calibration takes it
    taker = calibration_workdir(out)
    taker.acquire()
    assert (taker.path / "lock").read_text().endswith(str(os.getpid()))
    taker.remove()
    assert not taker.path.exists()


def test_impossible_options(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="jobs"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(), jobs=0)
    with pytest.raises(ConfigError, match="at most 3"):  # one per domain (the global set runs first, alone)
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(), jobs=4)
    with pytest.raises(ConfigError, match="backend"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(), backend="mpi")
    with pytest.raises(ConfigError, match="--scheduler"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(), scheduler="tcp://x:1")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ProfileError, match="not a profile"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "f", tiny_settings())
    with pytest.raises(ConfigError, match="built in memory"):  # worker processes cannot load it
        calibrate(tiny_lm("llama"), TINY_DOMAINS, tmp_path / "p", tiny_settings(), jobs=2)
    assert not (tmp_path / "p").exists()


def test_an_already_loaded_model_is_used_as_is(tiny_model_dir, tmp_path, monkeypatch):
    from adaptive.calibrate import parallel

    lm = load_model(str(tiny_model_dir), dtype="float32")
    monkeypatch.setattr(parallel, "load_model", lambda *a, **k: pytest.fail("loaded again"))
    s = tiny_settings(trials=3, init_trials=2)
    p = calibrate(lm, TINY_DOMAINS, tmp_path / "p", s, progress=False, cost_model=COSTS)
    assert p.model.same_model(lm.fingerprint()) and p.model.dtype == "float32"
    assert p.model.spec == str(tiny_model_dir.resolve())  # what a worker process would load
    monkeypatch.undo()
    ref = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "q", s, dtype="float32", progress=False,
                    cost_model=COSTS)
    assert {n: d.layer_skip for n, d in p.domains.items()} == {n: d.layer_skip for n, d in ref.domains.items()}


def _no_bound(**over):
    """Settings whose search always runs its trials (Self-SD's space has no bound)."""
    return tiny_settings(space="sublayer", **over)


def test_threading_backend(tiny_model_dir, tmp_path):
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", _no_bound(trials=3, init_trials=2),
                  jobs=2, backend="threading", dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    assert load_profile(tmp_path / "p").global_set.layer_skip.trials == 3


def test_the_global_set_runs_first_in_this_process_on_its_model(tiny_model_dir, tmp_path, monkeypatch):
    """With worker processes (loky, 2 jobs) the global task runs alone in the caller's process, on the
    model the caller loaded and its threads (not on a second copy with a worker's share of the cores)."""
    from adaptive.calibrate import runner

    calls, real = [], runner.calibrate_domain

    def spy(worker, task):  # runs here for the global task; pickled by value into the workers for the domains
        calls.append((task.name, worker.lm, worker.threads))
        return real(worker, task)

    monkeypatch.setattr(runner, "calibrate_domain", spy)
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", _no_bound(trials=3, init_trials=2),
                  jobs=2, backend="loky", dtype="float32", progress=False)
    assert [c[0] for c in calls] == [GLOBAL_TASK]  # the domains ran in the worker processes
    name, lm, threads = calls[0]
    assert lm is not None and p.model.same_model(lm.fingerprint()) and threads is None
    assert sorted(p.domains) == sorted(TINY_DOMAINS) and p.global_set.layer_skip.trials == 3


def test_dask_backend_on_a_local_cluster(tiny_model_dir, tmp_path):
    pytest.importorskip("dask.distributed")
    from dask.distributed import LocalCluster

    from adaptive.calibrate.search import neighbours

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", _no_bound(trials=3, init_trials=2),
                      jobs=2, backend="dask", scheduler=cluster.scheduler_address, dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    prof = load_profile(tmp_path / "p")
    glob = prof.global_set.layer_skip
    seeds = neighbours(glob.skip, None) if glob.skip else []  # every domain scores them after its 3 trials
    assert glob.trials == 3
    assert all(d.layer_skip.trials == 3 + len(seeds) for d in prof.domains.values())


def test_each_task_has_every_other_calibration_sequence_as_background():
    """A domain's bigram tables also hold the other domains' text; the global set's, what its pool lacks."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from adaptive.calibrate.prepare import Prepared
    from adaptive.calibrate.runner import _domain_tasks

    def prep(name, seqs):
        return Prepared(name, [p for p, _ in seqs], np.zeros((len(seqs), 2)), seqs, torch.zeros(2, 4))

    a = [([0, 1], [2]), ([3], [4]), ([9], [10])]
    b = [([5], [6]), ([0, 7], [8])]
    s = tiny_settings(prompts_per_domain=3, confirm_prompts=1)
    tasks = {t.name: t for t in _domain_tasks({"a": prep("a", a), "b": prep("b", b)},
                                              SimpleNamespace(labels=["a", "b"]), COSTS, s)}
    # the other domains' continuations after their prompts' last tokens
    assert tasks["a"].sequences == a and tasks["a"].background == [([5], [6]), ([7], [8])]
    assert tasks["b"].sequences == b and tasks["b"].background == [([1], [2]), ([3], [4]), ([9], [10])]
    glob = tasks[GLOBAL_TASK]
    # a round-robin pool of prompts_per_domain sequences; every other one behind it
    assert glob.sequences == [a[0], b[0], a[1]] and glob.background == [([9], [10]), ([7], [8])]
    assert glob.confirm_ids == [[0, 1]]


def test_the_race_drafts_each_prompt_from_a_table_without_its_own_text(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    scripted = _scripted({"candidate": (1.1, 1.05, 1.15), "lookup": (1.0, 0.9, 1.1), "cascade": (1.2, 1.1, 1.3),
                          "vocab": (1.0, 0.9, 1.1)}, [])

    def race(lm, prompt_ids, candidates, rc, **kw):
        reduced = any(c.draft_vocab for c in candidates.values())
        seen.append((prompt_ids[: rc.prompts], kw["bigram"], kw["vocab"], reduced))
        return scripted(lm, prompt_ids, candidates, rc, **kw)

    monkeypatch.setattr(measure_race, "race_candidates", race)
    # the 16-id head estimated faster than the full one: where a skip set is raced, so is the reduced head
    monkeypatch.setattr(vocab, "size_estimates", lambda *a: (16, {16: 2.0, 32: 1.5}, 1.0))
    s = tiny_settings(trials=4, init_trials=2, time_gate=0.0, acceptance_floor=0.0)
    # CHEAP: layer skipping can pay, so skip sets and reduced heads are raced
    calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", s, dtype="float32", progress=False, cost_model=CHEAP)
    assert len(seen) == len(TINY_DOMAINS) + 1
    for prompts, tables, vocabs, reduced in seen:
        assert isinstance(tables, list) and len(tables) == len(prompts) == s.confirm_prompts
        assert tables[0] is not tables[1] and len(tables[0]) > 0
        assert not reduced or (isinstance(vocabs, list) and len(vocabs) == len(prompts))
    assert any(reduced for *_, reduced in seen)  # a reduced head was raced somewhere: its vocabularies checked


def test_race_vocabs_rank_without_the_raced_prompts_text():
    from adaptive.calibrate.vocab import race_vocabs

    seqs = [([1], [2, 2]), ([4], [5])]
    (v,) = race_vocabs(seqs, [[1]], vocab_size=6, size=3)  # the docstring's example
    assert v.tolist() == [4, 5, 0]
    a, b = race_vocabs(seqs, [[4], [9]], vocab_size=6, size=2)
    assert a.tolist() == [2, 1] and b.tolist() == [2, 1]  # 2 twice, then 1 (ties: smaller id); [9] is no sequence's


@pytest.mark.slow
def test_ray_backend_on_a_local_cluster(tiny_model_dir, tmp_path):
    """`--backend ray --scheduler ADDRESS`: calibration on a local Ray cluster started here (as on an
    existing cluster, whose address the command takes), the same profile as the other backends."""
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", _no_bound(trials=3, init_trials=2),
                      jobs=2, backend="ray", dtype="float32", progress=False)
    finally:
        ray.shutdown()
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    assert load_profile(tmp_path / "p").global_set.layer_skip.trials == 3


def test_a_race_key_leaves_an_unset_copy_length_out():
    """Checkpoints of races timed before candidates had a copy length resume: their key is the same."""
    import hashlib
    import json

    from adaptive.calibrate.domain import race_key
    from adaptive.measure.timing import Candidate

    cands = {"pld": Candidate("pld", 4), "eagle": Candidate("eagle", 2, copy_len=5)}
    before = {"pld": {k: v for k, v in cands["pld"].to_dict().items() if k != "copy_len"}}
    assert race_key({"pld": cands["pld"]}) == hashlib.sha1(json.dumps(before, sort_keys=True).encode()).hexdigest()[:12]
    assert race_key(cands) != race_key({**cands, "eagle": Candidate("eagle", 2)})
