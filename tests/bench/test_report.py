"""Benchmark aggregation with literal runs, the table, the chart, prompt loading and method lists."""

import json

import pytest

from adaptive.bench.data import SHARED_QUESTIONS, BenchPrompt, load_bench_prompts, mixed_stream
from adaptive.bench.report import markdown, plot, position_acceptance, summarize
from adaptive.bench.runner import parse_methods
from adaptive.calibrate.sources import PromptFileError
from adaptive.errors import ConfigError

RUNS = [
    # prompt a (qa): ar 10 tok/s; ssd 15 tok/s with 3 steps, 6 drafted, 4 accepted, 0.12 s drafting
    {"id": "a", "group": "qa", "method": "ar", "tokens_per_s": 10.0, "steps": 8, "drafted": 0, "accepted": 0,
     "identical": True},
    {"id": "a", "group": "qa", "method": "ssd", "tokens_per_s": 15.0, "steps": 3, "drafted": 6, "accepted": 4,
     "draft_time_s": 0.12, "identical": True, "violation": False},
    {"id": "a", "group": "qa", "method": "hf", "tokens_per_s": 9.0, "steps": None, "drafted": None,
     "accepted": None, "identical": True, "violation": False},
    # prompt b (rag): ar 20 tok/s; ssd 20 tok/s, 2 steps, 4 drafted, 2 accepted, parted at a near-tie
    {"id": "b", "group": "rag", "method": "ar", "tokens_per_s": 20.0, "steps": 6, "drafted": 0, "accepted": 0,
     "identical": True},
    {"id": "b", "group": "rag", "method": "ssd", "tokens_per_s": 20.0, "steps": 2, "drafted": 4, "accepted": 2,
     "draft_time_s": 0.08, "identical": False, "violation": False},
    {"id": "b", "group": "rag", "method": "hf", "tokens_per_s": 21.0, "steps": None, "drafted": None,
     "accepted": None, "identical": True, "violation": False},
]


def test_summarize_worked_example():
    s = summarize(RUNS, ["ar", "ssd", "hf"])
    # speedup: mean(15, 20) / mean(10, 20) = 17.5 / 15
    assert s["ssd"]["speedup"] == pytest.approx(17.5 / 15, abs=1e-4)
    assert s["ar"]["speedup"] == 1.0 and s["ar"]["mean_accepted_tokens"] == 1.0
    # (accepted + steps) / steps = (6 + 5) / 5; acceptance 6 / 10
    assert s["ssd"]["mean_accepted_tokens"] == pytest.approx(2.2)
    assert s["ssd"]["acceptance_rate"] == pytest.approx(0.6)
    assert s["ssd"]["identical_to_ar"] is False and s["ssd"]["differing_prompts"] == ["b"]
    assert s["ssd"]["lossless_violations"] == 0
    assert s["ssd"]["by_category"]["qa"]["speedup"] == pytest.approx(1.5)
    assert s["ssd"]["by_category"]["rag"]["identical_to_ar"] is False
    assert s["hf"]["mean_accepted_tokens"] is None and s["hf"]["acceptance_rate"] is None
    assert s["hf"]["speedup"] == pytest.approx(1.0)


def test_position_acceptance_worked_example():
    # steps drafted 2, 2 and 1 tokens and kept 2, 0 and 1 (and a plain step: drafted 0, kept 0)
    run = {"draft_lengths": {"2": 2, "1": 1, "0": 1}, "accept_hist": {"2": 1, "0": 2, "1": 1}}
    assert position_acceptance([run]) == [0.6667, 0.5]
    assert position_acceptance([run, run]) == [0.6667, 0.5]  # pooled
    assert position_acceptance([{"draft_lengths": None}]) == []
    s = summarize([{**r, **run} if r["method"] == "ssd" else r for r in RUNS], ["ar", "ssd"])
    assert s["ssd"]["position_acceptance"] == [0.6667, 0.5] and s["ar"]["position_acceptance"] == []
    assert "0.67/0.50" in markdown(s, ["ar", "ssd"])


def test_aggregate_throughput_weighs_each_run_by_its_time():
    """The docstring's example: 60 tokens each; ar took 6 and 3 s, ssd 4 and 3 s."""
    runs = [{"id": i, "group": "g", "method": m, "new_tokens": 60, "tokens_per_s": 60 / t, "seconds": t,
             "steps": None} for m, times in (("ar", (6.0, 3.0)), ("ssd", (4.0, 3.0))) for i, t in zip("ab", times)]
    s = summarize(runs, ["ar", "ssd"])
    assert s["ar"]["aggregate_tokens_per_s"] == pytest.approx(120 / 9, abs=1e-3)
    assert s["ssd"]["aggregate_tokens_per_s"] == pytest.approx(120 / 7, abs=1e-3)
    assert s["ssd"]["aggregate_speedup"] == pytest.approx(9 / 7, abs=1e-4)
    assert s["ssd"]["speedup"] == pytest.approx((15 + 20) / (10 + 20), abs=1e-4)  # the per-prompt mean differs
    assert "| ssd | 17.1 (1.29x) |" in markdown(s, ["ar", "ssd"])
    assert summarize(RUNS, ["ar"])["ar"]["aggregate_tokens_per_s"] is None  # runs without seconds


