"""Phase 4 of a calibration, for one domain (or the global set over all domains).

In order, each step checkpointed in ``OUT.work/`` (so that a resumed run redoes nothing that finished):

1. the Bayesian search over skip sets (one line of ``trials-<domain>.jsonl`` per trial, fsynced);
2. timed decoding of the best candidates against ``ar`` (``confirm-<domain>.json``, one record each);
3. prompt lookup, timed the same way (``pld-<domain>.json``);
4. the cascade: the domain's bigram table, its statistical drafter's teacher-forced acceptance,
   the starting split, and a timed run (``cascade-<domain>.json``);
5. the reduced draft vocabulary (:mod:`.vocab`, ``vocab-<domain>.json``);
6. the decision (:mod:`.decision`), after timing the fastest drafter once more (``recheck-<domain>.json``).

:func:`calibrate_domain` returns the domain's typed :class:`~adaptive.profile.DomainRecord`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from adaptive.calibrate.cascade import choose_cascade, statistical_acceptance
from adaptive.calibrate.decision import decide, to_recheck
from adaptive.calibrate.parallel import Worker
from adaptive.calibrate.search import Estimate, MatchnessScorer, estimate, make_space, run_search, top_candidates
from adaptive.calibrate.settings import GLOBAL, CalibrationSettings
from adaptive.calibrate.timing import Candidate, measure_candidates
from adaptive.calibrate.vocab import choose_vocab
from adaptive.costs import STAT_DRAFT_COST, CostModel, measure_verify_costs
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.ngram import BigramTable, build_bigram_table
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from adaptive.profile import GLOBAL as GLOBAL_RECORD
from adaptive.profile import (
    Decision,
    DomainRecord,
    Measurement,
    Prior,
    Priors,
    SkipSearch,
    StatisticalAcceptance,
    VocabChoice,
)
from adaptive.workdir import WorkDir, append_json_line, checkpointed, read_json, read_json_lines, write_json

# the best "candidate" when every trial proposed the empty skip set: layer skipping cannot be chosen
NO_CANDIDATE = Measurement("ssd", "candidate", draft_len=1, speedup=0.0, estimated_acceptance=1.0,
                           estimated_draft_cost=1.0, estimated_speedup=0.0)


@dataclass
class DomainTask:
    """One domain's calibration text (:class:`~adaptive.calibrate.prepare.Prepared`'s ``sequences``
    and ``influence``), the cost model, the prompts decoding is timed on, and counts for the record."""

    name: str
    sequences: list[tuple[list[int], list[int]]]
    influence: torch.Tensor
    costs: CostModel
    confirm_ids: list[list[int]]
    prompts: int
    anchors: int


@dataclass
class CascadeCalibration:
    """The cascade's plan from the domain's measured acceptances, the statistical drafter's
    acceptance, the timed run, the verification costs at ``verify_context`` and the bigram table."""

    plan: CascadePlan
    statistical: StatisticalAcceptance
    timed: Measurement
    verify: tuple[float, ...]
    verify_context: int
    bigram: BigramTable


def search_seed(seed: int, name: str) -> int:
    """The search's seed for one domain: distinct per domain, the same on every run."""
    return seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:6], 16)


def search_skip_sets(worker: Worker, lm: LoadedModel, task: DomainTask) -> list[dict]:
    """The search's trial history (resumed from the checkpoint's complete trials)."""
    s = worker.settings
    space = make_space(s.space, lm.backbone.n_layers, task.influence)
    path = worker.work.file("trials", task.name, "jsonl")
    history = read_json_lines(path, accept=lambda i, rec: isinstance(rec, dict) and rec.get("trial") == i)
    scorer = None

    def score(skip: SkipSet) -> Estimate:
        nonlocal scorer
        if scorer is None:  # its prefill is wasted when every trial is resumed
            scorer = MatchnessScorer(lm.backbone, task.sequences)
        return estimate(skip, scorer, task.costs, s.max_draft_len)

    bar = None
    if worker.progress and len(history) < s.trials:
        from tqdm.auto import tqdm

        bar = tqdm(total=s.trials, initial=len(history), desc=f"search {task.name}", leave=False)
    best = [max((h["target"] for h in history), default=0.0)]

    def on_trial(rec: dict) -> None:
        append_json_line(path, rec)
        best[0] = max(best[0], rec["target"])
        if bar is not None:
            bar.update(1)
            bar.set_postfix(best=f"{best[0]:.3f}")

    history = run_search(space, score, s.trials, seed=search_seed(s.seed, task.name), n_init=s.init_trials,
                         history=history, on_trial=on_trial)
    if bar is not None:
        bar.close()
    return history


