"""A domain's race and what follows from it alone: shared by calibration and the online learner.

:func:`race_domain` races a domain's candidates against ``ar`` (:func:`~.timing.race_candidates`
with the :class:`~.timing.RaceConfig` of the :class:`~adaptive.profile.MeasureSettings`) and
decides (:func:`~.decision.decide` at their ``acceptance_floor``). :meth:`DomainRace.record` builds
the domain's :class:`~adaptive.profile.DomainRecord` around the result: the decision, the
measurements in :data:`~.decision.ROLES` order, and the priors of the statistical drafters (prompt
lookup's measured acceptance, the bigram-backed drafter's teacher-forced one).

Calibration (:mod:`adaptive.calibrate.domain`) races :func:`statistical_candidates` plus the best
skip set, checkpointed, and adds the search's layer-skip prior, skip set, reduced vocabulary and
tables; the online learner (:mod:`adaptive.runtime.online`) races a learned domain's statistical
drafters only (:func:`measure_learned_domain`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from adaptive.costs import STAT_DRAFT_COST, best_draft_length
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.live import LiveBigramTable, accepted_text
from adaptive.drafters.ngram import BigramTable
from adaptive.engine.skip import SkipSet
from adaptive.measure.decision import ROLES, decide
from adaptive.measure.statistical import choose_cascade, statistical_acceptance
from adaptive.measure.timing import Candidate, RaceConfig, race_candidates
from adaptive.models import LoadedModel
from adaptive.profile import (
    Decision,
    DomainRecord,
    Measurement,
    MeasureSettings,
    Prior,
    Priors,
    Profile,
    SkipSearch,
    StatisticalAcceptance,
    VocabChoice,
)

NO_LAYER_SKIP = Prior(0.0, 1.0)  # the layer-skip prior of a domain without a skip set


def statistical_candidates(pld_draft_len: int, plan: CascadePlan, skip: SkipSet | None = None,
                           lookup_estimate: float | None = None, cascade_estimate: float | None = None,
                           layer_skip_cost: float = 1.0) -> dict[str, Candidate]:
    """The candidates every domain races: prompt lookup (role ``lookup``, ``pld`` drafting
    ``pld_draft_len``) and the cascade (role ``cascade``: ``plan``, its layer-skip level drafting with
    ``skip``, none by default, at ``layer_skip_cost`` steps a token), each with its estimated speedup
    where there is one and its estimated cost per draft token (:func:`cascade_draft_cost`)."""
    return {"lookup": Candidate("pld", pld_draft_len, estimated_draft_cost=STAT_DRAFT_COST,
                                estimated_speedup=lookup_estimate),
            "cascade": Candidate("cascade", plan.draft_len, skip=skip or SkipSet(), cascade=plan,
                                 estimated_draft_cost=cascade_draft_cost(plan, layer_skip_cost),
                                 estimated_speedup=cascade_estimate)}


def cascade_draft_cost(plan: CascadePlan, layer_skip_cost: float) -> float:
    """A cascade's estimated cost per draft token, in target steps: ``plan.split`` layer-skip tokens
    at ``layer_skip_cost``, the rest statistical (:data:`STAT_DRAFT_COST`). Example: split 1 of 4
    at 0.7: ``(0.7 + 3 * 0.005) / 4 = 0.17875``."""
    k = max(plan.draft_len, 1)
    split = min(plan.split, k)
    return round((split * layer_skip_cost + (k - split) * STAT_DRAFT_COST) / k, 6)


@dataclass(frozen=True)
class DomainRace:
    """A domain's raced measurements (``timed``: ``{role: Measurement}``) and the decision they imply."""

    timed: dict[str, Measurement]
    decision: Decision

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        """The measurements in :data:`~.decision.ROLES` order, as a record holds them."""
        return tuple(self.timed[r] for r in ROLES if r in self.timed)

    def priors(self, statistical: StatisticalAcceptance, layer_skip: Prior = NO_LAYER_SKIP,
               reduced_head_cost: float | None = None) -> Priors:
        """Where the domain's bandits start: ``layer_skip`` (the caller's: from the search), prompt
        lookup at its measured acceptance (0 when it was not raced), the statistical drafter at its
        teacher-forced ``statistical`` acceptance by position; statistical drafts cost :data:`STAT_DRAFT_COST`."""
        lookup = self.timed.get("lookup")
        return Priors(layer_skip=layer_skip,
                      lookup=Prior(lookup.token_acceptance if lookup is not None else 0.0, STAT_DRAFT_COST),
                      statistical=Prior(statistical.token_acceptance, STAT_DRAFT_COST, statistical.position_acceptance),
                      reduced_head_cost=reduced_head_cost)

    def record(self, name: str, statistical: StatisticalAcceptance, cascade: CascadePlan, verify: tuple[float, ...],
               verify_context: int, *, prompts: int, anchors: int, layer_skip: SkipSearch | None = None,
               layer_skip_prior: Prior = NO_LAYER_SKIP, reduced_head_cost: float | None = None,
               vocab: VocabChoice | None = None, bigram: BigramTable | None = None,
               draft_vocab: np.ndarray | None = None) -> DomainRecord:
        """The domain's record: this race's decision, measurements and :meth:`priors`, with what the
        caller found besides (``layer_skip``: the search's skip set, none by default; the cascade's
        plan, the verification costs, the reduced vocabulary and the tables stored beside the JSON)."""
        return DomainRecord(
            name=name, decision=self.decision, layer_skip=layer_skip if layer_skip is not None else SkipSearch(
                SkipSet(), 1), priors=self.priors(statistical, layer_skip_prior, reduced_head_cost),
            verify=verify, verify_context=verify_context, cascade=cascade, statistical=statistical, vocab=vocab,
            measurements=self.measurements, prompts=prompts, anchors=anchors, bigram=bigram, draft_vocab=draft_vocab)


