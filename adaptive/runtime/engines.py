"""Two engines in one runtime: each request decoded on the engine expected to finish it first.

On these CPUs llama.cpp's quantized step decodes ~3x faster than the torch engine's bf16 step, and
the torch engine's packed bf16 prefill is several times faster than llama.cpp's (see
``docs/design.md``, "Two engines"). A two-engine profile (:mod:`adaptive.profile.engines`) holds
each engine's calibration of the same model; :class:`TwoEngineRuntime` loads both (each its own
:class:`~adaptive.runtime.AdaptiveRuntime`: model, caches, bandits, online overlay) and sends each
request, tokenized once, to one of them for its whole life (no KV cache moves between engines).

The choice (:func:`estimate`, :func:`choose`), for a prompt of ``P`` tokens and ``N`` new tokens,
is the engine that adds the least time to the machine's work::

    expected_s(engine) = prefill_s(P) + N * seconds_per_token * added_step(running)

``N``: the tokens the request is expected to decode under its cap ``max_new_tokens``, as the answers
of the domain the prompt's tokens suggest ended so far (with online learning on,
:class:`~adaptive.runtime.lengths.LengthLearner`: a Kaplan-Meier estimate over that domain's recent
requests); the cap itself before anything is learned, or with online learning off.
``prefill_s``: the engine's prefill times measured by calibration at a few prompt lengths,
interpolated (:meth:`CostModel.prefill_seconds <adaptive.costs.CostModel.prefill_seconds>`);
``seconds_per_token``: plain decoding's measured pace over the routed decision's measured speedup
(:meth:`Profile.seconds_per_token <adaptive.profile.Profile.seconds_per_token>`) in the domain the
prompt's token ids suggest (:meth:`TwoEngineRuntime.guess_domain`: the default member's
:class:`~adaptive.index.lexicon.Lexicon`, TF-IDF centroids fitted at calibration, ~0.1 ms a
request), averaged over the profile's domains by their calibration prompts where the profile has
no lexicon or the prompt holds none of its tokens; with online learning on, times the engine's pace
factor learned from the requests it served alone (:mod:`adaptive.runtime.pace`). The choice is made before the prompt is
prefilled, so before any embedding routes it; each engine then routes the request with its own
prefill's embedding, as a one-engine runtime does, at no extra cost: the guess prices, it does not
route.
``added_step`` (:func:`added_step`) prices the load: an idle engine's step is a whole step (1); an
engine already decoding ``b`` requests (those admitted and still prefilling included) steps them
with this one in one forward over ``b + 1`` rows, so the request adds only its verify table's
increment from ``b`` to ``b + 1`` rows (one row a request: a drafting request's extra verification
rows are not priced, and the table, measured over one sequence's tokens, stands in for a batch's
rows). For one request alone that is its expected time; under
load it is the time it adds to the machine (the engines take turns, :meth:`TwoEngineRuntime.step`):
on these CPUs a torch batch costs ~1.1 steps for 8 rows and a llama.cpp one ~4.7, so a busy server
fills the torch batch and keeps llama.cpp for the requests that find it idle or nearly.

Worked example (the embedded model on a 2-core EPYC; figures as measured by one calibration):
llama.cpp prefills 128 tokens in 0.38 s and 512 in 1.63 s and decodes at 9.0 ms a token; the torch
engine 0.13 s and 0.53 s, at 25 ms a token. A 100-token prompt and 64 new tokens: llama.cpp
0.30 + 0.58 = 0.88 s, torch 0.10 + 1.60 = 1.70 s: llama.cpp. A 700-token prompt: llama.cpp
2.28 + 0.58 = 2.86 s, torch 0.77 + 1.60 = 2.37 s: torch.

Why it runs past 600 lines: its one concern is choosing an engine for each request and keeping that
choice true while both engines run: the choice's arithmetic, which members can decode a request's
policy, the admission of requests, the engines' turns, and what their traffic teaches the choice.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from adaptive.costs import extrapolate
from adaptive.engine import llamacpp
from adaptive.engine.prefill_file import DEFAULT_PREFILL
from adaptive.errors import AdaptiveError, ConfigError, StepFailed
from adaptive.index.router import RouteDecision
from adaptive.models import load_model
from adaptive.profile import (
    TRAINING_ENGINE,
    Profile,
    ProfileError,
    is_two_engine,
    load_profile,
    member_dir,
    member_online_path,
    read_engines,
)
from adaptive.runtime.bandit import temperature_class
from adaptive.runtime.lengths import LengthLearner
from adaptive.runtime.online import OnlineSettings, link_members
from adaptive.runtime.pace import PaceLearner
from adaptive.runtime.policies import ROUTED_POLICY
from adaptive.runtime.runtime import AdaptiveRuntime, RoutedDecoding, RoutedPrefilling, RuntimeResult
from adaptive.runtime.turns import TurnLock

# The llama.cpp member's context, in positions shared by its live requests. Its KV cache is allocated whole
# (the embedded model: 23 KB a position, 189 MB for 8192): a request that does not fit goes to the torch
# member, whose caches are the request's own, and long prompts go there anyway (the faster prefill).
MEMBER_CONTEXT = 2048


@dataclass(frozen=True)
class EngineEstimate:
    """One engine's expected time for a request: ``prefill_s`` + ``decode_s`` (``N`` tokens at the
    engine's pace, its load included), in seconds."""

    engine: str
    prefill_s: float
    decode_s: float
    pace: float = 1.0  # the learned factor decode_s includes (:mod:`adaptive.runtime.pace`; 1: the calibrated price)
    cached: int = 0  # prompt tokens its prefix cache holds (not in prefill_s)
    per_token_s: float = 0.0  # the price of one new token (its load and pace included): decode_s over the tokens

    @property
    def expected_s(self) -> float:
        return self.prefill_s + self.decode_s

    def seconds_for(self, tokens: int) -> float:
        """What this estimate prices a request that decoded ``tokens`` new tokens at: its prefill and
        that many tokens (the cost model checked on its own, apart from where the answer was expected to end)."""
        return self.prefill_s + tokens * self.per_token_s

    def to_dict(self) -> dict:
        return {"engine": self.engine, "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "expected_s": round(self.expected_s, 4), "pace": round(self.pace, 4), "cached_tokens": self.cached,
                "per_token_s": round(self.per_token_s, 6)}


