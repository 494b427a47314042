"""Two engines in one runtime (adaptive.runtime.engines): the choice's arithmetic on literal costs,
then a two-engine profile of the tiny GGUF (llama.cpp and torch) calibrated, loaded and decoded."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from adaptive.costs import CostModel
from adaptive.errors import ConfigError
from adaptive.profile import ProfileError, is_two_engine, load_profile, read_engines
from adaptive.runtime.engines import EngineEstimate, added_step, choose


def _costs(prefill, verify=(1.0, 1.2, 1.5)) -> CostModel:
    return CostModel((0.0,), (0.0,), 1.0, verify, step_ms=10.0, prefill=prefill)


def test_added_step_prices_joining_a_batch_from_the_verify_table():
    assert added_step((1.0, 1.2, 1.5), 0) == 1.0  # an idle engine: a whole step
    assert added_step((1.0, 1.2, 1.5), 1) == pytest.approx(0.2)  # one more row beside one
    assert added_step((1.0, 1.2, 1.5), 2) == pytest.approx(0.3)
    assert added_step((1.0, 1.2, 1.5), 4) == pytest.approx(0.3)  # past the table: its last increment
    assert added_step((1.0, 1.0, 1.0), 3) == 0.0


def test_choose_takes_the_least_expected_time_and_says_why():
    fast_decode = EngineEstimate("llama.cpp", prefill_s=0.30, decode_s=0.58)
    fast_prefill = EngineEstimate("torch", prefill_s=0.10, decode_s=1.60)
    c = choose([fast_decode, fast_prefill], 100, 64)
    assert c.engine == "llama.cpp" and c.reason == "expected 0.88 s on llama.cpp, 1.70 s on torch"
    long = choose([replace(fast_decode, prefill_s=2.28), replace(fast_prefill, prefill_s=0.77)], 700, 64)
    assert long.engine == "torch" and long.reason == "expected 2.37 s on torch, 2.86 s on llama.cpp"
    d = long.to_dict()
    assert d["estimates"][1] == {"engine": "torch", "prefill_s": 0.77, "decode_s": 1.6, "expected_s": 2.37, "pace": 1.0,
                                 "cached_tokens": 0, "per_token_s": 0.0}
    priced = EngineEstimate("torch", prefill_s=0.10, decode_s=1.60, per_token_s=0.025)  # 64 tokens at 25 ms
    assert priced.seconds_for(10) == pytest.approx(0.35)  # an answer that ended after 10 tokens
    assert choose([fast_decode, replace(fast_decode, engine="torch")], 1, 1).engine == "llama.cpp"  # ties: first
    priced = choose([fast_decode, fast_prefill], 100, 256, "qa", expected_tokens=41.6)  # where answers end
    assert priced.reason == "expected 0.88 s on llama.cpp, 1.70 s on torch (priced as qa, for 42 of 256 tokens)"
    assert priced.to_dict()["expected_tokens"] == 41.6 and d["expected_tokens"] == 64  # None: all it may decode
    sampled = choose([fast_decode, fast_prefill], 100, 64, "qa", temperature=1.0)
    assert sampled.reason.endswith("(priced as qa, sampled: at plain decoding's pace)")
    assert sampled.to_dict()["temperature"] == 1.0 and d["temperature"] == 0.0 and not sampled.greedy
    with pytest.raises(ValueError):
        choose([], 1, 1)


def test_cost_model_prefill_is_interpolated_validated_and_round_trips():
    c = _costs(((100, 50.0), (400, 170.0)))
    assert c.prefill_seconds(40) == pytest.approx(0.020)
    assert c.prefill_seconds(250) == pytest.approx(0.110)
    assert c.prefill_seconds(1000) == pytest.approx(0.410)
    assert CostModel.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    old = c.to_dict()
    del old["prefill"]
    assert CostModel.from_dict(old).prefill == ()  # a profile from before: no prefill times
    with pytest.raises(ValueError, match="no measured prefill"):
        CostModel.from_dict(old).prefill_seconds(10)
    with pytest.raises(ValueError, match="increasing"):
        _costs(((400, 1.0), (100, 2.0)))


# -- a two-engine profile of the tiny GGUF ---------------------------------------------------------

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def two(two_engine_profile):
    return two_engine_profile


def _runtime(two, pace=None, lengths=None, **kw):
    from adaptive.runtime import AdaptiveRuntime, TwoEngineRuntime
    from adaptive.runtime.turns import TurnLock

    out, lms = two
    lock = TurnLock()
    kw.setdefault("prefix_cache", 0)  # the members' backbones are shared by these tests: no entry carries over
    return TwoEngineRuntime({e: AdaptiveRuntime(load_profile(out, e), lm, online=False, model_lock=lock, **kw)
                             for e, lm in lms.items()}, "llama.cpp", pace, lengths)


def _set_costs(rt, llama_prefill_ms_per_token: float, torch_prefill_ms_per_token: float):
    """Literal costs: llama.cpp decodes at 9 ms a token with a steep verify table, torch at 25 ms with
    a flat one; prefill rates as given."""
    for engine, per_token, step, verify in (("llama.cpp", llama_prefill_ms_per_token, 9.0, (1.0, 1.9, 2.3)),
                                            ("torch", torch_prefill_ms_per_token, 25.0, (1.0, 1.04, 1.1))):
        p = rt.runtimes[engine].profile
        p.cost_model = replace(p.cost_model, step_ms=step, prefill=((100, 100 * per_token),), verify=verify)
        p.domains = {n: replace(d, measurements=(), decision=replace(d.decision, drafter="ar", speedup=1.0))
                     for n, d in p.domains.items()}


def test_two_engine_profile_layout_and_members(two):
    out, _ = two
    assert is_two_engine(out) and read_engines(out).engines == ("llama.cpp", "torch")
    assert load_profile(out).model.engine == "llama.cpp"  # the default member
    t = load_profile(out, "torch")
    assert t.model.engine == "torch" and t.path == out / "torch"
    for e in ("llama.cpp", "torch"):
        c = load_profile(out, e).cost_model
        assert c.prefill and all(ms > 0 for _, ms in c.prefill)  # measured by calibration
        if Path("/proc/stat").exists():  # how busy the machine was meanwhile, where its counters are read
            assert c.others_share is not None and 0.0 <= c.others_share <= 1.0
    with pytest.raises(ProfileError, match="not on vllm"):
        load_profile(out, "vllm")


def test_the_members_share_one_model_lock(two):
    """Two engines on one machine run one at a time: a runtime whose members hold their own locks is
    refused, and while one thread holds the shared lock another's request on the other engine waits."""
    import threading

    from adaptive.runtime import AdaptiveRuntime, TwoEngineRuntime
    from tests.conftest import TINY_DOMAINS

    out, lms = two
    with pytest.raises(ValueError, match="share one model_lock"):
        TwoEngineRuntime({e: AdaptiveRuntime(load_profile(out, e), lm, online=False) for e, lm in lms.items()},
                         "llama.cpp")
    rt = _runtime(two)
    assert rt.runtimes["llama.cpp"].model_lock is rt.runtimes["torch"].model_lock
    done = threading.Event()
    with rt.runtimes["llama.cpp"].model_lock:  # the llama.cpp engine busy in this thread
        def other():
            rt.runtimes["torch"].generate(TINY_DOMAINS["math"][5], max_new_tokens=4)
            done.set()

        t = threading.Thread(target=other)
        t.start()
        assert not done.wait(0.5)  # the torch engine's request waits for it
    t.join(30)
    assert done.is_set()


