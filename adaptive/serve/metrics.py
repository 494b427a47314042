"""The server's counters, rendered in Prometheus' text exposition format (``GET /metrics``).

Thread-safe: the request handlers and the decoding worker update them; :meth:`Metrics.render`
reads a consistent snapshot. No client library: the format is a few lines of text.

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
=====================================  =========  ============================================

A request routed out of domain counts under ``domain="none"``.
"""

from __future__ import annotations

import threading
from collections import defaultdict

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
}


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, esc)) + "}"


class Metrics:
    """Counters, gauges and summaries by name and labels (names from the table above)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._check(name)
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] += value

    def set(self, name: str, value: float) -> None:
        self._check(name)
        with self._lock:
            self._values[name][()] = value

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
        """Prometheus text format (version 0.0.4)."""
        with self._lock:
            snapshot = {k: dict(v) for k, v in self._values.items()}
        lines = []
        for name, (kind, text) in _HELP.items():
            full = f"adaptive_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
            series = snapshot.get(name, {})
            if kind == "summary":
                lines.append(f"{full}_sum {_fmt(series.get((('_', 'sum'),), 0.0))}")
                lines.append(f"{full}_count {_fmt(series.get((('_', 'count'),), 0.0))}")
            elif not series and kind == "gauge":
                lines.append(f"{full} 0")
            for labels, v in sorted(series.items()):
                if kind != "summary":
                    lines.append(f"{full}{_labels(labels)} {_fmt(v)}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _check(name: str) -> None:
        if name not in _HELP:
            raise KeyError(f"unknown metric {name!r}")
