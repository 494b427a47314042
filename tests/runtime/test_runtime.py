"""The runtime on the tiny model: lossless under routing, result fields, streaming, threads."""

import dataclasses
import threading

import numpy as np
import pytest

from adaptive.drafters.cascade import CascadePlan
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.errors import ConfigError, PromptTooLongError
from adaptive.profile import ProfileError, VocabChoice, load_profile
from adaptive.runtime import POLICIES, AdaptiveRuntime, OnlineSettings
from adaptive.runtime.runtime import beta_prior
from tests.conftest import TINY_DOMAINS
from tests.helpers.profiles import with_domains


@pytest.fixture(scope="module")
def runtime(tiny_profile, tiny_model_dir):
    """A runtime whose domains draft: math with prompt lookup, the others and the global set with
    layer skipping (the tiny model's timings decide nothing)."""
    from adaptive.models import load_model

    p = with_domains(load_profile(tiny_profile), lambda n: "pld" if n == "math" else "ssd")
    lm = load_model(str(tiny_model_dir), dtype="float32")
    rt = AdaptiveRuntime(p, lm, seed=0)
    yield rt
    rt.close()  # a domain it began learning from these tests' traffic is not measured on into other modules


PROMPTS = [TINY_DOMAINS["math"][-1], TINY_DOMAINS["chat"][-1], TINY_DOMAINS["code"][-1], "zz qq xx"]


def _ar(rt, prompt, n=24):
    return Engine(rt.lm).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("policy", ["knn-ssd", "knn-skip", "cascade", "ssd-static", "ar"])
def test_runtime_greedy_output_equals_plain_decoding(runtime, policy):
    drafted = 0
    for prompt in PROMPTS:
        r = runtime.generate(prompt, max_new_tokens=24, policy=policy)
        assert r.token_ids == _ar(runtime, prompt), (policy, prompt)
        assert r.policy == policy
        drafted += r.stats.drafted
        if policy == "ar":
            assert r.decision == "ar" and r.stats.drafted == 0
        elif policy == "ssd-static":
            assert r.decision == "ssd" and r.applied == "global"
        elif policy == "cascade":
            assert r.decision == "cascade" and r.drafter_info["name"] == "cascade"
        elif policy == "knn-skip":
            assert r.decision == "ssd" and r.skip == runtime.profile.domain(r.domain).layer_skip.skip
        else:
            assert r.decision == runtime.profile.domain(r.domain).decision.drafter
    if policy != "ar":  # equality must not come from never drafting
        assert drafted > 0, policy


def test_result_records_the_routing_decision(runtime):
    r = runtime.generate(TINY_DOMAINS["code"][-1], max_new_tokens=16)
    assert r.domain in (*TINY_DOMAINS, None)
    assert r.applied in (*TINY_DOMAINS, "global") and r.applied == runtime.profile.domain(r.domain).name
    assert r.neighbours and all({"domain", "distance"} <= set(n) for n in r.neighbours)
    if r.decision == "ssd":
        assert r.skip == runtime.profile.domain(r.domain).layer_skip.skip
    else:
        assert r.decision == "pld" and r.skip is None and r.drafter_info["name"] == "pld"
    assert sum(r.draft_lengths.values()) >= 1
    assert r.draft_policy == "thompson" and "alpha" in r.bandit
    # the prefill's embedding is the profile's pooling (the last position after 1 of 4 layers): the same
    # route as embedding the prompt separately
    from adaptive.engine.config import Pooling

    assert runtime.profile.index.pooling == Pooling(1, "last")
    routed = runtime.route(TINY_DOMAINS["code"][-1]).route
    assert [n["domain"] for n in r.neighbours] == [dom for dom, _ in routed.neighbours]
    d = r.to_dict()
    assert d["route"]["neighbours"] and d["policy"] == "knn-ssd" and d["decision"] == r.decision
    assert d["applied"] == r.applied and d["bandit"] == r.bandit and d["drafter"]["name"] == r.decision
    if r.skip is not None:  # the skip set in the JSON: its object and its text form
        assert d["skip"] == r.skip.to_dict() and d["skip_text"] == r.skip.to_text() and isinstance(d["skip_text"], str)
    else:
        assert "skip" not in d and "skip_text" not in d


