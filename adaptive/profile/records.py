"""The typed contract between calibration, distillation and the runtime: what a profile holds.

Every record is a frozen dataclass whose JSON form is derived from its fields
(:func:`adaptive.codec.record`), so each field list exists once. ``docs/profile.md`` shows the
JSON. Terms: a *drafter* is one of :data:`adaptive.drafters.factory.DRAFTERS`; a *prior* is what
the runtime's bandit starts from for one drafter in one domain; a *measurement* is one timed
comparison of a drafter against plain decoding (``ar``) on the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from adaptive.codec import from_json, record, text_field
from adaptive.costs import CostModel, best_draft_length, verify_table
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.factory import DRAFTERS
from adaptive.drafters.ngram import DEFAULT_PLD_DRAFT_LEN, BigramTable
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError, ConfigError
from adaptive.index.anchors import AnchorIndex
from adaptive.index.lexicon import Lexicon
from adaptive.models import ModelFingerprint

DECISIONS = ("ar", "ssd", "pld", "cascade", "eagle")  # what a domain may be decided to decode with
GLOBAL = "global"  # the record used for out-of-domain requests (and by the `ssd-static` policy)
DISTILLED_KINDS = ("early-exit", "draft-model", "eagle")  # drafters `adaptive distill` trains into a profile


class ProfileError(AdaptiveError, ValueError):
    """A profile directory is missing, incomplete, corrupt, too old or new, or made for another model."""


@record
class Prior:
    """Where a drafter's bandit starts: ``acceptance`` per token until the first rejection, and one
    draft token's ``draft_cost`` in full steps; ``by_position``: acceptance at each draft position
    (the statistical tail of a cascade; empty elsewhere)."""

    acceptance: float
    draft_cost: float
    by_position: tuple[float, ...] = ()

    def __post_init__(self):
        if not 0.0 <= self.acceptance <= 1.0 or self.draft_cost < 0:
            raise ValueError(f"a prior needs acceptance in [0, 1] and draft_cost >= 0, got {self}")


@record
class Priors:
    """A domain's priors per drafter: ``layer_skip`` (``ssd`` and a cascade's layer-skip level, full
    LM head), ``lookup`` (``pld``), ``statistical`` (a cascade's bigram-backed tail, by position).
    ``reduced_head_cost``: a layer-skip draft token's cost over the domain's reduced vocabulary."""

    layer_skip: Prior
    lookup: Prior
    statistical: Prior
    reduced_head_cost: float | None = None


@record
class Interval:
    """A bootstrap interval (:mod:`adaptive.measure.interval`): ``low`` to ``high`` at ``level``
    (two-sided), of a timed speedup over ``blocks`` paired blocks of plain and speculative decoding, or
    of a share of drafts kept over ``blocks`` held-out sequences."""

    low: float
    high: float
    level: float = 0.9
    blocks: int = 0

    def __post_init__(self):
        if not self.low <= self.high or not 0.0 < self.level < 1.0:
            raise ValueError(f"an interval needs low <= high and a level in (0, 1), got {self}")

    def to_text(self, digits: int = 2) -> str:
        """``[0.95, 1.12]``: how tables show it (``digits`` decimals)."""
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]"


@record
class Measurement:
    """One timed run of a drafter against ``ar``, interleaved on the same prompts, decode phase only.

    ``role`` says why it was run: ``candidate`` (a searched skip set), ``lookup`` (prompt lookup),
    ``cascade``, ``vocab`` (the best skip set over a reduced head), ``eagle`` (the profile's eagle head,
    raced by ``adaptive distill``) or ``recheck`` (the winner, timed again). ``acceptance``: accepted /
    drafted; ``token_acceptance``: per token until the first rejection; ``mean_accepted``: tokens per
    verification step. ``skip``: the skip set it
    drafted with (stored as its text form, ``"attn=1,3;mlp=2"`` or ``"none"``, as profiles always have).
    """

    drafter: str
    role: str
    draft_len: int
    speedup: float
    acceptance: float = 0.0
    token_acceptance: float = 0.0
    mean_accepted: float = 1.0
    ar_tokens_per_s: float = 0.0
    tokens_per_s: float = 0.0
    identical_outputs: int = 0
    prompts: int = 0
    repeats: int = 1
    skip: SkipSet = text_field(default=SkipSet())
    estimated_acceptance: float | None = None
    estimated_draft_cost: float | None = None
    estimated_speedup: float | None = None
    cascade: CascadePlan | None = None
    draft_vocab: int | None = None
    interval: Interval | None = None
    verdict: str = ""


@record
class SkipSearch:
    """The best skip set the search found for a domain, at its best draft length, and its estimate
    (an empty skip set: none above the acceptance floor, or none searched). ``bound``: the most
    any skip set of the ranked space could reach (:mod:`adaptive.calibrate.bound`), against the
    ``reference`` it had to beat (:attr:`may_pay`); a domain's search went past the bound's corners
    only where it may pay, the global set's always (it seeds the domains and is ``ssd-static``'s set).
    ``seeded``: the set is the global set or one of its neighbours, scored on this domain's text
    (:func:`adaptive.calibrate.search.neighbours`; the domain's own search may have found it too)."""

    skip: SkipSet
    draft_len: int
    estimated_acceptance: float = 0.0
    estimated_draft_cost: float = 1.0
    estimated_speedup: float = 0.0
    trials: int = 0
    bound: float | None = None
    reference: float | None = None
    seeded: bool = False

    @property
    def may_pay(self) -> bool:
        """Whether the bound left room for layer skipping to beat the reference (always, without a bound)."""
        return self.bound is None or self.reference is None or self.bound >= self.reference

    def __post_init__(self):
        if self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1, got {self.draft_len}")


@record
class StatisticalAcceptance:
    """Teacher-forced acceptance of the statistical drafter on a domain's continuations
    (:func:`adaptive.measure.statistical.statistical_acceptance`)."""

    token_acceptance: float
    position_acceptance: tuple[float, ...]
    available: float = 0.0
    positions: int = 0
    accepted_per_step: float = 0.0
    drafted_per_step: float = 0.0


@record
class VocabChoice:
    """The domain's reduced draft vocabulary: ``size`` of ``vocab_size`` rows; per size tried, its
    leave-one-out ``coverage``, measured ``draft_cost`` and ``estimate`` (expected speedup at
    ``draft_len``); ``full_estimate`` for the full head. ``use``: measured faster than the full head."""

    size: int
    vocab_size: int
    draft_len: int
    coverage: dict[str, float]
    draft_cost: dict[str, float]
    estimate: dict[str, float]
    full_estimate: float
    use: bool = False


@record
class Decision:
    """What decodes a domain: ``drafter`` (one of :data:`DECISIONS`), at fixed length ``draft_len``
    when no bandit runs, chosen on measured ``speedup`` against ``ar`` (1.0 for ``ar``)."""

    drafter: str
    draft_len: int = 1
    speedup: float = 1.0

    def __post_init__(self):
        if self.drafter not in DECISIONS:
            raise ValueError(f"a domain decodes with one of {', '.join(DECISIONS)}, got {self.drafter!r}")
        if self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1, got {self.draft_len}")


@record
class DomainRecord:
    """What calibration found for one domain (or the global record over all domains).

    ``verify``: costs of a full forward over 1, 2, ... tokens at ``verify_context`` cached positions
    (the domain's own prompt length); :meth:`verify_table` extends them. ``bigram`` and
    ``draft_vocab`` (token ids, best first) are stored beside the JSON (``bigrams.npz``, ``vocab.npz``).
    """

    name: str
    decision: Decision
    layer_skip: SkipSearch
    priors: Priors
    verify: tuple[float, ...]
    verify_context: int = 0
    cascade: CascadePlan = field(default_factory=lambda: CascadePlan(split=0, max_split=0))
    statistical: StatisticalAcceptance | None = None
    vocab: VocabChoice | None = None
    measurements: tuple[Measurement, ...] = ()
    prompts: int = 0
    anchors: int = 0
    bigram: BigramTable | None = field(default=None, compare=False, repr=False, metadata={"json": False})
    draft_vocab: np.ndarray | None = field(default=None, compare=False, repr=False, metadata={"json": False})

    def __post_init__(self):
        if not self.verify or any(v <= 0 for v in self.verify):
            raise ValueError(f"domain {self.name!r}: verify costs must be positive, one per token count from 1")

    def verify_table(self, max_len: int) -> tuple[float, ...]:
        return verify_table(self.verify, max_len)

    @property
    def reduced_vocab(self) -> bool:
        """Layer-skip drafts of this domain run over its reduced vocabulary (measured faster)."""
        return self.vocab is not None and self.vocab.use and self.draft_vocab is not None

    def seconds_per_token(self, cost_model: CostModel, greedy: bool = True) -> float:
        """Expected seconds per new token under this domain's decision: plain decoding's measured pace
        (the mean ``ar_tokens_per_s`` of its races, whole decoding loop; the cost model's step where
        none was timed) over the decision's measured speedup. The races decode greedily, so a sampled
        request (``greedy=False``) is priced at plain decoding's pace: its drafts are kept less often
        and its bandit drafts only where that pays (:func:`~adaptive.runtime.bandit.temperature_class`)."""
        rates = [m.ar_tokens_per_s for m in self.measurements if m.ar_tokens_per_s > 0]
        plain = len(rates) / sum(rates) if rates else cost_model.step_ms / 1e3
        return plain / max(self.decision.speedup, 1e-6) if greedy else plain

    def copy_length(self, max_len: int) -> int:
        """How long the eagle drafter's copies of the context run where its length is fixed (a race, a
        runtime without bandits): the draft length that pays best at prompt lookup's calibrated
        acceptance and cost, by the formula the bandit's copy posterior chooses with
        (:class:`~adaptive.runtime.bandit.ThompsonDraftLength`)."""
        lookup = self.priors.lookup
        return best_draft_length(lookup.acceptance, lookup.draft_cost, self.verify_table(max_len), max_len)[0]

    def layer_skip_cost(self, reduced: bool) -> float:
        """A layer-skip draft token's cost: over the reduced head where ``reduced`` and chosen."""
        if reduced and self.reduced_vocab and self.priors.reduced_head_cost is not None:
            return self.priors.reduced_head_cost
        return self.priors.layer_skip.draft_cost


@record
class RuntimeSettings:
    """What the runtime takes from calibration: how prompts were encoded (``chat``; ``None``: the
    tokenizer's template when it has one) and the longest drafts the bandits may choose."""

    chat: bool | None = None
    max_draft_len: int = 8
    cascade_max_draft_len: int = 12  # statistical tokens cost no forward: the cascade may draft longer
    pld_draft_len: int = DEFAULT_PLD_DRAFT_LEN


@record
class MeasureSettings:
    """How a domain's drafters are measured: written by calibration (``profile.json``'s ``settings``,
    among the calibration's other settings) and read by the runtime, whose online learner measures a
    domain it finds in traffic the same way. Each default is here once
    (:class:`~adaptive.calibrate.settings.CalibrationSettings` takes them from this record).
    Validated on construction (:class:`~adaptive.errors.ConfigError` naming the field).

    The race (:class:`~adaptive.measure.timing.RaceConfig`): up to ``confirm_prompts`` prompts of
    ``confirm_tokens`` tokens, in paired blocks of ``block_tokens``; a candidate's verdict after
    ``min_blocks`` blocks of ``min_prompts`` prompts, once its bootstrap interval at ``interval_level``
    (prompts resampled with ``seed``) clears or misses ``1 + min_gain``. The decision: a drafter
    accepting fewer than ``acceptance_floor`` tokens per step is never faster. The statistical drafter: bigrams seen
    ``bigram_min_count`` times, a cascade's ``cascade_lenience``. Routing: at most
    ``anchors_per_domain`` anchors per domain (calibrated or learned)."""

    anchors_per_domain: int = 10
    confirm_prompts: int = 6  # the most prompts a domain's drafters are timed on (the race stops earlier when settled)
    confirm_tokens: int = 64  # the most tokens timed per prompt
    block_tokens: int = 16  # tokens per paired block of the race (ar and each candidate from the same state)
    min_blocks: int = 6  # blocks before a candidate's interval may settle it
    min_prompts: int = 2  # and the prompts they come from (the interval resamples prompts)
    interval_level: float = 0.9  # two-sided level of the bootstrap interval of a timed speedup
    min_gain: float = 0.02  # the margin: a drafter is declared faster when its interval's low end is >= 1 + min_gain
    acceptance_floor: float = 0.2  # below it a skip set is never a candidate, a drafter never declared faster
    bigram_min_count: int = 2
    cascade_lenience: float = 1.0
    seed: int = 0

    def __post_init__(self):
        problem = self._problem()
        if problem is not None:
            key, why = problem
            raise ConfigError(f"{key.replace('_', '-')} {why}", key=key)

    def _problem(self) -> tuple[str, str] | None:
        """The first impossible field and why, e.g. ``("min_gain", "must be in [0, 1), got 1.5")``."""
        for key in ("anchors_per_domain", "confirm_prompts", "confirm_tokens", "block_tokens", "min_blocks",
                    "min_prompts", "bigram_min_count"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return key, f"must be a positive integer, got {v!r}"
        for key in ("interval_level", "min_gain", "acceptance_floor", "cascade_lenience"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return key, f"must be a number, got {v!r}"
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            return "seed", f"must be an integer, got {self.seed!r}"
        if self.confirm_tokens < 2:
            return "confirm_tokens", f"must be at least 2 (decode-phase timing), got {self.confirm_tokens}"
        if self.block_tokens >= self.confirm_tokens:
            return "block_tokens", f"({self.block_tokens}) must be below confirm-tokens ({self.confirm_tokens})"
        if not 0 <= self.min_gain < 1:
            return "min_gain", f"must be in [0, 1), got {self.min_gain}"
        if not 0.5 <= self.interval_level < 1:
            return "interval_level", f"must be in [0.5, 1), got {self.interval_level}"
        if not 0 <= self.acceptance_floor < 1:
            return "acceptance_floor", f"must be in [0, 1), got {self.acceptance_floor}"
        if not self.cascade_lenience >= 1.0:
            return "cascade_lenience", f"must be >= 1, got {self.cascade_lenience}"
        return None

    @classmethod
    def split(cls, recorded: dict) -> tuple[MeasureSettings, dict]:
        """A calibration's settings as recorded (``profile.json``'s ``settings``) -> this record (a key
        missing: its default) and the other keys, as they are. ``ValueError`` naming the key for a
        value of the wrong type, :class:`~adaptive.errors.ConfigError` (with its ``key``) for an
        impossible one.

        Example: ``{"block_tokens": 8, "trials": 30}`` -> ``(MeasureSettings(block_tokens=8), {"trials": 30})``.
        """
        if not isinstance(recorded, dict):
            raise ValueError(f"settings: expected an object, got {type(recorded).__name__}")
        mine = {f.name for f in fields(cls)}
        return (from_json(cls, {k: v for k, v in recorded.items() if k in mine}, "settings"),
                {k: v for k, v in recorded.items() if k not in mine})


@record
class DistilledRecord:
    """A drafter trained by ``adaptive distill``: for the target ``model``, its held-out greedy
    ``acceptance`` and measured ``draft_cost``; the early-exit drafter's ``exit_layer`` and ``block``
    shape, the draft model's ``model_config``, or the eagle head's ``shape`` (a
    :class:`~adaptive.drafters.eagle.HeadShape` as a dict); how it was trained and its learning curve.
    An eagle head also records its held-out acceptance per draft position (``positions``: the share of
    drafts ``1 .. s`` all kept, for each ``s``), ``tau`` (1 + their sum: tokens per verification of a
    chain that long), the same per domain (``by_domain``), its rows (``vocab``) and their ``coverage`` of
    the held-out answers' tokens; ``interval`` and ``domain_intervals``: the first draft's 90% bootstrap
    :class:`Interval` over the held-out sequences, over the mix and per domain (``None`` and empty in
    profiles distilled before it was recorded)."""

    kind: str
    model: ModelFingerprint
    acceptance: float
    draft_cost: float
    exit_layer: int | None = None
    block: dict[str, Any] | None = None
    model_config: dict[str, Any] | None = None
    shape: dict[str, Any] | None = None
    positions: tuple[float, ...] = ()
    tau: float = 0.0
    by_domain: dict[str, Any] = field(default_factory=dict)
    interval: Interval | None = None
    domain_intervals: dict[str, Interval] = field(default_factory=dict)
    vocab: int = 0
    coverage: float = 0.0
    name: str = ""
    source: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    train_positions: int = 0
    eval_positions: int = 0
    train_prompts: int = 0
    eval_prompts: int = 0
    domains: tuple[str, ...] = ()
    train_seconds: float = 0.0
    seconds: float = 0.0
    history: tuple[dict[str, Any], ...] = ()
    created: str = ""

    def __post_init__(self):
        if self.kind not in DISTILLED_KINDS or self.kind not in DRAFTERS:
            raise ValueError(f"a distilled drafter is one of {', '.join(DISTILLED_KINDS)}, got {self.kind!r}")

    def kept_text(self) -> str:
        """The held-out first draft kept over the mix, with its interval where recorded:
        ``0.481 [0.452, 0.509]``, or ``0.481``."""
        return f"{self.acceptance:.3f}" + (f" {self.interval.to_text(3)}" if self.interval is not None else "")


@dataclass
class Profile:
    """A loaded (or freshly calibrated) profile. ``settings``: how its domains were measured (what
    the runtime reads of the calibration's settings); ``calibration``: the calibration's other
    settings and its run (``space``, ``trials``, ..., ``jobs``, ``backend``, ``seconds``) as recorded,
    shown by ``adaptive profile show`` and read by nothing. ``profile.json`` holds both under ``settings``.
    ``lexicon``: the domains guessed from token ids alone, which price the two-engine runtime's choice
    (:mod:`adaptive.index.lexicon`; ``None`` in profiles calibrated before it)."""

    model: ModelFingerprint
    settings: MeasureSettings
    runtime: RuntimeSettings
    cost_model: CostModel
    domains: dict[str, DomainRecord]
    global_set: DomainRecord
    index: AnchorIndex
    created: str = ""
    version: str = ""
    path: Path | None = None
    distilled: dict[str, DistilledRecord] = field(default_factory=dict)
    distilled_weights: dict = field(default_factory=dict, repr=False)  # kind -> {name: tensor}
    calibration: dict = field(default_factory=dict)
    lexicon: Lexicon | None = None

    def distilled_drafter(self, kind: str) -> tuple[DistilledRecord, dict]:
        """``(record, weights)`` of the drafter ``kind`` trained by ``adaptive distill``, or :class:`ProfileError`."""
        if kind not in self.distilled:
            where = f" {self.path}" if self.path else ""
            raise ProfileError(f"the profile{where} has no distilled {kind} drafter; train one with "
                               f"`adaptive distill --drafter {'MODEL' if kind == 'draft-model' else kind}`")
        return self.distilled[kind], self.distilled_weights[kind]

    @property
    def n_layers(self) -> int:
        return self.model.n_layers

    def domain(self, name: str | None) -> DomainRecord:
        """The domain's record, or the global one for ``None`` (out-of-domain)."""
        if name is None:
            return self.global_set
        try:
            return self.domains[name]
        except KeyError:
            raise ProfileError(
                f"the profile has no domain {name!r}; it has {', '.join(sorted(self.domains))}"
            ) from None

    def skip_sets(self) -> tuple[SkipSet, ...]:
        """Each record's skip set (the global record's too), distinct: those the decisions draft with (a
        layer-skip decision's, a cascade's with a layer-skip level) and those a request may ask for with a
        policy that forces layer skipping whatever the decision (``knn-skip``, ``ssd-static``, ``cascade``);
        what a server captures at startup."""
        out: dict[SkipSet, None] = {}
        for d in (*self.domains.values(), self.global_set):
            if d.layer_skip.skip:
                out[d.layer_skip.skip] = None
        return tuple(out)

    def seconds_per_token(self, domain: str | None = None, greedy: bool = True) -> float:
        """Expected seconds per new token before the request is routed: ``domain``'s
        :meth:`DomainRecord.seconds_per_token` where it is one of the profile's domains (a guess, e.g.
        :meth:`Lexicon.guess <adaptive.index.lexicon.Lexicon.guess>`), else each domain's weighted by
        its calibration prompts (the global record's without domains); ``greedy=False``: a sampled
        request's, plain decoding's pace."""
        if domain in self.domains:
            return self.domains[domain].seconds_per_token(self.cost_model, greedy)
        doms = [d for d in self.domains.values() if d.prompts > 0] or [self.global_set]
        weights = [max(d.prompts, 1) for d in doms]
        return sum(w * d.seconds_per_token(self.cost_model, greedy) for w, d in zip(weights, doms)) / sum(weights)

    def check_model(self, fingerprint: ModelFingerprint) -> None:
        """Raise :class:`ProfileError` unless ``fingerprint`` is this profile's model, on its engine."""
        where = f" ({self.path})" if self.path else ""
        if self.model.engine != fingerprint.engine:
            raise ProfileError(
                f"the profile{where} was calibrated on the {self.model.engine} engine, not {fingerprint.engine}: "
                f"its timings hold there only; load it with --engine {self.model.engine} or calibrate with "
                f"--engine {fingerprint.engine}")
        if not self.model.same_model(fingerprint):
            raise ProfileError(
                f"the profile{where} was calibrated for {self.model.name!r} (weights {self.model.weights_hash}, "
                f"config {self.model.config_hash}), not for the loaded model {fingerprint.name!r} (weights "
                f"{fingerprint.weights_hash}, config {fingerprint.config_hash}); calibrate this model or load the "
                "profile's model")

    def summary_rows(self) -> list[dict]:
        """One row per domain (then the global record) for tables."""
        rows = []
        def timed_text(m: Measurement | None) -> str | None:
            if m is None:
                return None
            return f"{m.speedup:.2f} {m.interval.to_text()}" if m.interval is not None else f"{m.speedup:.2f}"

        for d in [*(self.domains[n] for n in sorted(self.domains)), self.global_set]:
            timed = {m.role: m for m in d.measurements}
            ls = d.layer_skip
            ssd = timed.get("vocab") if d.reduced_vocab else timed.get("candidate")
            chosen = next((m for m in d.measurements if m.drafter == d.decision.drafter and m.verdict == "faster"
                           and m.speedup == d.decision.speedup), None)
            rows.append({"domain": d.name, "prompts": d.prompts, "anchors": d.anchors,
                         "skip_attn": len(ls.skip.attn), "skip_mlp": len(ls.skip.mlp), "draft_len": ls.draft_len,
                         "bound": ls.bound, "reference": ls.reference, "trials": ls.trials,
                         "est_acceptance": ls.estimated_acceptance if ls.skip.size else None,
                         "meas_acceptance": ssd.token_acceptance if ssd is not None else None,
                         "est_speedup": ls.estimated_speedup if ls.skip.size else None,
                         "meas_speedup": ssd.speedup if ssd is not None else None, "ssd_timed": timed_text(ssd),
                         "pld_speedup": timed["lookup"].speedup if "lookup" in timed else None,
                         "pld_timed": timed_text(timed.get("lookup")),
                         "cascade_speedup": timed["cascade"].speedup if "cascade" in timed else None,
                         "cascade_timed": timed_text(timed.get("cascade")),
                         "draft_vocab": d.vocab.size if d.reduced_vocab else None,
                         "decision": d.decision.drafter, "decision_speedup": d.decision.speedup,
                         "decision_interval": chosen.interval.to_text() if chosen and chosen.interval else None,
                         "skip": ls.skip.to_text()})
        return rows
