"""Phase 4 of a calibration, for one domain (or the global set over all domains).

In order, each timed or searched step checkpointed in ``OUT.work/`` (a resumed run redoes nothing
that finished):

1. what the statistical drafters reach, teacher-forced on the domain's continuations (free: no
   forward), and the verification costs at the domain's context length (``verify-<domain>.json``);
   from them the *reference* layer skipping must beat: ``max(1, pld, statistical cascade) * (1 + min_gain)``;
2. the bound on layer skipping over the ranked space (:mod:`.bound`); its scored corners are the
   search's first trials (``trials-<domain>.jsonl``). When even the bound cannot reach the
   reference, the search stops there and the record says so (``SkipSearch.bound``/``reference``),
   except for the global set, searched always (it seeds the domains and is ``ssd-static``'s set);
3. otherwise the Bayesian search over skip sets, its candidates above the acceptance floor; then,
   searched or not, the global skip set and its neighbours (:func:`~.search.neighbours`) scored on
   this domain's text, so a domain's skip set is never worse than the global one by the same
   estimate (the global task runs first: :mod:`.runner`);
4. the cascade's plan and the reduced draft vocabulary, from estimates (:mod:`.cascade`, :mod:`.vocab`);
5. the race (``race-<domain>.jsonl``, one line per timed prompt): prompt lookup, the cascade, and
   the best skip set (full head, and reduced head where that estimates faster) when its estimate
   reaches ``time_gate``, each against ``ar`` in paired blocks until its interval settles;
6. the decision, a pure function of the race (5 and 6: :func:`adaptive.measure.race.race_domain`,
   which the online learner measures a learned domain with too).

:func:`calibrate_domain` returns the domain's typed :class:`~adaptive.profile.DomainRecord`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from adaptive.calibrate.bound import Bound, layer_skip_bound
from adaptive.calibrate.parallel import Worker
from adaptive.calibrate.search import (
    MatchnessScorer,
    RankedSpace,
    estimate,
    make_space,
    neighbours,
    run_search,
    top_candidates,
    trial_estimate,
    trial_record,
    trial_skip,
)
from adaptive.calibrate.settings import GLOBAL_TASK, CalibrationSettings
from adaptive.calibrate.vocab import choose_vocab, race_vocabs
from adaptive.costs import CostModel, measure_verify_costs
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.ngram import BigramTable
from adaptive.engine.skip import SkipSet
from adaptive.measure.race import DomainRace, race_domain, statistical_candidates
from adaptive.measure.statistical import (
    choose_cascade,
    leave_one_out_table,
    race_tables,
    replay_speedup,
    statistical_acceptance,
)
from adaptive.measure.timing import Candidate
from adaptive.models import LoadedModel
from adaptive.profile import GLOBAL, DomainRecord, Prior, SkipSearch, StatisticalAcceptance, VocabChoice
from adaptive.workdir import append_json_line, checkpointed, read_json_lines


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
    seed: SkipSet | None = None  # the global set: scored with its neighbours in this domain (:func:`search_skip_sets`)
    # background: the other calibration sequences' continuations (after their prompts' last tokens), in
    # every bigram table of this task, never scored or raced on (:mod:`adaptive.measure.statistical`)
    background: list[tuple[list[int], list[int]]] = field(default_factory=list)
    # searched even where the bound rules layer skipping out of the decision: the global set, which seeds
    # every domain's search and is the static baseline (``ssd-static``), is searched always
    always_search: bool = False


def search_seed(seed: int, name: str) -> int:
    """The search's seed for one domain: distinct per domain, the same on every run."""
    return seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:6], 16)


@dataclass(frozen=True)
class Statistical:
    """What the domain's statistical drafters reach on its continuations: the bigram-backed
    drafter's teacher-forced acceptance (``bigram``, leave one out; the cascade's plan and prior),
    and the estimated speedups of prompt lookup alone and of the bigram-backed drafter
    (:func:`~.cascade.replay_speedup`, at the cost model's verification costs); ``verify``: forwards
    over 1, 2, ... tokens timed at the domain's ``context`` length, for the cascade's plan."""

    bigram: StatisticalAcceptance
    lookup_speedup: float
    bigram_speedup: float
    verify: tuple[float, ...]
    context: int