def test_stream_yields_the_text_then_the_result(runtime):
    items = list(runtime.stream(TINY_DOMAINS["chat"][-1], max_new_tokens=20))
    *deltas, result = items
    assert all(isinstance(d, str) for d in deltas) and "".join(deltas) == result.text
    assert result.token_ids == _ar(runtime, TINY_DOMAINS["chat"][-1], 20)


def test_raw_text_prompts_and_the_room_a_prompt_leaves(runtime):
    prompt = TINY_DOMAINS["code"][-1]
    raw_ids = runtime.encode(prompt, chat=False)
    assert raw_ids == runtime.engine.encode(prompt, chat=False) != runtime.encode(prompt)  # default: the template
    r = runtime.generate(prompt, max_new_tokens=12, chat=False)
    assert r.stats.prompt_tokens == len(raw_ids)
    ref = Engine(runtime.lm).generate(prompt, GenerationConfig(max_new_tokens=12), chat=False)
    assert r.token_ids == ref.token_ids
    room = runtime.room(raw_ids)
    assert room == runtime.engine.backbone.max_positions - len(raw_ids) - runtime.draft_len - 1 > 0
    assert runtime.generate(prompt, max_new_tokens=room, chat=False, policy="ar").stats.tokens >= 1  # fits
    with pytest.raises(PromptTooLongError):
        runtime.generate(prompt, max_new_tokens=room + 1, chat=False)


