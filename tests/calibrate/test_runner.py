"""The whole calibration on a tiny model: profile contents, checkpoints, resume, locks, backends, and the
per-domain decision (a pure function of scripted timings, then end to end with scripted timings)."""

import json
import os

import pytest

from adaptive.calibrate import domain, vocab
from adaptive.calibrate.decision import decide, to_recheck
from adaptive.calibrate.runner import CalibrationError, CalibrationSettings, calibrate, check_domains
from adaptive.calibrate.settings import calibration_workdir
from adaptive.calibrate.timing import Candidate
from adaptive.calibrate.vocab import size_estimates
from adaptive.costs import CostModel
from adaptive.errors import ConfigError
from adaptive.models import load_model
from adaptive.profile import Decision, Measurement, ProfileError, load_profile
from adaptive.workdir import slug
from tests.conftest import TINY_DOMAINS, tiny_lm, tiny_settings

COSTS = CostModel.uniform(4, verify=(1.0, 1.02, 1.04, 1.06, 1.08))  # fixed: timing noise cannot change the search


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
    q = CalibrationSettings.quick()
    assert q.trials < CalibrationSettings().trials


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


# -- the decision: a pure function of timed measurements -----------------------------------------------

def _m(drafter, speedup, role="candidate", draft_len=3):
    return Measurement(drafter, role, draft_len, speedup)


def _timed(ssd, pld, cascade):
    return {"ssd": _m("ssd", ssd, draft_len=4), "pld": _m("pld", pld, "lookup", 5),
            "cascade": _m("cascade", cascade, "cascade", 9)}


def test_decision_docstring_cases():
    timed = _timed(1.30, 1.10, 1.20)
    assert to_recheck(timed, 0.02) == "ssd"
    decision, speed = decide(timed, 0.02, _m("ssd", 1.14, "recheck", 4))
    assert decision == Decision("ssd", 4, 1.22)
    assert speed == pytest.approx({"ssd": 1.22, "pld": 1.10, "cascade": 1.20})
    assert decide(timed, 0.02, _m("ssd", 1.00, "recheck", 4))[0] == Decision("cascade", 9, 1.2)


def test_decision_nothing_pays_is_ar_and_needs_no_recheck():
    timed = _timed(1.01, 0.6, 1.019)
    assert to_recheck(timed, 0.02) is None
    assert decide(timed, 0.02)[0] == Decision("ar", 1, 1.0)
    # with a lower bar the cascade pays, at the length it was timed with
    assert to_recheck(timed, 0.01) == "cascade"
    assert decide(timed, 0.01, _m("cascade", 1.019, "recheck", 9))[0] == Decision("cascade", 9, 1.019)


def test_decision_recheck_below_the_bar_gives_ar():
    timed = _timed(0.9, 1.05, 1.0)
    assert to_recheck(timed, 0.02) == "pld"
    assert decide(timed, 0.02, _m("pld", 0.97, "recheck", 5))[0] == Decision("ar", 1, 1.0)  # mean 1.01
    assert decide(timed, 0.02, _m("pld", 1.03, "recheck", 5))[0] == Decision("pld", 5, 1.04)


def test_decision_refuses_incomplete_or_mismatched_timings():
    with pytest.raises(ValueError, match="missing cascade"):
        decide({"ssd": _m("ssd", 1.2), "pld": _m("pld", 1.0)}, 0.02)
    with pytest.raises(ValueError, match="recheck of pld"):
        decide(_timed(1.3, 1.0, 1.0), 0.02, _m("pld", 1.2, "recheck"))


def test_vocab_size_estimates_docstring_case():
    size, ests, full = size_estimates(0.5, 2, (1.0, 1.0, 1.0), {16: 1.0}, {16: 0.25, 48: 0.5}, 48)
    assert size == 16 and ests == {16: pytest.approx(1.1667, abs=1e-4)} and full == pytest.approx(0.875)


# -- end to end with scripted timings: the decision recorded is exactly the scripted one ----------------

def _scripted(script: dict, calls: list):
    """A stand-in for measure_candidates: speedup ``script[role]`` (``script[(role, drafter)]`` first)."""

    def measure(lm, prompt_ids, candidates, tokens, *, role="candidate", done=(), on_done=None, repeats=1,
                bigram=None, vocab=None):
        out = list(done)
        for c in candidates[len(out):]:
            calls.append((role, c.drafter))
            speed = script.get((role, c.drafter), script.get(role))
            m = Measurement(c.drafter, role, c.draft_len, speed, acceptance=0.5, token_acceptance=0.4,
                            mean_accepted=1.5, prompts=len(prompt_ids), skip=c.skip,
                            estimated_acceptance=c.estimated_acceptance, estimated_draft_cost=c.estimated_draft_cost,
                            estimated_speedup=c.estimated_speedup, cascade=c.cascade, draft_vocab=c.draft_vocab)
            out.append(m)
            if on_done is not None:
                on_done(m)
        return out

    return measure


