"""benchmarks/serve_bench.py's pure parts on literal arrays: prompts dealt out to passes, the waves'
order, per-request times, aggregates by server and group, ours over theirs, and the engine choice's
predictions against measured times. No server, no model."""

import argparse
from types import SimpleNamespace

import pytest

from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("serve_bench")


def prompt(pid, group):
    return SimpleNamespace(id=pid, group=group)


def test_prompts_are_dealt_out_without_repeats(script):
    prompts = [prompt(f"q{i}", "qa") for i in range(1, 5)] + [prompt("m1", "math"), prompt("m2", "math")]
    parts = script.deal(prompts, 2)
    assert [[p.id for p in part] for part in parts] == [["m1", "q1", "q3"], ["m2", "q2", "q4"]]
    three = script.deal(prompts, 3)  # math runs out for the last pass: dealt as far as it goes
    assert [[p.id for p in part] for part in three] == [["m1", "q1", "q4"], ["m2", "q2"], ["q3"]]
    ids = [p.id for part in three for p in part]
    assert sorted(ids) == sorted(p.id for p in prompts) and len(set(ids)) == len(ids)
    assert [[p.id for p in part] for part in script.deal(prompts, 1)] == [["m1", "q1", "m2", "q2", "q3", "q4"]]
    with pytest.raises(ValueError):
        script.deal(prompts, 0)