def _measured(path, cands: list[Candidate]) -> list[Measurement]:
    """The checkpoint's measurements that are of the leading ``cands`` (others are measured again)."""
    done = []
    try:
        recs = [Measurement.from_dict(d) for d in read_json(path)] if path.exists() else []
    except (ValueError, OSError):
        return []
    for m, c in zip(recs, cands):
        if (m.drafter, m.skip, m.draft_len) != (c.drafter, c.skip, c.draft_len):
            break  # measured for another candidate list: measure from here on
        done.append(m)
    return done


def confirm_candidates(lm: LoadedModel, s: CalibrationSettings, work: WorkDir, task: DomainTask,
                       history: list[dict]) -> list[Measurement]:
    """The ``confirm_candidates`` best skip sets of the search, timed against ``ar``."""
    cands = [Candidate("ssd", int(h["draft_len"]), skip=h["skip"], estimated_acceptance=h["matchness"],
                       estimated_draft_cost=h["draft_cost"], estimated_speedup=h["target"])
             for h in top_candidates(history, s.confirm_candidates)]
    if not cands:
        return []
    path = work.file("confirm", task.name)
    done = _measured(path, cands)
    if len(done) == len(cands):
        return done
    new: list[Measurement] = []

    def on_done(m: Measurement) -> None:
        new.append(m)
        write_json(path, [r.to_dict() for r in done + new])

    return measure_candidates(lm, task.confirm_ids, cands, s.confirm_tokens, done=done, on_done=on_done)


def timed_once(path, measure) -> Measurement:
    """``measure()`` (one :class:`Measurement`), checkpointed at ``path``."""
    return Measurement.from_dict(checkpointed(path, lambda: measure().to_dict()))


def calibrate_cascade(lm: LoadedModel, s: CalibrationSettings, work: WorkDir, task: DomainTask,
                      best: Measurement) -> CascadeCalibration:
    """The domain's bigram table, its statistical drafter's measured acceptance, the cascade's
    starting plan (from those and the best skip set's measured acceptance) and its timed speedup."""
    bigram = build_bigram_table([list(p) + list(c) for p, c in task.sequences], s.bigram_min_count)

    def compute() -> dict:
        n = s.cascade_max_draft_len
        # verification costs at this domain's context length (long prompts make long drafts relatively cheap)
        context = int(np.median([len(p) for p, _ in task.sequences])) + s.confirm_tokens // 2
        verify = measure_verify_costs(lm.backbone, context, max_verify=n + 1)
        stats = statistical_acceptance(task.sequences, n, s.bigram_min_count)
        skip_ok = best.skip not in ("none", "") and best.token_acceptance > 0
        plan = choose_cascade(stats.position_acceptance, best.token_acceptance, float(best.estimated_draft_cost),
                              verify, n, s.cascade_max_split if skip_ok else 0, s.cascade_lenience)
        cand = Candidate("cascade", plan.draft_len, skip=best.skip, cascade=plan)
        timed = measure_candidates(lm, task.confirm_ids, [cand], s.confirm_tokens, role="cascade", bigram=bigram)[0]
        return {"plan": plan.to_dict(), "statistical": stats.to_dict(), "timed": timed.to_dict(),
                "verify": list(verify), "verify_context": context}

    rec = checkpointed(work.file("cascade", task.name), compute)
    return CascadeCalibration(CascadePlan.from_dict(rec["plan"]), StatisticalAcceptance.from_dict(rec["statistical"]),
                              Measurement.from_dict(rec["timed"]), tuple(rec["verify"]), int(rec["verify_context"]),
                              bigram)