def test_each_request_runs_on_the_engine_expected_first_and_decodes_losslessly(two):
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    short, long = "what is 2 plus 5? answer:", "hello there friend " * 15
    # short: the prefills differ by little, 16 tokens at 9 ms against 25 ms: llama.cpp
    r = rt.generate(short, max_new_tokens=16)
    assert r.engine == "llama.cpp" and r.engine_choice["engine"] == "llama.cpp"
    long_ids = rt.encode(long)
    # long: the prefill gap (2 ms a token) outweighs 16 tokens' decoding gap (16 ms a token x 16)
    assert len(long_ids) * 2.0 > 16 * 16.0
    r2 = rt.generate(long, max_new_tokens=16)
    assert r2.engine == "torch"
    est = {e["engine"]: e for e in r2.engine_choice["estimates"]}
    assert est["torch"]["expected_s"] < est["llama.cpp"]["expected_s"]
    assert est["torch"]["prefill_s"] == pytest.approx(len(long_ids) * 1e-3, rel=1e-3)
    for res, text in ((r, short), (r2, long)):  # lossless on the engine that decoded it (fp32)
        plain = Engine(two[1][res.engine]).generate(rt.encode(text), GenerationConfig(max_new_tokens=16))
        assert res.token_ids == plain.token_ids
    assert r2.to_dict()["engine"] == "torch" and "engine_choice" in r2.to_dict()


def test_estimate_prices_a_known_domain_at_its_own_pace(two):
    from adaptive.runtime.engines import estimate

    p = load_profile(two[0], "torch")
    p.cost_model = replace(p.cost_model, step_ms=10.0, prefill=((100, 50.0),))
    p.domains = {n: replace(d, measurements=(), decision=replace(d.decision, speedup=2.0 if n == "code" else 1.0))
                 for n, d in p.domains.items()}
    code = estimate(p, 100, 64, domain="code")
    assert code.prefill_s == pytest.approx(0.05) and code.decode_s == pytest.approx(64 * 0.010 / 2.0)
    assert code.per_token_s == pytest.approx(0.010 / 2.0) and code.seconds_for(64) == pytest.approx(code.expected_s)
    assert estimate(p, 100, 64, domain="math").decode_s == pytest.approx(0.64)
    # no domain, or one the profile does not have: the average over domains, by calibration prompts
    average = 64 * 0.010 * (1 / 2.0 + 2 * 1.0) / 3
    assert estimate(p, 100, 64).decode_s == pytest.approx(average)
    assert estimate(p, 100, 64, domain="poetry").decode_s == pytest.approx(average)
    # a sampled request: plain decoding's pace (the races that measured the speedups are greedy)
    assert estimate(p, 100, 64, domain="code", greedy=False).decode_s == pytest.approx(0.64)
    assert estimate(p, 100, 64, greedy=False).decode_s == pytest.approx(0.64)