def test_sampling_is_reproducible_with_a_seed_and_fixed_draft_lengths(runtime):
    # The bandit's state moves between requests, and with it how the random stream is consumed;
    # with fixed draft lengths a seed reproduces a sampled request exactly.
    fixed = AdaptiveRuntime(runtime.profile, runtime.lm, bandit=False)
    a = fixed.generate("hello there", max_new_tokens=16, temperature=0.8, seed=3)
    b = fixed.generate("hello there", max_new_tokens=16, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids
    assert a.draft_policy.startswith("fixed")


def test_bad_options_are_clear_errors(runtime):
    with pytest.raises(ConfigError, match="policy 'fast'; choose one of " + ", ".join(POLICIES)):
        runtime.generate("x", policy="fast")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        runtime.generate("x", max_new_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        runtime.generate("x", temperature=-1)


def test_from_profile_checks_the_model(tiny_profile, tiny_model_dir, tmp_path):
    rt = AdaptiveRuntime.from_profile(tiny_profile, model=str(tiny_model_dir), dtype="float32")
    assert rt.lm.n_layers == 4
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp_path / "m"
    tiny_model("llama", seed=11).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    with pytest.raises(ProfileError, match="calibrated for"):
        AdaptiveRuntime.from_profile(tiny_profile, model=str(other), dtype="float32")


def test_a_profile_timed_on_a_busy_machine_is_said_at_load(runtime):
    """Costs timed while other work took the CPU read slow and skew every price: loading such a
    profile says so once (a warning); costs timed on an idle machine, or not measured, say nothing."""
    import warnings

    p = runtime.profile
    busy = dataclasses.replace(p, cost_model=dataclasses.replace(p.cost_model, others_share=0.45))
    with pytest.warns(UserWarning, match="other work used 45% of this machine's CPU"):
        AdaptiveRuntime(busy, runtime.lm, online=False).close()
    idle = dataclasses.replace(p, cost_model=dataclasses.replace(p.cost_model, others_share=0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveRuntime(idle, runtime.lm, online=False).close()


def test_concurrent_requests_match_single_threaded_output(runtime):
    jobs = [(p, t, s) for p in PROMPTS for t, s in ((0.0, None), (0.7, 5))]
    expected = {j: runtime.generate(j[0], max_new_tokens=20, temperature=j[1], seed=j[2]).token_ids
                for j in jobs if j[1] == 0.0}
    errors, got = [], {}

    def worker(offset):
        try:
            for i in range(len(jobs)):
                j = jobs[(i + offset) % len(jobs)]
                got[(offset, j)] = runtime.generate(j[0], max_new_tokens=20, temperature=j[1], seed=j[2]).token_ids
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 4 * len(jobs)
    for (_offset, j), ids in got.items():
        if j[1] == 0.0:  # greedy: identical to single-threaded output
            assert ids == expected[j], j
        else:  # sampled: a complete, valid generation
            assert 1 <= len(ids) <= 20 and all(0 <= t < runtime.lm.backbone.vocab_size for t in ids)
    # bounded state: one bandit per (drafting policy, record, temperature class) at most: knn-ssd, knn-skip,
    # cascade, ssd-static, each greedy and at 0.7
    assert len(runtime.bandit_state()) <= 2 * 4 * (len(TINY_DOMAINS) + 1)
    assert all(k.endswith("@t0.7") or "@" not in k for k in runtime.bandit_state())


def test_sampled_requests_learn_in_a_bandit_of_their_own(runtime):
    """A domain's greedy and sampled requests each draft from their own bandit (keyed by the
    temperature class): a sampled request's verifications leave the greedy bandit as it was."""
    rt = AdaptiveRuntime(runtime.profile, runtime.lm, online=False)
    try:
        greedy = rt.generate(PROMPTS[0], max_new_tokens=16, policy="knn-ssd")
        key = f"knn-ssd:{greedy.applied}"
        before = rt.bandit_state()[key]
        sampled = rt.generate(PROMPTS[0], max_new_tokens=16, policy="knn-ssd", temperature=1.0, seed=3)
        assert sampled.applied == greedy.applied
        states = rt.bandit_state()
        assert states[key] == before  # the sampled request taught the greedy bandit nothing
        assert f"{key}@t1" in states and sampled.bandit == states[f"{key}@t1"]
    finally:
        rt.close()


def test_started_requests_step_together_and_equal_plain_decoding(runtime):
    """start/step: requests routed to different drafters (layer skipping, the cascade, plain) share
    each verification forward; every greedy output is the plain one, every result routed."""
    jobs = [(p, pol) for p in PROMPTS for pol in ("knn-ssd", "cascade", "ar")]
    runs = [runtime.start(p, max_new_tokens=20, policy=pol) for p, pol in jobs]
    assert {r.plan.drafter for r in runs} >= {"ssd", "cascade", "ar"}
    texts = [r.first for r in runs]
    while not all(r.done for r in runs):
        live = [i for i, r in enumerate(runs) if not r.done]
        for i, delta in zip(live, runtime.step([runs[i] for i in live])):
            texts[i] += delta
    for (prompt, pol), run, text in zip(jobs, runs, texts):
        r = run.result()
        assert r.token_ids == _ar(runtime, prompt, 20), (prompt, pol)
        assert r.text == text and r.policy == pol and r.decision == run.plan.drafter


class _Listener:
    name = "probe"

    def __init__(self):
        self.seen, self.closed = [], 0

    def observe(self, finished):
        self.seen.append(finished)

    def state(self) -> dict:
        return {"seen": len(self.seen)}

    def close(self) -> None:
        self.closed += 1


def test_listeners_see_every_finished_request_once_and_close_with_the_runtime(tiny_profile, tiny_model_dir):
    """A listener (e.g. the eagle head's refiner) gets each finished request once, streamed or stepped in a
    batch, online learning on or off: its record, prompt and output ids, engine and whether it was greedy."""
    from adaptive.models import load_model

    lm = load_model(str(tiny_model_dir), dtype="float32")
    for online in (False, True):
        rt = AdaptiveRuntime(load_profile(tiny_profile), lm, seed=0, online=OnlineSettings(persist=False) if online
                             else False)
        probe = _Listener()
        rt.add_listener(probe)
        one = rt.generate(PROMPTS[0], max_new_tokens=12)
        sampled = rt.generate(PROMPTS[1], max_new_tokens=12, temperature=0.9, seed=3)
        runs = [rt.start(p, max_new_tokens=10) for p in PROMPTS[2:]]
        while not all(r.done for r in runs):
            rt.step([r for r in runs if not r.done])
        results = [one, sampled] + [r.result() for r in runs]
        assert len(probe.seen) == 4, online
        seen = {f.prompt: f for f in probe.seen}  # the batch's two in the order they finished
        for r, prompt, greedy in zip(results, PROMPTS, (True, False, True, True)):
            f = seen[tuple(rt.encode(prompt))]
            assert f.output == tuple(r.token_ids) and f.domain == r.applied and f.engine == "torch"
            assert f.greedy is greedy
        assert rt.listener_state() == {"probe": {"seen": 4}}
        rt.close()
        assert probe.closed == 1


def test_prompt_lookup_domains_are_lossless(runtime):
    # every domain (and the global set) decoded with prompt lookup
    p = with_domains(runtime.profile, "pld")
    rt = AdaptiveRuntime(p, runtime.lm)
    for prompt in PROMPTS:
        r = rt.generate(prompt, max_new_tokens=24)
        assert r.decision == "pld" and r.drafter_info["name"] == "pld" and r.skip is None
        assert r.token_ids == _ar(runtime, prompt)
    # with fixed draft lengths (the bandit may rightly stop drafting on this random model) it drafts
    fixed = AdaptiveRuntime(p, runtime.lm, bandit=False)
    r = fixed.generate("ab ab ab ab ab ab", max_new_tokens=16)
    assert r.stats.drafted > 0 and r.token_ids == _ar(runtime, "ab ab ab ab ab ab", 16)


def test_route_inside_a_stream_does_not_deadlock(runtime):
    it = runtime.stream("hello there friend", max_new_tokens=8)
    next(it)
    assert runtime.route("what is 1 plus 2?").route.nearest_domain in TINY_DOMAINS  # same thread, lock held
    assert isinstance(runtime.bandit_state(), dict)
    list(it)


def test_cascade_uses_the_domains_table_and_split(runtime, tmp_path):
    """Each domain's cascade drafts with its own bigram table; a profile split puts layer-skip tokens
    first; greedy output stays that of plain decoding; the two-level bandit learns per level."""
    p = with_domains(runtime.profile, cascade=CascadePlan(split=1, draft_len=4, max_split=2))
    # learning online from its own requests only: not from an overlay the module's runtime may save
    # beside the shared profile while this test runs (its background measurement of a learned domain)
    own = OnlineSettings(path=tmp_path / "own.online", persist=False)
    for bandit, online in ((False, False), (True, False), (True, own)):
        rt = AdaptiveRuntime(p, runtime.lm, bandit=bandit, online=online)
        moved = []
        for prompt in PROMPTS[:3]:
            r = rt.generate(prompt, max_new_tokens=24, policy="cascade")
            assert r.token_ids == _ar(runtime, prompt), (bandit, prompt)
            if r.domain is not None:
                d = r.drafter_info
                entries, calibrated = d["statistical"]["bigram_entries"], len(p.domains[r.domain].bigram)
                # online, the table is the calibrated one plus what earlier requests taught it
                assert entries == calibrated if not online else entries >= calibrated
                assert r.skip == p.domains[r.domain].layer_skip.skip
                if not bandit:
                    assert d["split"] == 1 and r.stats.drafted > 0
            if bandit and r.stats.drafted:
                moved.append(r.applied)
        if bandit:
            states = rt.bandit_state()
            assert all({"layer_skip", "statistical"} <= set(v) for k, v in states.items() if k.startswith("cascade:"))
            assert moved, "the cascade's bandit never drafted"
            for applied in moved:  # every bandit that saw a draft left its prior
                s, dp = states[f"cascade:{applied}"], p.domain(None if applied == "global" else applied)
                prior_ls = beta_prior(dp.priors.layer_skip.acceptance)
                prior_tail = beta_prior(dp.priors.statistical.acceptance)
                ls_moved = (s["layer_skip"]["alpha"], s["layer_skip"]["beta"]) != tuple(round(x, 3) for x in prior_ls)
                tail_moved = any(m != round(prior_tail[0] / sum(prior_tail), 4) for m in s["statistical"])
                assert ls_moved or tail_moved, (applied, s)


def test_cascade_with_a_profile_made_before_cascades(runtime):
    """A profile without cascade settings or tables: the cascade is prompt lookup alone, still lossless."""
    # what calibration records where it measured no cascade: prompt lookup alone, no table
    p = with_domains(runtime.profile, cascade=CascadePlan(split=0, draft_len=8, max_split=0), bigram=None)
    rt = AdaptiveRuntime(p, runtime.lm, bandit=False, online=False)  # online, a table would be learned
    r = rt.generate("ab ab ab ab ab ab", max_new_tokens=16, policy="cascade")
    assert r.drafter_info["split"] == 0 and "bigram_entries" not in r.drafter_info["statistical"] and r.skip is None
    assert r.token_ids == _ar(runtime, "ab ab ab ab ab ab", 16) and r.stats.drafted > 0


def test_knn_skip_with_a_reduced_vocabulary_is_lossless(runtime):
    """Routed layer skipping over each domain's reduced vocabulary (joined with the prompt's tokens):
    greedy output is plain decoding's; reduced_vocab=False keeps the full head."""
    p = reduced_profile(runtime.profile)
    reduced, full = AdaptiveRuntime(p, runtime.lm), AdaptiveRuntime(p, runtime.lm, reduced_vocab=False)
    for prompt in PROMPTS[:3]:
        r = reduced.generate(prompt, max_new_tokens=24, policy="knn-skip")
        f = full.generate(prompt, max_new_tokens=24, policy="knn-skip")
        assert r.token_ids == f.token_ids == _ar(runtime, prompt), prompt
        if r.domain is not None:
            assert r.decision == "ssd" and r.skip == p.domains[r.domain].layer_skip.skip
            prompt_ids = set(runtime.engine.encode(prompt, chat=p.runtime.chat))
            assert r.drafter_info["draft_vocab"] == len(set(range(3, 30)) | prompt_ids)
            assert "draft_vocab" not in f.drafter_info


def reduced_profile(profile):
    """Every record drafting layer-skip tokens over ids 3..29 (joined with each request's prompt ids)."""
    vocab = VocabChoice(size=27, vocab_size=40, draft_len=4, coverage={}, draft_cost={}, estimate={},
                        full_estimate=1.0, use=True)
    return with_domains(profile, "ssd", vocab=vocab, draft_vocab=np.arange(3, 30))


@pytest.mark.parametrize("policy", ["knn-skip", "cascade"])
def test_requests_do_not_change_drafters(runtime, policy):
    """Drafters are built per request: a request after another one through the same reduced-head
    domain decodes exactly as the same request on a fresh runtime, and an earlier plan's drafter
    description is not changed by a later request."""
    p = reduced_profile(runtime.profile)
    if policy == "cascade":
        p = with_domains(p, "ssd", cascade=CascadePlan(split=1, draft_len=4, max_split=2))
    first, second = TINY_DOMAINS["code"][-1], TINY_DOMAINS["code"][-2] + " zz 77"
    # online learning off: it changes a domain's live bigram table between requests by design
    shared = AdaptiveRuntime(p, runtime.lm, bandit=False, online=False)
    a = shared.generate(first, max_new_tokens=20, policy=policy)
    a_info = dict(a.drafter_info)
    b = shared.generate(second, max_new_tokens=20, policy=policy)
    fresh = AdaptiveRuntime(p, runtime.lm, bandit=False, online=False).generate(second, max_new_tokens=20,
                                                                                policy=policy)
    assert b.applied == fresh.applied and b.decision == fresh.decision == ("ssd" if policy == "knn-skip" else policy)
    assert b.token_ids == fresh.token_ids == _ar(runtime, second, 20)
    assert b.drafter_info == fresh.drafter_info and "draft_vocab" in b.drafter_info
    assert (b.stats.drafted, b.stats.accepted, b.draft_lengths) == (
        fresh.stats.drafted, fresh.stats.accepted, fresh.draft_lengths) and b.stats.drafted > 0
    assert a.drafter_info == a_info and a.drafter_info["draft_vocab"] != b.drafter_info["draft_vocab"]
    # plans built one after the other keep their own heads
    route = shared.route(first).route
    ids1, ids2 = (shared.engine.encode(t, chat=p.runtime.chat) for t in (first, second))
    plan1 = shared.plan(POLICIES[policy], route, ids1)
    n1 = len(plan1.spec.head)
    plan2 = shared.plan(POLICIES[policy], route, ids2)
    assert len(plan1.spec.head) == n1 and plan1.spec.head is not plan2.spec.head


def _batched_lengths(runtime, verify: tuple[float, ...], most: int | None = None) -> list[int]:
    """Six requests (three prompts, drafting and plain) stepped together to their end on a runtime whose
    profile's verify table is ``verify``: every draft length the batch's pricing chose (each within the
    request's longest, and within ``most`` if given), the outputs checked equal to plain greedy decoding."""
    p = with_domains(runtime.profile, lambda n: "pld" if n == "math" else "ssd")
    p.global_set = dataclasses.replace(p.global_set, verify=verify)
    rt = AdaptiveRuntime(p, runtime.lm, online=False)
    jobs = [(q, pol) for q in PROMPTS[:3] for pol in ("knn-ssd", "ar")]
    runs = [rt.start(q, max_new_tokens=16, policy=pol) for q, pol in jobs]
    lengths = []
    while not all(r.done for r in runs):
        live = [r for r in runs if not r.done]
        for r, c in zip(live, rt.batch_choices(live)):
            lane = r.decoding.lane
            assert (c is None) == (lane.max_draft == 0) and (c is None or c.length <= lane.max_draft)
            assert c is None or most is None or c.length <= most
            if c is not None:
                lengths.append(c.length)
        rt.step(live)
    for (q, _), r in zip(jobs, runs):
        assert r.result().token_ids == _ar(runtime, q, 16)
    return lengths


@pytest.mark.parametrize("verify,drafts", [((1.0,) * 40, True), (tuple(1.0 + r for r in range(40)), False)])
def test_a_batch_drafts_what_its_verification_costs_allow(runtime, verify, drafts):
    """Goodput pricing: where a forward's cost is flat in its rows the batch drafts; where every row
    costs a whole step, no draft can pay and each request decodes plainly. Outputs stay plain greedy."""
    lengths = _batched_lengths(runtime, verify)
    assert lengths and (max(lengths) > 0) == drafts


@pytest.mark.parametrize("steps,drafts", [({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.02}, True),
                                          ({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, False)])
def test_a_batch_on_batched_graphs_is_priced_by_their_row_buckets(runtime, monkeypatch, steps, drafts):
    """Where the batch replays batched graphs (their step costs by row bucket, timed at warm-up), every
    request feeds the bucket's rows: a flat table drafts, a table whose step grows with its rows turns
    speculation off (the profile's flat verify table notwithstanding); outputs stay plain greedy."""
    asked = []
    monkeypatch.setattr(runtime.lm.backbone, "batch_step_costs", lambda n: asked.append(n) or steps, raising=False)
    lengths = _batched_lengths(runtime, (1.0,) * 40, most=7)  # the eager pricing alone would draft
    assert lengths and (max(lengths) > 0) == drafts and asked and max(asked) == 6


def test_warm_captures_every_skip_set_a_request_may_draft_with(runtime, monkeypatch):
    """A server's startup warms the routing prefill and every record's skip set: those its decisions draft
    with and those a request asking for knn-skip or ssd-static would (the backbone captures them:
    tests/engine/test_graphs.py); 0 graphs without CUDA graphs."""
    got = {}

    def warm_graphs(pooling=None, max_len=1, skips=(), features=(), trees=False):
        got.update(pooling=pooling, skips=tuple(skips), features=tuple(features))
        return 7

    monkeypatch.setattr(runtime.engine.backbone, "warm_graphs", warm_graphs)
    assert runtime.warm() == 7
    assert got["pooling"] == runtime.profile.index.pooling
    assert got["skips"] == runtime.profile.skip_sets() and got["skips"]
    assert got["features"] == runtime.features  # the slot every request with a head gets: none here
    monkeypatch.undo()
    assert runtime.warm() == 0  # the CPU: no graphs
