"""Online learning across a two-engine runtime's members: each member (an AdaptiveRuntime with its own
learner and overlay) sees only the requests sent to its engine, so a new domain's traffic is split
between them; their learners pool it for discovery, and each member measures the domain on its own
engine (adaptive.runtime.online, "Two engines' members")."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adaptive.engine.config import Pooling
from adaptive.index.anchors import AnchorIndex
from adaptive.profile import member_online_path
from adaptive.profile.overlay import load_overlay, replica_path
from tests.runtime.test_online import OOD, _ar, cascades, scripted_profile

ENGINES = ("llama.cpp", "torch")


def test_a_request_id_reads_in_the_other_member_with_its_engine():
    from adaptive.runtime.replicas import member_id

    assert member_id("r1:3", "torch", "llama.cpp") == "torch/r1:3"
    assert member_id("llama.cpp/r1:4", "torch", "llama.cpp") == "r1:4"  # the target's own request, back home
    assert member_id("legacy:0", "llama.cpp", "torch") == "llama.cpp/legacy:0"


def test_members_pool_only_comparable_embeddings():
    """Vectors of two indexes are set side by side only where both embed a prompt the same way."""
    from adaptive.runtime.replicas import embedding_mismatch

    def index(anchors, mean, layer=10, threshold=0.3):
        return AnchorIndex(anchors, ["x", "y"], mean, threshold, 1, Pooling(layer, "last"))

    eye, zeros = np.eye(8, dtype=np.float32), np.zeros(4, np.float32)
    a = index(eye[:2, :4], zeros)
    same = index(eye[2:4, :4], zeros, threshold=0.5)
    assert embedding_mismatch(a, same) is None  # anchors and radii are each member's own
    deeper = index(a.anchors, zeros, layer=26)
    assert "last@10 and last@26" in embedding_mismatch(a, deeper)
    wide = index(eye[:2], np.zeros(8, np.float32))
    assert "dimension" in embedding_mismatch(a, wide)
    centred = index(a.anchors, np.ones(4, np.float32))
    assert "means" in embedding_mismatch(a, centred)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from adaptive.models import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def test_members_routing_on_different_embeddings_discover_apart(tiny_profile, lm):
    """Two learners whose indexes pool differently (as when calibration chose another layer on one
    engine) are not pooled, and their state says why."""
    from adaptive.runtime import AdaptiveRuntime, OnlineSettings
    from adaptive.runtime.online import link_members

    p = scripted_profile(cascades(tiny_profile), lm)
    q = dataclasses.replace(p)
    q.index = AnchorIndex(p.index.anchors, p.index.labels, p.index.mean, 0.3, p.index.k, Pooling(None, "mean"))
    settings = OnlineSettings(persist=False, background=False, min_cluster=4, measure_prompts=2)
    a, b = (AdaptiveRuntime(x, lm, seed=0, online=settings) for x in (p, q))
    link_members({"llama.cpp": a.online, "torch": b.online})
    assert "different embeddings" in a.online.state()["members"]["torch"]
    for i, prompt in enumerate(OOD[:4]):
        (a, b)[i % 2].generate(prompt, max_new_tokens=8)
    assert not a.online.learned and not b.online.learned  # two each: neither reaches min_cluster alone
    assert a.online.state()["buffered"] == 2


# -- a two-engine runtime over the tiny GGUF (llama.cpp and torch) ---------------------------------


def _scripted_member(out, engine, member_lm):
    """The ``engine`` member of the two-engine profile ``out``, routing as :func:`scripted_profile`
    does on that engine's model (math in-domain, ``OOD`` flagged and one coherent group)."""
    return scripted_profile(cascades(out / engine), member_lm)


def _pair(two, path, replica, lock):
    from adaptive.runtime import AdaptiveRuntime, OnlineSettings, TwoEngineRuntime

    out, lms = two
    members = {}
    for engine, member_lm in lms.items():  # as TwoEngineRuntime.from_profile: the overlay PATH.ENGINE
        settings = OnlineSettings(path=member_online_path(path, engine), replica=replica, background=False,
                                  min_cluster=4, measure_prompts=2, merge_interval=0.0)
        members[engine] = AdaptiveRuntime(_scripted_member(out, engine, member_lm), member_lm, seed=0,
                                          online=settings, model_lock=lock, prefix_cache=0)
    return TwoEngineRuntime(members, "llama.cpp")


@pytest.fixture
def measured(monkeypatch):
    """The engines each learned domain was measured on, in order."""
    from adaptive.runtime import online

    engines = []
    real = online.measure_learned_domain

    def spy(lm, *args, **kwargs):
        engines.append(lm.engine)
        return real(lm, *args, **kwargs)

    monkeypatch.setattr(online, "measure_learned_domain", spy)
    return engines


