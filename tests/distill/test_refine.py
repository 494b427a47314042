"""Online distillation of the eagle head (:mod:`adaptive.distill.refine`) on the tiny model: a round adopts a
copy that keeps more held-out first drafts and the runtime drafts that domain with it, losslessly; a
round that does not improve keeps the head; adopted heads are saved and loaded again, those of another
calibration and damaged files left out; sampled requests are not learned from; the background thread
runs rounds and stops."""

import time
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from adaptive.distill.heads import HeadConfig
from adaptive.distill.refine import RefineSettings, adoption, attach_refiner, head_file, t_critical
from adaptive.distill.trainer import distill_head
from adaptive.drafters.eagle import EagleHead, HeadShape
from adaptive.errors import ConfigError
from adaptive.profile import load_profile, save_profile
from adaptive.runtime import AdaptiveRuntime
from adaptive.runtime.runtime import FinishedRequest
from tests.conftest import TINY_DOMAINS

WEAK = dict(layers=(1, 2, 4), steps=3, new_tokens=16, eval_every=20, checkpoint_every=10, vocab=32, batch=2,
            window=32, warmup=2, held_out=0.25)
PROMPT = TINY_DOMAINS["math"][1]
# the tiny model's text is random characters: a head cannot generalise from a few of its sequences, so the
# traffic repeats one prompt (its held-out requests repeat the trained ones) and a round must learn that text
QUICK = dict(background=False, every=4, steps=60, lr=1e-2, min_held=2, held_every=2)


@pytest.fixture
def headed(lm, prof):
    distill_head(lm, prof, TINY_DOMAINS, HeadConfig(**WEAK), progress=False, race=False)
    return prof


def _runtime(prof, lm):
    return AdaptiveRuntime(load_profile(prof), lm, online=False, bandit=False)


def _serve(rt, n, prompt=PROMPT, **kw):
    return [rt.generate(prompt, max_new_tokens=24, policy=kw.pop("policy", "ar"), **kw) for _ in range(n)]


def _kept(result) -> float:
    s = result.stats
    return s.accepted / max(s.drafted, 1)


def test_a_round_adopts_a_head_that_keeps_more_held_out_drafts_and_decoding_stays_lossless(lm, headed):
    rt = _runtime(headed, lm)
    refiner = attach_refiner(rt, RefineSettings(**QUICK), replica="r1")
    before = rt.generate(PROMPT, max_new_tokens=24, policy="eagle")
    _serve(rt, 3)  # with the eagle request: 4 kept, every second held out -> a round
    assert len(refiner.history) == 1
    r = refiner.history[0]
    assert r.adopted and r.after >= r.before + 0.01 and r.held_sequences == 2 and r.held_rows >= 8, r
    domain = r.domain
    assert domain == before.applied
    assert rt.eagle_heads()[domain] is not None
    plain = rt.generate(PROMPT, max_new_tokens=24, policy="ar")
    after = rt.generate(PROMPT, max_new_tokens=24, policy="eagle")
    assert after.text == plain.text == before.text  # verification decides every token
    assert _kept(after) > _kept(before), (before.stats, after.stats)
    state = refiner.state()
    assert state["rounds"] == 1 and state["adopted"] == 1 and state["domains"][domain]["refined"]
    path = head_file(refiner.directory, "r1", domain)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["domain"] == domain and float(meta["after"]) == pytest.approx(r.after, abs=1e-4)
    rt.close()

    # a new server of that replica drafts with the adopted head from its start
    rt2 = _runtime(headed, lm)
    again = attach_refiner(rt2, RefineSettings(**QUICK), replica="r1")
    assert set(rt2.eagle_heads()) == {domain} and not again.errors
    assert torch.equal(rt2.eagle_heads()[domain].fc.weight, refiner.heads[domain].fc.weight)
    assert _kept(rt2.generate(PROMPT, max_new_tokens=24, policy="eagle")) == pytest.approx(_kept(after))
    # another replica has none of its own
    assert attach_refiner(_runtime(headed, lm), RefineSettings(**QUICK), replica="r2").heads == {}

    # a damaged file is reported and left out; a recalibrated profile (another digest) leaves the head out
    path.write_bytes(path.read_bytes()[:40])
    rt3 = _runtime(headed, lm)
    damaged = attach_refiner(rt3, RefineSettings(**QUICK), replica="r1")
    assert rt3.eagle_heads() == {} and damaged.errors and "load" in damaged.errors[0]
    profile = load_profile(headed)
    profile.runtime = replace(profile.runtime, max_draft_len=profile.runtime.max_draft_len + 1)
    save_profile(profile, headed)
    refiner._save(domain, refiner.heads[domain], r)  # a valid file, of the profile as it was
    rt4 = _runtime(headed, lm)
    assert attach_refiner(rt4, RefineSettings(**QUICK), replica="r1").heads == {} and rt4.eagle_heads() == {}


