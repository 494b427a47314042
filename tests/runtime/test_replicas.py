"""Many replicas, one profile (issue 45): each server writes its own overlay and merges the others'."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from adaptive.drafters.live import LiveBigramTable
from adaptive.profile.overlay import (
    LEGACY_REPLICA,
    OnlineOverlay,
    PairCounts,
    add_pair_counts,
    check_replica_id,
    load_overlay,
    load_replicas,
    merge_overlays,
    replica_dir,
    replica_path,
    save_overlay,
)
from adaptive.runtime import AdaptiveRuntime, OnlineSettings
from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength
from adaptive.runtime.replicas import LOCK_NAME
from tests.conftest import TINY_DOMAINS
from tests.runtime.test_online import OOD, _ar, cascades, scripted_profile


def test_pair_counts_add_up():
    a = PairCounts(np.array([1, 1, 2]), np.array([2, 3, 1]), np.array([1.0, 2.0, 1.0]))
    b = PairCounts(np.array([1, 5]), np.array([3, 6]), np.array([0.5, 4.0]))
    s = add_pair_counts([a, b])
    assert s.prev.tolist() == [1, 1, 2, 5] and s.succ.tolist() == [2, 3, 1, 6]
    assert s.count.tolist() == [1.0, 2.5, 1.0, 4.0]
    assert len(add_pair_counts([])) == 0


def test_replica_ids():
    assert check_replica_id("web-1.eu_2") == "web-1.eu_2"
    for bad in ("", "../x", "a/b", "-x", "x" * 65, "a b"):
        with pytest.raises(ValueError, match="replica id"):
            check_replica_id(bad)
    with pytest.raises(ValueError):
        OnlineSettings(replica="no/slash")
    assert replica_path("/p/prof.online", "r1").as_posix() == "/p/prof.online.d/r1.online"


def _overlay(replica, requests, pairs, buffer=(), learned=(), bandits=None, created=""):
    counts = {"global": PairCounts(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]),
                                   np.ones(len(pairs)))} if pairs else {}
    return OnlineOverlay("d" * 64, 1, created, requests, counts, bandits or {}, tuple(buffer), tuple(learned), replica)


def test_merging_is_order_free_and_idempotent(tmp_path):
    """The merged view is a sum of contributions kept by replica: any order gives it, and a file read
    twice (or the single file of earlier versions beside the replicas') counts once."""
    path = tmp_path / "p.online"
    save_overlay(_overlay("", 5, [(1, 2)]), path)  # an earlier version's single file
    save_overlay(_overlay("a", 3, [(1, 2), (2, 3)]), replica_path(path, "a"))
    save_overlay(_overlay("b", 4, [(2, 3)]), replica_path(path, "b"))
    reps = load_replicas(path)
    assert sorted(reps) == ["a", "b", LEGACY_REPLICA]
    m = merge_overlays(reps)
    assert m.requests == 12 and m.counts["global"].count.tolist() == [2.0, 2.0]
    backwards = merge_overlays(dict(reversed(list(reps.items()))))
    assert backwards.requests == m.requests and backwards.counts["global"].count.tolist() == [2.0, 2.0]
    again = merge_overlays({**reps, "a": load_overlay(replica_path(path, "a"))})  # the same file read again
    assert again.requests == 12
    assert sorted(load_replicas(path, skip="a")) == ["b", LEGACY_REPLICA]


def test_bandit_evidence_adds_up_across_replicas_once():
    """Two replicas' bandits: each saves its own evidence; a third folds both in (prior + theirs), and
    folding the same states twice changes nothing. A state saved before replicas counts as evidence
    beyond the prior."""
    def bandit():
        return ThompsonDraftLength(0.1, [1.0] * 9, 8, prior=(2.0, 2.0), window=1e6)

    a, b, c = bandit(), bandit(), bandit()
    for _ in range(10):
        a.posterior.update(1.0, 0.0)
    for _ in range(4):
        b.posterior.update(0.0, 1.0)
    states = [a.posteriors(), b.posteriors()]
    assert states[0]["evidence"] == [10.0, 0.0]
    c.posterior.update(1.0, 1.0)
    c.rebase(states)
    assert (c.alpha, c.beta) == (2.0 + 10 + 1, 2.0 + 4 + 1)
    c.rebase(states)
    assert (c.alpha, c.beta) == (13.0, 7.0)  # idempotent
    assert c.posteriors()["evidence"] == [1.0, 1.0]  # what c saves: its own only
    old = {"kind": "length", "acceptance": [7.0, 3.0]}  # an earlier version's state: 5 and 1 beyond the prior
    c.rebase([old])
    assert (c.alpha, c.beta) == (2.0 + 5 + 1, 2.0 + 1 + 1)
    cas = ThompsonCascade(0.3, [1.0] * 9, 4, 2, stat_prior=(1.0, 1.0), window=1e6)
    other = ThompsonCascade(0.3, [1.0] * 9, 4, 2, stat_prior=(1.0, 1.0), window=1e6)
    other.layer_skip.update(3.0, 1.0)
    other.tail[0].update(2.0, 0.0)
    cas.rebase([other.posteriors()])
    cas.rebase([other.posteriors()])
    assert cas.layer_skip.counts() == [4.0, 2.0] and cas.tail[0].counts() == [3.0, 1.0]


def test_a_live_table_answers_with_the_other_replicas_counts():
    t = LiveBigramTable(None, min_count=2.0)
    t.observe([5, 7])
    assert t.get(5) is None  # one observation: below min_count
    t.set_others(np.array([5]), np.array([7]), np.array([1.0]))
    assert t.get(5) == (7, 1.0) and t.others() == 1.0
    assert t.counts()[2].tolist() == [1.0]  # its own counts only: what it saves
    t.set_others(np.zeros(0), np.zeros(0), np.zeros(0))
    assert t.get(5) is None


def _replica(p, lm, path, name, **kw):
    settings = OnlineSettings(path=path, replica=name, background=False, min_cluster=4, measure_prompts=2,
                              merge_interval=0.0, **kw)
    return AdaptiveRuntime(p, lm, seed=0, online=settings)


def test_three_replicas_discover_one_domain_none_saw_enough_of(tiny_profile, lm, tmp_path):
    """Out-of-domain traffic split over three replicas (two requests each, min_cluster 4): pooled, it
    forms one learned domain, measured by one replica; the others adopt it and route to it; merged,
    every request is counted once; a new replica starts from the merged state. Outputs stay plain
    decoding's throughout."""
    p = scripted_profile(cascades(tiny_profile), lm)
    path = tmp_path / "shared.online"
    reps = [_replica(p, lm, path, f"r{i}") for i in range(3)]
    for i, prompt in enumerate(OOD[:6]):
        r = reps[i % 3].generate(prompt, max_new_tokens=12)
        assert r.token_ids == _ar(lm, prompt, 12) and r.online["flagged"]
    learned = [set(rt.online.learned) for rt in reps]
    owner = [rt for rt in reps if rt.online._own_learned]
    assert len(owner) == 1, [rt.online.state() for rt in reps]
    for rt in reps:
        rt.online.merge(force=True)
    assert all(set(rt.online.learned) == {"learned-1"} for rt in reps), learned
    assert not (replica_dir(path) / LOCK_NAME).exists()
    for rt, prompt in zip(reps, OOD[6:8] + [OOD[0]]):
        r = rt.generate(prompt, max_new_tokens=12)
        assert r.applied == "learned-1" and r.token_ids == _ar(lm, prompt, 12)
    for rt in reps:
        rt.close()
    state = reps[0].online.state()
    assert state["requests"] == 9 and set(state["replicas"]) == {"r0", "r1", "r2"}
    assert sum(len(load_overlay(replica_path(path, f"r{i}")).learned) for i in range(3)) == 1
    assert all(not load_overlay(replica_path(path, f"r{i}")).buffer for i in range(3))  # members left the buffers
    taught = {i: rt.online.tables["learned-1"].counts()[2].sum() for i, rt in enumerate(reps)}
    again = _replica(p, lm, path, "r1")  # a restart under its id: its own counts of the adopted domain's table
    assert again.online.tables["learned-1"].counts()[2].sum() == taught[1] > 0
    again.close()
    fourth = _replica(p, lm, path, "r3")
    assert fourth.online.state()["requests"] == 9 and set(fourth.online.learned) == {"learned-1"}
    assert fourth.generate(OOD[5], max_new_tokens=12).applied == "learned-1"
    fourth.close()


def test_the_same_traffic_learned_twice_is_one_domain(tiny_profile, lm, tmp_path):
    """Two replicas that each learned the same traffic (as after a stale lock) under different names:
    a replica merging both adopts the first made only."""
    p = scripted_profile(cascades(tiny_profile), lm)
    path = tmp_path / "twice.online"
    for name in ("a", "b"):
        rt = _replica(p, lm, tmp_path / f"{name}.online", name)  # apart: each learns alone
        for prompt in OOD[:4]:
            rt.generate(prompt, max_new_tokens=8)
        rt.close()
        ov = load_overlay(replica_path(tmp_path / f"{name}.online", name))
        assert [d.name for d in ov.learned] == ["learned-1"]
        d = ov.learned[0]
        d = dataclasses.replace(d, name=f"learned-{name}", created=f"2026-01-0{1 + (name == 'b')}",
                                record=dataclasses.replace(d.record, name=f"learned-{name}"))
        counts = {f"learned-{name}" if t == "learned-1" else t: c for t, c in ov.counts.items()}
        save_overlay(dataclasses.replace(ov, learned=(d,), counts=counts), replica_path(path, name))
    c = _replica(p, lm, path, "c")
    assert set(c.online.learned) == {"learned-a"}
    assert c.generate(OOD[4], max_new_tokens=8).applied == "learned-a"
    c.close()


def test_one_replica_measures_at_a_time(tiny_profile, lm, tmp_path):
    """Another replica's fresh measuring lock stops this one from proposing; a stale one is taken over."""
    p = scripted_profile(cascades(tiny_profile), lm)
    path = tmp_path / "lock.online"
    lock = replica_dir(path) / LOCK_NAME
    lock.parent.mkdir(parents=True)
    lock.write_text('{"replica": "elsewhere"}')
    rt = _replica(p, lm, path, "r1")
    for prompt in OOD[:4]:
        rt.generate(prompt, max_new_tokens=8)
    assert not rt.online.learned and len(rt.online.buffer) == 4  # waited: the other replica measures
    os.utime(lock, (0, 0))  # the holder died long ago
    for prompt in OOD[4:6]:
        rt.generate(prompt, max_new_tokens=8)
    assert set(rt.online.learned) == {"learned-1"} and not lock.exists()
    rt.close()


def test_a_killed_replica_loses_only_what_it_had_not_saved(tiny_profile, tmp_path):
    """A replica SIGKILLed while saving in a loop leaves a whole overlay (the last one saved) and no torn file."""
    path = tmp_path / "k.online"
    script = textwrap.dedent(f"""
        import numpy as np, sys, time
        from adaptive.profile.overlay import OnlineOverlay, PairCounts, replica_path, save_overlay
        n = 0
        while True:
            n += 1
            c = PairCounts(np.arange(20000), np.arange(20000), np.full(20000, float(n)))
            save_overlay(OnlineOverlay("d" * 64, n, "", n, {{"global": c}}, {{}}, (), (), "k"),
                         replica_path({str(path)!r}, "k"))
            if n == 3:
                print("saved", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == b"saved"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ov = load_overlay(replica_path(path, "k"))
    assert ov.requests >= 3 and ov.counts["global"].count[0] == ov.requests  # whole, and one save's
    assert merge_overlays(load_replicas(path)).requests == ov.requests


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from adaptive.models import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def test_in_domain_traffic_tables_merge(tiny_profile, lm, tmp_path):
    """Calibrated domains' tables: what one replica observed answers in another after a merge."""
    path = tmp_path / "t.online"
    a = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="a"))
    b = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="b"))
    a.generate(TINY_DOMAINS["math"][0], max_new_tokens=12)
    a.online.save()
    b.online.merge(force=True)
    applied = a.online.state()["tables"]
    name = next(iter(applied))
    assert b.online.table(name).others() > 0 and b.online.table(name).counts()[0].size == 0
    a.close()
    b.close()


