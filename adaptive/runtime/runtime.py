"""``AdaptiveRuntime``: route each request with a calibration profile and decode it losslessly.

Per request: the prompt is encoded as at calibration (the profile's chat setting); the engine's
prefill yields the prompt embedding (no extra forward); the anchor index picks the domain
(distance-weighted KNN vote; out-of-domain requests use the global set); the domain's decision
from calibration applies (``ssd`` with its skip set, ``pld`` prompt lookup, or ``cascade``,
whichever measured fastest where it beat plain decoding by the margin; ``ar`` otherwise); the
domain's Thompson-sampling bandit picks each step's draft length. Method ``cascade`` drafts every
request with its domain's cascade (the bigram-backed statistical drafter under and after the
domain's skip set), its split and draft length chosen by a two-level Thompson sampler. Methods
``early-exit`` and ``draft-model`` draft every request with the drafter ``adaptive distill``
stored in the profile, the draft length chosen by the routed domain's Thompson sampler (EESD).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from adaptive.costs import STAT_DRAFT_COST as PLD_DRAFT_COST
from adaptive.costs import best_draft_length, extrapolate
from adaptive.drafters.cascade import CascadePlan as CascadeConfig
from adaptive.drafters.cascade import CascadeDrafter
from adaptive.engine.protocol import FixedDraftLength
from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.drafters.ngram import NgramDrafter
from adaptive.drafters.vocab import DraftHead
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine, GenerationResult
from adaptive.engine.loop import Plan
from adaptive.errors import ConfigError
from adaptive.index.embedding import pooled_to_numpy
from adaptive.index.router import Decision, decide
from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength

METHODS = ("knn-ssd", "cascade", "knn-skip", "early-exit", "draft-model", "ssd-static", "ar")
DISTILLED_METHODS = ("early-exit", "draft-model")  # drafters trained by `adaptive distill`, stored in the profile


@dataclass
class RuntimeResult(GenerationResult):
    """A :class:`GenerationResult` with the routing decision (``info`` holds it all for JSON)."""

    @property
    def domain(self) -> str | None:
        """The routed domain; ``None`` when the request was out-of-domain (global set)."""
        return self.info.get("route", {}).get("domain")

    @property
    def neighbours(self) -> list[dict]:
        return self.info.get("route", {}).get("neighbours", [])

    @property
    def skip(self) -> str | None:
        """The skip set drafted with (text form), ``None`` unless layer-skip drafting was used."""
        return self.info.get("skip_text")

    @property
    def decision(self) -> str:
        """What decoded the request: ``ssd`` (layer-skip drafting), ``pld`` (prompt lookup), ``cascade``,
        ``early-exit``, ``draft-model`` or ``ar``."""
        return self.info.get("decision", "ar")

    @property
    def draft_lengths(self) -> dict[int, int]:
        """Draft length -> number of steps (0: the bandit chose a plain step)."""
        return dict(self.stats.draft_lengths)


def _prior(a) -> tuple[float, float]:
    """Beta pseudo-counts worth ~10 observed drafts around a measured per-token acceptance ``a``."""
    a = min(max(float(a), 0.01), 0.99)
    return 1.0 + 10.0 * a, 1.0 + 10.0 * (1.0 - a)


class AdaptiveRuntime:
    """Serving-side entry point; safe to share between threads (requests are serialised on the model).

    ``method``: ``"knn-ssd"`` (routed: the profile's per-domain decision), ``"cascade"`` (routed: the
    domain's cascade drafter), ``"knn-skip"`` (routed: always the domain's skip set, KNN-SSD as
    published), ``"ssd-static"`` (the global skip set for every request, the Self-SD baseline), or
    ``"ar"``; ``"early-exit"`` and ``"draft-model"`` (routed: the distilled drafter of that kind, a
    Thompson sampler per domain for its draft length). ``bandit=False`` drafts the fixed draft
    length calibration found (for a distilled drafter: the one its measured acceptance and cost
    give, at least 1) instead of Thompson sampling. ``reduced_vocab=False`` keeps the full LM head for layer-skip drafts in every domain
    (by default a domain drafts over its reduced vocabulary where calibration measured that faster).
    """

    def __init__(self, profile, lm, *, bandit: bool = True, seed: int | None = 0, window: float = 500.0,
                 reduced_vocab: bool = True):
        profile.check_model(lm.fingerprint())
        self.profile = profile
        self.lm = lm
        self.engine = Engine(lm)
        self.bandit = bandit
        self.reduced_vocab = reduced_vocab
        self._heads: dict[str, tuple] = {}  # domain -> (ids, LM-head rows): gathered once, reused per request
        self._seed = seed
        self._window = window
        self._lock = threading.RLock()  # the model: one decode at a time (re-entrant: route() inside stream())
        self._state_lock = threading.Lock()  # bandits and drafters, created on first use
        self._bandits: dict[str, ThompsonDraftLength] = {}
        self._drafters: dict[str, object] = {}
        self._cascade_policies: dict[str, object] = {}
        self.max_draft_len = int(profile.settings.get("max_draft_len", 8))
        self.cascade_max_len = int(profile.settings.get("cascade_max_draft_len", self.max_draft_len))

    @classmethod
    def from_profile(cls, directory: str | Path, model=None, device: str = "auto", dtype: str | None = None,
                     **kwargs) -> "AdaptiveRuntime":
        """Load a profile and its model (the one it names unless ``model`` is a spec or a loaded model).

        A model the profile was not calibrated for is a :class:`~adaptive.profile.ProfileError`.
        ``dtype`` defaults to the one calibration used.
        """
        from adaptive.models import LoadedModel, load_model
        from adaptive.profile import load_profile

        profile = load_profile(directory)
        if isinstance(model, LoadedModel):
            lm = model
        else:
            spec = model or profile.model.get("spec") or profile.model.get("name")
            lm = load_model(spec, device=device, dtype=dtype or profile.model.get("dtype", "auto"))
        return cls(profile, lm, **kwargs)

    # -- routing -------------------------------------------------------------------------------

    def route(self, prompt: str | Sequence[dict]) -> Decision:
        """Route without decoding (one prefill forward)."""
        from adaptive.index.embedding import embed_prompt

        ids = self.engine.encode(prompt, chat=self.profile.settings.get("chat"))
        with self._lock:
            vec = embed_prompt(self.engine.backbone, ids)
        return decide(self.profile, vec)

    def _policy(self, name: str, dp, use: str) -> ThompsonDraftLength:
        if name not in self._bandits:
            # the prior is the per-token acceptance up to the first rejection, as the bandit models it
            token = dp.extra.get("token_acceptance", {}).get(use)
            if use == "pld":  # a lookup over token ids: negligible against a forward
                c = PLD_DRAFT_COST
                a = token if token is not None else (dp.pld_acceptance if dp.pld_acceptance is not None else 0.5)
            else:
                c = self._draft_cost(dp)
                a = token if token is not None else (
                    dp.measured_acceptance if dp.measured_acceptance is not None else dp.estimated_matchness)
            self._bandits[name] = ThompsonDraftLength(
                c, self._verify(dp, self.max_draft_len), self.max_draft_len, _prior(a),
                window=self._window, seed=None if self._seed is None else self._seed + len(self._bandits))
        return self._bandits[name]

    def _verify(self, dp, max_len: int) -> list[float]:
        """Costs of verifying 0 .. ``max_len`` drafts: measured at the domain's context length where the
        profile has them (``extra.verify``), else the profile's cost model (measured at 128 positions)."""
        measured = dp.extra.get("verify")
        if measured:
            return [extrapolate(measured, k) for k in range(max_len + 1)]
        return [self.profile.cost_model.verify_cost(k) for k in range(max_len + 1)]

    def _draft_cost(self, dp) -> float:
        """A layer-skip draft token's cost in full steps: the estimate, scaled by the measured ratio of the
        reduced head's draft cost to the full head's where this runtime drafts over the reduced vocabulary."""
        vocab = dp.extra.get("vocab", {})
        if self.reduced_vocab and dp.reduced_vocab and vocab.get("draft_cost"):
            costs = vocab["draft_cost"]
            return dp.estimated_draft_cost * costs[str(vocab["size"])] / costs[str(vocab["vocab_size"])]
        return dp.estimated_draft_cost

    def _cascade(self, dp):
        """The domain's cascade drafter and its policy (created once, kept with the bandits)."""
        cc = dp.cascade or CascadeConfig(split=0, draft_len=dp.pld_draft_len, max_split=0)  # a profile without cascades
        use_skip = cc.max_split > 0 and bool(dp.skip.attn or dp.skip.mlp)
        drafter = CascadeDrafter(NgramDrafter(bigram=dp.bigram, min_prob=cc.min_prob), dp.skip if use_skip else None,
                                 self.lm.n_layers, split=cc.split if use_skip else 0, vertical=cc.vertical,
                                 lenience=cc.lenience)
        if not self.bandit:
            return drafter, FixedDraftLength(min(cc.draft_len, self.cascade_max_len))
        stats = dp.extra.get("cascade", {}).get("statistical", {})
        a_s = stats.get("token_acceptance", dp.extra.get("token_acceptance", {}).get("pld") or 0.3)
        # by tail position, up to the first one calibration saw nothing accepted at (or never reached)
        by_pos = list(stats.get("position_acceptance", []))
        by_pos = by_pos[: by_pos.index(0.0)] if 0.0 in by_pos else by_pos
        by_pos = by_pos or [a_s]
        a_n = dp.extra.get("token_acceptance", {}).get("ssd") or dp.measured_acceptance or dp.estimated_matchness
        policy = ThompsonCascade(drafter, self._draft_cost(dp), self._verify(dp, self.cascade_max_len),
                                 self.cascade_max_len, cc.max_split if use_skip else 0, _prior(a_n),
                                 [_prior(a) for a in by_pos],
                                 stat_cost=PLD_DRAFT_COST, window=self._window,
                                 seed=None if self._seed is None else self._seed + len(self._bandits))
        return drafter, policy

    def _distilled(self, kind: str):
        """The profile's distilled drafter of ``kind``, built once (caller holds ``_state_lock``)."""
        if kind not in self._drafters:
            from adaptive.profile import ProfileError

            meta, weights = self.profile.distilled_drafter(kind)
            fp = self.lm.fingerprint()
            if any(str(meta.get("model", {}).get(k)) != str(fp.get(k)) for k in ("config_hash", "weights_hash")):
                raise ProfileError(f"the distilled {kind} drafter was trained for another model "
                                   f"({meta.get('model', {}).get('name')!r}); distill it again for this one")
            bb = self.lm.backbone
            try:
                if kind == "early-exit":
                    from adaptive.drafters.early_exit import EarlyExitDrafter, ExitBlock

                    drafter = EarlyExitDrafter(int(meta["exit_layer"]), self.lm.n_layers,
                                               ExitBlock.from_state(meta["block"], weights),
                                               dtype=bb.dtype, device=bb.device)
                else:
                    from adaptive.drafters.model import ModelDrafter, build_draft_model

                    drafter = ModelDrafter(build_draft_model(meta["model_config"], weights, bb.device, bb.dtype),
                                           label=str(meta.get("name", "draft-model")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ProfileError(f"the distilled {kind} drafter in the profile is malformed "
                                   f"({type(exc).__name__}: {exc})") from None
            self._drafters[kind] = drafter
        return self._drafters[kind]

    def _distilled_policy(self, key: str, dp, kind: str):
        meta = self.profile.distilled[kind]
        a = float(meta.get("after", {}).get("greedy", 0.5))
        cost = float(meta.get("draft_cost", 0.5))
        verify = self._verify(dp, self.max_draft_len)
        if not self.bandit:
            return FixedDraftLength(max(1, best_length(a, cost, verify, self.max_draft_len)))
        if key not in self._bandits:
            self._bandits[key] = ThompsonDraftLength(
                cost, verify, self.max_draft_len, _prior(a), window=self._window,
                seed=None if self._seed is None else self._seed + len(self._bandits))
        return self._bandits[key]

    def _head(self, dp, prompt_ids: list[int]) -> DraftHead | None:
        """The domain's reduced draft head joined with the request's prompt tokens, or ``None``."""
        if not (self.reduced_vocab and dp.reduced_vocab and dp.draft_vocab is not None):
            return None
        with self._state_lock:
            if dp.name not in self._heads:
                weight = self.lm.backbone.lm_head.weight
                ids = torch.as_tensor(dp.draft_vocab, dtype=torch.long, device=weight.device)
                self._heads[dp.name] = (ids, weight[ids].contiguous())
            ids, rows = self._heads[dp.name]
        return DraftHead.build(self.lm.backbone.lm_head.weight, ids, rows, extra=prompt_ids)

    def _plan(self, method: str, prompt_ids: list[int]):
        def plan(pooled) -> Plan:
            d = decide(self.profile, pooled_to_numpy(pooled))
            if method == "ssd-static":
                dp, use = self.profile.global_set, "ssd"
            elif method in ("ar", "cascade", *DISTILLED_METHODS):
                dp, use = self.profile.domain(d.route.domain), method
            elif method == "knn-skip":
                dp = self.profile.domain(d.route.domain)
                use = "ssd" if dp.skip.attn or dp.skip.mlp else "ar"
            else:
                dp, use = self.profile.domain(d.route.domain), d.method
            info = {"route": d.route.to_dict(), "applied": dp.name, "decision": use, "runtime_method": method}
            if use == "ar":
                return Plan(None, None, info)
            key = f"{method}:{dp.name}"
            head = self._head(dp, prompt_ids) if use in ("ssd", "cascade") else None
            with self._state_lock:
                if use in DISTILLED_METHODS:
                    drafter, policy = self._distilled(use), self._distilled_policy(key, dp, use)
                    fixed_len = None if self.bandit else policy.k
                elif use == "cascade":
                    if key not in self._drafters:
                        self._drafters[key], self._cascade_policies[key] = self._cascade(dp)
                        if self.bandit:
                            self._bandits[key] = self._cascade_policies[key]
                    drafter, policy = self._drafters[key], self._cascade_policies[key]
                    fixed_len = None if self.bandit else policy.k
                    drafter.head = head if drafter.skip is not None else None  # requests are serialised
                else:
                    fixed_len = dp.pld_draft_len if use == "pld" else dp.draft_len
                    if head is not None:  # this request's head: a drafter is cheap, one per request
                        drafter = LayerSkipDrafter(dp.skip, self.lm.n_layers, head)
                    else:
                        drafter = self._drafters.get(key)
                        if drafter is None:
                            drafter = self._drafters[key] = (NgramDrafter() if use == "pld"
                                                             else LayerSkipDrafter(dp.skip, self.lm.n_layers))
                    policy = self._policy(key, dp, use) if self.bandit else FixedDraftLength(fixed_len)
            info.update(draft_policy="thompson" if self.bandit else f"fixed {fixed_len}",
                        drafter=drafter.describe())
            if use == "ssd" or (use == "cascade" and drafter.skip is not None):
                info.update(skip_text=dp.skip.to_text(), skip=dp.skip.to_dict())
            return Plan(drafter, policy, info)

        return plan

    # -- decoding ------------------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[dict], max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
               method: str = "knn-ssd", confidence_threshold: float | None = None) -> Iterator[str | RuntimeResult]:
        """Yield text deltas, then the final :class:`RuntimeResult`."""
        if method not in METHODS:
            raise ConfigError(f"unknown runtime method {method!r}; choose one of {', '.join(METHODS)}")
        if isinstance(stop, str):
            stop = (stop,)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               seed=seed, stop=tuple(stop), draft_len=max(self.max_draft_len, self.cascade_max_len),
                               confidence_threshold=confidence_threshold)
        ids = self.engine.encode(prompt, chat=self.profile.settings.get("chat"))
        # One request at a time on the model. The lock is held while the caller iterates and released
        # when the generator finishes or is closed (or garbage-collected, if abandoned).
        with self._lock:
            for item in self.engine.stream(ids, cfg, plan=self._plan(method, ids)):
                if isinstance(item, GenerationResult):
                    info = dict(item.info)
                    if self.bandit and info.get("decision") in ("ssd", "pld", "cascade", *DISTILLED_METHODS):
                        with self._state_lock:
                            bandit = self._bandits[f"{method}:{info['applied']}"]
                        info["bandit"] = bandit.state()
                    yield RuntimeResult(item.text, item.token_ids, item.finish_reason, item.stats,
                                        method, info)
                else:
                    yield item

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> RuntimeResult:
        """Decode ``prompt`` (a string or chat messages); see :meth:`stream` for the options."""
        result = None
        for item in self.stream(prompt, **kwargs):
            result = item
        return result

    def bandit_state(self) -> dict:
        """Each domain bandit's posterior and choices so far (does not wait for a running decode)."""
        with self._state_lock:
            bandits = dict(self._bandits)
        return {k: b.state() for k, b in bandits.items()}