@dataclass(frozen=True)
class EngineChoice:
    """Where a request runs and why: the ``engine`` whose estimate is least among ``estimates`` (ties:
    the first), for ``prompt_tokens`` and at most ``new_tokens``, each engine's pace that of ``domain``
    (the domain guessed from the prompt's tokens; ``None``: the average over domains), priced for
    ``expected_tokens`` of them (``None``: all ``new_tokens``; :mod:`adaptive.runtime.lengths`).
    ``unable``: the engines left out because their member cannot decode the request's ``policy``
    (:meth:`AdaptiveRuntime.refusal`, e.g. ``eagle`` where only the torch member holds a head)."""

    engine: str
    estimates: tuple[EngineEstimate, ...]
    prompt_tokens: int
    new_tokens: int
    domain: str | None = None
    expected_tokens: float | None = None
    unable: tuple[str, ...] = ()
    policy: str | None = None
    temperature: float = 0.0  # > 0: a sampled request, priced at plain decoding's pace (the races are greedy)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def priced_tokens(self) -> float:
        """The new tokens the estimates are for: ``expected_tokens``, else ``new_tokens``."""
        return self.new_tokens if self.expected_tokens is None else self.expected_tokens

    @property
    def reason(self) -> str:
        """E.g. ``"expected 0.88 s on llama.cpp, 1.70 s on torch (priced as qa, for 42 of 256 tokens)"``
        (the chosen engine first), or ``"expected 1.70 s on torch (priced as qa, llama.cpp cannot decode
        eagle)"``."""
        ordered = sorted(self.estimates, key=lambda e: e.engine != self.engine)
        notes = [f"priced as {self.domain}"] if self.domain is not None else []
        if not self.greedy:
            notes.append("sampled: at plain decoding's pace")
        if round(self.priced_tokens) < self.new_tokens:
            notes.append(f"for {round(self.priced_tokens)} of {self.new_tokens} tokens")
        if self.unable:
            notes.append(f"{' and '.join(self.unable)} cannot decode {self.policy}")
        return ("expected " + ", ".join(f"{e.expected_s:.2f} s on {e.engine}"
                                        + (f" ({e.cached} prompt tokens cached)" if e.cached else "") for e in ordered)
                + (f" ({', '.join(notes)})" if notes else ""))

    def to_dict(self) -> dict:
        return {"engine": self.engine, "reason": self.reason, "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "domain": self.domain,
                "expected_tokens": float(round(self.priced_tokens, 1)), "policy": self.policy,
                "unable": list(self.unable), "temperature": self.temperature,
                "estimates": [e.to_dict() for e in self.estimates]}