def test_an_idle_replica_publishes_its_last_requests(tiny_profile, lm, tmp_path):
    """Among other replicas, what a replica learned reaches its file within about a merge interval even
    if no request follows (a background thread publishes), and close() stops that thread."""
    import time

    path = tmp_path / "idle.online"
    b = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="b"))
    b.generate(TINY_DOMAINS["code"][0], max_new_tokens=4)
    b.close()
    a = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="a",
                                                                           merge_interval=0.2))
    a.generate(TINY_DOMAINS["math"][0], max_new_tokens=4)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not replica_path(path, "a").exists():
        time.sleep(0.1)
    assert load_overlay(replica_path(path, "a")).requests == 1
    a.close()
    assert a.online._publisher is None


def test_two_replicas_saving_at_once_never_tear_a_file(tiny_profile, lm, tmp_path):
    """Two replicas saving in a loop while a third merges in a loop: every read loads (no torn or
    damaged file), and the merged requests only grow."""
    import threading

    path = tmp_path / "busy.online"
    reps = [AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica=f"w{i}"))
            for i in range(2)]
    for rt in reps:
        rt.generate(TINY_DOMAINS["math"][0], max_new_tokens=4)
    stop = threading.Event()
    errors: list = []

    def saver(rt):
        while not stop.is_set():
            try:
                rt.online.requests += 1  # as if another request had been learned from
                rt.online.save()
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

    threads = [threading.Thread(target=saver, args=(rt,)) for rt in reps]
    for t in threads:
        t.start()
    reader = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="r"))
    seen = []
    deadline = time.monotonic() + 60  # at least 40 merges, and on until the savers' files were seen to grow
    try:  # (a loaded machine may run all 40 before either saver's first write lands)
        while len(seen) < 40 or (seen[-1] <= 2 and time.monotonic() < deadline):
            reader.online.merge(force=True)
            seen.append(reader.online.state()["requests"])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and not reader.online.errors, (errors, reader.online.errors)
    assert seen == sorted(seen) and seen[-1] > 2
    assert sorted(load_replicas(path)) == ["w0", "w1"]


def test_a_merge_reads_only_the_files_that_changed(tmp_path, monkeypatch):
    from adaptive.profile import overlay as overlay_mod

    path = tmp_path / "c.online"
    for name in ("a", "b"):
        save_overlay(_overlay(name, 1, [(1, 2)]), replica_path(path, name))
    reads = []
    real = overlay_mod.load_overlay
    monkeypatch.setattr(overlay_mod, "load_overlay", lambda f, *a: reads.append(f.name) or real(f, *a))
    cache: dict = {}
    assert sorted(load_replicas(path, cache=cache)) == ["a", "b"] and sorted(reads) == ["a.online", "b.online"]
    reads.clear()
    assert sorted(load_replicas(path, cache=cache)) == ["a", "b"] and reads == []  # nothing changed: nothing read
    save_overlay(_overlay("b", 2, [(1, 2)]), replica_path(path, "b"))
    merged = merge_overlays(load_replicas(path, cache=cache))
    assert reads == ["b.online"] and merged.requests == 3