def statistical(worker: Worker, lm: LoadedModel, task: DomainTask) -> Statistical:
    """:class:`Statistical` for the domain; the verification costs are timed once (checkpointed)."""
    s = worker.settings
    bar = worker.phase("verify", task.name, 1)

    def compute() -> dict:
        # verification costs at this domain's context length (long prompts make long drafts relatively cheap)
        context = int(np.median([len(p) for p, _ in task.sequences])) + s.confirm_tokens // 2
        verify = measure_verify_costs(lm.backbone, context, max_verify=s.cascade_max_draft_len + 1, repeats=5)
        return {"verify": list(verify), "context": context}

    rec = checkpointed(worker.work.file("verify", task.name), compute)
    bar.close()
    verify = tuple(float(v) for v in rec["verify"])
    stats = statistical_acceptance(task.sequences, s.cascade_max_draft_len, s.bigram_min_count,
                                   background=task.background)
    # replayed at the cost model's verification costs, as the search's estimates are: with a given
    # cost model the reference, the bound and the search are deterministic
    model = task.costs.verify
    pld = replay_speedup(task.sequences, s.pld_draft_len, model, s.bigram_min_count, bigram=False)
    stat = replay_speedup(task.sequences, s.cascade_max_draft_len, model, s.bigram_min_count,
                          background=task.background)
    return Statistical(stats, round(pld, 4), round(stat, 4), verify, int(rec["context"]))


def search_skip_sets(worker: Worker, lm: LoadedModel, task: DomainTask, reference: float
                     ) -> tuple[list[dict], Bound | None]:
    """The search's trial history (resumed from the checkpoint's complete trials) and, in the ranked
    space, the bound that decided whether to search beyond its scored corners; no trials on an
    engine that cannot skip layers. The task's ``seed`` and its neighbours are scored last, as
    trials marked ``"seed": true`` (with no parameters: they are not points of this space)."""
    s = worker.settings
    if not lm.backbone.layer_skip:  # the engine runs the whole model only: nothing to search
        return [], None
    space = make_space(s.space, lm.backbone.n_layers, task.influence)
    path = worker.work.file("trials", task.name, "jsonl")
    history = read_json_lines(path, accept=lambda i, rec: isinstance(rec, dict) and rec.get("trial") == i)
    scorer = None

    def score(skip: SkipSet):
        nonlocal scorer
        if scorer is None:  # its prefill is wasted when every trial is resumed
            scorer = MatchnessScorer(lm.backbone, task.sequences)
        return estimate(skip, scorer, task.costs, s.max_draft_len, s.acceptance_floor)

    seeds = neighbours(task.seed, space) if task.seed else []
    bar = worker.phase("search", task.name, s.trials + len(seeds), len(history))
    best = [max((h["target"] for h in history), default=0.0)]

    def on_trial(rec: dict) -> None:
        append_json_line(path, rec)
        best[0] = max(best[0], rec["target"])
        bar.update(1, best=round(best[0], 3))

    bound, corners = None, 0
    if isinstance(space, RankedSpace):
        bound, corners = _bound(space, task, s, score, history, on_trial, reference)
    if bound is None or bound.pays or task.always_search:
        # the bound's corners, where there are two, stand for the random first trials; counted as
        # visited (not from the history's length) so that a resumed search suggests what it would have
        n_init = 0 if corners >= 2 else s.init_trials
        history = run_search(space, score, max(s.trials, len(history)), seed=search_seed(s.seed, task.name),
                             n_init=n_init, history=history, on_trial=on_trial)
    seeded = {trial_skip(h) for h in history if h.get("seed")}
    scored = {trial_skip(h): h for h in history}
    for skip in seeds:
        if skip in seeded:  # resumed
            continue
        t0 = time.perf_counter()  # a set the search scored is not scored again
        est = trial_estimate(scored[skip]) if skip in scored else score(skip)
        rec = {**trial_record(len(history), {}, skip, est, time.perf_counter() - t0), "seed": True}
        history.append(rec)
        on_trial(rec)
    bar.close()
    return history, bound


