"""The runtime on the tiny model: lossless under routing, result fields, streaming, threads."""

import dataclasses
import threading

import pytest

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.errors import ConfigError
from adaptive.profile import ProfileError, load_profile
from adaptive.runtime import AdaptiveRuntime
from tests.conftest import TINY_DOMAINS


@pytest.fixture(scope="module")
def runtime(tiny_profile, tiny_model_dir):
    """A runtime whose domains draft: math with prompt lookup, the others and the global set with
    layer skipping (the tiny model's timings decide nothing)."""
    from adaptive.models import load_model

    p = load_profile(tiny_profile)
    p.domains = {n: dataclasses.replace(d, pays=True, method="pld" if n == "math" else "ssd")
                 for n, d in p.domains.items()}
    p.global_set = dataclasses.replace(p.global_set, pays=True, method="ssd")
    lm = load_model(str(tiny_model_dir), dtype="float32")
    return AdaptiveRuntime(p, lm, seed=0)


PROMPTS = [TINY_DOMAINS["math"][-1], TINY_DOMAINS["chat"][-1], TINY_DOMAINS["code"][-1], "zz qq xx"]


def _ar(rt, prompt, n=24):
    return Engine(rt.lm).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("method", ["knn-ssd", "cascade", "ssd-static", "ar"])
def test_runtime_greedy_output_equals_plain_decoding(runtime, method):
    for prompt in PROMPTS:
        r = runtime.generate(prompt, max_new_tokens=24, method=method)
        assert r.token_ids == _ar(runtime, prompt), (method, prompt)
        if method == "ar":
            assert r.decision == "ar"
        elif method == "ssd-static":
            assert r.decision == "ssd" and r.info["applied"] == "global"
        elif method == "cascade":
            assert r.decision == "cascade" and r.info["drafter"]["name"] == "cascade"
        else:
            assert r.decision == runtime.profile.domain(r.domain).decision


def test_result_records_the_routing_decision(runtime):
    r = runtime.generate(TINY_DOMAINS["code"][-1], max_new_tokens=16)
    assert r.domain in (*TINY_DOMAINS, None)
    assert r.info["applied"] in (*TINY_DOMAINS, "global")
    assert r.neighbours and all({"domain", "distance"} <= set(n) for n in r.neighbours)
    if r.decision == "ssd":
        assert r.skip == runtime.profile.domain(r.domain).skip.to_text()
    else:
        assert r.decision == "pld" and r.skip is None and r.info["drafter"]["name"] == "ngram"
    assert sum(r.draft_lengths.values()) >= 1
    assert r.info["draft_policy"] == "thompson" and "alpha" in r.info["bandit"]
    assert r.to_dict()["route"]["neighbours"]


def test_stream_yields_the_text_then_the_result(runtime):
    items = list(runtime.stream(TINY_DOMAINS["chat"][-1], max_new_tokens=20))
    *deltas, result = items
    assert all(isinstance(d, str) for d in deltas) and "".join(deltas) == result.text
    assert result.token_ids == _ar(runtime, TINY_DOMAINS["chat"][-1], 20)