def test_summarize_over_another_reference():
    s = summarize(RUNS, ["ar", "ssd", "hf"], reference="hf")
    # hf at 9 and 21 tok/s: qa 15 / 9, rag 20 / 21; overall mean(15, 20) / mean(9, 21)
    assert s["ssd"]["by_category"]["qa"]["speedup"] == pytest.approx(15 / 9, abs=1e-4)
    assert s["ssd"]["by_category"]["rag"]["speedup"] == pytest.approx(20 / 21, abs=1e-4)
    assert s["ar"]["by_category"]["qa"]["speedup"] == pytest.approx(10 / 9, abs=1e-4)
    assert s["hf"]["speedup"] == 1.0
    assert s["ssd"]["identical_to_ar"] is False  # equality is still against ar's output


def test_markdown_and_plot(tmp_path):
    s = summarize(RUNS, ["ar", "ssd", "hf"])
    md = markdown(s, ["ar", "ssd", "hf"])
    assert "| qa | 1.00x (10.0) | 1.50x (15.0) | 0.90x (9.0) |" in md
    # 0.2 s of drafting over 10 drafted tokens: 20 ms per draft token
    assert "| ssd | - | 2.20 | 0.60 | - | 20.00 | no (1 prompts) | 0 |" in md  # no seconds: no aggregate; no hists
    plot(s, ["ar", "ssd", "hf"], tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_methods():
    assert parse_methods("knn-ssd,hf") == ["ar", "knn-ssd", "hf"]
    assert parse_methods("hf,ar") == ["ar", "hf"]
    with pytest.raises(ConfigError, match="unknown"):
        parse_methods("ar,turbo")
    with pytest.raises(ConfigError, match="twice"):
        parse_methods("hf,hf")


def test_load_spec_bench_format(tmp_path):
    f = tmp_path / "sb.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", f"follow{i}"]}
            for i, c in enumerate(["writing", "coding", "qa", "qa", "qa", "rag"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_bench_prompts(f)
    assert [p.group for p in ps] == ["mt_bench", "mt_bench", "qa", "qa", "qa", "rag"]
    assert ps[0].turns == ("q0",)
    assert [p.id for p in load_bench_prompts(f, per_category=1)] == ["0", "2", "5"]
    assert [p.id for p in load_bench_prompts(f, per_category=1, skip_first=1)] == ["1", "3"]
    apart = load_bench_prompts(f, group_mt_bench=False)
    assert {p.group for p in apart} == {"writing", "coding", "qa", "rag"}
    assert load_bench_prompts(f, all_turns=True)[0].turns == ("q0", "follow0")
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"prompt": "hi"}\n{"prompt": "yo", "category": "x"}\n')
    assert [p.group for p in load_bench_prompts(plain)] == ["default", "x"]
    with pytest.raises(PromptFileError, match="no prompts selected"):
        load_bench_prompts(f, skip_first=10)
    with pytest.raises(PromptFileError, match=":2"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
        load_bench_prompts(tmp_path / "bad.jsonl")


def test_load_the_shared_context_workload(tmp_path):
    f = tmp_path / "sb.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"text {i}"]}
            for i, c in enumerate(["rag", "qa", "summarization", "writing"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_bench_prompts(f, shared_context=2)
    assert [(p.id, p.group, p.shared) for p in ps] == [("0", "rag", True), ("2", "summarization", True)]
    assert ps[0].turns == (f"text 0\n\n{SHARED_QUESTIONS[0]}", f"text 0\n\n{SHARED_QUESTIONS[1]}")
    with pytest.raises(PromptFileError, match="choose one"):
        load_bench_prompts(f, shared_context=2, all_turns=True)
    with pytest.raises(PromptFileError, match="shared-context must be"):
        load_bench_prompts(f, shared_context=len(SHARED_QUESTIONS) + 1)
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"prompt": "x", "category": "qa"}\n')
    with pytest.raises(PromptFileError, match="in groups rag, summarization"):
        load_bench_prompts(qa, shared_context=1)


def test_ttft_by_turn_and_its_table_worked_example():
    def run(method, id_, turn, ttft, cached, prompt):
        return {"id": id_, "group": "g", "method": method, "tokens_per_s": 10.0, "seconds": 1.0, "new_tokens": 10,
                "steps": None, "turn": turn, "ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": prompt}

    runs = [run("ar", "a/turn1", 1, 0.4, 0, 100), run("ar", "a/turn2", 2, 0.8, 0, 200),
            run("knn-ssd", "a/turn1", 1, 0.4, 0, 100), run("knn-ssd", "a/turn2", 2, 0.1, 150, 200)]
    s = summarize(runs, ["ar", "knn-ssd"])
    assert s["knn-ssd"]["ttft_by_turn"] == {"1": 0.4, "2": 0.1} and s["knn-ssd"]["ttft_s"] == 0.25
    assert (s["knn-ssd"]["cached_tokens"], s["knn-ssd"]["prompt_tokens"]) == (150, 300)
    table = markdown(s, ["ar", "knn-ssd"])
    assert "| ar | 0.400 | 0.800 | 2.000 | 0 of 300 |" in table
    assert "| knn-ssd | 0.400 | 0.100 | 0.250 | 150 of 300 |" in table
    single = summarize([{**r, "turn": None} for r in runs[:1]], ["ar"])
    assert single["ar"]["ttft_by_turn"] == {} and "TTFT turn" not in markdown(single, ["ar"])


def test_mixed_stream_worked_example():
    def p(id_, group):
        return BenchPrompt(id_, group, group, (f"text of {id_}",))

    file_order = [p("q1", "qa"), p("q2", "qa"), p("q3", "qa"), p("c1", "code"), p("m1", "math"), p("m2", "math")]
    stream = mixed_stream(file_order)
    assert [x.id for x in stream] == ["c1", "m1", "q1", "m2", "q2", "q3"]
    assert sorted(stream, key=file_order.index) == file_order  # a reordering: nothing lost, nothing added
    assert mixed_stream([]) == []
    one_group = [p("a", "x"), p("b", "x")]
    assert mixed_stream(one_group) == one_group


def test_mixed_stream_of_a_loaded_file(tmp_path):
    f = tmp_path / "sb.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]}
            for i, c in enumerate(["writing", "coding", "qa", "qa", "qa", "rag", "rag"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # groups mt_bench (0, 1), qa (2, 3, 4), rag (5, 6) -> round robin in sorted group order
    assert [x.id for x in mixed_stream(load_bench_prompts(f))] == ["0", "2", "5", "1", "3", "6", "4"]


def test_each_speedup_comes_with_its_interval_over_prompts():
    """The docstring's example: 15 and 20 tok/s against 10 and 20 on two prompts."""
    s = summarize(RUNS, ["ar", "ssd", "hf"])
    assert s["ssd"]["speedup_interval"] == [1.0, 1.5]  # resampled: b twice, a twice
    assert s["ar"]["speedup_interval"] == [1.0, 1.0]  # against itself
    assert s["ssd"]["by_category"]["qa"]["speedup_interval"] is None  # one prompt: nothing to resample
    md = markdown(s, ["ar", "ssd", "hf"])
    assert "| **overall** | 1.00x (15.0) | 1.17x [1.00, 1.50] (17.5) | 1.00x [0.90, 1.05] (15.0) |" in md
    same = [dict(r, method="ssd2", tokens_per_s=2 * r["tokens_per_s"]) for r in RUNS if r["method"] == "ar"]
    assert summarize(RUNS + same, ["ar", "ssd2"])["ssd2"]["speedup_interval"] == [2.0, 2.0]  # no spread at all


def test_builtin_data_is_the_shipped_domains_a_group_each(tmp_path, monkeypatch):
    """``--data builtin`` (make bench): the shipped domains' prompts, each domain a group, the first of each
    skipped as `make demo` calibrated on them; a file of that name in the working directory is read instead."""
    from adaptive.bench.data import BUILTIN
    from adaptive.calibrate.prompts import builtin_domains

    domains = builtin_domains()
    ps = load_bench_prompts(BUILTIN, per_category=2, skip_first=6)
    assert sorted({p.group for p in ps}) == sorted(domains) and len(ps) == 2 * len(domains)
    math = [p for p in ps if p.group == "math"]
    assert [p.turns[0] for p in math] == domains["math"][6:8] and math[0].id == "math-6"
    monkeypatch.chdir(tmp_path)
    (tmp_path / BUILTIN).write_text("mine\n", encoding="utf-8")  # a text file: a prompt a line
    assert [p.turns[0] for p in load_bench_prompts(BUILTIN)] == ["mine"]