def _bound(space: RankedSpace, task: DomainTask, s: CalibrationSettings, score: Callable, history: list[dict],
           on_trial: Callable[[dict], None], reference: float) -> tuple[Bound, int]:
    """:func:`~.bound.layer_skip_bound` over ``space`` and how many distinct corners it visited, its
    scored corners recorded as trials (already recorded ones are read back, not scored again)."""
    seen = {trial_skip(h): h for h in history}
    visited = set()

    def corner(na: int, nm: int) -> float:
        params = {"n_attn": na, "n_mlp": nm}
        skip = space.decode(params)
        visited.add(skip)
        if skip not in seen:
            t0 = time.perf_counter()
            rec = trial_record(len(history), params, skip, score(skip), time.perf_counter() - t0)
            history.append(rec)
            seen[skip] = rec
            on_trial(rec)
        return float(seen[skip]["matchness"])

    def cost(na: int, nm: int) -> float:
        return task.costs.draft_cost(space.decode({"n_attn": na, "n_mlp": nm}).masks(space.n_layers))

    bound = layer_skip_bound(space.n_layers, corner, cost, task.costs.verify_table(s.max_draft_len), s.max_draft_len,
                             s.acceptance_floor, reference)
    return bound, len(visited)


def race_key(candidates: dict[str, Candidate], tables: Sequence[BigramTable] = (),
             vocabs: Sequence[np.ndarray] = ()) -> str:
    """A short hash of the raced candidates, the cascade's tables and the draft vocabularies: a
    checkpoint's lines are replayed only into the same race."""
    # a field added with a None default (copy_len) stays out: checkpoints of races made before it still resume
    blob = json.dumps({k: {f: v for f, v in c.to_dict().items() if not (f == "copy_len" and v is None)}
                       for k, c in sorted(candidates.items())}, sort_keys=True).encode()
    digest = hashlib.sha1(blob)
    for a in [x for t in tables for x in (t.keys, t.succ, t.prob)] + list(vocabs):
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()[:12]


def race(worker: Worker, lm: LoadedModel, task: DomainTask, candidates: dict[str, Candidate],
         vocab_size: int | None) -> DomainRace:
    """The domain's race and decision (:func:`~adaptive.measure.race.race_domain`), one checkpoint
    line per timed prompt. Each raced prompt is drafted as a new prompt would be: the cascade from a
    table without that prompt's own continuation (:func:`~adaptive.measure.statistical.race_tables`),
    a reduced head (``vocab_size`` ids; ``None``: none raced) ranked without it (:func:`race_vocabs`)."""
    s = worker.settings
    prompts = task.confirm_ids[: s.confirm_prompts]
    tables = race_tables(task.sequences, prompts, s.bigram_min_count, task.background)
    vocabs = [] if vocab_size is None else race_vocabs(task.sequences, prompts, lm.backbone.vocab_size, vocab_size)
    key = race_key(candidates, tables, vocabs)
    path = worker.work.file("race", task.name, "jsonl")
    done = read_json_lines(path, accept=lambda i, rec: isinstance(rec, dict) and rec.get("key") == key)
    bar = worker.phase("race", task.name, s.race_blocks, sum(len(r["blocks"]) for r in done))
    out = race_domain(lm, task.confirm_ids, candidates, s.measure, bigram=tables, vocab=vocabs or None, done=done,
                      on_prompt=lambda rec: append_json_line(path, {**rec, "key": key}), on_block=lambda: bar.update(1))
    bar.close()
    return out