def test_waves_and_their_order(script):
    assert script.waves([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert script.waves([1, 2, 3], 1) == [[1], [2], [3]]
    assert [script.wave_order(["ours", "peer"], w) for w in range(3)] == [["ours", "peer"], ["peer", "ours"],
                                                                           ["ours", "peer"]]
    assert script.wave_order(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_request_metrics(script):
    m = script.request_metrics(10.0, 10.5, 12.5, 5)
    assert m == {"ttft_s": 0.5, "latency_s": 2.5, "decode_s": 2.0, "tokens": 5, "tokens_after_first": 4}
    one = script.request_metrics(0.0, 0.3, 0.3, 1)  # one token: no pace after it
    assert one["tokens_after_first"] == 0 and one["decode_s"] == 0.0 and one["latency_s"] == 0.3
    none = script.request_metrics(0.0, None, None, 0)  # no text came
    assert none["ttft_s"] is None and none["latency_s"] is None


def rec(server, group, wave, send, first, last, tokens, prompt_tokens=10, script=None):
    return {"server": server, "group": group, "wave": wave, "send": send, "last": last,
            "prompt_tokens": prompt_tokens, **script.request_metrics(send, first, last, tokens)}


def test_aggregate(script):
    rows = [script.request_metrics(0.0, 0.5, 2.5, 5), script.request_metrics(3.0, 3.1, 4.1, 11),
            script.request_metrics(5.0, 5.2, 5.2, 1)]
    a = script.aggregate(rows, 8.0)
    assert a["requests"] == 3 and a["completion_tokens"] == 17 and a["tokens_per_s"] == pytest.approx(17 / 8)
    assert a["ttft_median_s"] == pytest.approx(0.2)
    assert a["pace_tokens_per_s"] == pytest.approx((4 + 10) / (2.0 + 1.0))  # the one-token request adds nothing
    assert a["latency_median_s"] == pytest.approx(1.1)
    empty = script.aggregate([script.request_metrics(0.0, None, None, 0)], 0.0)
    assert empty["requests"] == 0 and empty["tokens_per_s"] is None and empty["pace_tokens_per_s"] is None


def test_summary_by_server_and_group_and_the_ratios(script):
    r = lambda *a: rec(*a, script=script)
    records = [  # one client: one request a wave, the servers alternating
        r("ours", "qa", 0, 0.0, 0.2, 1.0, 9), r("peer", "qa", 0, 1.0, 1.1, 3.0, 9),
        r("peer", "math", 1, 3.0, 3.5, 5.0, 7), r("ours", "math", 1, 5.0, 5.1, 6.0, 7),
    ]
    s = script.summarize(records)
    assert set(s) == {"ours", "peer"}
    assert s["ours"]["all"]["wall_s"] == pytest.approx(2.0) and s["ours"]["all"]["tokens_per_s"] == pytest.approx(8.0)
    assert s["peer"]["all"]["wall_s"] == pytest.approx(4.0) and s["peer"]["all"]["tokens_per_s"] == pytest.approx(4.0)
    assert s["ours"]["all"]["prompt_tokens"] == 20
    assert s["ours"]["groups"]["qa"]["tokens_per_s"] == pytest.approx(9.0)
    assert s["peer"]["groups"]["math"]["pace_tokens_per_s"] == pytest.approx(6 / 1.5)
    v = script.ratios(s, "ours", "peer")
    assert v["all"]["tokens_per_s"] == pytest.approx(2.0)
    assert v["all"]["ttft_median"] == pytest.approx(0.15 / 0.3)
    assert v["groups"]["qa"]["tokens_per_s"] == pytest.approx(9.0 / (9 / 2.0))
    assert v["groups"]["math"]["pace"] == pytest.approx((6 / 0.9) / (6 / 1.5))


def test_a_wave_of_concurrent_requests_counts_its_wall_once(script):
    r = lambda *a: rec(*a, script=script)
    records = [r("ours", "qa", 0, 0.0, 0.5, 2.0, 10), r("ours", "math", 0, 0.1, 0.6, 3.0, 20),
               r("ours", "qa", 1, 5.0, 5.2, 6.0, 5),
               {"server": "ours", "group": "qa", "wave": 1, "send": 5.0, "last": None,  # failed: left out
                **script.request_metrics(5.0, None, None, 0)}]
    assert script.wave_walls(records) == {("ours", 0): pytest.approx(3.0), ("ours", 1): pytest.approx(1.0)}
    s = script.summarize(records)["ours"]
    assert s["all"]["wall_s"] == pytest.approx(4.0) and s["all"]["tokens_per_s"] == pytest.approx(35 / 4.0)
    # by group, the group's own request times (a wave mixes groups): qa 15 tokens in 2.0 + 1.0 s
    assert s["groups"]["qa"]["tokens_per_s"] == pytest.approx(15 / 3.0)
    assert s["groups"]["qa"]["requests"] == 2


def test_predictions_within_twenty_percent(script):
    usage = {"engine": "llama.cpp", "engine_choice": {"engine": "llama.cpp", "estimates": [
        {"engine": "llama.cpp", "expected_s": 0.9}, {"engine": "torch", "expected_s": 1.7}]}}
    assert script.predicted_s(usage) == 0.9
    assert script.predicted_s({"engine": "torch", "engine_choice": None}) is None  # one-engine profile
    assert script.predicted_s(None) is None
    usage["engine_choice"]["estimates"][0].update(prefill_s=0.1, per_token_s=0.01)
    assert script.priced_s(usage, 20) == pytest.approx(0.3)
    older = {"engine_choice": {"engine": "torch", "estimates": [{"engine": "torch", "expected_s": 1.0}]}}
    assert script.priced_s(older, 5) is None  # a server before per_token_s
    share = script.within_share([(1.0, 1.1), (2.0, 1.0), (None, 1.0)])
    assert share == {"requests": 2, "within": 1, "share": 0.5}
    assert script.within_share([(1.2, 1.0), (0.8, 1.0)])["within"] == 2  # the edges count
    assert script.within_share([])["share"] is None


def test_temperatures_parse(script):
    assert script.temperatures("0,0.7,1.0") == [0.0, 0.7, 1.0]
    for bad in ("", "0,0", "3"):
        with pytest.raises(argparse.ArgumentTypeError):
            script.temperatures(bad)
    args = script.parse_args(["--profile", "p", "--data", "d.jsonl", "--clients", "1", "--clients", "8"])
    assert args.clients == [1, 8] and args.temperatures == [0.0, 0.7, 1.0] and args.prompt_cache