def added_step(verify: Sequence[float], running: int) -> float:
    """What one more request adds to a step of an engine decoding ``running`` requests, in its
    one-request steps: a whole step when it is idle, else its verify table's increment from
    ``running`` to ``running + 1`` rows (:func:`~adaptive.costs.extrapolate` past the table's end).
    Example: ``verify = (1.0, 1.2, 1.5)``: ``running = 0`` -> 1.0, ``1`` -> 0.2, ``2`` -> 0.3."""
    if running <= 0:
        return 1.0
    return max(extrapolate(verify, running) - extrapolate(verify, running - 1), 0.0)


def pace_key(engine: str, domain: str | None, temperature: float) -> tuple[str, str | None]:
    """The engine and domain a request's pace is learned and priced under
    (:class:`~adaptive.runtime.pace.PaceLearner`): a greedy request's own; a sampled one's each with its
    :func:`~adaptive.runtime.bandit.temperature_class`, so that its sampler's cost and the drafts it
    keeps at that temperature correct its price apart, and never the greedy requests' price.
    Example: ``("torch", "qa", 0.0)`` -> ``("torch", "qa")``, ``("torch", "qa", 0.7)`` ->
    ``("torch@t0.7", "qa@t0.7")``, ``("torch", None, 1.0)`` -> ``("torch@t1", None)``."""
    if temperature == 0.0:
        return engine, domain
    suffix = temperature_class(temperature)
    return f"{engine}{suffix}", None if domain is None else f"{domain}{suffix}"


def estimate(profile: Profile, prompt_tokens: int, new_tokens: float, running: int = 0,
             domain: str | None = None, pace: float = 1.0, cached: int = 0, greedy: bool = True) -> EngineEstimate:
    """The :class:`EngineEstimate` on ``profile``'s engine: its measured prefill of ``prompt_tokens``
    less the ``cached`` ones its prefix cache holds, and ``new_tokens`` (an expectation may be
    fractional) at its expected pace in ``domain`` (``None`` or not one of its domains: the average,
    :meth:`Profile.seconds_per_token <adaptive.profile.Profile.seconds_per_token>`) times ``pace``
    (a learned correction, :class:`~adaptive.runtime.pace.PaceLearner`), each step priced by :func:`added_step` with
    ``running`` requests already decoding there; ``greedy=False``: a sampled request, at plain decoding's
    pace (:meth:`Profile.seconds_per_token <adaptive.profile.Profile.seconds_per_token>`)."""
    per_token = profile.seconds_per_token(domain, greedy) * pace * added_step(profile.cost_model.verify, running)
    uncached = max(prompt_tokens - cached, 1)
    return EngineEstimate(profile.model.engine, profile.cost_model.prefill_seconds(uncached),
                          new_tokens * per_token, pace, cached, per_token)


def choose(estimates: Sequence[EngineEstimate], prompt_tokens: int, new_tokens: int,
           domain: str | None = None, expected_tokens: float | None = None, unable: Sequence[str] = (),
           policy: str | None = None, temperature: float = 0.0) -> EngineChoice:
    """The engine with the least expected time (the first among equals), priced as ``domain`` for
    ``expected_tokens`` of the ``new_tokens`` allowed (``None``: all of them), for a request sampled at
    ``temperature`` (0: greedy); ``unable``: the engines left out of ``estimates`` because they cannot
    decode ``policy`` (said in the choice's reason)."""
    if not estimates:
        raise ValueError("no engine to choose from")
    best = min(estimates, key=lambda e: e.expected_s)
    return EngineChoice(best.engine, tuple(estimates), prompt_tokens, new_tokens, domain, expected_tokens,
                        tuple(unable), policy, temperature)


