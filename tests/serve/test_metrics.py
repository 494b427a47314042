"""The Prometheus text the server exposes."""

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaptive.serve.metrics import Metrics


def test_render_counters_gauges_and_summaries():
    m = Metrics()
    m.inc("requests_total", endpoint="chat_completions", status="200")
    m.inc("requests_total", endpoint="chat_completions", status="200")
    m.inc("drafted_tokens_total", 12, domain='we"ird', drafter="ssd")
    m.set("queue_depth", 3)
    m.observe("time_per_output_token_seconds", 0.5, count=10)
    text = m.render()
    assert 'adaptive_requests_total{endpoint="chat_completions",status="200"} 2.0\n' in text
    assert 'adaptive_drafted_tokens_total{domain="we\\"ird",drafter="ssd"} 12.0\n' in text
    assert "adaptive_queue_depth 3.0\n" in text
    assert "adaptive_running_requests 0.0\n" in text  # a gauge never set reads 0
    assert "adaptive_time_per_output_token_seconds_count 10.0\nadaptive_time_per_output_token_seconds_sum 0.5\n" in text
    assert "# TYPE adaptive_requests_total counter" in text
    assert m.value("requests_total", endpoint="chat_completions", status="200") == 2
    parsed = {f.name: f for f in text_string_to_metric_families(text)}  # the client's own parser reads it back
    assert parsed["adaptive_requests"].type == "counter" and parsed["adaptive_batch_size"].type == "summary"
    assert [s.value for s in parsed["adaptive_drafted_tokens"].samples] == [12.0]


def test_unknown_metric_is_an_error():
    with pytest.raises(KeyError):
        Metrics().inc("requests")


def test_counts_from_many_threads_add_up():
    m = Metrics()

    def work():
        for _ in range(1000):
            m.inc("generated_tokens_total")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.value("generated_tokens_total") == 4000