def test_a_round_that_does_not_improve_keeps_the_current_head(lm, headed):
    rt = _runtime(headed, lm)
    refiner = attach_refiner(rt, RefineSettings(**{**QUICK, "margin": 0.99}), replica="r1")
    _serve(rt, 4)
    assert len(refiner.history) == 1 and not refiner.history[0].adopted
    assert rt.eagle_heads() == {} and not list(refiner.directory.glob("r1.head-*"))


def test_a_round_that_fails_is_reported_and_serving_goes_on(lm, headed, monkeypatch):
    rt = _runtime(headed, lm)
    refiner = attach_refiner(rt, RefineSettings(**QUICK), replica="r1")

    def broken(ids):
        raise RuntimeError("no rows today")

    monkeypatch.setattr(refiner, "_features", broken)
    results = _serve(rt, 4)  # the fourth request's round fails in its thread (background=False)
    assert len(results) == 4 and results[-1].text == results[0].text
    (error,) = refiner.errors
    assert error.endswith(": RuntimeError: no rows today") and refiner.state()["errors"] == [error]
    assert not refiner.history and refiner.state()["rounds"] == 0 and rt.eagle_heads() == {}


def test_only_greedy_requests_of_some_length_are_kept_and_held_out_ones_are_every_nth(lm, headed):
    rt = _runtime(headed, lm)
    refiner = attach_refiner(rt, RefineSettings(**{**QUICK, "every": 100}), replica="r1")
    _serve(rt, 2, temperature=0.8, seed=1)
    refiner.observe(FinishedRequest("math", (1, 2), (3,), "torch", True))  # one token: nothing to learn
    # llama.cpp's own learned domain (a two-engine runtime's members each learn theirs): not this engine's
    refiner.observe(FinishedRequest("learned-1", (1, 2), (3, 4, 5), "llama.cpp", True))
    assert refiner.skipped == 4 and refiner.domains == {}
    refiner.observe(FinishedRequest("math", (1, 2), (3, 4, 5), "llama.cpp", True))  # a calibrated domain: kept
    assert refiner.domains["math"].seen == 1
    refiner.domains.clear()
    _serve(rt, 5)
    (d,) = refiner.domains.values()
    assert [q.held for q in d.kept] == [False, True, False, True, False]
    assert not refiner.history  # not due yet


def test_background_rounds_run_on_their_own_thread_and_close_stops_it(lm, headed):
    rt = _runtime(headed, lm)
    refiner = attach_refiner(rt, RefineSettings(**{**QUICK, "background": True, "steps": 5}), replica="r1")
    _serve(rt, 4)
    deadline = time.monotonic() + 60
    while not refiner.history and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(refiner.history) == 1 and refiner._thread.is_alive()
    rt.close()  # closes its listeners
    assert not refiner._thread.is_alive()
    rt.close()  # twice is harmless


def test_without_a_head_nothing_attaches_and_bad_settings_are_refused(lm, prof):
    assert attach_refiner(_runtime(prof, lm), RefineSettings(background=False)) is None
    for bad, match in ((dict(every=0), "every"), (dict(held_every=1), "held_every"), (dict(lr=0), "lr"),
                       (dict(margin=1.0), "margin"), (dict(steps=1.5), "steps"), (dict(min_held=0), "min_held")):
        with pytest.raises(ConfigError, match=match):
            RefineSettings(**bad)


