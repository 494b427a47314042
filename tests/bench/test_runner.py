"""The benchmark's driver (:mod:`adaptive.bench.runner`): the order methods run in on each prompt."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from adaptive.bench import runner
from adaptive.bench.data import BenchPrompt
from adaptive.bench.runner import BenchSettings, balanced_order, run_bench
from adaptive.errors import ConfigError


def test_balanced_order_rows_are_a_williams_design():
    assert [balanced_order([0, 1, 2, 3], k) for k in range(4)] == [
        [0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert ["".join(balanced_order("abc", k)) for k in range(7)] == ["abc", "bca", "cab", "cba", "acb", "bac", "abc"]
    assert balanced_order(["ar"], 5) == ["ar"] and balanced_order([], 3) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_over_a_cycle_each_method_takes_each_place_and_follows_each_other_equally_often(n):
    methods = [f"m{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    rows = [balanced_order(methods, k) for k in range(cycle)]
    assert all(sorted(r) == methods for r in rows)
    for place in range(n):
        assert set(Counter(r[place] for r in rows).values()) == {cycle // n}
    follows = Counter(pair for r in rows for pair in pairwise(r))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_the_bench_runs_each_prompt_s_methods_in_its_row_and_lists_them_in_order(tiny, monkeypatch):
    """Runs happen in the balanced order; the report lists each prompt's runs in the asked order, with
    ar first as the reference of the others' equality."""
    called = []
    run = runner._Methods.run

    def logged(self, method, messages, fresh=True, seed=None):
        called.append((messages[-1]["content"], method))
        return run(self, method, messages, fresh, seed)

    monkeypatch.setattr(runner._Methods, "run", logged)
    prompts = [BenchPrompt(f"p{i}", "g", "g", (f"abc abc {i} abc",)) for i in range(3)]
    prompts.append(BenchPrompt("p3", "g", "g", ("abc abc 3 abc", "and again abc")))  # two turns: two items
    methods = ["ar", "pld"]
    seen = []
    report = run_bench(tiny, prompts, methods, BenchSettings(max_new_tokens=6, warmup=0), progress=False,
                       on_run=seen.append)
    assert [m for _, m in called] == [m for k in range(5) for m in balanced_order(methods, k)]
    ids = ["p0", "p1", "p2", "p3/turn1", "p3/turn2"]
    assert [(r["id"], r["method"]) for r in report["runs"]] == [(i, m) for i in ids for m in methods]
    assert seen == report["runs"] and all(r["identical"] for r in report["runs"])
    assert called[-1][0] == "and again abc" and called[-2][0] == "and again abc"  # the second turn after ar's reply


def test_after_the_warm_up_every_cache_is_emptied_and_cache_keeping_servers_restart():
    from types import SimpleNamespace

    from adaptive.engine.prefix import PrefixStore

    class Held:
        def release(self):
            pass

    class Server:
        def __init__(self, cache_prompt):
            self.settings, self.starts = SimpleNamespace(cache_prompt=cache_prompt), 0

        def start(self):
            self.starts += 1

    methods = runner._Methods.__new__(runner._Methods)  # its state alone: no model needed
    store = PrefixStore(100)
    store.add([1, 2, 3], Held(), 10)
    methods._stores = {"knn-ssd": [store]}
    methods.servers = {"llama-server": Server(True), "llama-server-ngram-mod": Server(False)}
    methods.new_conversation()
    assert store.stats().entries == 0
    assert [s.starts for s in methods.servers.values()] == [1, 0]  # a slot keeps its last prompt: a fresh process


def test_eagle_chain_is_the_eagle_policy_drafting_chains_in_a_runtime_of_its_own():
    chain, eagle = runner.BENCH_METHODS["eagle-chain"], runner.BENCH_METHODS["eagle"]
    assert chain.policy == eagle.policy == "eagle" and eagle.tree and not chain.tree
    assert chain.runtime_key != eagle.runtime_key and chain.needs_profile


def test_a_sampled_bench_seeds_each_prompt_and_compares_no_identity(tiny, monkeypatch):
    """At a temperature above 0 every method samples, each prompt with seed --seed plus its index (the same for
    every method on it): a run is reproduced by its seed, and no output is compared with ar's (the distribution
    tests show losslessness there); methods that decode greedily only are refused before anything runs."""
    seeds = []
    run = runner._Methods.run

    def logged(self, method, messages, fresh=True, seed=None):
        seeds.append((method, seed))
        return run(self, method, messages, fresh, seed)

    monkeypatch.setattr(runner._Methods, "run", logged)
    prompts = [BenchPrompt(f"p{i}", "g", "g", (f"abc abc {i} abc",)) for i in range(3)]
    settings = BenchSettings(max_new_tokens=12, warmup=0, temperature=1.0, seed=7)
    first = run_bench(tiny, prompts, ["ar", "pld"], settings, progress=False)
    assert sorted(seeds) == sorted((m, 7 + k) for k in range(3) for m in ("ar", "pld"))
    assert all(r["identical"] is None and "violation" not in r for r in first["runs"])
    assert first["settings"]["greedy"] is False and first["settings"]["temperature"] == 1.0
    assert first["results"]["pld"]["identical_to_ar"] is None and first["results"]["pld"]["lossless_violations"] == 0
    methods = runner._Methods(tiny, None, BenchSettings(max_new_tokens=24, warmup=0, temperature=1.0), ["ar", "pld"])
    try:
        chat = [{"role": "user", "content": "abc abc 1 abc"}]
        draws = {seed: methods.run("ar", chat, seed=seed)["token_ids"] for seed in range(6)}
        assert methods.run("ar", chat, seed=3)["token_ids"] == draws[3]  # reproduced by its seed
        assert len({tuple(d) for d in draws.values()}) > 1  # and sampled: other seeds, other draws
        greedy_ar = runner._Methods(tiny, None, BenchSettings(max_new_tokens=24, warmup=0), ["ar"]).run("ar", chat)
        assert any(d != greedy_ar["token_ids"] for d in draws.values())
    finally:
        methods.close()
    greedy = run_bench(tiny, prompts, ["ar"], BenchSettings(max_new_tokens=12, warmup=0), progress=False)
    assert greedy["settings"]["greedy"] is True and all(r["identical"] for r in greedy["runs"])
    from adaptive.bench.report import markdown

    table = markdown(first["results"], ["ar", "pld"], sampled=True)
    assert "| sampled: the distribution tests | - |" in table  # no identity compared, no audit run
    with pytest.raises(ConfigError, match="hf decode greedily only"):
        run_bench(tiny, prompts, ["ar", "hf"], settings, progress=False)
    for bad, match in ((dict(temperature=-1.0), "temperature must be >= 0"), (dict(top_p=0.0), "top-p must be")):
        with pytest.raises(ConfigError, match=match):
            BenchSettings(**bad)
