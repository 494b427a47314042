"""``AdaptiveRuntime``: route each request with a calibration profile and decode it losslessly.

One request, in a straight line (:meth:`AdaptiveRuntime.stream`)::

    encode (the profile's chat setting)
    -> Engine.start: the prefill, pooling the prompt's embedding (no extra forward)
    -> profile.index.route: distance-weighted KNN vote over the anchors (out-of-domain: the global record)
    -> plan: the routing policy (:data:`~adaptive.runtime.policies.POLICIES`) picks the applied record and
       the drafter kind; the record's typed priors give its draft-length policy (a Thompson sampler
       per (policy, domain), or calibration's fixed length): a :class:`RoutedPlan`
    -> build_drafter(plan.spec) -> Engine.begin, then :meth:`AdaptiveRuntime.step` (Engine.step, and the
       online learner's observation of each step) until done: text deltas, then a :class:`RuntimeResult`

``knn-ssd`` applies the domain's calibrated decision (``ssd`` with its skip set, ``pld`` prompt
lookup, ``cascade``, or ``ar``); ``cascade`` drafts every request with its domain's cascade (the
bigram-backed statistical drafter under and after the domain's skip set), its split and draft
length chosen by a two-level Thompson sampler; ``early-exit`` and ``draft-model`` draft with the
drafter ``adaptive distill`` stored in the profile (EESD).

Why it runs past 600 lines: its one concern is that request path, and each of its steps (routing,
the plan of every policy, the distilled drafters' parts built once, prefilling a chunk at a time,
the batch's step and its draft lengths) is a method of the runtime; what stands apart already
lives apart (bandits, policies, online learning, the two-engine choice, replicas).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from adaptive.costs import best_draft_length, busy_warning
from adaptive.costs.batch import batch_draft_lengths, padded_draft_lengths
from adaptive.drafters.eagle import DEFAULT_TREE, EagleHead, HeadShape, TreeShape
from adaptive.drafters.eagle_static import release_head, warm_head
from adaptive.drafters.early_exit import ExitBlock
from adaptive.drafters.factory import DrafterSpec, build_drafter, eagle_vocab
from adaptive.drafters.head import DraftHead
from adaptive.drafters.model import build_draft_model
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Decoding, Engine, GenerationResult, Prefilling, Session
from adaptive.engine.loop import cache_positions
from adaptive.engine.prefill_file import DEFAULT_PREFILL
from adaptive.engine.prefix import DEFAULT_PREFIX_CACHE_MIB, PrefixStats, budget_bytes
from adaptive.engine.protocol import DraftChoice, DraftLengthPolicy, FixedDraftLength
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError, ConfigError
from adaptive.index.anchors import Route
from adaptive.index.embedding import embed_prompt, pooled_to_numpy
from adaptive.index.router import RouteDecision, decision_of, route_vector
from adaptive.measure.race import HeadCandidate
from adaptive.models import LoadedModel, load_model
from adaptive.profile import GLOBAL, DomainRecord, Profile, ProfileError, is_two_engine, load_profile
from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength, temperature_class
from adaptive.runtime.online import Observation, OnlineLearner, OnlineSettings
from adaptive.runtime.pace import prefill_as_loaded
from adaptive.runtime.policies import DISTILLED, ROUTED_POLICY, Policy, get_policy
from adaptive.runtime.turns import TurnLock

THOMPSON = "thompson"


@dataclass(frozen=True)
class FinishedRequest:
    """A request the runtime finished, as a :class:`RequestListener` sees it: the record it was decoded
    with (``domain``, the applied record's name), its ``prompt`` and ``output`` token ids, the ``engine``
    that decoded it and whether it was decoded greedily (its output is then the target's greedy text)."""

    domain: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    engine: str
    greedy: bool


class RequestListener(Protocol):
    """What learns from finished requests beside the online learner (:meth:`AdaptiveRuntime.add_listener`):
    ``observe`` is called once per finished request, cheaply (a request's thread calls it, at times under
    the model lock: heavy work belongs on the listener's own thread); ``state`` is what a server reports;
    ``close`` stops it (:meth:`AdaptiveRuntime.close`)."""

    name: str

    def observe(self, finished: FinishedRequest) -> None: ...

    def state(self) -> dict: ...

    def close(self) -> None: ...


def beta_prior(a: float) -> tuple[float, float]:
    """Beta pseudo-counts worth ~10 observed drafts around a measured per-token acceptance ``a``.

    Example: ``a = 0.7`` -> ``(8.0, 4.0)``; ``a`` is clipped to ``[0.01, 0.99]`` (``1.0`` -> ``(10.9, 1.1)``).
    """
    a = min(max(float(a), 0.01), 0.99)
    return 1.0 + 10.0 * a, 1.0 + 10.0 * (1.0 - a)


@dataclass(frozen=True)
class RoutedPlan:
    """What decodes one request. ``route``: the index's decision; ``applied``: the profile record
    whose settings apply (a domain, or ``"global"``); ``policy``: the routing policy's name;
    ``drafter``: the drafter kind and ``spec`` its :class:`DrafterSpec`; ``draft_policy``: how the
    draft length is chosen (``"thompson"``, ``"fixed K"``; ``""`` for ``ar``); ``skip``: the skip set
    drafted with, ``None`` when no layer-skip level drafts; ``length_policy``: the
    :class:`DraftLengthPolicy` object (a bandit shared by the domain's requests, or a fixed length)."""

    route: Route | None
    applied: str
    policy: str
    drafter: str
    spec: DrafterSpec
    draft_policy: str = ""
    skip: SkipSet | None = None
    length_policy: DraftLengthPolicy | None = field(default=None, compare=False, repr=False)


@dataclass
class RuntimeResult(GenerationResult):
    """A :class:`GenerationResult` (``drafter``: the kind that decoded it) with the routing decision:
    the ``policy``, the index's ``route``, the ``applied`` record, the ``skip`` set drafted with
    (``None`` without a layer-skip level), the ``draft_policy`` and the ``bandit``'s state after the
    request (``None`` without one). :meth:`to_dict` gives the skip set as ``skip`` (its JSON object)
    and ``skip_text`` (its text form)."""

    policy: str = ROUTED_POLICY
    route: Route | None = None
    applied: str = "global"
    skip: SkipSet | None = None
    draft_policy: str = ""
    bandit: dict | None = None
    online: dict | None = None
    engine: str = ""
    engine_choice: dict | None = None

    @property
    def domain(self) -> str | None:
        """The routed domain; ``None`` when the request was out-of-domain (global set)."""
        return self.route.domain if self.route is not None else None

    @property
    def decision(self) -> str:
        """What decoded the request: a drafter kind (``ssd``, ``pld``, ``cascade``, ``early-exit``,
        ``draft-model``) or ``ar``."""
        return self.drafter

    @property
    def neighbours(self) -> list[dict]:
        """The nearest anchors: ``[{"domain", "distance"}]``, nearest first."""
        return self.route.to_dict()["neighbours"] if self.route is not None else []

    @property
    def draft_lengths(self) -> dict[int, int]:
        """Draft length -> number of steps (0: the bandit chose a plain step)."""
        return dict(self.stats.draft_lengths)

    def to_dict(self) -> dict:
        d = {**super().to_dict(), "route": self.route.to_dict() if self.route is not None else None,
             "applied": self.applied, "decision": self.decision, "policy": self.policy}
        if self.draft_policy:
            d["draft_policy"] = self.draft_policy
        if self.skip is not None:
            d["skip_text"] = self.skip.to_text()
            d["skip"] = self.skip.to_dict()
        if self.bandit is not None:
            d["bandit"] = self.bandit
        if self.online is not None:
            d["online"] = self.online
        if self.engine:
            d["engine"] = self.engine
        if self.engine_choice is not None:
            d["engine_choice"] = self.engine_choice
        return d


@dataclass(eq=False)
class RoutedDecoding:
    """A request :meth:`AdaptiveRuntime.start` prefilled, routed and planned: its engine
    :class:`~adaptive.engine.engine.Decoding` and :class:`RoutedPlan`. ``first``: the text of the
    prefill's token; :meth:`AdaptiveRuntime.step` advances it; :meth:`result` ends it."""

    decoding: Decoding
    plan: RoutedPlan
    observation: Observation | None = None  # what the online learner learns from once it is done
    observed: bool = False
    engine: str = ""  # the engine that decodes it
    engine_choice: dict | None = None  # why it runs there, when a two-engine runtime chose (EngineChoice.to_dict)

    @property
    def first(self) -> str:
        return self.decoding.first

    @property
    def done(self) -> bool:
        return self.decoding.done

    def result(self) -> RuntimeResult:
        """The :class:`RuntimeResult` (with the bandit's state as it is now)."""
        r, plan = self.decoding.result(), self.plan
        length = plan.length_policy
        bandit = length.state() if isinstance(length, (ThompsonDraftLength, ThompsonCascade)) else None
        obs = self.observation
        online = {"flagged": obs.flagged, "learned_domain": obs.learned} if obs is not None else None
        return RuntimeResult(r.text, r.token_ids, r.finish_reason, r.stats, r.drafter, r.drafter_info,
                             policy=plan.policy, route=plan.route, applied=plan.applied, skip=plan.skip,
                             draft_policy=plan.draft_policy, bandit=bandit, online=online, engine=self.engine,
                             engine_choice=self.engine_choice)


@dataclass(eq=False)
class RoutedPrefilling:
    """A request :meth:`AdaptiveRuntime.prefilling` is prefilling a chunk at a time."""

    runtime: AdaptiveRuntime
    task: Prefilling
    policy: Policy

    @property
    def remaining(self) -> int:
        """Prompt tokens not prefilled yet."""
        return self.task.remaining

    @property
    def config(self) -> GenerationConfig:
        """The request's :class:`GenerationConfig`."""
        return self.task.config

    @property
    def can_ride(self) -> bool:
        """Whether a decoding step can carry the next chunk (:meth:`AdaptiveRuntime.step`'s ``riders``)."""
        return self.task.can_ride

    def advance(self, tokens: int | None = None) -> RoutedDecoding | None:
        """The next chunk (or ``tokens``; under the model lock); after the last, the routed
        :class:`RoutedDecoding`."""
        rt = self.runtime
        with rt._lock:
            session = self.task.advance(tokens)
            return None if session is None else rt._route(session, self.policy, shared_draft_model=False)


def _positions(prior) -> list[float]:
    """A statistical prior's acceptance by tail position, up to the first position calibration saw
    nothing accepted at (or never reached); its overall acceptance when it has none."""
    by_pos = list(prior.by_position)
    by_pos = by_pos[: by_pos.index(0.0)] if 0.0 in by_pos else by_pos
    return by_pos or [prior.acceptance]


class AdaptiveRuntime:
    """Serving-side entry point; safe to share between threads (requests are serialised on the model).

    ``policy`` (per request): one of :data:`~adaptive.runtime.policies.POLICIES`. ``bandit=False``
    drafts the fixed draft length calibration found (for a distilled drafter: the one its measured
    acceptance and cost give, at least 1) instead of Thompson sampling. ``reduced_vocab=False``
    keeps the full LM head for layer-skip drafts in every domain (by default a domain drafts over
    its reduced vocabulary where calibration measured that faster). ``online`` (on by default):
    learn from the traffic served (:mod:`adaptive.runtime.online`: live bigram tables, saved bandit
    posteriors, new domains discovered among out-of-domain requests), saved to an overlay beside the
    profile; ``False`` turns it off, an :class:`OnlineSettings` tunes it. ``goodput`` (on by default):
    requests stepped together draft the lengths that maximise the batch's expected tokens per
    second (:meth:`batch_choices`); ``False``: each request's bandit chooses as if alone. Call
    :meth:`close` when done (it saves what was learned). ``prefix_cache``: the MiB of finished
    requests' keys and values kept for later requests that start with the same tokens (a
    conversation's next turn, a shared system prompt or document; :mod:`adaptive.engine.prefix`);
    0 keeps none.
    """

    def __init__(self, profile: Profile, lm: LoadedModel, *, bandit: bool = True, seed: int | None = 0,
                 window: float = 500.0, reduced_vocab: bool = True, online: bool | OnlineSettings = True,
                 goodput: bool = True, model_lock: TurnLock | None = None,
                 prefix_cache: float = DEFAULT_PREFIX_CACHE_MIB, tree: TreeShape | None = DEFAULT_TREE):
        self._fingerprint = lm.fingerprint()
        profile.check_model(self._fingerprint)
        profile = prefill_as_loaded(profile, self._fingerprint, lm.backbone) if lm.model is None else profile
        busy = busy_warning(f"the {profile.model.engine} engine's costs in the profile "
                            f"{profile.path or '(in memory)'}", profile.cost_model.others_share)
        if busy:  # said once per profile a process loads: it skews every price, decisions and engine choice
            warnings.warn(busy, stacklevel=2)
        self.profile = profile
        self.lm = lm
        self.engine = Engine(lm)
        self.bandit = bandit
        self.reduced_vocab = reduced_vocab
        self.tree = tree  # how the eagle head's drafts branch, greedy or sampled (None: chains)
        self.goodput = goodput
        self.max_draft_len = profile.runtime.max_draft_len
        self.cascade_max_len = profile.runtime.cascade_max_draft_len
        self.draft_len = max(self.max_draft_len, self.cascade_max_len)  # the longest draft any policy makes
        self._seed = seed
        self._window = window
        # the model: one decode at a time, in arrival order (re-entrant); shared by the engines of one machine
        self._lock = model_lock if model_lock is not None else TurnLock()
        self._state_lock = threading.Lock()  # what is built on first use, below
        self._bandits: dict[str, DraftLengthPolicy] = {}  # "policy:domain[@tT]" -> its Thompson sampler
        self._heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # domain -> (ids, LM-head rows)
        self._exit_block: ExitBlock | None = None  # the distilled early-exit block, in the model's dtype
        self._draft_model = None  # the distilled draft model's drafter: built once, its own KV cache reused
        self._eagle: EagleHead | None = None  # the distilled eagle head, on the model's device
        self._domain_eagle: dict[str, EagleHead] = {}  # domain -> a head refined on its traffic (set_eagle_head)
        self._listeners: list[RequestListener] = []
        # the feature rows a request that may draft with the head keeps (request_features): the eagle head's,
        # where the profile holds one and the engine gives them as the head was trained on (torch, with CUDA
        # graphs the captured steps writing them into the slot; llama.cpp from its layer inputs and output rows);
        # the routing happens after the prefill, whose rows the head reads too
        eagle = profile.distilled.get("eagle")
        bb = lm.backbone
        shape = HeadShape.from_dict(eagle.shape) if eagle is not None and eagle.shape else None
        self.features = shape.layers if shape is not None and shape.top == bb.feature_top and \
            bb.keeps_features(shape.layers) else ()
        # finished requests' keys, reused by later requests sharing their first tokens (a conversation's
        # history, a shared system prompt or document): MiB on this engine, 0 off (:mod:`adaptive.engine.prefix`)
        bb.prefixes.resize(budget_bytes(prefix_cache))
        settings = OnlineSettings.coerce(online)
        self.online = OnlineLearner(profile, lm, settings, self._lock, self._live_bandits,
                                    self._head_candidate if self.features else None) if settings.enabled else None

    @property
    def model_lock(self) -> TurnLock:
        """The lock every use of the model takes (decoding, prefill, the online learner's races);
        a two-engine runtime's members share one: two engines on one machine run one at a time."""
        return self._lock

    @classmethod
    def from_profile(cls, directory: str | Path, model: str | LoadedModel | None = None, device: str = "auto",
                     dtype: str | None = None, weights: str | None = None, engine: str | None = None,
                     prefill: str = DEFAULT_PREFILL, **kwargs) -> AdaptiveRuntime:
        """Load a profile and its model (the one it names unless ``model`` is a spec or a loaded model).

        A model the profile was not calibrated for, or on another engine, is a
        :class:`~adaptive.profile.ProfileError`. ``dtype``, ``weights`` and ``engine`` default to the
        ones calibration used; ``prefill``: the llama.cpp engine's prefill file (:func:`~adaptive.models.load_model`).
        A two-engine profile's directory gives its default member alone (said
        once, as a warning): ``adaptive.open(directory)`` gives both, choosing the engine per request.
        """
        if is_two_engine(directory):
            warnings.warn(f"{directory} is a two-engine profile: AdaptiveRuntime.from_profile loads its default "
                          "member alone (no engine choice); adaptive.open(directory) loads both", stacklevel=2)
        profile = load_profile(directory)
        if isinstance(model, LoadedModel):
            lm = model
        else:
            spec = model or profile.model.spec or profile.model.name
            eng = engine or profile.model.engine
            default_dtype = (profile.model.dtype or "auto") if eng == "torch" else "auto"
            lm = load_model(spec, device=device, dtype=dtype or default_dtype,
                            weights=weights or profile.model.weights, engine=eng, prefill=prefill)
        return cls(profile, lm, **kwargs)

    def reserve_batch(self, requests: int) -> bool:
        """A server decodes up to ``requests`` together: the engine lays its caches out for one batched
        step (:meth:`Backbone.reserve_batch <adaptive.engine.backbone.Backbone.reserve_batch>`; CUDA graphs
        only). ``True`` where it did; the CPU and llama.cpp keep their eager batch."""
        reserve = getattr(self.engine.backbone, "reserve_batch", None)  # the llama.cpp engine has none
        if reserve is None:
            return False
        with self._lock:
            return reserve(requests)

    def warm(self) -> int:
        """Capture the CUDA graphs of plain decoding, verification, the routing prefill and the drafting
        steps of every skip set of the profile's records (:meth:`Profile.skip_sets
        <adaptive.profile.Profile.skip_sets>`: a request may ask for a policy that forces layer skipping),
        on a slot with the feature rows its eagle heads read (:attr:`features`), with the tree steps their
        trees need, now (a server's startup) rather than inside its first requests (:meth:`Backbone.warm_graphs
        <adaptive.engine.backbone.Backbone.warm_graphs>`); and the profile's eagle head's own levels
        (:func:`~adaptive.drafters.eagle_static.warm_head`). The graphs captured (0 without CUDA graphs)."""
        bb = self.engine.backbone
        warm = getattr(bb, "warm_graphs", None)  # the llama.cpp engine has none
        if warm is None:
            return 0
        with self._lock:
            n = warm(self.profile.index.pooling, skips=self.profile.skip_sets(), features=self.features,
                     trees=bool(self.features) and self.tree is not None)
            graphs = getattr(bb, "graphs", None)
            if graphs is not None and graphs.enabled and self.features and "eagle" in self.profile.distilled:
                try:  # and the head's own levels
                    with self._state_lock:
                        head = self._distilled("eagle")[0].eagle
                except (ProfileError, ConfigError):  # the head does not fit this model: its requests say so
                    return n
                n += warm_head(head, bb, self.tree)
            return n

    # -- routing and planning ------------------------------------------------------------------

    def route(self, prompt: str | Sequence[dict]) -> RouteDecision:
        """Route without decoding (one prefill forward): the domain and its decision (a learned
        domain's when the calibrated index says out-of-domain and online learning found one near)."""
        ids = self.encode(prompt)
        with self._lock:
            vector = embed_prompt(self.engine.backbone, ids, self.profile.index.pooling)
        if self.online is None:
            return route_vector(self.profile, vector)
        route, _ = self.online.route(vector)
        return decision_of(route, self._record(route.domain))

    def _record(self, name: str | None) -> DomainRecord:
        """A domain's record (a learned domain's too); ``None``: the global record."""
        return self.online.record(name) if self.online is not None else self.profile.domain(name)

    def _live_bandits(self) -> dict:
        with self._state_lock:
            return dict(self._bandits)

    def plan(self, policy: Policy, route: Route | None, prompt_ids: list[int], features: bool = True,
             temperature: float = 0.0) -> RoutedPlan:
        """What decodes a request routed to ``route`` under ``policy`` (``prompt_ids`` join a reduced
        draft head; ``features``: its cache keeps the head's feature rows, :meth:`request_features`),
        sampled at ``temperature``. Takes the state lock once; creates the domain's bandit on first use:
        one per policy, domain and :func:`~adaptive.runtime.bandit.temperature_class` (greedy requests'
        acceptance says little of sampled ones', so each learns its own)."""
        dp = self._record(route.domain if policy.routed and route is not None else None)
        kind = policy.drafter or dp.decision.drafter
        if kind == "ssd" and not dp.layer_skip.skip:
            kind = "ar"  # no skip set to draft with
        if kind == "eagle" and policy.drafter is None and not (self.features and features):
            kind = "ar"  # a domain decided for the head, on an engine where it cannot draft (see features), or
            # a request prefilled without its rows (no record had decided for the head when it started)
        if kind == "ar":
            return RoutedPlan(route, dp.name, policy.name, "ar", DrafterSpec("ar"))
        key = f"{policy.name}:{dp.name}{temperature_class(temperature)}"
        with self._state_lock:
            if kind == "cascade":
                return self._cascade_plan(key, policy, route, dp, prompt_ids)
            skip = None
            if kind == "ssd":
                skip = dp.layer_skip.skip
                spec = DrafterSpec("ssd", skip=skip, head=self._head(dp, prompt_ids))
                prior, cost, fixed = dp.priors.layer_skip.acceptance, dp.layer_skip_cost(self.reduced_vocab), \
                    dp.layer_skip.draft_len
            elif kind == "pld":
                spec = DrafterSpec("pld")
                prior, cost, fixed = dp.priors.lookup.acceptance, dp.priors.lookup.draft_cost, \
                    self.profile.runtime.pld_draft_len
            else:  # a distilled drafter
                spec, rec = self._distilled(kind)
                refined = self._refined_eagle(dp.name) if kind == "eagle" else None
                if refined is not None:  # refined on the domain's traffic
                    spec = replace(spec, eagle=refined)
                if kind == "eagle":  # its rows joined with the request's prompt tokens
                    spec = replace(spec, head=eagle_vocab(spec.eagle, self.lm.backbone, prompt_ids))
                prior, cost = rec.acceptance, rec.draft_cost
                fixed = max(1, best_draft_length(prior, cost, dp.verify_table(self.max_draft_len),
                                                 self.max_draft_len)[0])
            # the eagle drafter copies where prompt lookup matches: its copies get a posterior of their own
            copies = dict(copy_prior=beta_prior(dp.priors.lookup.acceptance),
                          copy_cost=dp.priors.lookup.draft_cost) if kind == "eagle" else {}
            if self.bandit:
                length = self._bandits.get(key)
                if length is None:
                    length = self._bandits[key] = ThompsonDraftLength(
                        cost, dp.verify_table(self.max_draft_len), self.max_draft_len, beta_prior(prior),
                        window=self._window, seed=self._next_seed(), **copies)
                    if self.online is not None:
                        self.online.restore_bandit(key, length)
                draft_policy = THOMPSON
            else:
                copy = dp.copy_length(self.max_draft_len) if copies else None
                length = FixedDraftLength(fixed, copy)
                draft_policy = f"fixed {fixed}" + ("" if copy is None else f", copies {copy}")
        return RoutedPlan(route, dp.name, policy.name, kind, spec, draft_policy, skip, length)

    def _cascade_plan(self, key: str, policy: Policy, route: Route | None, dp: DomainRecord,
                      prompt_ids: list[int]) -> RoutedPlan:
        """The domain's cascade: its plan, bigram table and (where it can draft) skip set (caller holds the lock)."""
        cc = dp.cascade
        use_skip = cc.max_split > 0 and bool(dp.layer_skip.skip)
        skip = dp.layer_skip.skip if use_skip else None
        bigram = self.online.table(dp.name) if self.online is not None else dp.bigram
        spec = DrafterSpec("cascade", skip=skip, cascade=cc, bigram=bigram,
                           head=self._head(dp, prompt_ids) if use_skip else None)
        if not self.bandit:
            fixed = min(cc.draft_len, self.cascade_max_len)
            length, draft_policy = FixedDraftLength(fixed), f"fixed {fixed}"
        else:
            length = self._bandits.get(key)
            if length is None:
                stat = dp.priors.statistical
                length = self._bandits[key] = ThompsonCascade(
                    dp.layer_skip_cost(self.reduced_vocab), dp.verify_table(self.cascade_max_len),
                    self.cascade_max_len, cc.max_split if use_skip else 0, beta_prior(dp.priors.layer_skip.acceptance),
                    [beta_prior(a) for a in _positions(stat)], stat_cost=stat.draft_cost, window=self._window,
                    seed=self._next_seed())
                if self.online is not None:
                    self.online.restore_bandit(key, length)
            draft_policy = THOMPSON
        return RoutedPlan(route, dp.name, policy.name, "cascade", spec, draft_policy, skip, length)

    def _next_seed(self) -> int | None:
        return None if self._seed is None else self._seed + len(self._bandits)

    def _head(self, dp: DomainRecord, prompt_ids: list[int]) -> DraftHead | None:
        """The domain's reduced draft head joined with the request's prompt tokens, or ``None``
        (the domain's LM-head rows are gathered once; caller holds the state lock)."""
        if not (self.reduced_vocab and dp.reduced_vocab):
            return None
        bb = self.lm.backbone
        if dp.name not in self._heads:
            ids = torch.as_tensor(dp.draft_vocab, dtype=torch.long, device=bb.device)
            self._heads[dp.name] = (ids, bb.head_rows(ids).contiguous())
        ids, rows = self._heads[dp.name]
        return DraftHead.build(bb, ids, rows, extra=prompt_ids)

    def refusal(self, policy: str) -> AdaptiveError | None:
        """Why this runtime cannot decode a request under ``policy``, known before its prompt is prefilled
        (``None``: it can): the policy names a distilled drafter the profile does not hold, one trained for
        another model, or the eagle head on an engine that keeps no hidden states. An unknown policy
        raises :class:`ConfigError` (:func:`get_policy`). A two-engine runtime sends such a request to a
        member that can decode it (:class:`~adaptive.runtime.engines.TwoEngineRuntime`)."""
        kind = get_policy(policy).drafter
        return self._distilled_refusal(kind) if kind in DISTILLED else None

    def _refuses(self, policy: str) -> bool:
        """Whether a request under ``policy`` would be refused (:meth:`refusal`; an unknown policy too)."""
        try:
            return self.refusal(policy) is not None
        except AdaptiveError:
            return True

    def _decodable(self, policy: str) -> Policy:
        """``policy``'s :class:`Policy`, or the error it would meet (:meth:`refusal`), raised before the prefill:
        nothing is spent on a request that cannot be decoded."""
        refused = self.refusal(policy)
        if refused is not None:
            raise refused
        return get_policy(policy)

    def _distilled_refusal(self, kind: str) -> AdaptiveError | None:
        try:
            rec, _ = self.profile.distilled_drafter(kind)
        except ProfileError as exc:  # it names the profile and the command to run
            return exc
        if not rec.model.same_model(self._fingerprint):
            return ProfileError(f"the distilled {kind} drafter was trained for another model ({rec.model.name!r}); "
                                "distill it again for this one")
        if kind == "eagle" and not self.features:
            return ConfigError(f"the profile's eagle head drafts from hidden states the {self.lm.backbone.engine} "
                               "engine does not keep as it was trained on: use the engine it was distilled on")
        return None

    def _distilled(self, kind: str):
        """``(DrafterSpec, DistilledRecord)`` of the profile's distilled drafter ``kind``; its exit block
        or draft backbone is built once (caller holds the state lock)."""
        refused = self._distilled_refusal(kind)
        if refused is not None:
            raise refused
        rec, weights = self.profile.distilled_drafter(kind)
        bb = self.lm.backbone
        try:
            if kind == "eagle":
                if self._eagle is None:
                    self._eagle = EagleHead.from_state(HeadShape.from_dict(rec.shape), weights).to(bb.device)
                tree = self.tree if getattr(bb, "verifies_trees", False) else None  # llama.cpp verifies chains
                return DrafterSpec("eagle", eagle=self._eagle, tree=tree), rec
            if kind == "early-exit":
                if self._exit_block is None:
                    block = ExitBlock.from_state(rec.block, weights)
                    self._exit_block = block.to(device=bb.device, dtype=bb.dtype).eval()
                return DrafterSpec("early-exit", exit_layer=rec.exit_layer, exit_block=self._exit_block), rec
            if self._draft_model is None:
                draft_bb = build_draft_model(rec.model_config, weights, bb.device, bb.dtype)
                self._draft_model = build_drafter(DrafterSpec("draft-model", draft_backbone=draft_bb,
                                                              label=rec.name or kind), bb)
            return DrafterSpec("draft-model", draft_backbone=self._draft_model.bb, label=rec.name or kind), rec
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"the distilled {kind} drafter in the profile is malformed "
                               f"({type(exc).__name__}: {exc})") from None

    # -- decoding ------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[dict], chat: bool | None = None) -> list[int]:
        """The token ids :meth:`stream` decodes from: chat messages through the chat template; a string
        through it too where the profile says so (``chat=False``: as raw text)."""
        return self.engine.encode(prompt, chat=self.profile.runtime.chat if chat is None else chat)

    @property
    def carry_chunks(self) -> bool:
        """Whether a decoding step can carry prompt chunks of requests being prefilled (the engine's
        backbone measured it to pay: torch)."""
        return bool(getattr(self.engine.backbone, "carry_chunks", False))

    def room(self, prompt_ids: Sequence[int], policy: str | None = None) -> int:
        """The most new tokens a request with this prompt can ask for (the model's context less the
        prompt and the longest draft beyond the last token); 0 or less: the prompt alone is too long.
        ``policy``: as a two-engine runtime's (one runtime's room is the same for every policy)."""
        return self.engine.backbone.max_positions - cache_positions(len(prompt_ids), 0, self.draft_len)

    def fits(self, prompt_tokens: int, max_new_tokens: int, policy: str | None = None) -> bool:
        """Whether a request of ``prompt_tokens`` and ``max_new_tokens`` can start now and decode to its
        end: when the model's context holds it (:meth:`room`) and, on an engine whose live caches share
        that context (llama.cpp's), the positions its cache is made for are free (else it would overflow
        the context mid-request: a server keeps it queued until running requests finish). Torch's caches
        each hold their own positions. ``policy``: as a two-engine runtime's; one this runtime cannot
        decode (:meth:`refusal`) does not keep a request waiting: it fails at once, saying why."""
        if policy is not None and self._refuses(policy):
            return True
        bb = self.engine.backbone
        need = cache_positions(prompt_tokens, max_new_tokens, self.draft_len)
        return need <= bb.max_positions and bb.room_for(need)

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """The prompt tokens a request would start from the prefix cache now (0 where it keeps none, or
        routing pools a ``mean`` over every position), touching nothing: what the engine choice prices."""
        store = self.engine.backbone.prefixes
        if not store.enabled or self.profile.index.pooling.mode == "mean":
            return 0
        return store.peek(prompt_ids)

    def prefix_caches(self) -> dict[str, PrefixStats]:
        """Engine -> its prefix cache's entries, bytes and hits (``/metrics``)."""
        return {self.lm.engine: self.engine.backbone.prefixes.stats()}

    def config(self, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               stop: Sequence[str] | str = (), seed: int | None = None,
               confidence_threshold: float | None = None, policy: str = ROUTED_POLICY) -> GenerationConfig:
        """A request's :class:`GenerationConfig` (its draft length: the longest any policy makes; its feature
        rows: :meth:`request_features` under ``policy``)."""
        return GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=(stop,) if isinstance(stop, str) else tuple(stop),
                                draft_len=self.draft_len, confidence_threshold=confidence_threshold,
                                features=self.request_features(get_policy(policy)))

    def request_features(self, policy: Policy) -> tuple[int, ...]:
        """The feature rows a request under ``policy`` keeps from its prefill on (the routing comes after it):
        the head's (:attr:`features`) where it may draft with them, under the ``eagle`` policy, or under one the
        records decide while any record (a calibrated domain's, the global one, a domain learned online) decides
        for the head; else none. Kept, they cost every forward on llama.cpp (the embedded model: a prefill
        +13-15%, a step +4%), so a request that cannot draft with the head does not pay for them."""
        if not self.features or (policy.drafter != "eagle" and not (policy.drafter is None and self._head_decided())):
            return ()
        return self.features

    def _head_decided(self) -> bool:
        """Whether any record decides for the eagle head: the global one, a calibrated domain's or a learned one's."""
        records = [self.profile.global_set, *self.profile.domains.values()]
        if self.online is not None:
            records += [d.record for d in list(self.online.learned.values())]
        return any(r.decision.drafter == "eagle" for r in records)

    def start(self, prompt: str | Sequence[dict], max_new_tokens: int = 128, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
              policy: str = ROUTED_POLICY, confidence_threshold: float | None = None,
              chat: bool | None = None) -> RoutedDecoding:
        """Prefill, route and plan one request (options as :meth:`stream`): a :class:`RoutedDecoding`
        for :meth:`step`, which decodes it together with other started requests. Its drafter is its
        own (a distilled draft model gets a KV cache per request). :meth:`prefilling` in one chunk."""
        run = self.prefilling(self.encode(prompt, chat), max_new_tokens, temperature, top_p, top_k, stop, seed,
                              policy, confidence_threshold).advance()
        assert run is not None  # one chunk: the whole prompt
        return run

    def prefilling(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
                   policy: str = ROUTED_POLICY, confidence_threshold: float | None = None,
                   chunk: int = 0) -> RoutedPrefilling:
        """:meth:`start` on encoded ``prompt_ids``, a chunk at a time: a :class:`RoutedPrefilling`
        whose ``advance()`` prefills ``chunk`` more prompt tokens (``0``: all) under the model lock
        and, after the last, routes and plans the request (a :class:`RoutedDecoding`). A server
        steps its running requests between the chunks (:mod:`adaptive.serve.scheduler`)."""
        pol = self._decodable(policy)
        cfg = self.config(max_new_tokens, temperature, top_p, top_k, stop, seed, confidence_threshold, pol.name)
        with self._lock:
            task = self.engine.prefilling(list(prompt_ids), cfg, pool=self.profile.index.pooling, chunk=chunk,
                                          prefix=True)
        return RoutedPrefilling(self, task, pol)

    def _start(self, ids: list[int], cfg: GenerationConfig, pol: Policy, shared_draft_model: bool) -> RoutedDecoding:
        return self._route(self.engine.start(ids, cfg, pool=self.profile.index.pooling, prefix=True), pol,
                           shared_draft_model)

    def _route(self, session: Session, pol: Policy, shared_draft_model: bool) -> RoutedDecoding:
        """Route a prefilled session, plan it and make it ready to step (caller holds the model lock)."""
        ids = session.prompt_ids
        vector = pooled_to_numpy(session.pooled)
        flagged = None
        if self.online is not None:
            route, flagged = self.online.route(vector)
        else:
            route = self.profile.index.route(vector)
        plan = self.plan(pol, route, ids, getattr(session.state.cache, "features", None) is not None,
                         session.config.temperature)
        obs = None if flagged is None else Observation(vector, tuple(ids), (), plan.applied, flagged,
                                                       learned=flagged and not route.out_of_domain)
        if plan.drafter == "draft-model" and shared_draft_model:
            drafter = self._draft_model  # its own KV cache, reused across one-at-a-time requests (common prefix)
        else:
            drafter = build_drafter(plan.spec, self.engine.backbone)
        run = RoutedDecoding(self.engine.begin(session, drafter, plan.length_policy), plan, obs, engine=self.lm.engine)
        self._observe(run)  # done at the prefill already (its one token was EOS, or one was asked for)
        return run

    def step(self, decodings: Sequence[RoutedDecoding], riders: Sequence[RoutedPrefilling] = ()) -> list[str]:
        """One verification step of each started, unfinished request, verified together in one forward
        (:meth:`Engine.step`) that also carries the next chunk of each of ``riders`` (requests being
        prefilled whose ``can_ride``); each decoding's text delta. Greedy outputs are those of
        decoding each alone. Several requests draft the lengths that goodput pricing gives the batch
        (:meth:`batch_choices`)."""
        with self._lock:
            choices = self.batch_choices(decodings) if self.goodput and len(decodings) > 1 else None
            deltas = self.engine.step([d.decoding for d in decodings], choices, [r.task for r in riders])
        for d in decodings:
            self._observe(d)
        return deltas

    def batch_choices(self, decodings: Sequence[RoutedDecoding]) -> list[DraftChoice | None]:
        """Each request's draft choice for one batched step: every length policy that prices its drafts
        (a Thompson bandit's :meth:`~adaptive.engine.protocol.DraftLengthPolicy.plan`) is given the
        length that maximises the batch's expected tokens per unit time on this engine's measured
        verification costs (the profile's global verify table, a forward over 1, 2, ... rows:
        :func:`~adaptive.costs.batch.batch_draft_lengths`), or, where the batch replays batched CUDA graphs, on
        their step costs by row bucket timed at warm-up (:meth:`Backbone.batch_step_costs
        <adaptive.engine.backbone.Backbone.batch_step_costs>`, :func:`~adaptive.costs.batch.padded_draft_lengths`:
        speculation off where no bucket pays); ``None`` where the request's own length policy
        chooses (a fixed length) or it cannot draft (its row counts all the same)."""
        priced, plans, fixed = [], [], 0
        for i, d in enumerate(decodings):
            lane = d.decoding.lane
            plan = lane.length_policy.plan(lane.max_draft) if lane.max_draft > 0 else None
            if plan is None:
                fixed += 1
            else:
                priced.append(i)
                plans.append(plan)
        choices: list[DraftChoice | None] = [None] * len(decodings)
        costs = getattr(self.engine.backbone, "batch_step_costs", None)  # batched graphs' own, timed at warm-up
        steps = costs(len(decodings)) if costs is not None else None
        if steps is not None:  # every request feeds the batch's row bucket: priced by bucket
            lengths = padded_draft_lengths([p.gains for p in plans], [p.costs for p in plans], steps,
                                           fixed_rows=fixed)
        else:
            lengths = batch_draft_lengths([p.gains for p in plans], [p.costs for p in plans],
                                          self.profile.global_set.verify, fixed_rows=fixed)
        for i, plan, k in zip(priced, plans, lengths):
            choices[i] = plan.choice(k)
        return choices

    def _observe(self, d: RoutedDecoding) -> None:
        """Hand a finished request's output to the online learner and the listeners (once)."""
        if d.observed or not d.done or (d.observation is None and not self._listeners):
            return
        d.observed = True
        output = tuple(d.decoding.out.ids)
        if d.observation is not None:
            self.online.observe(replace(d.observation, output=output))
        if self._listeners:
            session = d.decoding.session
            finished = FinishedRequest(d.plan.applied, tuple(session.prompt_ids), output, self.lm.engine,
                                       session.config.temperature == 0.0)
            for listener in list(self._listeners):
                listener.observe(finished)

    def add_listener(self, listener: RequestListener) -> None:
        """Hand every request finished from now on to ``listener`` too (:class:`RequestListener`; e.g. a
        :class:`~adaptive.distill.refine.HeadRefiner`); :meth:`close` closes it."""
        self._listeners.append(listener)

    def listener_state(self) -> dict:
        """Each listener's :meth:`~RequestListener.state`, by its name."""
        return {listener.name: listener.state() for listener in self._listeners}

    def set_eagle_head(self, domain: str, head: EagleHead | None) -> None:
        """Draft ``domain``'s requests with ``head`` (one refined on its traffic, of the profile's head's
        shape and rows) where they draft with the eagle head; ``None``: the profile's head again. A domain
        learned online without a head of its own drafts with the global record's (:meth:`refined_eagle`).
        Requests already decoding keep theirs."""
        if head is not None and not self.features:
            raise ConfigError(f"the {self.lm.engine} engine does not draft with an eagle head here")
        with self._state_lock:
            old = self._domain_eagle.pop(domain, None)
            if head is not None:
                self._domain_eagle[domain] = head.to(self.lm.backbone.device)
            stale = old is not None and old is not head and all(h is not old for h in self._domain_eagle.values())
        if stale:  # its captured levels (CUDA graphs) go with it, between two steps (they replay under the model lock)
            with self._lock:
                release_head(old, self.lm.backbone)

    def refined_eagle(self, domain: str) -> EagleHead | None:
        """The head ``domain`` drafts with instead of the profile's (``None``: the profile's)."""
        with self._state_lock:
            return self._refined_eagle(domain)

    def _refined_eagle(self, domain: str) -> EagleHead | None:
        """:meth:`refined_eagle`: its own (:meth:`set_eagle_head`), else, for a domain learned online (its
        requests went to the global record before it was learned), the global record's (caller holds the
        state lock)."""
        head = self._domain_eagle.get(domain)
        if head is None and domain not in self.profile.domains and domain != GLOBAL:
            head = self._domain_eagle.get(GLOBAL)
        return head

    def _head_candidate(self) -> HeadCandidate:
        """The eagle head a domain learned online races (:mod:`adaptive.runtime.online`): the one its requests
        drafted with before it was learned (the global record's refined head, else the profile's), priced by
        the profile's record."""
        with self._state_lock:
            spec, rec = self._distilled("eagle")
            head = self._domain_eagle.get(GLOBAL)
        return HeadCandidate(head if head is not None else spec.eagle, rec.acceptance, rec.draft_cost)

    def eagle_heads(self) -> dict[str, EagleHead]:
        """The domains drafting with a head of their own (:meth:`set_eagle_head`), and those heads."""
        with self._state_lock:
            return dict(self._domain_eagle)

    def stream(self, prompt: str | Sequence[dict], max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
               policy: str = ROUTED_POLICY, confidence_threshold: float | None = None,
               chat: bool | None = None) -> Iterator[str | RuntimeResult]:
        """Yield text deltas, then the final :class:`RuntimeResult`. ``policy``: one of ``POLICIES``;
        ``chat``: see :meth:`encode`."""
        return self.stream_ids(self.encode(prompt, chat), max_new_tokens, temperature, top_p, top_k, stop, seed,
                               policy, confidence_threshold)

    def stream_ids(self, ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
                   policy: str = ROUTED_POLICY, confidence_threshold: float | None = None,
                   engine_choice: dict | None = None) -> Iterator[str | RuntimeResult]:
        """:meth:`stream` of encoded prompt ``ids`` (``engine_choice``: recorded on the result)."""
        pol = self._decodable(policy)
        cfg = self.config(max_new_tokens, temperature, top_p, top_k, stop, seed, confidence_threshold, pol.name)
        return self._stream(list(ids), cfg, pol, engine_choice)

    def _stream(self, ids: list[int], cfg: GenerationConfig, pol: Policy,
                engine_choice: dict | None) -> Iterator[str | RuntimeResult]:
        # One request at a time on the model. The lock is held while the caller iterates and released
        # when the generator finishes or is closed (or garbage-collected, if abandoned).
        with self._lock:
            run = self._start(ids, cfg, pol, shared_draft_model=True)
            run.engine_choice = engine_choice
            if run.first:
                yield run.first
            while not run.done:
                delta = self.step([run])[0]
                if delta:
                    yield delta
            yield run.result()

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> RuntimeResult:
        """Decode ``prompt`` (a string or chat messages); see :meth:`stream` for the options."""
        result = None
        for item in self.stream(prompt, **kwargs):
            result = item
        return result

    def close(self) -> None:
        """Stop the listeners and a running online measurement, and save what was learned."""
        for listener in self._listeners:
            listener.close()
        if self.online is not None:
            self.online.close()

    def bandit_state(self) -> dict:
        """Each ``"policy:domain[@tT]"`` bandit's posterior and choices so far (does not wait for a running decode)."""
        with self._state_lock:
            bandits = dict(self._bandits)
        return {k: b.state() for k, b in bandits.items()}
