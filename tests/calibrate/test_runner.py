"""The whole calibration on a tiny model: profile contents, checkpoints, resume, locks, backends."""

import json
import os

import pytest

from adaptive.calibrate import runner
from adaptive.calibrate.costs import CostModel
from adaptive.calibrate.runner import (CalibrationError, CalibrationSettings, WorkDir, calibrate, check_domains,
                                       slug)
from adaptive.errors import ConfigError
from adaptive.profile import ProfileError, load_profile
from tests.conftest import TINY_DOMAINS, tiny_settings


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


def test_calibration_writes_a_complete_profile(tiny_profile):
    p = load_profile(tiny_profile)
    assert not WorkDir(tiny_profile).path.exists()  # checkpoints removed after success
    assert p.settings["trials"] == 6 and p.settings["space"] == "ranked"
    cm = p.cost_model
    assert cm.n_layers == 4 and cm.verify[0] == 1.0
    for d in [*p.domains.values(), p.global_set]:
        ssd = [c for c in d.candidates if not c.get("recheck") and c["method"] == "ssd"]
        pld = [c for c in d.candidates if not c.get("recheck") and c["method"] == "pld"]
        assert len(ssd) == 1 and len(pld) == 1  # confirm_candidates=1, and prompt lookup
        c = ssd[0]
        assert c["skip"] == d.skip.to_text() and c["prompts"] >= 1
        assert 0.0 <= d.estimated_matchness <= 1.0
        assert d.estimated_speedup == c["target"]
        timed = d.extra["cascade"]["timed"]
        assert timed["method"] == "cascade"
        assert (timed["split"], timed["draft_len"]) == (d.cascade.split, d.cascade.draft_len)
        # the skip set's timing: over the reduced vocabulary where that measured faster
        first = {"ssd": d.extra["vocab"]["timed"] if d.reduced_vocab else c, "pld": pld[0], "cascade": timed}
        got = {"ssd": d.measured_speedup, "pld": d.pld_speedup, "cascade": d.cascade_speedup}
        rechecks = [r for r in d.candidates if r.get("recheck")]
        if rechecks:  # the fastest of ssd, pld and cascade beat ar: timed again, decided on the mean
            r = rechecks[0]
            assert got[r["method"]] == pytest.approx((first[r["method"]]["measured_speedup"] + r["measured_speedup"]) / 2,
                                                     abs=1e-3)
        else:
            assert all(got[m] == first[m]["measured_speedup"] for m in got)
            assert d.decision == "ar"
        if d.decision != "ar":  # the fastest of the three, by the margin
            assert got[d.decision] >= 1.02 and got[d.decision] == max(got.values())
        assert d.extra["cascade"]["statistical"]["positions"] > 0
        assert d.cascade.max_split in (0, 2) and d.cascade.split <= d.cascade.max_split
        # the reduced draft vocabulary: coverage and measured draft cost per size, the chosen ids
        v = d.extra.get("vocab")
        if d.skip.attn or d.skip.mlp:
            assert set(v["coverage"]) == {"16", "32"} and 0.0 <= min(v["coverage"].values()) <= 1.0
            assert set(v["draft_cost"]) == {"16", "32", "48"} and v["size"] in (16, 32)  # the tiny vocabulary: 48
            assert d.draft_vocab is not None and len(d.draft_vocab) == v["size"]
            if "timed" in v:  # its estimate beat the full head's: timed, and used only if measured faster
                assert v["timed"]["draft_vocab"] == v["size"]
                assert d.reduced_vocab == (v["timed"]["measured_speedup"] > c["measured_speedup"])
            else:
                assert not d.reduced_vocab
        else:
            assert v is None and d.draft_vocab is None and not d.reduced_vocab


def test_interrupted_calibration_resumes_without_redoing_trials(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    settings = tiny_settings(trials=5, init_trials=2)
    costs = CostModel.uniform(4, verify=(1.0, 1.02, 1.04, 1.06, 1.08))  # fixed: timing noise cannot differ
    kw = dict(dtype="float32", progress=False, cost_model=costs)
    reference = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "ref", settings, **kw)

    real_measure = runner.measure_candidates

    def killed(*a, **kw):
        raise KeyboardInterrupt  # as if killed after the first domain's search

    monkeypatch.setattr(runner, "measure_candidates", killed)
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)
    work = WorkDir(out)
    assert not out.exists() and work.path.exists()
    first = sorted(TINY_DOMAINS)[0]
    trials = work.file("trials", first, "jsonl").read_text().splitlines()
    assert len(trials) == 5 and json.loads(trials[-1])["trial"] == 4

    # without --resume the leftover checkpoint is not silently discarded
    monkeypatch.setattr(runner, "measure_candidates", real_measure)
    with pytest.raises(CalibrationError, match="--resume"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, **kw)

    started_with = []
    real_search = runner.run_search

    def recording(space, score, trials, **kws):
        started_with.append(len(kws.get("history") or []))
        return real_search(space, score, trials, **kws)

    monkeypatch.setattr(runner, "run_search", recording)
    # as if killed while writing trial 3: three complete lines, then a torn one
    tfile = work.file("trials", first, "jsonl")
    tfile.write_text("".join(line + "\n" for line in trials[:3]) + '{"trial": 3, "par')
    resumed = calibrate(str(tiny_model_dir), TINY_DOMAINS, out, settings, resume=True, **kw)
    assert not work.path.exists()
    # jobs=1 searches domains in name order, then the global set: the first resumed from 3 trials
    assert started_with == [3] + [0] * len(TINY_DOMAINS)
    # same seed, same candidates: the same skip sets as an uninterrupted run
    for name in TINY_DOMAINS:
        assert resumed.domains[name].skip == reference.domains[name].skip
    assert resumed.global_set.skip == reference.global_set.skip


def test_resume_with_other_settings_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setattr(runner, "measure_candidates", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(trials=3, init_trials=2),
                  dtype="float32", progress=False)
    with pytest.raises(CalibrationError, match="different settings"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(trials=4, init_trials=2),
                  dtype="float32", progress=False, resume=True)


def test_a_live_lock_refuses_a_second_calibration(tiny_model_dir, tmp_path):
    out = tmp_path / "prof"
    holder = WorkDir(out)
    holder.acquire()  # as another live calibration would hold it
    with pytest.raises(CalibrationError, match=f"another calibration .*{os.getpid()}"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(), dtype="float32", progress=False)
    assert not out.exists()
    holder.release()  # its process ending (even by SIGKILL) releases it: the next calibration takes it
    taker = WorkDir(out)
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


def test_threading_backend(tiny_model_dir, tmp_path):
    p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(trials=3, init_trials=2),
                  jobs=2, backend="threading", dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    assert load_profile(tmp_path / "p").global_set.trials == 3


def test_dask_backend_on_a_local_cluster(tiny_model_dir, tmp_path):
    pytest.importorskip("dask.distributed")
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        p = calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "p", tiny_settings(trials=3, init_trials=2),
                      jobs=2, backend="dask", scheduler=cluster.scheduler_address, dtype="float32", progress=False)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    prof = load_profile(tmp_path / "p")
    assert all(d.trials == 3 for d in prof.domains.values())
