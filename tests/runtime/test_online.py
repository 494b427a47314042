"""Online adaptation (issue 20): its settings, and a runtime learning from scripted traffic."""

import dataclasses

import numpy as np
import pytest

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.index.anchors import AnchorIndex
from adaptive.profile import load_profile
from adaptive.profile.overlay import (
    OverlayError,
    load_overlay,
    overlay_path,
    remove_overlay,
    replica_dir,
    replica_path,
    save_overlay,
)
from adaptive.runtime import AdaptiveRuntime, OnlineSettings
from adaptive.runtime.online import Observation
from tests.conftest import TINY_DOMAINS
from tests.helpers.profiles import with_domains


def test_settings_are_validated():
    with pytest.raises(ValueError):
        OnlineSettings(min_cluster=1)
    with pytest.raises(ValueError):
        OnlineSettings(min_cluster=10, buffer_size=4)
    with pytest.raises(ValueError):
        OnlineSettings(coherence=0)
    assert OnlineSettings.coerce(False).enabled is False and OnlineSettings.coerce(None).enabled


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from adaptive.models import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def cascades(tiny_profile):
    return with_domains(load_profile(tiny_profile), "cascade")


def _ar(lm, prompt, n=24):
    return Engine(lm).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


OOD = [f"zq xv zq xv zq xv zq xv number {i}" for i in range(8)]


def scripted_profile(profile, lm):
    """``profile`` routing by an index whose anchors are the math prompts' own embeddings, threshold
    0.3: math is in-domain (distance 0), the scripted out-of-domain prompts ``OOD`` lie about 1 from
    it (flagged) and within 0.01 of each other (a coherent group), as measured on the tiny model."""
    from adaptive.index.embedding import embed_prompt

    engine = Engine(lm)
    idx = profile.index
    vecs = np.stack([embed_prompt(lm.backbone, engine.encode(q), idx.pooling) for q in TINY_DOMAINS["math"]])
    p = dataclasses.replace(profile)
    p.index = AnchorIndex(idx.transform(vecs), ["math"] * len(vecs), idx.mean, 0.3, idx.k, idx.pooling)
    return p


def test_runtime_learns_tables_bandits_and_a_new_domain_losslessly(tiny_profile, lm, tmp_path):
    """Scripted traffic: in-domain requests, then out-of-domain ones: every greedy output equals plain
    decoding before, during and after adaptation; the tables learn; the out-of-domain requests form
    a learned domain, measured against ar; later ones route to it; a new runtime reloads all of it."""
    p = scripted_profile(cascades(tiny_profile), lm)
    settings = OnlineSettings(path=tmp_path / "t.online", background=False, min_cluster=4, save_every=3,
                              measure_prompts=2)
    rt = AdaptiveRuntime(p, lm, seed=0, online=settings)
    traffic = TINY_DOMAINS["math"][:3] + OOD[:6]
    results = []
    for prompt in traffic:
        r = rt.generate(prompt, max_new_tokens=16)
        assert r.token_ids == _ar(lm, prompt, 16), prompt
        results.append(r)
    assert [r.online["flagged"] for r in results] == [False] * 3 + [True] * 6
    assert [r.applied for r in results[:3]] == ["math"] * 3 and [r.applied for r in results[3:7]] == ["global"] * 4
    learner = rt.online
    assert learner.requests == len(traffic) and learner.tables["math"].observed > 0
    assert list(learner.learned) == ["learned-1"], (learner.state(), learner.errors)
    rec = learner.learned["learned-1"].record
    assert {m.role for m in rec.measurements} == {"lookup", "cascade"} and rec.prompts == 4
    assert rec.decision.drafter in ("ar", "pld", "cascade")
    # after the fourth flagged request the domain was measured (inline here); the next route to it
    assert [r.applied for r in results[7:]] == ["learned-1"] * 2 and all(r.online["learned_domain"]
                                                                         for r in results[7:])
    assert len(learner.buffer) == 0 and learner.saves >= 1
    again = rt.generate(OOD[6], max_new_tokens=16)  # after adaptation: still lossless
    assert again.token_ids == _ar(lm, OOD[6], 16) and again.applied == "learned-1"
    bandits = {k: b.posteriors() for k, b in rt._live_bandits().items()}
    assert "knn-ssd:learned-1" in bandits or rec.decision.drafter == "ar"
    rt.close()
    ov = load_overlay(learner.own_path)
    assert learner.own_path == replica_path(settings.path, learner.replica) and ov.replica == learner.replica
    assert ov.requests == len(traffic) + 1 and [d.name for d in ov.learned] == ["learned-1"]
    assert ov.bandits == bandits
    # a new runtime (the same replica id) starts where this one stopped
    rt2 = AdaptiveRuntime(p, lm, seed=0, online=dataclasses.replace(settings, persist=False,
                                                                     replica=learner.replica))
    assert set(rt2.online.learned) == {"learned-1"} and rt2.online.saved_bandits == bandits
    np.testing.assert_array_equal(rt2.online.tables["math"].counts()[2], learner.tables["math"].counts()[2])
    r2 = rt2.generate(OOD[7], max_new_tokens=16)
    assert r2.applied == "learned-1" and r2.token_ids == _ar(lm, OOD[7], 16)
    for key, b in rt2._live_bandits().items():  # restored, then updated by the one request
        assert key in bandits and b.posteriors()["kind"] == bandits[key]["kind"]


