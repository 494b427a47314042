"""Each engine's decoding pace as the machine's own requests measure it: a correction of the calibrated price.

A two-engine runtime chooses an engine by expected time (:mod:`adaptive.runtime.engines`): the
engine's prefill plus ``N`` tokens at its calibrated pace (plain decoding's measured step over the
domain's raced speedup). Calibration races a domain's drafter on a few of its prompts, so that pace
carries the error of a small sample, and of the host it was measured on. Over five held-out runs on
three profiles the torch engine's requests took 0.69-0.80x the time they were priced at, llama.cpp's
0.92-0.98x (``docs/history/2026-11-26-two-engines.md``). :class:`PaceLearner` learns, from every
request that had the machine to itself, the ratio of its measured decoding time to the price, and
multiplies each engine's future price by it.

Terms: a request's **log ratio** ``x = log(actual_s / expected_s)``, both over its decoded tokens
(those after the prefill's first); an engine's **pace factor** ``exp(m_e + m_d)``: ``m_e`` the
engine's learned mean log ratio, ``m_d`` the learned deviation of the domain the request was priced
as (``None``: no domain term). A normal model with known variances (``noise_sd`` for one request,
priors ``engine_sd`` and ``domain_sd`` around 0: the calibrated price is the prior), the engine's
mean plugged into the domain's (an empirical-Bayes shortcut, not the joint posterior), O(1) a request::

    m_e = S_e / (n_e + noise_sd² / engine_sd²)           v_e = noise_sd² / (n_e + noise_sd² / engine_sd²)
    m_d = (S_d - n_d m_e) / (n_d + noise_sd² / domain_sd²)   v_d = noise_sd² / (n_d + noise_sd² / domain_sd²)

(``S``, ``n``: the sum and count of the log ratios observed on the engine, and on the engine in the
domain, each discounted by ``1 - 1 / memory`` at every new one of its own: the pace is the host's of
the moment, and older requests weigh less; one log ratio is clipped to ``±3 noise_sd``, so one request
slowed by something else moves a factor by little).

Worked example (``noise_sd = 0.3``, ``engine_sd = 0.3``, ``domain_sd = 0.15``, ``memory = inf``):
three torch requests in ``qa`` with log ratios ``-0.3, -0.2, -0.25`` (took 0.74-0.82x their price):
``m_e = -0.75 / (3 + 1) = -0.1875``, ``m_d = (-0.75 + 0.5625) / (3 + 4) = -0.0268``: the factor in qa
``exp(-0.2143) = 0.807``, in another domain ``exp(-0.1875) = 0.829``.

A choice multiplies each engine's price by its factor's posterior mean. With ``explore=True`` it
draws the factor from its posterior instead (Thompson sampling): an engine the price says is slower
for a domain then gets an occasional request while the posterior is wide, so a price wrong against
it can be found out. Measured (``benchmarks/engine_pace.py``, ``docs/history/2026-11-26-two-engines.md``,
"Eighth session"), the draws' early requests cost more than they found: the engine factor, learned
from every domain's requests on the engine, already carries most of the correction, so the mean is
the default. Requests that shared the machine (another request live
on either engine at any time of theirs, or a race block of the online learner's background
measurement), ones under another policy than the routed
``knn-ssd`` (their pace is not the priced decision's) and ones that decoded fewer than
``min_tokens`` tokens teach nothing. A sampled request teaches its engine and domain under their
temperature class (:func:`~adaptive.runtime.engines.pace_key`: ``torch@t1``, ``qa@t1``), against
plain decoding's price, so its sampler's cost and what it drafts at that temperature are learned
apart from the greedy requests' factors.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, replace

import numpy as np

from adaptive.costs import measure_prefill
from adaptive.errors import ConfigError


@dataclass(frozen=True)
class PaceSettings:
    """How the pace factors are learned (see the module doc). Validated on construction
    (:class:`~adaptive.errors.ConfigError` naming the field)."""

    noise_sd: float = 0.3  # one request's log ratio about its engine's and domain's mean
    engine_sd: float = 0.3  # prior: how far an engine's calibrated price may be off (log scale)
    domain_sd: float = 0.15  # prior: how far a domain's may be off beyond its engine's
    min_tokens: int = 8  # decoded tokens a request needs to teach (fewer: its time is mostly overhead)
    memory: float = 200.0  # requests: each new one discounts the sums by 1 - 1/memory (inf: never forget)
    explore: bool = False  # Thompson draws in choices (False: posterior means)

    def __post_init__(self):
        for key in ("noise_sd", "engine_sd", "domain_sd"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{key.replace('_', '-')} must be a positive number, got {v!r}", key=key)
        if isinstance(self.memory, bool) or not isinstance(self.memory, (int, float)) or not self.memory >= 1:
            raise ConfigError(f"memory must be a number >= 1, got {self.memory!r}", key="memory")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ConfigError(f"min-tokens must be a positive integer, got {self.min_tokens!r}", key="min_tokens")


@dataclass
class _Sums:
    n: float = 0.0  # discounted count of log ratios
    s: float = 0.0  # discounted sum of log ratios
    count: int = 0  # requests, undiscounted


class PaceLearner:
    """The engines' pace factors, learned from their requests' measured decoding times. Thread-safe."""

    def __init__(self, settings: PaceSettings | None = None, seed: int | None = 0):
        self.settings = settings or PaceSettings()
        self._engines: dict[str, _Sums] = {}
        self._domains: dict[tuple[str, str], _Sums] = {}
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def observe(self, engine: str, domain: str | None, expected_s: float, actual_s: float, tokens: int) -> bool:
        """Learn from one request that decoded ``tokens`` tokens on ``engine`` in ``actual_s`` seconds
        where its price said ``expected_s`` (priced as ``domain``). Whether it taught anything: not
        when ``tokens < min_tokens`` or a time is not positive and finite."""
        st = self.settings
        if tokens < st.min_tokens or not all(t > 0 and math.isfinite(t) for t in (expected_s, actual_s)):
            return False
        bound = 3 * st.noise_sd
        x = min(max(math.log(actual_s / expected_s), -bound), bound)
        keep = 1 - 1 / st.memory
        with self._lock:
            sums = [self._engines.setdefault(engine, _Sums())]
            if domain is not None:
                sums.append(self._domains.setdefault((engine, domain), _Sums()))
            for t in sums:
                t.n, t.s, t.count = t.n * keep + 1, t.s * keep + x, t.count + 1
        return True

    def _posterior(self, engine: str, domain: str | None) -> tuple[float, float, float, float]:
        """``(m_e, v_e, m_d, v_d)`` (module doc); the domain's terms 0 without one. Under the lock."""
        st = self.settings
        noise = st.noise_sd ** 2
        e = self._engines.get(engine, _Sums())
        denom = e.n + noise / st.engine_sd ** 2
        m_e, v_e = e.s / denom, noise / denom
        if domain is None:
            return m_e, v_e, 0.0, 0.0
        d = self._domains.get((engine, domain), _Sums())
        denom = d.n + noise / st.domain_sd ** 2
        return m_e, v_e, (d.s - d.n * m_e) / denom, noise / denom

    def factor(self, engine: str, domain: str | None = None, draw: bool | None = None) -> float:
        """The factor ``engine``'s price in ``domain`` is multiplied by: the posterior mean's, or with
        ``draw`` (``None``: the settings' ``explore``) one Thompson draw."""
        draw = self.settings.explore if draw is None else draw
        with self._lock:
            m_e, v_e, m_d, v_d = self._posterior(engine, domain)
            if draw:
                m_e = self._rng.normal(m_e, math.sqrt(v_e))
                m_d = self._rng.normal(m_d, math.sqrt(v_d)) if domain is not None else 0.0
        return math.exp(m_e + m_d)

    def _mean(self, engine: str, domain: str | None) -> float:
        m_e, _, m_d, _ = self._posterior(engine, domain)
        return round(math.exp(m_e + m_d), 4)

    def state(self) -> dict:
        """Per engine: the requests it learned from and its mean factor, and per domain the same (one
        moment's, under the lock)."""
        with self._lock:
            return {engine: {"requests": e.count, "factor": self._mean(engine, None),
                             "domains": {d: {"requests": s.count, "factor": self._mean(engine, d)}
                                         for (eng, d), s in sorted(self._domains.items()) if eng == engine}}
                    for engine, e in sorted(self._engines.items())}


def prefill_as_loaded(profile, fingerprint, backbone):
    """``profile`` with its cost model's prefill times measured again on ``backbone`` when the loaded llama.cpp
    engine prefills on another file than calibration's did (``fingerprint.prefill``, the hybrid's prefill file
    kind, against the profile's: e.g. a profile calibrated without a prefill file served with one, ~3x faster
    prompts): the engine choice prices prompts by them. Said once on stderr; ``profile`` itself otherwise.
    One repeat per length (the embedded model: ~2 s; a 1.5B model: ~10 s)."""
    if fingerprint.prefill == profile.model.prefill or not profile.cost_model.prefill:
        return profile
    was, now = profile.model.prefill or "none", fingerprint.prefill or "none"
    print(f"adaptive: the profile's {profile.model.engine} prefill times were measured with prefill file {was}, "
          f"this engine has {now}: measuring them again", file=sys.stderr)
    points = measure_prefill(backbone, repeats=1)
    return replace(profile, cost_model=replace(profile.cost_model, prefill=points),
                   model=replace(profile.model, prefill=fingerprint.prefill))