class TwoEngineRuntime:
    """A request on the engine that serves it fastest: one :class:`AdaptiveRuntime` per engine of a
    two-engine profile, the same interface (``stream``, ``generate``, ``prefilling``, ``step``,
    ...). ``runtimes``: engine -> its runtime, the ``default`` one's tokenizer and chat setting
    encode every prompt (the same model's). ``pace``: learns each engine's pace from the requests
    that had the machine to themselves and corrects its price by it (``None``: the calibrated prices
    as they are). ``lengths``: learns where each domain's answers end and prices a request for the
    tokens it is expected to decode (``None``: for its cap). Safe to share between threads as a
    one-engine runtime is."""

    def __init__(self, runtimes: dict[str, AdaptiveRuntime], default: str, pace: PaceLearner | None = None,
                 lengths: LengthLearner | None = None):
        if len(runtimes) < 2 or default not in runtimes:
            raise ValueError(f"a two-engine runtime needs two runtimes and a default among them, got "
                             f"{sorted(runtimes)} and {default!r}")
        for name, rt in runtimes.items():
            if rt.lm.engine != name:
                raise ValueError(f"the runtime given for {name} runs on {rt.lm.engine}")
            if rt.model_lock is not next(iter(runtimes.values())).model_lock:
                raise ValueError("the runtimes of a two-engine runtime share one model_lock (two engines on one "
                                 "machine run one at a time; each online learner then sees the machine's idleness)")
            if not rt.profile.cost_model.prefill:
                raise ProfileError(f"the {name} profile ({rt.profile.path}) has no measured prefill times, which "
                                   "choosing an engine needs: calibrate it again with this adaptive")
        self.runtimes = dict(runtimes)
        self.default = default
        # the members' online learners pool their out-of-domain requests to discover domains (online.py)
        link_members({name: rt.online for name, rt in runtimes.items() if rt.online is not None})
        # each engine's requests: RoutedDecodings, and _ChosenPrefillings still being prefilled
        self._live: dict[str, weakref.WeakSet] = {name: weakref.WeakSet() for name in runtimes}
        self._live_lock = threading.Lock()
        self.pace = pace
        self.lengths = lengths
        self._chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> choice, to learn lengths
        self._streams = weakref.WeakSet()  # requests stream() decodes (one at a time on the model: not load)
        self._shared = weakref.WeakSet()  # live requests that have not had the machine to themselves
        # request -> (its choice, the members' background measuring seconds at its admission), to learn from
        self._priced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pass = {name: 0.0 for name in runtimes}  # machine seconds per request each engine's steps took

    @classmethod
    def from_profile(cls, directory: str | Path, model: str | None = None, device: str = "auto",
                     online: bool | OnlineSettings = True, context: int | None = MEMBER_CONTEXT,
                     prefill: str = DEFAULT_PREFILL, **kwargs) -> TwoEngineRuntime:
        """Load each member of a two-engine profile and its model on its engine (``model``: another
        spec of the same model, e.g. a path to its GGUF file). An explicit online overlay ``path``
        becomes one per engine (``PATH.ENGINE``). ``context``: the positions of the llama.cpp member's
        shared context (:data:`MEMBER_CONTEXT`; ``None``: the model's, up to 8192); ``prefill``: its prefill file
        (:func:`~adaptive.models.load_model`). With online
        learning on, each engine's pace is learned too (:class:`~adaptive.runtime.pace.PaceLearner`,
        in memory: a restart starts again from the calibrated prices), and where answers end
        (:class:`~adaptive.runtime.lengths.LengthLearner`, in memory too)."""
        members = read_engines(directory)
        runtimes, lock = {}, kwargs.pop("model_lock", None) or TurnLock()
        for engine in members.engines:
            profile = load_profile(directory, engine)
            spec = model or profile.model.spec or profile.model.name
            lm = load_model(spec, device=device, dtype=(profile.model.dtype or "auto") if engine == "torch" else "auto",
                            weights=profile.model.weights, engine=engine,
                            context=context if engine == llamacpp.ENGINE else None, prefill=prefill)
            runtimes[engine] = AdaptiveRuntime(profile, lm, online=_member_online(online, engine), model_lock=lock,
                                               **kwargs)
        learning = OnlineSettings.coerce(online).enabled
        pace = PaceLearner(seed=kwargs.get("seed", 0)) if learning else None
        return cls(runtimes, members.default, pace, LengthLearner() if learning else None)

    # -- what a one-engine runtime offers, from the default member ----------------------------------

    @property
    def primary(self) -> AdaptiveRuntime:
        return self.runtimes[self.default]

    @property
    def profile(self) -> Profile:
        return self.primary.profile

    @property
    def lm(self):
        return self.primary.lm

    @property
    def engine(self):
        return self.primary.engine

    @property
    def online(self) -> _Learners | None:
        """Each engine's online learner (each learns from the requests it decodes), as one: ``None``
        when learning is off."""
        learners = {name: rt.online for name, rt in self.runtimes.items() if rt.online is not None}
        return _Learners(learners, self.default, self.pace, self.lengths) if learners else None

    @property
    def carry_chunks(self) -> bool:
        """Whether steps may carry prompt chunks: where an engine's do (a request being prefilled rides
        only while its own engine has requests decoding, :attr:`_ChosenPrefilling.can_ride`)."""
        return any(rt.carry_chunks for rt in self.runtimes.values())

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        return self.primary.encode(prompt, chat)

    def room(self, prompt_ids: Sequence[int], policy: str | None = None) -> int:
        """The most new tokens the prompt leaves room for on an engine that can decode ``policy``
        (:meth:`decoders`; every engine where none can: the request then fails when it starts, saying
        why) (the choice keeps a request to the engines whose context holds it)."""
        return max(self.runtimes[name].room(prompt_ids) for name in self._able(policy) or self.runtimes)

    def _able(self, policy: str | None) -> list[str]:
        """:meth:`decoders`, or none where no member can decode ``policy``."""
        try:
            return self.decoders(policy)
        except AdaptiveError:
            return []

    def _fitting(self, prompt_tokens: int, new_tokens: int, engines: Sequence[str] | None = None) -> list[str]:
        """The ``engines`` (``None``: every one) that can take such a request now: their context holds it
        and, where the live caches share it (llama.cpp), the positions it needs are free
        (:meth:`AdaptiveRuntime.fits`)."""
        return [name for name in (self.runtimes if engines is None else engines)
                if self.runtimes[name].fits(prompt_tokens, new_tokens)]

    def decoders(self, policy: str | None) -> list[str]:
        """The engines whose member can decode a request under ``policy`` (``None``: every engine;
        :meth:`AdaptiveRuntime.refusal`): a forced ``eagle`` goes to the member that holds the head. Where
        no member can, raises what the :data:`~adaptive.profile.TRAINING_ENGINE` member (where distilled
        drafters are trained; else the default member) refuses it with."""
        if policy is None:
            return list(self.runtimes)
        refusals = {name: rt.refusal(policy) for name, rt in self.runtimes.items()}
        able = [name for name, refused in refusals.items() if refused is None]
        if not able:
            raise refusals.get(TRAINING_ENGINE) or refusals[self.default]
        return able

    def fits(self, prompt_tokens: int, max_new_tokens: int, policy: str | None = None) -> bool:
        """Whether some engine that can decode ``policy`` (:meth:`decoders`) can take the request now (a
        server keeps it queued until one can); ``True`` where none can decode it: it then fails at once,
        saying why, rather than wait."""
        able = self._able(policy)
        return not able or bool(self._fitting(prompt_tokens, max_new_tokens, able))

    def route(self, prompt) -> RouteDecision:
        return self.primary.route(prompt)

    def reserve_batch(self, requests: int) -> bool:
        return any([rt.reserve_batch(requests) for rt in self.runtimes.values()])

    def warm(self) -> int:
        return sum(rt.warm() for rt in self.runtimes.values())

    def prefix_caches(self) -> dict:
        """Engine -> its prefix cache's :class:`~adaptive.engine.prefix.PrefixStats` (``/metrics``)."""
        return {name: stats for rt in self.runtimes.values() for name, stats in rt.prefix_caches().items()}

    def bandit_state(self) -> dict:
        return {f"{name}/{k}": v for name, rt in self.runtimes.items() for k, v in rt.bandit_state().items()}

    def add_listener(self, listener) -> None:
        """Every member hands its finished requests to ``listener``
        (:meth:`AdaptiveRuntime.add_listener <adaptive.runtime.runtime.AdaptiveRuntime.add_listener>`)."""
        for rt in self.runtimes.values():
            rt.add_listener(listener)

    def listener_state(self) -> dict:
        return {name: st for rt in self.runtimes.values() for name, st in rt.listener_state().items()}

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.close()

    # -- the choice ------------------------------------------------------------------------------

    def guess_domain(self, prompt_ids: Sequence[int]) -> str | None:
        """The domain the prompt's token ids suggest (the default member's
        :class:`~adaptive.index.lexicon.Lexicon`), which prices the choice; ``None`` where the profile has
        no lexicon (calibrated before it) or the prompt holds none of its tokens."""
        lexicon = self.profile.lexicon
        return lexicon.guess(prompt_ids) if lexicon is not None else None

    def choose(self, prompt_tokens: int, new_tokens: int, domain: str | None = None,
               prompt_ids: Sequence[int] | None = None, policy: str | None = None,
               temperature: float = 0.0) -> EngineChoice:
        """Where a request of ``prompt_tokens`` and at most ``new_tokens`` runs, among the engines that can
        take it now (:meth:`fits`), with the requests this runtime is decoding now on each engine in the
        cost, each engine's pace that of ``domain`` (:meth:`guess_domain`; ``None``: the average over
        domains), priced for the tokens it is expected to decode (:attr:`lengths`; see the module
        docstring). Given its ``prompt_ids``, each engine prices only the prompt tokens its prefix
        cache does not hold (:meth:`AdaptiveRuntime.cached_tokens`): a conversation stays where its
        history is, unless the other engine is expected to finish first anyway. Only the engines that can
        decode ``policy`` are candidates (:meth:`decoders`, which raises where none can). A request sampled
        at ``temperature`` > 0 is priced at plain decoding's pace, with its pace factor learned from the
        requests sampled at that temperature (:func:`pace_key`)."""
        with self._live_lock:  # decoding, or admitted and still prefilling (about to decode)
            running = {name: sum(1 for r in live if not r.done) for name, live in self._live.items()}
        # the engines that can decode it and take it now; none (its caller did not ask fits()): every engine
        # that can decode it, and the one chosen says why it cannot take it
        decoders = self.decoders(policy)
        names = self._fitting(prompt_tokens, new_tokens, decoders) or decoders
        expected = self.lengths.expected(domain, new_tokens) if self.lengths is not None else None
        estimates = [estimate(self.runtimes[name].profile, prompt_tokens, new_tokens if expected is None else expected,
                              running[name], domain,
                              self.pace.factor(*pace_key(name, domain, temperature)) if self.pace is not None else 1.0,
                              self.runtimes[name].cached_tokens(prompt_ids) if prompt_ids is not None else 0,
                              temperature == 0.0)
                     for name in names]
        return choose(estimates, prompt_tokens, new_tokens, domain, expected,
                      [name for name in self.runtimes if name not in decoders], policy, temperature)

    # -- learning each engine's pace ------------------------------------------------------------

    def _measuring(self) -> tuple[float, bool]:
        """The members' online learners' background measurements: model seconds taken so far, and
        whether one is running now (a request's time then holds some of it)."""
        learners = [rt.online for rt in self.runtimes.values() if rt.online is not None]
        return (sum(o.measure_cost()["measure_seconds"] for o in learners),
                any(o.measuring is not None for o in learners))

    def _admit(self, engine: str, request, choice: EngineChoice) -> None:
        """Count ``request`` (anything with ``done``) live on ``engine`` (a :class:`_Streamed` one
        only among the streams: it runs alone on the model, so it is no load a batch shares); it and
        every request live now share the machine if any is. It may teach its engine's pace once done
        (:meth:`_learn`)."""
        seconds = self._measuring()[0] if self.pace is not None else 0.0
        with self._live_lock:
            others = [r for live in (*self._live.values(), self._streams) for r in live if not r.done]
            for r in others + ([request] if others else []):
                self._shared.add(r)
            (self._streams if isinstance(request, _Streamed) else self._live[engine]).add(request)
            if self.pace is not None:
                self._priced[request] = (choice, seconds)
            if self.lengths is not None:
                self._chosen[request] = choice

    def _track(self, engine: str, run: RoutedDecoding, prefilled: _ChosenPrefilling) -> RoutedDecoding:
        """``run``, the decoding ``prefilled`` became, live on ``engine`` in its place (one step under
        the lock: no request is admitted between, unseen)."""
        run.engine_choice = prefilled.choice.to_dict()
        with self._live_lock:
            prefilled.done = True
            self._live[engine].add(run)
            if prefilled in self._shared:
                self._shared.add(run)
            priced = self._priced.pop(prefilled, None)
            if priced is not None:
                self._priced[run] = priced
            chosen = self._chosen.pop(prefilled, None)
            if chosen is not None:
                self._chosen[run] = chosen
        self._learn(run, run.result if run.done else None)
        return run

    def _learn(self, request, result: Callable[[], RuntimeResult] | None) -> None:
        """Learn from ``request`` once it is done (``result``: how to get its :class:`RuntimeResult`):
        where its answer ended (every request, with :attr:`lengths`), and its engine's pace if it was
        priced, decoded under the routed ``knn-ssd`` policy (the priced decision), had the machine to
        itself (no other request, no background measurement) and decoded enough."""
        if result is None:
            return
        with self._live_lock:
            priced = self._priced.pop(request, None)
            chosen = self._chosen.pop(request, None)
            alone = request not in self._shared
        if chosen is None and (priced is None or not alone):
            return
        r = result()  # once: what it costs is building the result
        if chosen is not None:
            self.lengths.observe(chosen.domain, len(r.token_ids), r.finish_reason)
        if priced is None or not alone:
            return
        (choice, seconds), (now, running) = priced, self._measuring()
        if running or now != seconds or r.policy != ROUTED_POLICY:
            return
        per_token = self.runtimes[choice.engine].profile.seconds_per_token(choice.domain, choice.greedy)
        self.pace.observe(*pace_key(choice.engine, choice.domain, choice.temperature),
                          r.stats.decoded_tokens * per_token, r.stats.decode_time, r.stats.decoded_tokens)

    # -- decoding ----------------------------------------------------------------------------------

    def stream(self, prompt, max_new_tokens: int = 128, *, chat: bool | None = None,
               **options) -> Iterator[str | RuntimeResult]:
        """:meth:`AdaptiveRuntime.stream` on the chosen engine; the result says which and why
        (``engine``, ``engine_choice``)."""
        ids = self.encode(prompt, chat)
        choice = self.choose(len(ids), max_new_tokens, self.guess_domain(ids), ids, options.get("policy"),
                             options.get("temperature", 0.0))
        member = self.runtimes[choice.engine]
        items = member.stream_ids(ids, max_new_tokens, engine_choice=choice.to_dict(), **options)  # checks them now
        return self._stream(items, choice)

    def _stream(self, items: Iterator[str | RuntimeResult], choice: EngineChoice) -> Iterator[str | RuntimeResult]:
        request = _Streamed()
        self._admit(choice.engine, request, choice)
        try:
            for item in items:
                if isinstance(item, RuntimeResult):
                    request.done = True
                    self._learn(request, lambda item=item: item)
                yield item
        finally:
            request.done = True

    def generate(self, prompt, **kwargs) -> RuntimeResult:
        result = None
        for item in self.stream(prompt, **kwargs):
            result = item
        return result

    def start(self, prompt, max_new_tokens: int = 128, *, chat: bool | None = None, **options) -> RoutedDecoding:
        """Prefill, route and plan one request on the chosen engine (:meth:`AdaptiveRuntime.start`)."""
        run = self.prefilling(self.encode(prompt, chat), max_new_tokens, **options).advance()
        assert run is not None  # one chunk: the whole prompt
        return run

    def prefilling(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, **options) -> _ChosenPrefilling:
        """:meth:`AdaptiveRuntime.prefilling` on the engine chosen now (the server's admission)."""
        choice = self.choose(len(prompt_ids), max_new_tokens, self.guess_domain(prompt_ids), prompt_ids,
                             options.get("policy"), options.get("temperature", 0.0))
        task = _ChosenPrefilling(self.runtimes[choice.engine].prefilling(prompt_ids, max_new_tokens, **options),
                                 self, choice)
        self._admit(choice.engine, task, choice)
        return task

    def _busy_turn(self) -> str | None:
        """The engine :meth:`step` would serve next among those with requests decoding now (``None``:
        none decodes), without taking the turn: a prompt chunk may ride only in that engine's step."""
        with self._live_lock:
            busy = [e for e, live in self._live.items()
                    if any(isinstance(r, RoutedDecoding) and not r.done for r in live)]
        return min(busy, key=lambda e: self._pass[e]) if busy else None

    def _next_engine(self, engines: list[str]) -> str:
        """Which of the busy ``engines`` steps next: the one whose requests have had the least machine
        time each (stride scheduling: an engine's pass grows by its step's time over the requests it
        stepped), so every running request gets about the same share of the machine, whichever engine
        it is on, and a large cheap batch is stepped more often than one expensive request. An engine
        that was idle starts level with the busy ones."""
        floor = min(self._pass[e] for e in engines)
        for e in self.runtimes:
            if e not in engines:
                self._pass[e] = max(self._pass[e], floor)
        return min(engines, key=lambda e: self._pass[e])

    def step(self, decodings: Sequence[RoutedDecoding], riders: Sequence[RoutedPrefilling] = ()) -> list[str]:
        """One step of one engine's requests among ``decodings`` (with that engine's ``riders``), the
        engines taking turns by :meth:`_next_engine` while both have requests running. The other
        engine's requests get empty deltas this call; if the step fails, :class:`StepFailed` names
        the requests it was for (the other engine's go on)."""
        counts = {name: sum(1 for d in decodings if d.engine == name) for name in self.runtimes}
        engines = [name for name, n in counts.items() if n]
        if not engines:
            return ["" for _ in decodings]
        engine = self._next_engine(engines)
        mine = [i for i, d in enumerate(decodings) if d.engine == engine]
        riding = [i for i, r in enumerate(riders) if isinstance(r, _ChosenPrefilling) and r.engine == engine]
        t0 = time.perf_counter()
        try:
            deltas = self.runtimes[engine].step([decodings[i] for i in mine], [riders[i].task for i in riding])
        except Exception as exc:  # noqa: BLE001 - re-raised, naming whose step it was
            raise StepFailed(exc, tuple(mine), tuple(riding)) from exc
        self._pass[engine] += (time.perf_counter() - t0) / counts[engine]  # machine time per request stepped
        out = [""] * len(decodings)
        for i, delta in zip(mine, deltas):
            out[i] = delta
            if decodings[i].done:
                self._learn(decodings[i], decodings[i].result)
        return out