def test_a_runtime_drafting_with_an_eagle_head_races_it_in_a_learned_domain(tiny_profile, lm, tmp_path):
    """Where the runtime drafts with an eagle head, a domain learned from out-of-domain traffic races the
    head beside prompt lookup and the cascade (the one its requests drafted with: the global record's
    refined head once there is one), and its requests stay lossless whatever it decides."""
    import shutil

    from adaptive.distill.heads import HeadConfig
    from adaptive.distill.trainer import distill_head

    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    distill_head(lm, prof, TINY_DOMAINS, HeadConfig(layers=(1, 2, 4), steps=3, new_tokens=12, vocab=32, batch=2,
                                                    window=32, warmup=2), progress=False, race=False)
    p = scripted_profile(cascades(prof), lm)
    settings = OnlineSettings(path=tmp_path / "h.online", background=False, min_cluster=4, measure_prompts=2)
    rt = AdaptiveRuntime(p, lm, seed=0, online=settings)
    assert rt.features == (1, 2, 4)
    refined = rt._head_candidate().head  # stands in for a head refined on the global record's traffic
    rt.set_eagle_head("global", refined)
    for prompt in OOD[:5]:
        assert rt.generate(prompt, max_new_tokens=16).token_ids == _ar(lm, prompt, 16), prompt
    rec = rt.online.learned["learned-1"].record
    assert {m.role for m in rec.measurements} == {"lookup", "cascade", "eagle"}
    eagle = next(m for m in rec.measurements if m.role == "eagle")
    assert eagle.drafter == "eagle" and eagle.draft_len >= 1
    assert rt.refined_eagle("learned-1") is refined  # and it drafts with the global record's refined head
    for policy in ("knn-ssd", "eagle"):
        r = rt.generate(OOD[6], max_new_tokens=16, policy=policy)
        assert r.applied == "learned-1" and r.token_ids == _ar(lm, OOD[6], 16)
    rt.close()


def test_background_measurement_takes_turns_with_serving(tiny_profile, lm, tmp_path):
    """The default: the new domain is raced in a thread while requests keep being served; outputs
    stay plain decoding's, and the domain is learned once the thread finishes."""
    p = scripted_profile(cascades(tiny_profile), lm)
    rt = AdaptiveRuntime(p, lm, seed=0, online=OnlineSettings(path=tmp_path / "b.online", min_cluster=4,
                                                               measure_prompts=2))
    for prompt in OOD[:4]:
        rt.generate(prompt, max_new_tokens=12)
    assert rt.online.measuring == "learned-1" or rt.online.learned
    for prompt in [*TINY_DOMAINS["math"][:2], *OOD[4:6]]:  # served while it measures
        assert rt.generate(prompt, max_new_tokens=12).token_ids == _ar(lm, prompt, 12)
    assert rt.online.wait(timeout=120)
    assert list(rt.online.learned) == ["learned-1"] and rt.online.measuring is None
    assert not rt.online.buffer  # those flagged while it was measured joined it (or routed to it)
    assert rt.generate(OOD[7], max_new_tokens=12).applied == "learned-1"
    rt.close()
    assert load_overlay(rt.online.own_path).learned[0].name == "learned-1"


def test_close_stops_a_measurement_and_keeps_its_requests(tiny_profile, lm, tmp_path):
    p = scripted_profile(cascades(tiny_profile), lm)
    rt = AdaptiveRuntime(p, lm, seed=0, online=OnlineSettings(path=tmp_path / "c.online", min_cluster=4,
                                                               measure_prompts=2))
    with rt._lock:  # the measurement cannot take a turn while we hold the model
        for prompt in OOD[:4]:
            rt.generate(prompt, max_new_tokens=8)
        assert rt.online.measuring == "learned-1"
        rt.online._stop.set()
    rt.close()
    ov = load_overlay(rt.online.own_path)
    assert not ov.learned and len(ov.buffer) == 4  # back in the buffer, saved
    assert not (tmp_path / "c.online.d" / "measuring.lock").exists()  # the measuring lock went with it