def test_sampling_is_reproducible_with_a_seed_and_fixed_draft_lengths(runtime):
    # The bandit's state moves between requests, and with it how the random stream is consumed;
    # with fixed draft lengths a seed reproduces a sampled request exactly.
    fixed = AdaptiveRuntime(runtime.profile, runtime.lm, bandit=False)
    a = fixed.generate("hello there", max_new_tokens=16, temperature=0.8, seed=3)
    b = fixed.generate("hello there", max_new_tokens=16, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids
    assert a.info["draft_policy"].startswith("fixed")


def test_bad_options_are_clear_errors(runtime):
    with pytest.raises(ConfigError, match="method"):
        runtime.generate("x", method="fast")
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
    for (offset, j), ids in got.items():
        if j[1] == 0.0:  # greedy: identical to single-threaded output
            assert ids == expected[j], j
        else:  # sampled: a complete, valid generation
            assert 1 <= len(ids) <= 20 and all(0 <= t < runtime.lm.backbone.vocab_size for t in ids)
    # bounded state: one bandit per (drafting method, domain) at most: knn-ssd, cascade, ssd-static
    assert len(runtime.bandit_state()) <= 3 * (len(TINY_DOMAINS) + 1)


def test_prompt_lookup_domains_are_lossless(runtime):
    # every domain (and the global set) decoded with prompt lookup
    p = dataclasses.replace(runtime.profile)
    p.domains = {n: dataclasses.replace(d, method="pld") for n, d in p.domains.items()}
    p.global_set = dataclasses.replace(p.global_set, method="pld")
    rt = AdaptiveRuntime(p, runtime.lm)
    for prompt in PROMPTS:
        r = rt.generate(prompt, max_new_tokens=24)
        assert r.decision == "pld" and r.info["drafter"]["name"] == "ngram" and r.skip is None
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


def test_cascade_uses_the_domains_table_and_split(runtime):
    """Each domain's cascade drafts with its own bigram table; a profile split puts layer-skip tokens
    first; greedy output stays that of plain decoding; the two-level bandit learns per level."""
    from adaptive.drafters.cascade import CascadeConfig

    p = dataclasses.replace(runtime.profile)
    p.domains = {n: dataclasses.replace(d, cascade=CascadeConfig(split=1, draft_len=4, max_split=2),
                                        skip=d.skip if (d.skip.attn or d.skip.mlp) else d.skip.__class__((1,), ()))
                 for n, d in p.domains.items()}
    for bandit in (False, True):
        rt = AdaptiveRuntime(p, runtime.lm, bandit=bandit)
        for prompt in PROMPTS[:3]:
            r = rt.generate(prompt, max_new_tokens=24, method="cascade")
            assert r.token_ids == _ar(runtime, prompt), (bandit, prompt)
            if r.domain is not None:
                d = r.info["drafter"]
                assert d["statistical"]["bigram_entries"] == len(p.domains[r.domain].bigram)
                assert r.skip == p.domains[r.domain].skip.to_text()
                if not bandit:
                    assert d["split"] == 1 and r.stats.drafted > 0
        if bandit:
            states = [v for k, v in rt.bandit_state().items() if k.startswith("cascade:")]
            assert states and all({"layer_skip", "statistical"} <= set(s) for s in states)
            # some tokens were credited to a level beyond the priors' pseudo-counts
            assert any(s["chosen"] for s in states)


def test_cascade_with_a_profile_made_before_cascades(runtime):
    """A profile without cascade settings or tables: the cascade is prompt lookup alone, still lossless."""
    p = dataclasses.replace(runtime.profile)
    p.domains = {n: dataclasses.replace(d, cascade=None, bigram=None) for n, d in p.domains.items()}
    p.global_set = dataclasses.replace(p.global_set, cascade=None, bigram=None)
    rt = AdaptiveRuntime(p, runtime.lm, bandit=False)
    r = rt.generate("ab ab ab ab ab ab", max_new_tokens=16, method="cascade")
    assert r.info["drafter"]["split"] == 0 and "bigram_entries" not in r.info["drafter"]["statistical"]
    assert r.token_ids == _ar(runtime, "ab ab ab ab ab ab", 16) and r.stats.drafted > 0


def test_knn_skip_with_a_reduced_vocabulary_is_lossless(runtime):
    """Routed layer skipping over each domain's reduced vocabulary (joined with the prompt's tokens):
    greedy output is plain decoding's; reduced_vocab=False keeps the full head."""
    import numpy as np

    p = dataclasses.replace(runtime.profile)
    p.domains = {n: dataclasses.replace(d, reduced_vocab=True, draft_vocab=np.arange(3, 30),
                                        skip=d.skip if (d.skip.attn or d.skip.mlp) else d.skip.__class__((1,), ()))
                 for n, d in p.domains.items()}
    reduced, full = AdaptiveRuntime(p, runtime.lm), AdaptiveRuntime(p, runtime.lm, reduced_vocab=False)
    for prompt in PROMPTS[:3]:
        r = reduced.generate(prompt, max_new_tokens=24, method="knn-skip")
        f = full.generate(prompt, max_new_tokens=24, method="knn-skip")
        assert r.token_ids == f.token_ids == _ar(runtime, prompt), prompt
        if r.domain is not None:
            assert r.decision == "ssd" and r.skip == p.domains[r.domain].skip.to_text()
            prompt_ids = set(runtime.engine.encode(prompt, chat=p.settings.get("chat")))
            assert r.info["drafter"]["draft_vocab"] == len(set(range(3, 30)) | prompt_ids)
            assert "draft_vocab" not in f.info["drafter"]