def calibrate_domain(worker: Worker, task: DomainTask) -> DomainRecord:
    """Search, confirm, lookup, cascade, vocabulary and decision for one domain (or the global set)."""
    s, work = worker.settings, worker.work
    lm = worker.model()
    history = search_skip_sets(worker, lm, task)
    results = confirm_candidates(lm, s, work, task, history)
    best = max(results, key=lambda m: m.speedup) if results else NO_CANDIDATE
    pld = timed_once(work.file("pld", task.name), lambda: measure_candidates(
        lm, task.confirm_ids, [Candidate("pld", s.pld_draft_len)], s.confirm_tokens, role="lookup")[0])
    cascade = calibrate_cascade(lm, s, work, task, best)
    vocab, vocab_timed, vocab_ids = choose_vocab(lm, s, work.file("vocab", task.name), task.sequences, best,
                                                 cascade.verify, task.confirm_ids)
    timed = {"ssd": vocab_timed if vocab is not None and vocab.use else best, "pld": pld, "cascade": cascade.timed}
    winner = to_recheck(timed, s.min_gain)
    recheck = None
    if winner is not None:
        recheck = timed_once(work.file("recheck", task.name), lambda: measure_candidates(
            lm, task.confirm_ids, [Candidate.of(timed[winner])], s.confirm_tokens, role="recheck",
            bigram=cascade.bigram, vocab=vocab_ids)[0])
    decision, _ = decide(timed, s.min_gain, recheck)
    measurements = (*results, pld, *([recheck] if recheck else []), cascade.timed,
                    *([vocab_timed] if vocab_timed else []))
    return domain_record(task, decision, best, len(history), timed["ssd"], cascade, vocab, vocab_ids, measurements)


def domain_record(task: DomainTask, decision: Decision, best: Measurement, trials: int, ssd: Measurement,
                  cascade: CascadeCalibration, vocab: VocabChoice | None, vocab_ids, measurements) -> DomainRecord:
    """The typed record of one domain: ``best`` is the search's best skip set as timed, ``ssd`` the
    timing of layer skipping used for the decision (over the reduced vocabulary where that was faster)."""
    lookup = next(m for m in measurements if m.role == "lookup")
    stats = cascade.statistical
    reduced_cost = None
    if vocab is not None:
        costs = vocab.draft_cost
        reduced_cost = best.estimated_draft_cost * costs[str(vocab.size)] / costs[str(vocab.vocab_size)]
    priors = Priors(layer_skip=Prior(min(max(ssd.token_acceptance, 0.0), 1.0), float(best.estimated_draft_cost)),
                    lookup=Prior(lookup.token_acceptance, STAT_DRAFT_COST),
                    statistical=Prior(stats.token_acceptance, STAT_DRAFT_COST, stats.position_acceptance),
                    reduced_head_cost=reduced_cost)
    layer_skip = SkipSearch(SkipSet.from_text(best.skip), best.draft_len, float(best.estimated_acceptance),
                            float(best.estimated_draft_cost), float(best.estimated_speedup), trials)
    return DomainRecord(
        name=GLOBAL_RECORD if task.name == GLOBAL else task.name, decision=decision, layer_skip=layer_skip,
        priors=priors, verify=cascade.verify, verify_context=cascade.verify_context, cascade=cascade.plan,
        statistical=stats, vocab=vocab, measurements=tuple(measurements), prompts=task.prompts, anchors=task.anchors,
        bigram=cascade.bigram, draft_vocab=np.asarray(vocab_ids) if vocab_ids is not None else None)