def test_online_off_learns_and_writes_nothing(tiny_profile, lm):
    p = cascades(tiny_profile)
    rt = AdaptiveRuntime(p, lm, online=False)
    r = rt.generate(TINY_DOMAINS["math"][0], max_new_tokens=8)
    assert rt.online is None and r.online is None and "online" not in r.to_dict()
    rt.close()
    assert not overlay_path(tiny_profile).exists()


def test_default_overlay_is_beside_the_profile_and_saved_on_close(tiny_profile, lm):
    rt = AdaptiveRuntime(cascades(tiny_profile), lm)
    r = rt.generate(TINY_DOMAINS["code"][0], max_new_tokens=8)
    assert r.online is not None and r.to_dict()["online"] == r.online
    rt.close()
    assert rt.online.own_path.parent == replica_dir(overlay_path(tiny_profile))
    ov = load_overlay(rt.online.own_path)
    assert ov.requests == 1 and sum(c.count.sum() for c in ov.counts.values()) >= 1
    remove_overlay(overlay_path(tiny_profile))


def test_a_bad_or_stale_overlay(tiny_profile, lm, tmp_path, caplog):
    path = tmp_path / "bad.online"
    own = replica_path(path, "r1")
    own.parent.mkdir()
    own.write_bytes(b"garbage")  # this replica's own file: it does not start
    with pytest.raises(OverlayError, match="not an adaptive online overlay"):
        AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="r1"))
    # another replica's damaged file: left out, said, and serving goes on
    rt = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=path, replica="r2"))
    assert rt.online.requests == 0 and "not an adaptive online overlay" in rt.online.state()["errors"][0]
    # another calibration's overlay (here the single file of earlier versions): left out with a warning
    rt = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=tmp_path / "a.online"))
    rt.generate(TINY_DOMAINS["math"][0], max_new_tokens=4)
    ov = rt.online.snapshot()
    save_overlay(dataclasses.replace(ov, profile="0" * 64), tmp_path / "s.online")
    rt2 = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(path=tmp_path / "s.online"))
    assert rt2.online.state()["requests"] == 0 and "another calibration" in caplog.text


def test_observe_counts_the_output_with_the_prompt_s_last_token(tiny_profile, lm):
    rt = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(persist=False, discover=False))
    vec = np.zeros(rt.profile.index.dim, np.float32)
    rt.online.observe(Observation(vec, [5, 6], [7, 8, 7, 8], "math", flagged=True))
    t = rt.online.tables["math"]
    assert t.counts()[0].tolist() == [6, 7, 8] and t.observed == 4
    assert not rt.online.buffer  # discover=False: nothing buffered
    assert rt.online.state()["tables"]["math"]["pairs"] == 3


def test_clustering_is_tried_every_half_cluster_of_new_requests(tiny_profile, lm, monkeypatch):
    """Unrelated out-of-domain requests do not pay a clustering search each: it runs once
    ``min_cluster`` are pending, then after every ``min_cluster // 2`` more."""
    from adaptive.runtime import online as online_mod

    calls = []
    monkeypatch.setattr(online_mod, "find_cluster", lambda *a, **k: calls.append(len(a[0])))
    rt = AdaptiveRuntime(cascades(tiny_profile), lm, online=OnlineSettings(persist=False, min_cluster=4))
    rng = np.random.default_rng(0)
    for _ in range(9):
        vec = rng.normal(size=rt.profile.index.dim).astype(np.float32)
        rt.online.observe(Observation(vec, (1, 2), (3, 4), "global", flagged=True))
    assert calls == [4, 6, 8]


def test_a_measurement_the_context_has_no_room_for_waits_for_later_quietly(tiny_profile, lm, tmp_path, monkeypatch):
    """llama.cpp's served requests may hold the positions a measurement's race needs (ContextFullError):
    the proposal's members go back to the buffer, no error is recorded, and the next attempt measures it."""
    from adaptive.errors import ContextFullError
    from adaptive.runtime import online as online_mod

    real, calls = online_mod.measure_learned_domain, []

    def measure(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ContextFullError("100 positions are needed and live requests leave 20")
        return real(*a, **k)

    monkeypatch.setattr(online_mod, "measure_learned_domain", measure)
    p = scripted_profile(cascades(tiny_profile), lm)
    settings = OnlineSettings(path=tmp_path / "t.online", background=False, min_cluster=4, measure_prompts=2)
    rt = AdaptiveRuntime(p, lm, seed=0, online=settings)
    for prompt in OOD[:4]:
        rt.generate(prompt, max_new_tokens=8)
    learner = rt.online
    assert calls == [1] and not learner.learned and learner.errors == [] and len(learner.buffer) == 4
    for prompt in OOD[4:6]:  # the next attempt (after min_cluster // 2 more requests) measures it
        rt.generate(prompt, max_new_tokens=8)
    assert len(calls) == 2 and list(learner.learned) == ["learned-1"], learner.errors
    rt.close()
