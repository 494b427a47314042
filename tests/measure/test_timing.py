"""The paired-block race on a tiny model: same tokens for ar and every drafter, blocks, EOS, resume."""

import pytest

from adaptive.drafters.cascade import CascadePlan
from adaptive.engine.skip import SkipSet
from adaptive.measure.interval import bootstrap_speedup
from adaptive.measure.timing import Candidate, RaceConfig, race_candidates, time_prompt
from tests.conftest import tiny_lm

PROMPT = [5, 9, 12, 5, 9, 12, 5, 9, 30, 31]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def _candidates():
    return {"lookup": Candidate("pld", 3), "candidate": Candidate("ssd", 2, skip=SkipSet((1, 2))),
            "cascade": Candidate("cascade", 3, cascade=CascadePlan(split=0, draft_len=3, max_split=0))}


def test_time_prompt_decodes_the_same_tokens_block_by_block(lm):
    blocks = []
    tally = time_prompt(lm, PROMPT, _candidates(), lambda: ["lookup", "candidate", "cascade"],
                        lambda ar, secs: blocks.append((ar, secs)), block_tokens=4, max_tokens=13, eos=set())
    # 12 tokens after the first one, in blocks of 4: three blocks, each timed for ar and every drafter
    assert len(blocks) == 3 and all(set(s) == {"lookup", "candidate", "cascade"} and a > 0 for a, s in blocks)
    for name, t in tally.items():
        assert t["tokens"] == 12 and t["blocks"] == 3 and t["prompts"] == 1
        assert t["same"] == 3, name  # greedy fp32: every block's tokens equal ar's
        assert t["steps"] >= 1 and t["accepted"] <= t["drafted"]
        assert t["seconds"] == pytest.approx(sum(s[name] for _, s in blocks))
        assert t["ar_seconds"] == pytest.approx(sum(a for a, _ in blocks))


def test_time_prompt_stops_after_an_eos_block_and_when_nothing_is_active(lm):
    from adaptive.engine.config import GenerationConfig
    from tests.helpers.decoding import decode_ids

    out = decode_ids(lm.backbone, PROMPT, GenerationConfig(max_new_tokens=13))
    # out[0] comes from the prefill; blocks of 4 hold out[1:5], out[5:9], out[9:13]
    eos = {out[5]}  # as if out[5] ended the text: the second block is the last one timed
    blocks = []
    time_prompt(lm, PROMPT, {"lookup": Candidate("pld", 3)}, lambda: ["lookup"],
                lambda ar, secs: blocks.append(secs), block_tokens=4, max_tokens=13, eos=eos)
    assert len(blocks) == (1 if out[5] in out[1:5] else 2)
    blocks.clear()
    time_prompt(lm, PROMPT, {"lookup": Candidate("pld", 3)}, lambda: [], lambda ar, secs: blocks.append(secs),
                block_tokens=4, max_tokens=13, eos=set())
    assert blocks == []


def test_race_candidates_replays_a_checkpoint_without_timing(lm, monkeypatch):
    from adaptive.measure import timing

    rc = RaceConfig(block_tokens=4, max_tokens=9, prompts=2, min_blocks=2, margin=0.02, level=0.9, seed=0,
                    min_prompts=1)
    lines = []
    first = race_candidates(lm, [PROMPT, PROMPT[::-1]], _candidates(), rc, on_prompt=lines.append)
    assert 1 <= len(lines) <= 2 and set(first) == {"lookup", "candidate", "cascade"}
    for role, m in first.items():
        assert m.role == role and m.interval is not None and m.interval.low <= m.speedup <= m.interval.high
        assert m.repeats == m.interval.blocks == sum(1 for rec in lines for _, s in rec["blocks"] if role in s)
    monkeypatch.setattr(timing, "time_prompt", lambda *a, **k: pytest.fail("timed again"))
    again = race_candidates(lm, [PROMPT, PROMPT[::-1]][: len(lines)], _candidates(), rc, done=lines)
    assert again == first