@dataclass(frozen=True)
class _Learners:
    """The engines' online learners behind the one learner's reporting interface (the server's
    ``/v1/adaptive/online`` and metrics): the default engine's state with every engine's under
    ``engines``, the races' costs summed."""

    learners: dict
    default: str
    pace: PaceLearner | None = None
    lengths: LengthLearner | None = None

    def state(self) -> dict:
        states = {name: learner.state() for name, learner in self.learners.items()}
        first = states.get(self.default) or next(iter(states.values()))
        out = {**first, "requests": sum(st["requests"] for st in states.values()), "engines": states}
        if self.pace is not None:
            out["pace"] = self.pace.state()
        if self.lengths is not None:
            out["lengths"] = self.lengths.state()
        return out

    def measure_cost(self) -> dict:
        costs = [learner.measure_cost() for learner in self.learners.values()]
        return {"measure_seconds": round(sum(c["measure_seconds"] for c in costs), 3),
                "measure_waits": sum(c["measure_waits"] for c in costs)}


@dataclass(eq=False)
class _ChosenPrefilling:
    """A request being prefilled on the engine :meth:`TwoEngineRuntime.prefilling` chose (the
    scheduler's view is a :class:`RoutedPrefilling`'s)."""

    task: RoutedPrefilling
    owner: TwoEngineRuntime
    choice: EngineChoice
    done: bool = False  # prefilled (then its RoutedDecoding counts in the engine's load instead)

    @property
    def engine(self) -> str:
        return self.choice.engine

    @property
    def remaining(self) -> int:
        return self.task.remaining

    @property
    def can_ride(self) -> bool:
        """A chunk rides in a decoding step only on an engine whose steps carry chunks, and only when
        its engine takes the next step (the other engine's steps do not carry it)."""
        return (self.task.can_ride and self.owner.runtimes[self.engine].carry_chunks
                and self.owner._busy_turn() == self.engine)

    def advance(self, tokens: int | None = None) -> RoutedDecoding | None:
        run = self.task.advance(tokens)
        if run is None:
            return None
        return self.owner._track(self.engine, run, self)  # done from then on