def test_the_domain_guessed_from_the_prompt_prices_the_choice(two):
    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=1.0, torch_prefill_ms_per_token=1.0)
    code, chat = "def f9(x): return x * 9 + 10", "hello there friend number 9, how are you today?"
    assert rt.guess_domain(rt.encode(code)) == "code" and rt.guess_domain(rt.encode(chat)) == "chat"
    # the torch engine's routed decision in code drafts 4x faster than plain decoding (25 / 4 ms a token
    # against llama.cpp's 9): code goes to torch, chat (plain decoding there) stays on llama.cpp
    t = rt.runtimes["torch"].profile
    t.domains["code"] = replace(t.domains["code"], decision=replace(t.domains["code"].decision, speedup=4.0))
    r = rt.generate(code, max_new_tokens=8, policy="ar")
    assert r.engine == "torch" and r.engine_choice["domain"] == "code"
    assert r.engine_choice["reason"].endswith("(priced as code)")
    r2 = rt.generate(chat, max_new_tokens=8, policy="ar")
    assert r2.engine == "llama.cpp" and r2.engine_choice["domain"] == "chat"
    # without a lexicon (a profile calibrated before it): the average pace, no domain named
    rt.runtimes["llama.cpp"].profile.lexicon = None
    assert rt.guess_domain(rt.encode(code)) is None
    r3 = rt.generate(code, max_new_tokens=8, policy="ar")
    assert r3.engine_choice["domain"] is None and "priced as" not in r3.engine_choice["reason"]
    assert r3.engine == "llama.cpp"  # the average, (25 / 4 + 25 + 25) / 3 ms a token, loses to 9


@pytest.mark.parametrize("prefix_cache", [0, 64])
def test_a_conversation_stays_on_the_engine_that_holds_its_history(two, prefix_cache):
    """llama.cpp prefills 5 ms a token and decodes 9, torch 1 and 25: a short first turn goes to
    llama.cpp; the second (the first, its reply and a new turn) would go to torch whole, but with
    the first turn's keys cached on llama.cpp only its new part is priced there, and it stays."""
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    rt = _runtime(two, prefix_cache=prefix_cache)
    _set_costs(rt, llama_prefill_ms_per_token=5.0, torch_prefill_ms_per_token=1.0)
    first = [{"role": "user", "content": "what is 2 plus 5? answer:"}]
    r1 = rt.generate(first, max_new_tokens=16, policy="ar")
    assert r1.engine == "llama.cpp" and r1.stats.cached_tokens == 0
    second = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "and 3 plus 8? say it"}]
    r2 = rt.generate(second, max_new_tokens=16, policy="ar")
    held = {e["engine"]: e["cached_tokens"] for e in r2.engine_choice["estimates"]}
    if not prefix_cache:
        assert r2.engine == "torch" and held == {"llama.cpp": 0, "torch": 0}
        return
    assert r2.engine == "llama.cpp" and held["llama.cpp"] == r2.stats.cached_tokens > len(rt.encode(first))
    assert held["torch"] == 0 and "prompt tokens cached" in r2.engine_choice["reason"]
    plain = Engine(two[1]["llama.cpp"]).generate(rt.encode(second), GenerationConfig(max_new_tokens=16))
    assert r2.token_ids == plain.token_ids


def test_a_request_goes_where_the_positions_it_needs_are_free(two):
    """llama.cpp's live caches share one context: while they leave a request too few positions to decode
    to its end the choice keeps it to torch (fits() says some engine can take it), then llama.cpp again."""
    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    ids = rt.encode("what is 2 plus 5? answer:")
    cpp = rt.runtimes["llama.cpp"]
    assert rt.choose(len(ids), 16).engine == "llama.cpp" and cpp.fits(len(ids), 16)
    held = cpp.engine.backbone.new_cache(cpp.engine.backbone.max_positions - len(ids) - 16)
    assert not cpp.fits(len(ids), 16) and cpp.fits(1, 1) and rt.fits(len(ids), 16)
    choice = rt.choose(len(ids), 16)
    assert choice.engine == "torch" and [e.engine for e in choice.estimates] == ["torch"]
    r = rt.generate("what is 2 plus 5? answer:", max_new_tokens=16)
    assert r.engine == "torch"
    held.release()
    assert rt.choose(len(ids), 16).engine == "llama.cpp"
    too_long = rt.runtimes["torch"].engine.backbone.max_positions
    assert not rt.fits(too_long, 1) and not cpp.fits(too_long, 1)  # no context holds it
    assert rt.room(ids) == max(m.room(ids) for m in rt.runtimes.values())


