"""``adaptive bench`` end to end on the tiny model."""

import json

import pytest

from tests.helpers.cli import run, run_ok


def test_bench_every_method_is_lossless_in_fp32(capsys, tiny_model_dir, tiny_profile, data_file, tmp_path):
    out = tmp_path / "report.json"
    md, png = tmp_path / "report.md", tmp_path / "report.png"
    table, err = run_ok(capsys, "bench", "--data", str(data_file), "--profile", str(tiny_profile), "--model",
                        str(tiny_model_dir), "--methods", "ar,hf,hf-pld,hf-early-exit,pld,ssd-static,knn-ssd,"
                        "knn-ssd-fixed,cascade,cascade-fixed", "--max-new-tokens", "10", "--dtype", "float32",
                        "--out", str(out), "--markdown", str(md), "--plot", str(png), "--quiet")
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "model", "settings", "methods", "results", "runs"}
    assert report["machine"]["torch"] and report["machine"]["threads"] >= 1
    res = report["results"]
    assert list(res) == ["ar", "hf", "hf-pld", "hf-early-exit", "pld", "ssd-static", "knn-ssd", "knn-ssd-fixed",
                         "cascade", "cascade-fixed"]
    for m, r in res.items():
        assert set(r) >= {"speedup", "mean_accepted_tokens", "acceptance_rate", "tokens_per_s", "identical_to_ar",
                          "lossless_violations", "by_category"}
        assert r["prompts"] == 6 and r["lossless_violations"] == 0
        assert r["identical_to_ar"], (m, r["differing_prompts"])  # fp32: every method token for token
        assert set(r["by_category"]) == {"math_reasoning", "chat", "code"}
    assert res["ar"]["speedup"] == 1.0 and res["ar"]["mean_accepted_tokens"] == 1.0
    assert res["ar"]["aggregate_speedup"] == 1.0 and all(r["aggregate_tokens_per_s"] > 0 for r in res.values())
    assert all(r["seconds"] > 0 for r in report["runs"])
    assert res["knn-ssd"]["mean_accepted_tokens"] >= 1.0
    knn_runs = [r for r in report["runs"] if r["method"] == "knn-ssd"]
    assert all("applied" in r and "decision" in r for r in knn_runs)
    assert all(r["prefill_time_s"] > 0 for r in report["runs"] if r["method"] in ("ar", "pld", "knn-ssd"))
    assert all(r["prefill_time_s"] is None for r in report["runs"] if r["method"].startswith("hf"))
    assert not any("graph_captures" in r for r in report["runs"])  # no CUDA graphs on a CPU
    assert all(isinstance(r["skip_text"], str) for r in report["runs"] if r.get("decision") == "ssd")
    assert {r["decision"] for r in report["runs"] if r["method"].startswith("cascade")} == {"cascade"}
    assert "| **overall** |" in table and md.read_text().strip() == table.strip()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_all_turns(capsys, tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "r.json"
    run_ok(capsys, "bench", "--data", str(data_file), "--model", str(tiny_model_dir), "--methods", "ar,hf",
           "--per-category", "1", "--all-turns", "--max-new-tokens", "6", "--dtype", "float32", "--out", str(out),
           "--quiet", "--warmup", "0")
    runs = json.loads(out.read_text())["runs"]
    ids = sorted({r["id"] for r in runs})
    assert len(ids) == 6 and all("/turn" in i for i in ids)
    tokens = {r["id"]: r["prompt_tokens"] for r in runs if r["method"] == "ar"}
    for i in ids:
        if i.endswith("turn2"):  # the second turn carries the first turn and ar's reply to it
            assert tokens[i] > tokens[i.replace("turn2", "turn1")]


def test_bench_conversations_with_a_prefix_cache_report_ttft_by_turn(capsys, tiny_model_dir, tiny_profile, data_file,
                                                                       tmp_path):
    """Two turns with --prefix-cache: the routed runtime's second turns start from its own first turns'
    keys (plain decoding, the reference, never caches), outputs stay identical, and the TTFT table
    by turn is printed; --shared-context asks each RAG prompt several times over its shared text."""
    out = tmp_path / "r.json"
    table, _ = run_ok(capsys, "bench", "--data", str(data_file), "--profile", str(tiny_profile), "--model",
                      str(tiny_model_dir), "--methods", "ar,knn-ssd,cascade", "--per-category", "1", "--all-turns",
                      "--prefix-cache", "16", "--max-new-tokens", "6", "--dtype", "float32", "--out", str(out),
                      "--quiet")
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert report["settings"]["prefix_cache_mib"] == 16
    assert all(r["identical"] for r in runs)
    for r in runs:
        assert r["turn"] in (1, 2) and r["ttft_s"] > 0
        if r["method"] == "ar":
            assert r["cached_tokens"] == 0
        elif r["turn"] == 1:  # each method's own cache: at most what prompts share (the chat template's start)
            assert r["cached_tokens"] < r["prompt_tokens"] // 2
        else:  # the first turn and its reply (ar's, which the lossless runs decoded too)
            first = next(x for x in runs if x["method"] == r["method"] and x["id"] == r["id"].replace("2", "1"))
            assert r["cached_tokens"] >= first["prompt_tokens"]
    res = report["results"]["knn-ssd"]
    assert set(res["ttft_by_turn"]) == {"1", "2"} and res["cached_tokens"] > 0
    assert "| method | TTFT turn 1 (s) | TTFT turn 2 (s) | later turns / first | prompt tokens cached |" in table

    rag = tmp_path / "rag.jsonl"
    rag.write_text("".join(json.dumps({"question_id": f"r{i}", "category": cat, "turns": [f"doc {i} says abc abc"]})
                           + "\n" for i, cat in enumerate(["rag", "qa", "summarization"])))
    run_ok(capsys, "bench", "--data", str(rag), "--profile", str(tiny_profile), "--model", str(tiny_model_dir),
           "--methods", "ar,knn-ssd", "--shared-context", "3", "--prefix-cache", "16", "--max-new-tokens", "4",
           "--dtype", "float32", "--out", str(out), "--quiet", "--warmup", "0")
    runs = json.loads(out.read_text())["runs"]
    assert sorted({r["id"] for r in runs}) == ["r0/turn1", "r0/turn2", "r0/turn3", "r2/turn1", "r2/turn2", "r2/turn3"]
    later = [r for r in runs if r["method"] == "knn-ssd" and r["turn"] > 1]
    assert later and all(r["cached_tokens"] > 0 for r in later) and all(r["identical"] for r in runs)


def test_bench_mixed_order_interleaves_the_groups(capsys, tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "r.json"
    run_ok(capsys, "bench", "--data", str(data_file), "--model", str(tiny_model_dir), "--methods", "ar,pld",
           "--order", "mixed", "--max-new-tokens", "4", "--dtype", "float32", "--out", str(out), "--quiet",
           "--warmup", "0")
    report = json.loads(out.read_text())
    assert report["settings"]["order"] == "mixed"
    groups = [r["group"] for r in report["runs"] if r["method"] == "ar"]
    # two prompts of each of three groups, round robin in sorted group order
    assert groups == ["chat", "code", "math_reasoning"] * 2
    # every method on a prompt before the next: the runs go ar, pld, ar, pld, ...
    assert [r["method"] for r in report["runs"]] == ["ar", "pld"] * 6


@pytest.mark.parametrize("args, message", [
    (["--methods", "ar,knn-ssd"], "need --profile"),
    (["--methods", "ar,warp"], "unknown method"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--methods", "ar", "--per-category", "0"], "per-category"),
    (["--methods", "ar", "--order", "shuffled"], "'shuffled' is not one of 'file', 'mixed'"),
])
def test_bench_errors(capsys, tiny_model_dir, data_file, args, message):
    code, _, err = run(capsys, "bench", "--data", str(data_file), "--model", str(tiny_model_dir), "--quiet",
                       "--dtype", "float32", *args)
    assert code != 0 and message in err and "Traceback" not in err


def test_bench_missing_data_file(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "--data", str(tmp_path / "none.jsonl"), "--methods", "ar")
    assert code == 1 and "no such file" in err