def test_a_two_engine_runtime_learns_a_domain_from_traffic_split_between_its_members(two_engine_profile, tmp_path,
                                                                                     measured):
    """The regression: out-of-domain traffic sent alternately to the llama.cpp and the torch member
    (two requests each, min_cluster 4: neither member alone reaches it) forms one learned domain,
    found from the members' pooled buffers and measured once on each engine; both members route
    the next such requests to it, losslessly; every request counted once (no buffer keeps a
    member); the default member's state (what /v1/adaptive/online shows) lists it; another server on
    the same directory adopts both members' records."""
    from adaptive.runtime.turns import TurnLock

    out, lms = two_engine_profile
    path = tmp_path / "shared.online"
    rt = _pair(two_engine_profile, path, "r1", TurnLock())
    for i, prompt in enumerate(OOD[:4]):
        engine = ENGINES[i % 2]
        r = rt.runtimes[engine].generate(prompt, max_new_tokens=12)
        assert r.online["flagged"] and r.applied == "global" and r.token_ids == _ar(lms[engine], prompt, 12)
    for engine, member in rt.runtimes.items():
        learner = member.online
        assert set(learner.learned) == {"learned-1"}, (engine, learner.state())
        assert learner.learned["learned-1"].members == 4 and not learner.buffer and not learner.state()["buffered"]
    assert measured == ["torch", "llama.cpp"]  # found by the member that saw the fourth; then the other's race
    a, b = (rt.runtimes[e].online.learned["learned-1"] for e in ENGINES)
    assert a.record is not b.record and np.array_equal(a.anchors, b.anchors)
    assert set(a.member_ids) == {f"r1:{n}" for n in (1, 2)} | {f"torch/r1:{n}" for n in (1, 2)}
    assert set(b.member_ids) == {f"r1:{n}" for n in (1, 2)} | {f"llama.cpp/r1:{n}" for n in (1, 2)}
    state = rt.online.state()
    assert set(state["learned"]) == {"learned-1"} and state["requests"] == 4
    assert state["members"] == {"torch": "pooled"}
    for engine, prompt in zip(ENGINES, OOD[4:6]):
        r = rt.runtimes[engine].generate(prompt, max_new_tokens=12)
        assert r.applied == "learned-1" and r.token_ids == _ar(lms[engine], prompt, 12), engine
    rt.close()
    for engine in ENGINES:  # each member's overlay keeps its own record
        ov = load_overlay(replica_path(member_online_path(path, engine), "r1"))
        assert [d.name for d in ov.learned] == ["learned-1"] and not ov.buffer
    again = _pair(two_engine_profile, path, "r2", TurnLock())
    for member in again.runtimes.values():
        assert set(member.online.learned) == {"learned-1"} and not member.online.state()["buffered"]
        assert member.generate(OOD[6], max_new_tokens=12).applied == "learned-1"
    again.close()
    assert measured == ["torch", "llama.cpp"]  # adopted, not measured again


def test_replicas_of_a_two_engine_server_pool_both_members_traffic(two_engine_profile, tmp_path, measured):
    """Two servers of one two-engine profile, six out-of-domain requests spread over the four members
    (three to each engine: neither engine's replicas reach min_cluster 4 together): the replicas'
    and the members' pooled buffers form one domain, measured once per engine; after a merge every
    member of every server holds it and no buffer keeps any of its requests."""
    from adaptive.runtime.turns import TurnLock

    path = tmp_path / "shared.online"
    lock = TurnLock()
    servers = [_pair(two_engine_profile, path, f"r{i}", lock) for i in (1, 2)]
    for i, prompt in enumerate(OOD[:6]):
        server, engine = servers[(i // 2) % 2], ENGINES[i % 2]
        r = server.runtimes[engine].generate(prompt, max_new_tokens=8)
        assert r.online["flagged"]
    assert sorted(measured) == ["llama.cpp", "torch"], [s.online.state() for s in servers]
    finder = servers[0].runtimes["llama.cpp"].online  # the fifth request's: two of its own, one of each other
    assert finder._own_learned == {"learned-1"}
    assert set(finder.learned["learned-1"].member_ids) >= {"r1:1", "r1:2", "r2:1", "torch/r1:1"}
    for server in servers:
        for member in server.runtimes.values():
            member.online.merge(force=True)
    for server in servers:
        for engine, member in server.runtimes.items():
            assert set(member.online.learned) == {"learned-1"}, (engine, member.online.state())
            assert not member.online.state()["buffered"], (engine, member.online.state())
    for server in servers:
        server.close()