def test_a_forced_policy_goes_to_the_member_that_can_decode_it(two, tmp_path):
    """A two-engine profile whose torch member holds an eagle head (``adaptive calibrate --heads`` makes one):
    a request forcing ``eagle`` runs on torch where llama.cpp is expected to finish first, and decodes as
    plain decoding does there; the routed policy still chooses by time. With no head in any member, the
    torch member's refusal (what to train, and where), raised before any prefill; fits() lets such a request
    start, to fail at once rather than wait."""
    import shutil

    from adaptive.distill.heads import HeadConfig
    from adaptive.distill.trainer import distill_head
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from tests.conftest import TINY_DOMAINS

    out, lms = two
    headed = tmp_path / "p"
    shutil.copytree(out, headed)
    distill_head(lms["torch"], headed / "torch", TINY_DOMAINS,
                 HeadConfig(layers=(1, 2, 4), steps=3, new_tokens=12, vocab=32, batch=2, window=32, warmup=2),
                 progress=False, race=False)
    rt = _runtime((headed, lms))
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    short = "what is 2 plus 5? answer:"
    assert rt.runtimes["llama.cpp"].refusal("eagle") is not None and rt.runtimes["torch"].refusal("eagle") is None
    assert rt.decoders("eagle") == ["torch"] and rt.decoders("ar") == ["llama.cpp", "torch"]
    assert rt.generate(short, max_new_tokens=16).engine == "llama.cpp"  # routed: the time decides
    r = rt.generate(short, max_new_tokens=16, policy="eagle")
    assert r.engine == "torch" and r.decision == "eagle"
    assert [e["engine"] for e in r.engine_choice["estimates"]] == ["torch"]
    assert r.engine_choice["unable"] == ["llama.cpp"] and "llama.cpp cannot decode eagle" in r.engine_choice["reason"]
    plain = Engine(lms["torch"]).generate(rt.encode(short), GenerationConfig(max_new_tokens=16))
    assert r.token_ids == plain.token_ids
    ids = rt.encode(short)
    run = rt.prefilling(ids, 16, policy="eagle").advance()  # the server's path
    assert run.engine == "torch" and rt.fits(len(ids), 16, "eagle")
    torch_rt = rt.runtimes["torch"]
    torch_rt.fits = lambda *a, **k: False  # the member that can decode it cannot take it now: it waits
    torch_rt.room = lambda *a, **k: 3
    assert not rt.fits(len(ids), 16, "eagle") and rt.fits(len(ids), 16) and rt.fits(len(ids), 16, "ar")
    assert rt.room(ids, "eagle") == 3 and rt.room(ids) == rt.runtimes["llama.cpp"].room(ids) > 3
    assert r.engine_choice["policy"] == "eagle"

    bare = _runtime(two)  # no head in either member
    _set_costs(bare, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    with pytest.raises(ProfileError, match=r"torch has no distilled eagle drafter"):
        bare.generate(short, max_new_tokens=16, policy="eagle")
    prefilled = []
    for member in bare.runtimes.values():  # refused before any prefill
        member.engine.prefilling = lambda *a, **k: prefilled.append(a)
    with pytest.raises(ProfileError, match="no distilled eagle"):
        bare.prefilling(ids, 16, policy="eagle")
    with pytest.raises(ProfileError, match="no distilled eagle"):
        bare.runtimes["torch"].generate(short, max_new_tokens=16, policy="eagle")
    assert prefilled == []
    assert bare.fits(len(ids), 16, "eagle") and bare.decoders(None) == ["llama.cpp", "torch"]
    assert bare.room(ids, "eagle") == bare.room(ids)  # no member can: sized as any, then refused at its start
    assert bare.runtimes["torch"].fits(len(ids), 16, "eagle")  # one runtime: refused at once, never waiting
    with pytest.raises(ConfigError, match="unknown routing policy"):
        bare.decoders("nope")


def test_steps_take_turns_between_engines_and_the_load_moves_the_choice(two):
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    a = rt.prefilling(rt.encode("what is 3 plus 6? answer:"), max_new_tokens=12).advance()
    b = rt.prefilling(rt.encode("hello there friend " * 15), max_new_tokens=12).advance()
    assert (a.engine, b.engine) == ("llama.cpp", "torch")
    runs = [a, b]
    stepped = []
    while not all(r.done for r in runs):
        deltas = rt.step([r for r in runs if not r.done])
        stepped.append(sum(1 for d in deltas if d))
    assert max(stepped) == 1  # one engine's batch per step
    for run, text in ((a, "what is 3 plus 6? answer:"), (b, "hello there friend " * 15)):
        plain = Engine(two[1][run.engine]).generate(rt.encode(text), GenerationConfig(max_new_tokens=12))
        assert run.result().token_ids == plain.token_ids
    # load: joining torch's running batch adds little (its flat verify table), so a prompt that goes to
    # llama.cpp alone goes to torch while torch decodes (or prefills) another request
    short = rt.encode("what is 4 plus 4? answer:")
    assert rt.choose(len(short), 16).engine == "llama.cpp"
    busy = rt.prefilling(rt.encode("hello there friend " * 15), max_new_tokens=12)  # admitted, still prefilling
    assert busy.engine == "torch"
    c = rt.choose(len(short), 16)
    est = {e.engine: e for e in c.estimates}
    assert c.engine == "torch" and est["torch"].decode_s == pytest.approx(16 * 0.025 * 0.04)
    assert est["llama.cpp"].decode_s == pytest.approx(16 * 0.009)  # llama.cpp idle: whole steps
    run = busy.advance()
    assert rt.choose(len(short), 16).engine == "torch"  # decoding now, still in the load
    while not run.done:
        rt.step([run])
    assert rt.choose(len(short), 16).engine == "llama.cpp"  # done: both idle again


def test_a_prompt_chunk_rides_only_in_its_own_engines_steps(two):
    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    assert rt.carry_chunks  # the torch engine's steps carry chunks
    long = rt.encode("hello there friend " * 15)
    filling = rt.prefilling(long, max_new_tokens=12, chunk=16)
    assert filling.engine == "torch" and filling.task.can_ride
    assert not filling.can_ride  # nothing decodes on torch: no torch step would carry it
    other = rt.prefilling(rt.encode("hello there friend " * 14), max_new_tokens=12).advance()
    assert other.engine == "torch" and filling.can_ride
    deltas = rt.step([other], [filling])  # rides in torch's step
    assert filling.remaining == len(long) - 16 and len(deltas) == 1


def test_the_busy_engine_with_the_least_machine_time_per_request_steps_next(two):
    rt = _runtime(two)
    rt._pass.update({"llama.cpp": 0.030, "torch": 0.004})  # one llama.cpp request's steps against a batch's share
    assert rt._next_engine(["llama.cpp", "torch"]) == "torch"
    rt._pass["torch"] = 0.031
    assert rt._next_engine(["llama.cpp", "torch"]) == "llama.cpp"
    rt._pass.update({"llama.cpp": 0.0, "torch": 5.0})  # llama.cpp was idle: it starts level, not 5 s ahead
    assert rt._next_engine(["torch"]) == "torch" and rt._pass["llama.cpp"] == 5.0


def test_resume_keeps_a_finished_member(two, tmp_path):
    import shutil

    from adaptive.calibrate.runner import calibrate_engines
    from tests.conftest import TINY_DOMAINS, tiny_settings

    out, lms = two
    part = tmp_path / "p"
    shutil.copytree(out / "llama.cpp", part / "llama.cpp")  # interrupted after the first member
    assert not is_two_engine(part)
    logs = []
    calibrate_engines(lms, TINY_DOMAINS, part, tiny_settings(), resume=True, progress=False, log=logs.append)
    assert any("keeping the llama.cpp profile" in m for m in logs)
    assert is_two_engine(part) and load_profile(part, "torch").model.engine == "torch"


def test_bench_runs_the_two_engine_methods_and_checks_each_on_its_engine(two, monkeypatch):
    import adaptive.bench.runner as runner
    from adaptive.bench.data import BenchPrompt
    from adaptive.bench.runner import BenchSettings, run_bench
    from tests.conftest import TINY_DOMAINS

    out, lms = two
    monkeypatch.setattr(runner, "load_model", lambda *a, **kw: lms["torch"])  # the tiny model is built in-process
    prompts = [BenchPrompt("a", "math", "math", (TINY_DOMAINS["math"][5],)),
               BenchPrompt("b", "chat", "chat", (TINY_DOMAINS["chat"][5] * 6,))]
    report = run_bench(lms["llama.cpp"], prompts, ["ar", "engines", "torch-ar", "torch-knn-ssd"],
                       BenchSettings(max_new_tokens=8, warmup=0), load_profile(out), progress=False)
    runs = {(r["id"], r["method"]): r for r in report["runs"]}
    for pid in ("a", "b"):
        e = runs[(pid, "engines")]
        assert e["engine"] in ("llama.cpp", "torch") and e["engine_reason"].startswith("expected ")
        assert set(e["expected_s"]) == {"llama.cpp", "torch"}
        assert e["identical"] is True  # against plain decoding on the engine that ran it (fp32 tiny model)
        assert runs[(pid, "torch-knn-ssd")]["identical"] is True
    assert {runs[(p, "engines")]["engine"] for p in ("a", "b")} <= {"llama.cpp", "torch"}
    assert report["results"]["engines"]["aggregate_tokens_per_s"] > 0


def test_bench_refuses_the_two_engine_methods_without_a_two_engine_profile(tiny_profile, tiny_model_dir):
    from adaptive.bench.runner import BenchSettings, run_bench
    from adaptive.errors import ConfigError
    from adaptive.models import load_model

    with pytest.raises(ConfigError, match="two-engine profile"):
        run_bench(load_model(str(tiny_model_dir), dtype="float32"), [], ["ar", "engines"],
                  BenchSettings(max_new_tokens=4, warmup=0), load_profile(tiny_profile),
                  progress=False)


def test_one_engine_calibration_refuses_a_two_engine_profile(two):
    from adaptive.calibrate.runner import calibrate
    from tests.conftest import TINY_DOMAINS, tiny_settings

    out, lms = two
    with pytest.raises(ProfileError, match="is a two-engine profile: calibrate one of its engines into"):
        calibrate(lms["torch"], TINY_DOMAINS, out, tiny_settings(), progress=False)
    assert is_two_engine(out) and not (out / "profile.json").exists()


def test_a_failed_step_names_only_its_own_engines_requests(two, monkeypatch):
    from adaptive.errors import StepFailed

    rt = _runtime(two)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    a = rt.prefilling(rt.encode("what is 3 plus 6? answer:"), max_new_tokens=12).advance()
    b = rt.prefilling(rt.encode("hello there friend " * 15), max_new_tokens=12).advance()
    assert (a.engine, b.engine) == ("llama.cpp", "torch")

    def boom(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(rt.runtimes["torch"], "step", boom)
    with pytest.raises(StepFailed) as info:
        while True:  # the engines take turns: llama.cpp's steps go on until torch's turn fails
            rt.step([b, a])
    assert info.value.decodings == (0,) and info.value.riders == ()
    assert isinstance(info.value.cause, RuntimeError) and not a.done


def test_one_member_served_alone_keeps_its_overlay_where_the_pair_would(two, monkeypatch, tmp_path):
    """`serve --engine torch --online-path FILE` on a two-engine profile learns into FILE.torch, as
    both engines served together do and as `profile show --engine torch --online-path FILE` reads."""
    from adaptive.runtime import AdaptiveRuntime, OnlineSettings
    from adaptive.runtime.engines import open_runtime

    out, _ = two
    seen = {}
    monkeypatch.setattr(AdaptiveRuntime, "from_profile", classmethod(lambda cls, d, **kw: seen.update(dir=d, **kw)))
    open_runtime(out, engine="torch", online=OnlineSettings(path=tmp_path / "learned"))
    assert seen["dir"] == out / "torch" and seen["online"].path == tmp_path / "learned.torch"
    open_runtime(out, engine="torch", online=False)
    assert seen["online"] is False


def test_the_llama_cpp_member_gets_a_context_of_its_own_size(two, monkeypatch):
    """Its KV cache is allocated whole: the member's is MEMBER_CONTEXT positions by default (requests that
    do not fit go to torch, whose caches are each request's own); ``context=None`` keeps the model's."""
    from adaptive.runtime import engines
    from adaptive.runtime.engines import MEMBER_CONTEXT, TwoEngineRuntime

    out, lms = two
    asked = {}

    def load(spec, engine, context=None, **kw):
        asked[engine] = context
        return lms[engine]

    monkeypatch.setattr(engines, "load_model", load)
    TwoEngineRuntime.from_profile(out, online=False).close()
    assert asked == {"llama.cpp": MEMBER_CONTEXT, "torch": None}
    TwoEngineRuntime.from_profile(out, online=False, context=None).close()
    assert asked == {"llama.cpp": None, "torch": None}


def _pace(**kw):
    from adaptive.runtime.pace import PaceLearner, PaceSettings

    return PaceLearner(PaceSettings(**{"explore": False, "min_tokens": 1, **kw}))


def test_a_request_alone_teaches_its_engine_the_pace_it_decoded_at(two):
    """Measured decoding time over its price: the learner gets the request's own figures, once."""
    import math

    pace = _pace(noise_sd=10.0, engine_sd=10.0)  # wide: the tiny model's ratio is far from 1, and not clipped
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    code = "def f9(x): return x * 9 + 10"
    r = rt.generate(code, max_new_tokens=12)
    assert r.engine == "llama.cpp" and r.engine_choice["domain"] == "code"
    assert [e["pace"] for e in r.engine_choice["estimates"]] == [1.0, 1.0]  # nothing learned before it
    decoded = r.stats.tokens - 1  # after the prefill's token
    assert decoded >= 1 and decoded == r.stats.decoded_tokens
    expected = decoded * 0.009  # 9 ms a token, plain decoding in every domain (_set_costs)
    actual = r.stats.total_time - r.stats.prefill_time
    st = pace.state()
    assert st["llama.cpp"]["requests"] == 1 and st["llama.cpp"]["domains"]["code"]["requests"] == 1
    assert "torch" not in st
    m_e = math.log(actual / expected) / (1 + 1)  # noise_sd = engine_sd: one request counts as the prior
    assert pace.factor("llama.cpp") == pytest.approx(math.exp(m_e), rel=1e-6)
    # the next choice prices llama.cpp with it, and says so
    c = rt.choose(len(rt.encode(code)), 12, "code")
    est = {e.engine: e for e in c.estimates}
    assert est["llama.cpp"].pace == pytest.approx(pace.factor("llama.cpp", "code"))
    assert est["llama.cpp"].decode_s == pytest.approx(12 * 0.009 * est["llama.cpp"].pace)
    assert est["torch"].pace == 1.0


def test_pace_key_keeps_sampled_requests_apart_by_temperature():
    from adaptive.runtime.engines import pace_key

    assert pace_key("torch", "qa", 0.0) == ("torch", "qa") and pace_key("torch", None, 0.0) == ("torch", None)
    assert pace_key("torch", "qa", 0.7) == ("torch@t0.7", "qa@t0.7")
    assert pace_key("llama.cpp", None, 1.0) == ("llama.cpp@t1", None)


def test_shared_and_unrouted_requests_teach_nothing_and_sampled_ones_teach_apart(two):
    pace = _pace()
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    ar = rt.generate("what is 2 plus 5? answer:", max_new_tokens=8, policy="ar")  # not the priced decision
    assert ar.stats.decoded_tokens >= 1  # it could have taught
    assert pace.state() == {}
    sampled = rt.generate("what is 2 plus 5? answer:", max_new_tokens=8, temperature=0.8, seed=1)
    assert sampled.stats.decoded_tokens >= 1 and sampled.engine_choice["temperature"] == 0.8
    domain = sampled.engine_choice["domain"]
    assert set(pace.state()) == {f"{sampled.engine}@t0.8"}  # the greedy requests' factors untouched
    learned = pace.state()[f"{sampled.engine}@t0.8"]
    assert learned["requests"] == 1 and set(learned["domains"]) == ({f"{domain}@t0.8"} if domain else set())
    pace = _pace()  # the rest as before, on a learner that has seen nothing
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    # two requests live together (a server's batch): neither had the machine to itself
    a = rt.prefilling(rt.encode("what is 3 plus 6? answer:"), max_new_tokens=8).advance()
    b = rt.prefilling(rt.encode("hello there friend " * 15), max_new_tokens=8).advance()
    while not (a.done and b.done):
        rt.step([r for r in (a, b) if not r.done])
    assert a.result().stats.decoded_tokens >= 1 and b.result().stats.decoded_tokens >= 1
    assert pace.state() == {}
    # alone again, through the server's path: prefilling, then steps
    c = rt.prefilling(rt.encode("hello there friend " * 15), max_new_tokens=8).advance()
    while not c.done:
        rt.step([c])
    assert pace.state()[c.engine]["requests"] == 1


def test_a_request_beside_a_background_measurement_teaches_nothing(two, monkeypatch):
    """The online learner's races take turns on the model: a request whose life saw one run, or saw its
    measured seconds grow, did not have the machine to itself."""
    pace = _pace()
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    seen = iter([(0.0, False), (0.4, False),  # a race block ran during the first request
                 (0.4, False), (0.4, True),  # one was running when the second ended
                 (0.4, False), (0.4, False)])  # nothing beside the third
    monkeypatch.setattr(rt, "_measuring", lambda: next(seen))
    for expected in (0, 0, 1):
        r = rt.generate("what is 2 plus 5? answer:", max_new_tokens=8)
        assert r.stats.decoded_tokens >= 1
        assert pace.state().get("llama.cpp", {}).get("requests", 0) == expected


def test_a_learned_pace_moves_the_choice(two):
    """The calibrated price sends a short prompt to llama.cpp; once torch's requests are measured to
    decode at a quarter of their price (and llama.cpp's at theirs), torch wins it."""
    pace = _pace(engine_sd=1.0, noise_sd=1.0)
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=1.0, torch_prefill_ms_per_token=1.0)
    ids = rt.encode("what is 2 plus 5? answer:")
    assert rt.choose(len(ids), 32).engine == "llama.cpp"  # 9 ms a token against 25
    for _ in range(20):
        pace.observe("torch", None, expected_s=1.0, actual_s=0.25, tokens=32)
        pace.observe("llama.cpp", None, expected_s=1.0, actual_s=1.0, tokens=32)
    c = rt.choose(len(ids), 32)
    est = {e.engine: e for e in c.estimates}
    assert c.engine == "torch" and est["torch"].pace == pytest.approx(0.25, rel=0.1)
    assert est["llama.cpp"].pace == pytest.approx(1.0)
    assert c.to_dict()["estimates"][0]["pace"] == pytest.approx(est[c.estimates[0].engine].pace, abs=1e-4)


def test_online_learning_reports_the_pace_and_no_online_learns_none(two):
    from adaptive.runtime.engines import _Learners

    pace = _pace()
    pace.observe("torch", "code", expected_s=1.0, actual_s=0.5, tokens=16)
    state = _Learners({"llama.cpp": _FakeLearner(), "torch": _FakeLearner()}, "llama.cpp", pace).state()
    assert state["pace"]["torch"]["requests"] == 1 and state["requests"] == 0
    assert "pace" not in _Learners({"llama.cpp": _FakeLearner()}, "llama.cpp").state()
    assert _runtime(two).pace is None
    lengths = _lengths()
    lengths.observe("code", 12, "length")
    state = _Learners({"llama.cpp": _FakeLearner()}, "llama.cpp", None, lengths).state()
    assert state["lengths"] == {"requests": 1, "stopped": 0, "domains": {"code": {"requests": 1, "stopped": 0}}}


class _FakeLearner:
    def state(self) -> dict:
        return {"requests": 0}


def _lengths(min_requests=2):
    from adaptive.runtime.lengths import LengthLearner, LengthSettings

    return LengthLearner(LengthSettings(window=50, min_requests=min_requests))


def test_every_finished_request_teaches_where_its_answer_ended(two):
    """Greedy or sampled, alone or beside another, streamed or stepped: each finished request records its
    new tokens and how it ended, under the domain it was priced as."""
    lengths = _lengths()
    rt = _runtime(two, lengths=lengths)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    code = "def f9(x): return x * 9 + 10"
    r = rt.generate(code, max_new_tokens=12)
    s = rt.generate(code, max_new_tokens=5, temperature=0.8, seed=1)
    assert r.engine_choice["domain"] == "code" and r.engine_choice["expected_tokens"] == 12.0  # nothing yet
    a = rt.prefilling(rt.encode("what is 3 plus 6? answer:"), max_new_tokens=8).advance()
    b = rt.prefilling(rt.encode(code), max_new_tokens=6).advance()
    while not (a.done and b.done):
        rt.step([x for x in (a, b) if not x.done])
    results = [r, s, a.result(), b.result()]
    st = lengths.state()
    assert st["requests"] == 4
    assert st["stopped"] == sum(x.finish_reason != "length" for x in results)
    assert st["domains"]["code"]["requests"] == 3  # r, s and b; a's domain is the lexicon's guess
    want = [(len(x.token_ids), x.finish_reason != "length") for x in (r, s, b.result())]
    from adaptive.runtime.lengths import expected_tokens

    for cap in (3, 8, 100):  # the code domain's own record: exactly these three requests
        assert lengths.expected("code", cap) == pytest.approx(expected_tokens(want, cap))
    assert _runtime(two).lengths is None  # nothing learns without a learner


def test_where_answers_end_moves_the_choice(two):
    """A 300-token prompt capped at 256 new tokens is priced for all 256: llama.cpp's faster decoding wins
    (3 ms a prompt token and 9 a new one, against 1 and 25). Once the domain's answers are seen to end
    after 10 tokens, torch's faster prefill does."""
    lengths = _lengths()
    rt = _runtime(two, lengths=lengths)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    before = rt.choose(300, 256, "code")
    assert before.engine == "llama.cpp" and before.expected_tokens == 256.0
    for _ in range(2):
        lengths.observe("code", 10, "eos")
    after = rt.choose(300, 256, "code")
    est = {e.engine: e for e in after.estimates}
    assert after.engine == "torch" and after.expected_tokens == pytest.approx(10.0)
    assert est["torch"].decode_s == pytest.approx(10 * 0.025) and est["llama.cpp"].decode_s == pytest.approx(0.09)
    assert "for 10 of 256 tokens" in after.reason
    assert rt.choose(300, 256, "summarization").engine == "torch"  # a domain not seen: every request's record


def test_a_stream_is_no_load_but_shares_the_machine_with_a_request_admitted_beside_it(two):
    from adaptive.runtime import RuntimeResult

    pace = _pace()
    rt = _runtime(two, pace)
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    short = rt.encode("what is 4 plus 4? answer:")
    alone = rt.stream("what is 2 plus 5? answer:", max_new_tokens=8)
    next(alone)  # started: streams run one at a time on the model, so the choice prices no batch
    est = {e.engine: e for e in rt.choose(len(short), 16).estimates}
    assert est["llama.cpp"].decode_s == pytest.approx(16 * 0.009)
    assert isinstance(list(alone)[-1], RuntimeResult)
    assert pace.state()["llama.cpp"]["requests"] == 1  # it ran alone
    first = rt.stream("what is 2 plus 5? answer:", max_new_tokens=8)
    next(first)
    beside = rt.prefilling(short, max_new_tokens=8).advance()  # admitted while the stream is live
    while not beside.done:
        rt.step([beside])
    list(first)
    before = pace.state()
    assert before["llama.cpp"]["requests"] == 1 and "torch" not in before  # neither had the machine to itself
    left = rt.stream("what is 2 plus 5? answer:", max_new_tokens=8)
    next(left)
    left.close()  # its client went away: it teaches nothing, and is no longer live
    assert pace.state() == before
    rt.generate("what is 2 plus 5? answer:", max_new_tokens=8)
    assert pace.state()["llama.cpp"]["requests"] == 2  # alone again
    with pytest.raises(ConfigError, match="unknown routing policy"):
        rt.stream("what is 2 plus 5? answer:", max_new_tokens=8, policy="nope")  # checked when called


def test_adaptive_open_gives_the_runtime_the_profile_describes(two, tiny_profile, tiny_model_dir, monkeypatch):
    import warnings

    import adaptive
    from adaptive.runtime import AdaptiveRuntime, TwoEngineRuntime
    from adaptive.runtime import engines as engines_module
    from adaptive.runtime import runtime as runtime_module

    out, lms = two

    def loaded(spec, engine="auto", **kw):  # the fixture's models (their in-process tokenizer has no file)
        return lms[engine]

    monkeypatch.setattr(engines_module, "load_model", loaded)
    monkeypatch.setattr(runtime_module, "load_model", loaded)
    both = adaptive.open(out, online=False)
    try:
        assert isinstance(both, TwoEngineRuntime) and set(both.runtimes) == {"llama.cpp", "torch"}
    finally:
        both.close()
    one = adaptive.open(tiny_profile, model=str(tiny_model_dir), dtype="float32", online=False)
    assert isinstance(one, AdaptiveRuntime)
    one.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        member = AdaptiveRuntime.from_profile(out, online=False)  # the default member alone, said
    member.close()
    assert any("adaptive.open" in str(w.message) for w in caught)