def calibrate_domain(worker: Worker, task: DomainTask) -> DomainRecord:
    """Reference, bound, search, cascade, vocabulary, race and decision for one domain (or the global set)."""
    s, work = worker.settings, worker.work
    lm = worker.model()
    st = statistical(worker, lm, task)
    reference = max(1.0, st.lookup_speedup, st.bigram_speedup) * (1.0 + s.min_gain)
    history, bound = search_skip_sets(worker, lm, task, reference)
    pays = bound is None or bound.pays
    searched = pays or task.always_search
    # where the bound ruled the search out, the seeded sets (scored on this text) may still be the domain's
    top = top_candidates([h for h in history if searched or h.get("seed")], 1, s.acceptance_floor)
    best = top[0] if top else None
    bigram = leave_one_out_table(task.sequences, -1, s.bigram_min_count, task.background)  # the runtime's: all of it
    a_l = float(best["matchness"]) if best else 0.0
    c_l = float(best["draft_cost"]) if best else 1.0
    plan = choose_cascade(st.bigram.position_acceptance, a_l, c_l, st.verify, s.cascade_max_draft_len,
                          s.cascade_max_split if best else 0, s.cascade_lenience)
    best_skip = trial_skip(best) if best else SkipSet()
    candidates = statistical_candidates(s.pld_draft_len, plan, skip=best_skip,
                                        lookup_estimate=st.lookup_speedup, cascade_estimate=st.bigram_speedup,
                                        layer_skip_cost=c_l)
    vocab, vocab_ids = None, None
    # timed where its estimate reaches the gate and layer skipping could beat the statistical drafters
    timed_ssd = best is not None and (pays or best["target"] >= reference)
    if timed_ssd and best["target"] >= s.time_gate:
        ssd = Candidate("ssd", int(best["draft_len"]), skip=best_skip, estimated_acceptance=best["matchness"],
                        estimated_draft_cost=best["draft_cost"], estimated_speedup=best["target"])
        candidates["candidate"] = ssd
        vocab, vocab_ids = choose_vocab(lm, s, work.file("vocab", task.name), task.sequences, ssd.skip, ssd.draft_len,
                                        a_l, st.verify)
        if vocab is not None and vocab.estimate[str(vocab.size)] > vocab.full_estimate:
            candidates["vocab"] = replace(ssd, draft_vocab=vocab.size)
    raced = race(worker, lm, task, candidates, vocab.size if vocab is not None else None)
    timed = raced.timed
    if vocab is not None and "vocab" in timed:
        vocab = replace(vocab, use=timed["vocab"].speedup > timed["candidate"].speedup)
    return domain_record(task, raced, history, best, bound, st, plan, bigram, vocab, vocab_ids)


def domain_record(task: DomainTask, raced: DomainRace, history: list[dict], best: dict | None, bound: Bound | None,
                  st: Statistical, plan: CascadePlan, bigram: BigramTable, vocab: VocabChoice | None,
                  vocab_ids) -> DomainRecord:
    """The typed record of one domain (:meth:`~adaptive.measure.race.DomainRace.record`, with what
    the search found). ``best``: the best skip set above the floor that was searched or seeded
    (``None`` when none; searched sets only where the bound did not rule layer skipping out); its
    prior is the race's measured acceptance where it was raced, else the search's teacher-forced
    estimate."""
    timed = raced.timed
    ssd = timed.get("vocab") if vocab is not None and vocab.use else timed.get("candidate")
    a_l = ssd.token_acceptance if ssd is not None else (float(best["matchness"]) if best else 0.0)
    c_l = float(best["draft_cost"]) if best else 1.0
    reduced_cost = None
    if vocab is not None:
        costs = vocab.draft_cost
        reduced_cost = c_l * costs[str(vocab.size)] / costs[str(vocab.vocab_size)]
    if best is not None:
        layer_skip = SkipSearch(trial_skip(best), int(best["draft_len"]), float(best["matchness"]),
                                float(best["draft_cost"]), float(best["target"]), len(history),
                                seeded=any(h.get("seed") and h["skip"] == best["skip"] for h in history))
    else:
        layer_skip = SkipSearch(SkipSet(), 1, 0.0, 1.0, 0.0, len(history))
    if bound is not None:
        layer_skip = replace(layer_skip, bound=bound.speedup, reference=bound.reference)
    return raced.record(
        GLOBAL if task.name == GLOBAL_TASK else task.name, st.bigram, plan, st.verify, st.context,
        prompts=task.prompts, anchors=task.anchors, layer_skip=layer_skip,
        layer_skip_prior=Prior(min(max(a_l, 0.0), 1.0), c_l), reduced_head_cost=reduced_cost, vocab=vocab,
        bigram=bigram, draft_vocab=np.asarray(vocab_ids) if vocab_ids is not None else None)
