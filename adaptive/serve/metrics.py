"""The server's counters, rendered in Prometheus' text exposition format (``GET /metrics``).

Thread-safe: the request handlers and the decoding worker update them; :meth:`Metrics.render`
reads a consistent snapshot and hands it to ``prometheus-client`` as a custom collector, whose
exposition writes the text (names, label escaping, number formats). The values live here rather
than in the client's own metric objects because one of ours is not its shape: a summary observed
in bulk (a request's decode time over its tokens, one observation per token).

Series (all prefixed ``adaptive_``):

=====================================  =========  ============================================
``requests_total{endpoint,status}``    counter    finished HTTP requests by endpoint and status
``prompt_tokens_total``                counter    prompt tokens of decoded requests
``generated_tokens_total``             counter    tokens generated
``drafted_tokens_total{domain,drafter}``  counter tokens drafted, by routed domain and drafter
``accepted_tokens_total{domain,drafter}`` counter drafted tokens the target accepted
``verify_steps_total{domain,drafter}`` counter    target forwards after the prefill
``cancelled_requests_total``           counter    requests dropped because their client left
``queue_depth``                        gauge      requests waiting for the model
``running_requests``                   gauge      requests being decoded
``time_per_output_token_seconds``      summary    decode time per generated token (``_sum``, ``_count``)
``time_to_first_token_seconds``        summary    admission to first token (``_sum``, ``_count``)
``batch_size``                         summary    requests verified together per decoding step
``online_measure_seconds_total``       counter    model time the online learner's background races took
``online_measure_waits_total``         counter    times a race block waited for serving to leave it room
``online_head_rounds_total``           counter    eagle-head refinement rounds run on the traffic
``online_head_adoptions_total``        counter    rounds whose refined head was adopted
``online_head_round_seconds_total``    counter    seconds those rounds took
``prefix_cache_bytes{engine}``         gauge      bytes of keys and values the prefix cache keeps
``prefix_cache_budget_bytes{engine}``  gauge      the prefix cache's budget (0: off)
``prefix_cache_entries{engine}``       gauge      finished sequences the prefix cache keeps
``prefix_cache_hits_total{engine}``    counter    requests started from a cached prefix
``prefix_cached_tokens_total{engine}`` counter    prompt tokens not prefilled because they were cached
``prefix_cache_evictions_total{engine}`` counter  entries evicted (the budget, or a new request's room)
=====================================  =========  ============================================

A request routed out of domain counts under ``domain="none"``.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST  # what GET /metrics answers with

_HELP = {
    "requests_total": ("counter", "Finished HTTP requests by endpoint and status."),
    "prompt_tokens_total": ("counter", "Prompt tokens of decoded requests."),
    "generated_tokens_total": ("counter", "Tokens generated."),
    "drafted_tokens_total": ("counter", "Tokens drafted, by routed domain and drafter."),
    "accepted_tokens_total": ("counter", "Drafted tokens the target model accepted."),
    "verify_steps_total": ("counter", "Target forwards after the prefill (verification steps)."),
    "cancelled_requests_total": ("counter", "Requests dropped (queued or decoding) because their client left."),
    "queue_depth": ("gauge", "Requests waiting for the model."),
    "running_requests": ("gauge", "Requests being decoded."),
    "time_per_output_token_seconds": ("summary", "Decode wall time per generated token."),
    "time_to_first_token_seconds": ("summary", "Admission to first generated token."),
    "batch_size": ("summary", "Requests verified together per decoding step (_sum / _count: the mean)."),
    "online_measure_seconds_total": ("counter", "Model time taken by the online learner's background races."),
    "online_measure_waits_total": ("counter", "Times a background race block waited for serving to leave room."),
    "online_head_rounds_total": ("counter", "Eagle-head refinement rounds run on the traffic served."),
    "online_head_adoptions_total": ("counter", "Refinement rounds whose refined head was adopted."),
    "online_head_round_seconds_total": ("counter", "Seconds the head refinement rounds took."),
    "prefix_cache_bytes": ("gauge", "Bytes of keys and values the prefix cache keeps, by engine."),
    "prefix_cache_budget_bytes": ("gauge", "The prefix cache's budget in bytes, by engine (0: off)."),
    "prefix_cache_entries": ("gauge", "Finished sequences the prefix cache keeps, by engine."),
    "prefix_cache_hits_total": ("counter", "Requests started from a cached prefix, by engine."),
    "prefix_cached_tokens_total": ("counter", "Prompt tokens not prefilled because they were cached, by engine."),
    "prefix_cache_evictions_total": ("counter", "Prefix-cache entries evicted, by engine."),
}
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class Metrics:
    """Counters, gauges and summaries by name and labels (names from the table above)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._check(name)
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        self._check(name)
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float, count: int = 1) -> None:
        """A summary's observation: ``value`` (seconds, or requests) over ``count`` events (e.g. tokens)."""
        self._check(name)
        with self._lock:
            self._values[name][(("_", "sum"),)] += value
            self._values[name][(("_", "count"),)] += count

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        """Prometheus' text exposition format, written by ``prometheus-client``."""
        return generate_latest(self._registry).decode("utf-8")

    def collect(self):
        """The metric families now (``prometheus-client``'s collector protocol)."""
        with self._lock:
            snapshot = {k: dict(v) for k, v in self._values.items()}
        for name, (kind, text) in _HELP.items():
            full = f"adaptive_{name}"
            series = snapshot.get(name, {})
            if kind == "summary":
                yield SummaryMetricFamily(full, text, count_value=series.get((("_", "count"),), 0.0),
                                          sum_value=series.get((("_", "sum"),), 0.0))
                continue
            if kind == "counter":
                full = full.removesuffix("_total")  # the client writes the suffix
            keys = [k for k, _ in next(iter(series))] if series else []
            family = _FAMILIES[kind](full, text, labels=keys)
            for labels, v in sorted(series.items()):
                family.add_metric([v for _, v in labels], v)
            if not series and kind == "gauge":
                family.add_metric([], 0.0)
            yield family

    @staticmethod
    def _check(name: str) -> None:
        if name not in _HELP:
            raise KeyError(f"unknown metric {name!r}")