def test_adoption_worked_example():
    rows = [10, 10, 10, 10]
    before = list(zip([3, 4, 5, 4], rows))
    a = adoption(before, list(zip([5, 5, 6, 6], rows)), margin=0.01)
    assert (a.before, a.after, a.rows, a.adopted) == (0.4, 0.55, 40, True) and a.t == pytest.approx(5.196, abs=1e-3)
    b = adoption(before, list(zip([5, 3, 6, 4], rows)), margin=0.01)  # a pooled rise, one sequence's loss
    assert b.after == 0.45 and b.t == pytest.approx(0.775, abs=1e-3) and not b.adopted
    c = adoption(before, list(zip([4, 5, 6, 5], rows)), margin=0.01)  # every sequence +1: no spread
    assert c.t == float("inf") and c.adopted
    assert not adoption(before, list(zip([4, 5, 6, 5], rows)), margin=0.2).adopted  # below the margin
    # t = 1.99 clears the normal's 1.645 but not Student's t with 3 degrees of freedom (2.353)
    d = adoption(before, list(zip([6, 4, 6, 5], rows)), margin=0.01)
    assert 1.645 < d.t < 2.353 and not d.adopted
    assert not adoption(before[:1], [(5, 10)], margin=0.0).adopted  # one sequence decides nothing
    assert not adoption([], [], margin=0.0).adopted


def test_the_critical_values_are_students():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 41):
        assert t_critical(df) == pytest.approx(stats.t.ppf(0.95, min(df, 30)), abs=6e-4), df


def test_a_domain_learned_online_drafts_with_the_global_records_refined_head_until_it_has_its_own(lm, headed):
    rt = _runtime(headed, lm)
    rec, weights = rt.profile.distilled_drafter("eagle")
    glob, own = (EagleHead.from_state(HeadShape.from_dict(rec.shape), weights) for _ in range(2))
    rt.set_eagle_head("global", glob)
    assert rt.refined_eagle("learned-0") is glob and rt.refined_eagle("global") is glob
    assert rt.refined_eagle("math") is None  # a calibrated domain: the profile's head until its own is adopted
    rt.set_eagle_head("learned-0", own)
    assert rt.refined_eagle("learned-0") is own
    rt.set_eagle_head("global", None)
    assert rt.refined_eagle("learned-1") is None and rt.eagle_heads() == {"learned-0": own}


def test_a_runtime_that_keeps_no_feature_rows_takes_no_head(lm, headed, tiny_profile):
    rec, weights = load_profile(headed).distilled_drafter("eagle")
    with pytest.raises(ConfigError, match="does not draft with an eagle head"):
        _runtime(tiny_profile, lm).set_eagle_head("math", EagleHead.from_state(HeadShape.from_dict(rec.shape), weights))


def test_rows_are_kept_for_the_last_positions_from_the_whole_and_within_the_budget(lm, headed):
    """A long request keeps its last ``kept_positions`` positions' rows, taken from a forward over all of it;
    past ``feature_mib`` the other domains' rows go (least recently refined first) and are captured again,
    the same, at their next round."""
    rt = _runtime(headed, lm)
    prompts = {"math": TINY_DOMAINS["math"][0], "chat": TINY_DOMAINS["chat"][0]}
    texts = {d: (tuple(rt.encode(p)), tuple(rt.generate(p, max_new_tokens=12, policy="ar").token_ids))
             for d, p in prompts.items()}
    refiner = attach_refiner(rt, RefineSettings(**{**QUICK, "every": 100, "steps": 1, "kept_positions": 8,
                                                   "feature_mib": 0.018}), replica="r1")
    for domain, (ids, out) in texts.items():
        for _ in range(4):
            refiner.observe(FinishedRequest(domain, ids, out, "torch", True))
    refiner.refine("math")
    q = refiner.domains["math"].kept[0]
    assert q.cut == len(q.ids) - 8 > 0 and q.features.shape[0] == 8
    assert torch.equal(q.features, refiner._features(q.ids)[q.cut:])
    first = q.features.clone()
    one = first.numel() * first.element_size() * 4  # a domain's rows: 4 sequences of 8 positions
    assert refiner.feature_bytes() == one < 0.018 * 2**20 < 2 * one
    refiner.refine("chat")  # two domains' rows are over the budget: math's go
    assert all(s.features is None for s in refiner.domains["math"].kept)
    assert refiner.feature_bytes() == one
    refiner.refine("math")  # captured again, the same rows; chat's go
    assert torch.equal(refiner.domains["math"].kept[0].features, first)
    assert all(s.features is None for s in refiner.domains["chat"].kept)