@pytest.mark.parametrize("script,expect", [
    # prompt lookup is fastest; its recheck (1.20) gives the mean 1.25
    ({"candidate": 1.10, "lookup": 1.30, "cascade": 1.05, "vocab": 1.0, "recheck": 1.20}, ("pld", 1.25, "pld")),
    # layer skipping first at 1.30, its recheck 1.00: mean 1.15, below the cascade's 1.20
    ({"candidate": 1.30, "lookup": 0.90, "cascade": 1.20, "vocab": 0.5, "recheck": 1.00}, ("cascade", 1.2, "ssd")),
    # nothing beats ar by min_gain: no recheck at all
    ({"candidate": 0.80, "lookup": 1.01, "cascade": 0.95, "vocab": 0.7}, ("ar", 1.0, None)),
])
def test_calibration_records_the_decision_of_scripted_timings(tiny_model_dir, tmp_path, monkeypatch, script, expect):
    calls = []
    monkeypatch.setattr(domain, "measure_candidates", _scripted(script, calls))
    monkeypatch.setattr(vocab, "measure_candidates", _scripted(script, calls))
    s = tiny_settings(trials=4, init_trials=2)
    p = load_profile(calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", s, dtype="float32", progress=False,
                               cost_model=COSTS).path)
    drafter, speedup, rechecked = expect
    lens = {"pld": s.pld_draft_len, "ar": 1}
    for d in [*p.domains.values(), p.global_set]:
        want_len = lens.get(drafter, d.cascade.draft_len)
        assert d.decision == Decision(drafter, want_len, speedup), d.name
        assert [m.drafter for m in d.measurements if m.role == "recheck"] == [rechecked][: rechecked is not None]
        assert d.priors.layer_skip.acceptance == 0.4 and d.priors.lookup.acceptance == 0.4
        assert d.vocab is None or not d.vocab.use  # scripted: the reduced head is never faster
    records = len(p.domains) + 1  # the domains and the global record: each timed once per phase
    roles = [role for role, _ in calls]
    assert roles.count("lookup") == records and roles.count("cascade") == records
    assert roles.count("recheck") == (records if rechecked else 0)


def _timed_of(d):
    """The measurements a domain's decision was taken on, from its record."""
    by_role = {}
    for m in d.measurements:
        by_role.setdefault(m.role, []).append(m)
    best = max(by_role["candidate"], key=lambda m: m.speedup)
    ssd = by_role["vocab"][0] if d.reduced_vocab else best
    timed = {"ssd": ssd, "pld": by_role["lookup"][0], "cascade": by_role["cascade"][0]}
    return timed, by_role.get("recheck", [None])[0]


def test_calibration_writes_a_complete_profile(tiny_profile):
    p = load_profile(tiny_profile)
    assert not calibration_workdir(tiny_profile).path.exists()  # checkpoints removed after success
    assert p.settings["trials"] == 6 and p.settings["space"] == "ranked"
    cm = p.cost_model
    assert cm.n_layers == 4 and cm.verify[0] == 1.0
    min_gain = p.settings["min_gain"]
    for d in [*p.domains.values(), p.global_set]:
        roles = [m.role for m in d.measurements]
        assert roles.count("candidate") == 1 and roles.count("lookup") == 1  # confirm_candidates=1, prompt lookup
        assert roles.count("cascade") == 1 and roles.count("recheck") <= 1
        c = next(m for m in d.measurements if m.role == "candidate")
        assert c.drafter == "ssd" and c.skip == d.layer_skip.skip.to_text() and c.prompts >= 1
        assert 0.0 <= d.layer_skip.estimated_acceptance <= 1.0
        assert d.layer_skip.estimated_speedup == c.estimated_speedup
        timed, recheck = _timed_of(d)
        assert timed["cascade"].drafter == "cascade" and timed["cascade"].cascade == d.cascade
        # the fastest of ssd, pld and cascade beating ar was timed again, and the decision is the pure function's
        assert (recheck.drafter if recheck else None) == to_recheck(timed, min_gain)
        assert decide(timed, min_gain, recheck)[0] == d.decision
        assert d.statistical.positions > 0 and d.priors.statistical.by_position == d.statistical.position_acceptance
        assert d.cascade.max_split in (0, 2) and d.cascade.split <= d.cascade.max_split
        assert d.priors.layer_skip.acceptance == timed["ssd"].token_acceptance
        assert d.priors.lookup.acceptance == timed["pld"].token_acceptance
        # the reduced draft vocabulary: chosen where the skip set drafts, coverage and measured cost per size
        v = d.vocab
        assert (v is None) == (d.layer_skip.skip.size == 0) == (d.draft_vocab is None)
        vocab_timed = [m for m in d.measurements if m.role == "vocab"]
        assert all(set(x.coverage) == {"16", "32"} and set(x.draft_cost) == {"16", "32", "48"} and x.size in (16, 32)
                   and len(d.draft_vocab) == x.size and 0.0 <= min(x.coverage.values()) <= 1.0 for x in [v] if x)
        # timed only where its estimate beat the full head's, and used only where measured faster
        assert bool(vocab_timed) == bool(v and v.estimate[str(v.size)] > v.full_estimate)
        assert d.reduced_vocab == bool(vocab_timed and vocab_timed[0].speedup > c.speedup)
        assert all(m.draft_vocab == v.size for m in vocab_timed)