def race_domain(lm: LoadedModel, prompt_ids: list[list[int]], candidates: dict[str, Candidate],
                settings: MeasureSettings, prompts: int | None = None, *,
                bigram: BigramTable | Sequence[BigramTable | None] | None = None,
                vocab=None, eagle=None, guard: Callable[[], AbstractContextManager] = nullcontext,
                done: Sequence[dict] = (),
                on_prompt: Callable[[dict], None] | None = None,
                on_block: Callable[[], None] | None = None) -> DomainRace:
    """Race ``candidates`` against ``ar`` on up to ``prompts`` of ``prompt_ids`` (``None``: the
    settings' ``confirm_prompts``) as ``settings`` say (:meth:`RaceConfig.of
    <adaptive.measure.timing.RaceConfig.of>`), and decide. ``bigram``, ``vocab``, ``eagle``, ``guard``,
    ``done``, ``on_prompt``, ``on_block``: :func:`~.timing.race_candidates`'s."""
    timed = race_candidates(lm, prompt_ids, candidates, RaceConfig.of(settings, prompts), done=done,
                            on_prompt=on_prompt, bigram=bigram, vocab=vocab, eagle=eagle, on_block=on_block,
                            guard=guard)
    return DomainRace(timed, decide(timed, settings.acceptance_floor))


@dataclass(frozen=True)
class HeadCandidate:
    """An eagle head a learned domain races too: the ``head`` its requests would draft with, and the
    ``acceptance`` and ``draft_cost`` that price its draft length (the profile's distilled record's)."""

    head: object  # adaptive.drafters.eagle.EagleHead
    acceptance: float
    draft_cost: float


def measure_learned_domain(lm: LoadedModel, profile: Profile, name: str, sequences: list[tuple[list[int], list[int]]],
                           prompts: int, table: LiveBigramTable, guard: Callable = nullcontext,
                           anchors: int = 0, eagle: HeadCandidate | None = None) -> DomainRecord:
    """A learned domain's record, measured as calibration measures one (:mod:`adaptive.calibrate.domain`)
    but without a skip-set search (layer skipping is searched offline only): the bigram-backed
    drafter's teacher-forced acceptance on the members' ``(prompt, output)`` pairs (leave one out)
    gives the cascade's plan; prompt lookup and the cascade are raced against ``ar`` on up to
    ``prompts`` member prompts, the cascade drafting from ``table`` (the domain's, already fed the
    members' outputs, each raced prompt's own output taken out: :meth:`LiveBigramTable.snapshot`;
    ``guard``: the model lock, one block at a time), and decided
    (:func:`race_domain`, with the profile's settings, as calibration). With ``eagle`` (a runtime that
    drafts with a head), the head races too, drafting the length its acceptance and cost give, as
    ``adaptive distill`` races it in a calibrated domain, its copies the global record's
    (:meth:`DomainRecord.copy_length`; the learned record's own lookup prior exists only after the race;
    served, its bandit learns their length). Verification costs: the global record's."""
    s, glob = profile.settings, profile.global_set
    max_len = profile.runtime.cascade_max_draft_len
    stat = statistical_acceptance(sequences, max_len, s.bigram_min_count)
    plan = choose_cascade(stat.position_acceptance, 0.0, 1.0, glob.verify, max_len, 0, s.cascade_lenience)
    candidates = statistical_candidates(profile.runtime.pld_draft_len, plan)
    if eagle is not None:
        most = profile.runtime.max_draft_len
        k = max(1, best_draft_length(eagle.acceptance, eagle.draft_cost, glob.verify_table(most), most)[0])
        candidates["eagle"] = Candidate("eagle", k, estimated_acceptance=eagle.acceptance,
                                        estimated_draft_cost=eagle.draft_cost, copy_len=glob.copy_length(most))
    tables = [table.snapshot(without=accepted_text(p, out)) for p, out in sequences[:prompts]]
    raced = race_domain(lm, [list(p) for p, _ in sequences], candidates, s, prompts, bigram=tables, guard=guard,
                        eagle=eagle.head if eagle is not None else None)
    return raced.record(name, stat, plan, glob.verify, glob.verify_context, prompts=len(sequences), anchors=anchors)
