"""benchmarks/mixed_stream_plot.py on a literal report: the cumulative series, the speedups (the
report's own aggregation), the text table, the PNG and its one-line errors."""

import json

import pytest

from adaptive.bench.report import summarize
from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def plot_script():
    return load_benchmark("mixed_stream_plot")


def _run(id_, group, method, new_tokens, tps):
    return {"id": id_, "group": group, "category": group, "method": method, "new_tokens": new_tokens,
            "tokens_per_s": tps, "steps": None, "drafted": None, "accepted": None, "identical": True}


# a mixed stream: code, qa, code, qa; every method on a request before the next
RUNS = [
    _run("c1", "code", "ar", 10, 10.0), _run("c1", "code", "knn-ssd", 10, 20.0),
    _run("q1", "qa", "ar", 30, 15.0), _run("q1", "qa", "knn-ssd", 30, 15.0),
    _run("c2", "code", "ar", 20, 10.0), _run("c2", "code", "knn-ssd", 20, 40.0),
    _run("q2", "qa", "ar", 0, 0.0), _run("q2", "qa", "knn-ssd", 0, 0.0),
]
REPORT = {"model": {"name": "tiny", "dtype": "float32"}, "settings": {"order": "mixed", "max_new_tokens": 30,
          "prompts": 4}, "methods": {"ar": "plain", "knn-ssd": "routed"}, "runs": RUNS}


def test_cumulative_speed_worked_example(plot_script):
    # the docstring's example: 10 tokens in 1 s, 30 in 2 s, then a run with no tokens
    runs = [_run("a", "x", "m", 10, 10.0), _run("b", "x", "other", 5, 1.0), _run("c", "x", "m", 30, 15.0),
            _run("d", "x", "m", 0, 0.0)]
    assert plot_script.cumulative_speed(runs, "m") == pytest.approx([10.0, 40 / 3, 40 / 3])
    assert plot_script.cumulative_speed([_run("a", "x", "m", 0, 0.0)], "m") == [None]
    # the stream: ar 10/1, 40/3, 60/5, 60/5; knn-ssd 10/0.5, 40/2.5, 60/3, 60/3
    assert plot_script.cumulative_speed(RUNS, "ar") == pytest.approx([10.0, 40 / 3, 12.0, 12.0])
    assert plot_script.cumulative_speed(RUNS, "knn-ssd") == pytest.approx([20.0, 16.0, 20.0, 20.0])
    assert plot_script.stream_groups(RUNS, "ar") == ["code", "qa", "code", "qa"]


def test_speedups_are_the_reports_own(plot_script):
    groups, table = plot_script.speedups(REPORT, "ar")
    assert groups == ["code", "qa", "overall"]
    s = summarize(RUNS, ["ar", "knn-ssd"])
    assert table["knn-ssd"] == {"code": s["knn-ssd"]["by_category"]["code"]["speedup"],
                                "qa": s["knn-ssd"]["by_category"]["qa"]["speedup"], "overall": s["knn-ssd"]["speedup"]}
    # code: mean(20, 40) / mean(10, 10) = 3; overall: mean(20, 15, 40, 0) / mean(10, 15, 10, 0) = 75 / 35
    assert table["knn-ssd"]["code"] == pytest.approx(3.0)
    assert table["knn-ssd"]["overall"] == pytest.approx(75 / 35, abs=1e-4)
    assert table["ar"]["overall"] == 1.0
    _, over_knn = plot_script.speedups(REPORT, "knn-ssd")
    assert over_knn["ar"]["code"] == pytest.approx(1 / 3, abs=1e-4)


def test_main_prints_the_table_and_writes_the_png(plot_script, tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(REPORT))
    assert plot_script.main([str(report), str(tmp_path / "out" / "m.png")]) == 0
    out = capsys.readouterr().out
    assert "code" in out and "3.00x" in out and "overall" in out
    assert "4/4" in out and "20.0" in out  # knn-ssd's cumulative speed at the end of the stream
    assert (tmp_path / "out" / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, args, message", [
    (None, [], "no such report file"),
    ("{oops", [], "not a JSON report"),
    (json.dumps({"runs": []}), [], "no runs"),
    (json.dumps(REPORT), ["--baseline", "hf"], "no runs of the baseline method 'hf' (methods: ar, knn-ssd)"),
])
def test_errors_are_one_line_and_exit_2(plot_script, tmp_path, capsys, content, args, message):
    report = tmp_path / "r.json"
    if content is not None:
        report.write_text(content)
    assert plot_script.main([str(report), str(tmp_path / "m.png"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "m.png").exists()