@dataclass(eq=False)
class _Streamed:
    """A request :meth:`TwoEngineRuntime.stream` decodes, as the live requests count it."""

    done: bool = False


def open_runtime(directory: str | Path, model: str | None = None, device: str = "auto", dtype: str | None = None,
                 weights: str | None = None, engine: str | None = None, **kwargs):
    """The runtime of a profile directory: a :class:`TwoEngineRuntime` for a two-engine profile unless
    ``engine`` names one of its members (then that member's :class:`AdaptiveRuntime`), else the
    profile's :class:`AdaptiveRuntime` (:meth:`AdaptiveRuntime.from_profile`). A member's explicit
    online overlay ``path`` is ``PATH.ENGINE`` either way (:func:`member_online_path`)."""
    if is_two_engine(directory) and engine is None:
        if dtype is not None or weights is not None:
            raise ConfigError("--dtype and --weights choose one engine's numerics: give --engine torch with them")
        return TwoEngineRuntime.from_profile(directory, model=model, device=device, **kwargs)
    if is_two_engine(directory) and "online" in kwargs:
        kwargs["online"] = _member_online(kwargs["online"], engine)
    return AdaptiveRuntime.from_profile(member_dir(directory, engine), model=model, device=device, dtype=dtype,
                                        weights=weights, engine=engine, **kwargs)


def _member_online(online: bool | OnlineSettings, engine: str) -> bool | OnlineSettings:
    """A two-engine profile's ``engine`` member's online settings: an explicit overlay ``path`` becomes
    ``PATH.ENGINE`` (:func:`member_online_path`); anything else as given."""
    settings = OnlineSettings.coerce(online)
    return online if settings.path is None else replace(settings, path=member_online_path(settings.path, engine))
