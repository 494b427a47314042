"""How many tokens a request will decode: the lengths its domain's answers had, as traffic shows them.

A two-engine runtime prices a request's decoding by the tokens it will decode
(:mod:`adaptive.runtime.engines`). At admission only its cap is known, ``max_new_tokens`` (a
server's default 256 where the client gives none), and answers often stop well before it:
the embedded model, greedy, 36 held-out Spec-Bench prompts capped at 256 stopped after 19-87
tokens on every QA prompt and after 15-115 tokens on four of six RAG prompts
(``docs/history/2026-11-26-two-engines.md``, "Tenth session"). Priced at the cap, a long RAG prompt goes
to the engine that decodes faster, where its short answer does not pay back the slower prefill.
:class:`LengthLearner` learns each domain's answer lengths from the requests the runtime finishes
and prices a request at the tokens it is expected to decode under its cap.

Terms: a request's **length** ``L``: the new tokens it decoded; **stopped** (finish reason ``eos``
or ``stop``: ``L`` is its own length) or **cut** (``length``: it reached its cap ``c``, so its own
length is at least ``c``, a censored observation). The **expected tokens** of a request capped at
``N``::

    E[min(L, N)] = sum over t = 0 .. N - 1 of S(t),        S(t) = P(L > t)

with ``S`` the Kaplan-Meier product-limit estimate over the domain's recent requests::

    S(t) = product over stop lengths s <= t of (1 - d(s) / r(s))

``d(s)``: the requests that stopped at ``s``; ``r(s)``: those whose length is at least ``s``
(stopped or cut there or later: a cut request counts as still running up to its cut). Past the
longest request seen, ``S`` keeps its last value (requests cut there are priced to run on to
``N``: the cautious side).

Worked example: lengths 10 (stopped), 30 (stopped), 50 (cut), 80 (stopped). ``S(t) = 1`` for
``t < 10``; ``3/4`` from 10 (one of four stopped); ``3/4 * 2/3 = 1/2`` from 30; at 80 one request
is at risk (the cut one left at 50) and stops: ``S = 0`` from 80. Capped at 64:
``10 * 1 + 20 * 3/4 + 34 * 1/2 = 42`` tokens; capped at 256: ``10 + 15 + 50 * 1/2 = 50``.

A domain's own requests price it once it has ``min_requests`` of them; before, all requests
together do (those the lexicon guessed no domain for included); before ``min_requests`` in all,
the cap does (what the choice assumed before anything was learned). Only the last ``window``
requests of each record count: traffic changes. Sampled and greedy, every policy's requests
teach alike: speculation is lossless, so it does not change where an answer ends; a request whose
client left before its end teaches nothing (a slight lean to short answers, where clients leave
long ones). In memory only (a restart learns again).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from adaptive.errors import ConfigError

STOPPED_REASONS = frozenset({"eos", "stop"})  # finish reasons that end an answer by itself; "length" cuts it


@dataclass(frozen=True)
class LengthSettings:
    """``window``: the requests each record keeps (the domain's, and all together);
    ``min_requests``: those a record needs before it prices. Validated on construction
    (:class:`~adaptive.errors.ConfigError` naming the field)."""

    window: int = 200
    min_requests: int = 8

    def __post_init__(self):
        for name in ("window", "min_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LengthSettings.{name} must be a positive integer, not {value!r}")
        if self.min_requests > self.window:
            raise ConfigError(f"LengthSettings.min_requests ({self.min_requests}) must not exceed the window "
                              f"({self.window})")


def expected_tokens(lengths: Iterable[tuple[int, bool]], cap: int) -> float:
    """``E[min(L, cap)]`` by the Kaplan-Meier estimate over ``lengths``, ``(length, stopped)`` pairs
    (``stopped``: the answer ended by itself; else it was cut at that length); ``cap`` when there are none.
    Example (the module's): ``[(10, True), (30, True), (50, False), (80, True)]``, cap 64 -> 42.0."""
    if cap < 0:
        raise ValueError(f"a cap of new tokens is at least 0, not {cap}")
    obs = sorted(lengths)  # by length
    if not obs:
        return float(cap)
    at_risk, survival, total, t = len(obs), 1.0, 0.0, 0  # S(u) = survival for t <= u < the next stop length
    i = 0  # each length's requests together: those cut there are still at risk of its stops, then leave
    while i < len(obs) and t < cap:
        length = obs[i][0]
        stopped = cut = 0
        while i < len(obs) and obs[i][0] == length:
            stopped, cut, i = stopped + obs[i][1], cut + (not obs[i][1]), i + 1
        if stopped:
            end = min(length, cap)
            total += survival * (end - t)
            t = end
            survival *= 1.0 - stopped / at_risk
        at_risk -= stopped + cut
    return total + survival * max(cap - t, 0)


class LengthLearner:
    """Each domain's recent answer lengths (and all domains' together), and the tokens a request
    capped at ``N`` is expected to decode (:meth:`expected`; the module doc). Safe to share
    between threads."""

    def __init__(self, settings: LengthSettings | None = None):
        self.settings = settings or LengthSettings()
        self._all: deque = deque(maxlen=self.settings.window)
        self._domains: dict[str, deque] = {}
        self._lock = threading.Lock()

    def observe(self, domain: str | None, length: int, finish_reason: str) -> None:
        """Record one finished request: ``length`` new tokens, ended by ``finish_reason`` (``eos``,
        ``stop``: by itself; ``length``: cut at its cap), priced as ``domain`` (``None``: none guessed)."""
        if length < 0:
            raise ValueError(f"a request decodes at least 0 tokens, not {length}")
        item = (int(length), finish_reason in STOPPED_REASONS)
        with self._lock:
            self._all.append(item)
            if domain is not None:
                self._domains.setdefault(domain, deque(maxlen=self.settings.window)).append(item)

    def expected(self, domain: str | None, cap: int) -> float:
        """The new tokens a request priced as ``domain`` and capped at ``cap`` is expected to decode:
        from the domain's record once it holds ``min_requests``, else from all requests', else ``cap``."""
        with self._lock:
            record = self._domains.get(domain) if domain is not None else None
            if record is None or len(record) < self.settings.min_requests:
                record = self._all
            items = list(record) if len(record) >= self.settings.min_requests else []
        return expected_tokens(items, cap)

    def state(self) -> dict:
        """``{"requests": n, "stopped": k, "domains": {domain: {"requests", "stopped"}}}`` (the records now)."""
        with self._lock:
            def count(record):
                return {"requests": len(record), "stopped": sum(s for _, s in record)}
            return {**count(self._all), "domains": {d: count(r) for d, r in sorted(self._domains.items())}}