def test_interrupted_calibration_resumes_without_redoing_trials(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    settings = tiny_settings(trials=5, init_trials=2)
    kw = dict(dtype="float32", progress=False, cost_model=COSTS)
    reference = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "ref", settings, **kw)

    real_measure = domain.measure_candidates

    def killed(*a, **kw):
        raise KeyboardInterrupt  # as if killed after the first domain's search

    monkeypatch.setattr(domain, "measure_candidates", killed)
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)
    work = calibration_workdir(out)
    assert not out.exists() and work.path.exists()
    first = sorted(TINY_DOMAINS)[0]
    trials = work.file("trials", first, "jsonl").read_text().splitlines()
    assert len(trials) == 5 and json.loads(trials[-1])["trial"] == 4

    # without --resume the leftover checkpoint is not silently discarded
    monkeypatch.setattr(domain, "measure_candidates", real_measure)
    with pytest.raises(CalibrationError, match="--resume"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)

    started_with = []
    real_search = domain.run_search

    def recording(space, score, trials, **kws):
        started_with.append(len(kws.get("history") or []))
        return real_search(space, score, trials, **kws)

    monkeypatch.setattr(domain, "run_search", recording)
    # as if killed while writing trial 3: three complete lines, then a torn one
    tfile = work.file("trials", first, "jsonl")
    tfile.write_text("".join(line + "\n" for line in trials[:3]) + '{"trial": 3, "par')
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert not work.path.exists()
    # jobs=1 searches domains in name order, then the global set: the first resumed from 3 trials
    assert started_with == [3] + [0] * len(TINY_DOMAINS)
    # same seed, same candidates: the same skip sets as an uninterrupted run
    for name in TINY_DOMAINS:
        assert resumed.domains[name].layer_skip == reference.domains[name].layer_skip
    assert resumed.global_set.layer_skip == reference.global_set.layer_skip


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
    for mod in (domain, vocab):
        monkeypatch.setattr(mod, "measure_candidates", lambda *a, **k: pytest.fail("timed again on resume"))
    monkeypatch.setattr(domain, "measure_verify_costs", lambda *a, **k: pytest.fail("verify timed again"))
    monkeypatch.setattr(vocab, "measure_head_costs", lambda *a, **k: pytest.fail("head costs timed again"))
    monkeypatch.setattr(domain, "MatchnessScorer", lambda *a, **k: pytest.fail("searched again"))
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert resumed.domains == saved[0].domains and resumed.global_set == saved[0].global_set
    for name, d in resumed.domains.items():
        assert d.bigram.keys.tolist() == saved[0].domains[name].bigram.keys.tolist()


def test_resume_with_other_settings_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setattr(domain, "measure_candidates", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
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
    with pytest.raises(ConfigError, match="at most 4"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(), jobs=9)
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


def test_threading_backend(tiny_model_dir, tmp_path):
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(trials=3, init_trials=2),
                  jobs=2, backend="threading", dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    assert load_profile(tmp_path / "p").global_set.layer_skip.trials == 3


def test_dask_backend_on_a_local_cluster(tiny_model_dir, tmp_path):
    pytest.importorskip("dask.distributed")
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(trials=3, init_trials=2),
                      jobs=2, backend="dask", scheduler=cluster.scheduler_address, dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    prof = load_profile(tmp_path / "p")
    assert all(d.layer_skip.trials == 3 for d in prof.domains.values())


def test_candidate_of_a_measurement_times_the_same_drafter():
    m = Measurement("ssd", "vocab", 3, 1.1, skip="attn=1", draft_vocab=16, estimated_speedup=1.2)
    assert Candidate.of(m) == Candidate("ssd", 3, skip="attn=1", draft_vocab=16, estimated_speedup=1.2)