def test_race_candidates_gives_each_prompt_its_own_table_and_vocabulary(lm, monkeypatch):
    from adaptive.drafters.ngram import build_bigram_table
    from adaptive.measure import timing

    rc = RaceConfig(block_tokens=4, max_tokens=9, prompts=2, min_blocks=2, margin=0.02, level=0.9, seed=0,
                    min_prompts=1)
    tables = [build_bigram_table([[1, 2, 1, 2]]), build_bigram_table([[3, 4, 3, 4]])]
    seen = []

    def fake_time_prompt(lm, prompt, candidates, active, on_block, *, bigram, vocab, **kw):
        seen.append((prompt, bigram, vocab))
        on_block(1.0, {"lookup": 0.5})
        return {}

    monkeypatch.setattr(timing, "time_prompt", fake_time_prompt)
    cands = {"lookup": Candidate("pld", 3)}
    vocabs = ["v0", "v1"]
    race_candidates(lm, [PROMPT, PROMPT[::-1]], cands, rc, bigram=tables, vocab=vocabs)
    assert seen == [(PROMPT, tables[0], "v0"), (PROMPT[::-1], tables[1], "v1")]
    seen.clear()  # a resumed race: the second prompt still gets the second table; one vocabulary for all
    race_candidates(lm, [PROMPT, PROMPT[::-1]], cands, rc, bigram=tables, vocab="v",
                    done=[{"blocks": [[1.0, {"lookup": 0.5}]], "tally": {}}])
    assert seen == [(PROMPT[::-1], tables[1], "v")]
    with pytest.raises(ValueError, match="1 bigram tables for 2 raced prompts"):
        race_candidates(lm, [PROMPT, PROMPT[::-1]], cands, rc, bigram=tables[:1])
    with pytest.raises(ValueError, match="1 draft vocabularies for 2 raced prompts"):
        race_candidates(lm, [PROMPT, PROMPT[::-1]], cands, rc, vocab=["v0"])



def test_race_candidates_resamples_by_prompt_fresh_or_resumed(lm, monkeypatch):
    """Each block is recorded under its prompt (a checkpoint's records too): the interval resamples the
    prompts, and a candidate settles only on ``min_prompts`` of them."""
    from adaptive.measure import timing

    rc = RaceConfig(block_tokens=4, max_tokens=9, prompts=3, min_blocks=2, margin=0.02, level=0.9, seed=0,
                    min_prompts=2)
    times = {0: 0.5, 1: 0.9, 2: 0.6}
    prompts = [PROMPT, PROMPT[::-1], PROMPT[1:]]
    lines = []

    def fake_time_prompt(lm, prompt, candidates, active, on_block, **kw):
        t = times[prompts.index(prompt)]
        for _ in range(2):
            on_block(1.0, {"lookup": t})
        return {"lookup": {"tokens": 8, "blocks": 2, "prompts": 1}}

    monkeypatch.setattr(timing, "time_prompt", fake_time_prompt)
    cands = {"lookup": Candidate("pld", 3)}
    m = race_candidates(lm, prompts, cands, rc, on_prompt=lines.append)["lookup"]
    # settled by the first block of the second prompt (the race keeps no later block of a settled candidate)
    _, want = bootstrap_speedup([1.0] * 3, [0.5, 0.5, 0.9], prompts=[0, 0, 1])
    assert len(lines) == 2 and m.verdict == "faster" and m.interval == want
    resumed = race_candidates(lm, prompts, cands, rc, done=lines)["lookup"]
    assert resumed.interval == want


def test_a_block_that_captured_graphs_is_decoded_again_from_the_same_state(monkeypatch):
    """A capture is startup work: the block that paid one is timed again, from the state it started at."""
    from types import SimpleNamespace

    from adaptive.measure import timing

    bb = SimpleNamespace(graphs=SimpleNamespace(captures=0))
    cache = SimpleNamespace(length=10)
    calls, capture = [], [True]

    def block(bb_, cache_, tokens, n, draft_len, drafter, copy=None):
        calls.append((cache_.length, list(tokens)))
        captured = capture.pop() if capture else False
        if captured and hasattr(bb_, "graphs"):
            bb_.graphs.captures += 2
        cache_.length += n
        tokens.extend(range(100, 100 + n))
        return (0.5 if captured else 0.01), tokens[-n:], None

    monkeypatch.setattr(timing, "_block", block)
    tokens = [1, 2, 3]
    seconds, out, _ = timing._timed_block(bb, cache, tokens, 4, 2, None)
    assert calls == [(10, [1, 2, 3]), (10, [1, 2, 3])]  # decoded again from the same state
    assert (seconds, out, cache.length, tokens) == (0.01, [100, 101, 102, 103], 14, [1, 2, 3, 100, 101, 102, 103])
    calls.clear()
    assert timing._timed_block(bb, cache, tokens, 4, 2, None)[0] == 0.01 and len(calls) == 1  # no capture: once
    calls.clear()
    capture.append(True)  # no graphs (the CPU, llama.cpp): nothing to count, decoded once
    assert timing._timed_block(SimpleNamespace(), cache, tokens, 1, 1, None)[0] == 0.5 and len(calls) == 1
