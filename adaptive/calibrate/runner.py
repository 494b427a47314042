"""``calibrate()``: prompts per domain in, a profile directory out.

Phases, each checkpointed in ``OUT.work/`` (:mod:`adaptive.workdir`) so that ``resume=True`` after a
kill redoes nothing that finished:

1. cost model: time the forwards of this machine (``costs.json``);
2. per domain, in parallel: encode, continue and measure influence (:mod:`.prepare`, ``prep-*.pt``);
3. FAISS k-means anchors per domain, one index over all;
4. once over all domains (the global set, in the calling process), then per domain in parallel:
   the bound and search of skip sets (a domain's also scores the global set and its neighbours),
   the cascade and reduced vocabulary, the race against ``ar`` and the decision (:mod:`.domain`);
5. the profile, written atomically; the work directory is then removed.

One progress bar (:mod:`.progress`) covers all phases and domains with an ETA. Settings live in
:mod:`.settings`, timing, intervals and the decision in :mod:`adaptive.measure`, parallel execution
in :mod:`.parallel`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from adaptive import __version__
from adaptive.calibrate.domain import DomainTask, calibrate_domain
from adaptive.calibrate.parallel import Worker, in_process, run_parallel, shared_model
from adaptive.calibrate.prepare import Prepared, candidate_poolings, check_prompt_lengths, prepare_domain
from adaptive.calibrate.progress import Progress, budgets
from adaptive.calibrate.settings import (
    BACKENDS,
    GLOBAL_TASK,
    CalibrationError,
    CalibrationSettings,
    calibration_workdir,
    check_domains,
    domains_digest,
)
from adaptive.costs import CostModel, CpuWatch, busy_warning, measure_costs, measure_prefill
from adaptive.engine.config import Pooling
from adaptive.errors import ConfigError
from adaptive.index.anchors import AnchorIndex
from adaptive.index.choice import choose_pooling, pooling_key
from adaptive.index.lexicon import Lexicon
from adaptive.models import LoadedModel, ModelFingerprint
from adaptive.profile import (
    ENGINES_FILE,
    EngineSet,
    MeasureSettings,
    Profile,
    ProfileError,
    check_writable,
    is_two_engine,
    load_profile,
    save_profile,
    write_engines,
)
from adaptive.workdir import CHECKPOINT_FORMAT, checkpointed

__all__ = ["BACKENDS", "CalibrationError", "CalibrationSettings", "calibrate", "check_domains", "model_spec"]


def check_options(domains: dict[str, list[str]], s: CalibrationSettings, jobs: int, backend: str,
                  scheduler: str | None) -> dict[str, list[str]]:
    """The prompts used per domain (:func:`check_domains`); refuse impossible options
    (:class:`ConfigError`) before anything is loaded."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a positive integer, got {jobs!r}")
    if scheduler and backend not in ("dask", "ray"):
        raise ConfigError("--scheduler is for --backend dask or ray")
    domains = check_domains(domains, s)
    if jobs > len(domains):
        raise ConfigError(f"{jobs} jobs for {len(domains)} domains (the global set runs first, alone): "
                          f"use at most {len(domains)}")
    return domains


def model_spec(lm: LoadedModel) -> str:
    """What a worker process passes to ``load_model`` to load ``lm`` again (its directory, GGUF file
    or hub id), or :class:`ConfigError` for a model built in memory."""
    if lm.spec is None:
        raise ConfigError("a model built in memory cannot be loaded by worker processes: use jobs=1, "
                          "backend='threading', or pass the model's spec")
    return lm.spec


def _worker(model: str | LoadedModel, settings: CalibrationSettings, out: Path, jobs: int, backend: str, device: str,
            dtype: str, weights: str = "dense", engine: str = "auto") -> Worker:
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    if isinstance(model, LoadedModel):
        try:
            spec = model_spec(model)
        except ConfigError:
            if not in_process(jobs, backend):
                raise
            spec = model.name  # recorded in the profile; never loaded
        dt = str(model.dtype).replace("torch.", "")
        return Worker(spec, str(model.device), dt, settings, str(out), threads, lm=model,
                      weights=model.weights, engine=model.engine)
    lm = shared_model(model, device, dtype, weights, engine) if in_process(jobs, backend) else None
    return Worker(model, device, dtype, settings, str(out), threads, lm=lm, weights=weights,
                  engine=lm.engine if lm is not None else engine)


def _domain_tasks(prep: dict[str, Prepared], index: AnchorIndex, costs: CostModel,
                  s: CalibrationSettings) -> list[DomainTask]:
    """One task per domain (name order), then the global set: sequences taken round-robin over
    domains, as many as one domain has; the first prompt of each domain to time on. Each task's
    background (in its bigram tables only) is the model's own text of every other calibration
    sequence: its continuation after the prompt's last token (another domain's prompts, passages or
    text in another language, are not what the model writes)."""
    names = sorted(prep)

    def others(keep: list) -> list:
        kept = {id(pair) for pair in keep}
        return [(pair[0][-1:], pair[1]) for n in names for pair in prep[n].sequences if id(pair) not in kept]

    tasks = [DomainTask(n, prep[n].sequences, prep[n].influence, costs, prep[n].ids[: s.confirm_prompts],
                        len(prep[n].ids), index.labels.count(n), background=others(prep[n].sequences))
             for n in names]
    pool = [prep[n].sequences[i] for i in range(s.prompts_per_domain) for n in names
            if i < len(prep[n].sequences)][: s.prompts_per_domain]
    confirm = [prep[n].ids[i] for i in range(s.confirm_prompts) for n in names
               if i < len(prep[n].ids)][: s.confirm_prompts]
    influence = sum(prep[n].influence for n in names) / len(names)
    tasks.append(DomainTask(GLOBAL_TASK, pool, influence, costs, confirm, sum(len(prep[n].ids) for n in names),
                            len(index.labels), always_search=True, background=others(pool)))
    return tasks


def _profile(fingerprint: ModelFingerprint, s: CalibrationSettings, costs: CostModel, records: list,
             index: AnchorIndex, extra_settings: dict, encoded: dict[str, list[list[int]]]) -> Profile:
    """The profile of a finished calibration; ``encoded``: each domain's prompts as the runtime encodes
    them, for its :class:`~adaptive.index.lexicon.Lexicon`."""
    *domains, glob = records
    measure, others = MeasureSettings.split({**s.to_dict(), **extra_settings})
    return Profile(model=fingerprint, settings=measure, runtime=s.runtime, cost_model=costs,
                   domains={d.name: d for d in domains}, global_set=glob, index=index,
                   created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), version=__version__, calibration=others,
                   lexicon=Lexicon.fit(encoded))


def calibrate(model: str | LoadedModel, domains: dict[str, list[str]], out: str | Path,
              settings: CalibrationSettings | None = None, *, jobs: int = 1, backend: str = "loky",
              scheduler: str | None = None, resume: bool = False, device: str = "auto", dtype: str = "auto",
              progress: bool = True, log: Callable[[str], None] = lambda msg: None,
              cost_model: CostModel | None = None, weights: str = "dense", engine: str = "auto") -> Profile:
    """Calibrate ``model`` on ``domains`` (``{name: [prompt, ...]}``) and write the profile to ``out``.

    ``model``: a spec for :func:`adaptive.models.load_model` (with ``device``, ``dtype`` and ``weights``), or an
    already loaded model, used as is by tasks in this process (``jobs == 1`` or the threading
    backend); worker processes load it again from its source in its dtype, on its engine (``engine``:
    ``auto``, ``torch`` or ``llama.cpp``, :func:`adaptive.models.resolve_engine`). On llama.cpp, which
    cannot skip layers, no skip set is searched and only the statistical drafters are raced.
    ``cost_model`` replaces the timed measurement (e.g. another profile's, for a reproducible search:
    with it and the same seed, the bound and the search are deterministic; the race is timed).
    """
    s = settings or CalibrationSettings()
    domains = check_options(domains, s, jobs, backend, scheduler)
    out = Path(out)
    if is_two_engine(out):
        raise ProfileError(f"{out} is a two-engine profile: calibrate one of its engines into {out}/ENGINE, or both "
                           "with --engine auto")
    check_writable(out)
    started = time.perf_counter()
    worker = _worker(model, s, out, jobs, backend, device, dtype, weights, engine)
    lm = worker.lm or shared_model(worker.spec, worker.device, worker.dtype, worker.weights, worker.engine)
    worker.engine = lm.engine
    encoded = check_prompt_lengths(lm, domains, s)  # before anything is written: a bad prompt leaves nothing behind
    log(f"calibrating {worker.spec} on {len(domains)} domains: "
        f"{', '.join(sorted(domains))}")
    fingerprint = replace(lm.fingerprint(), spec=worker.spec, weights=lm.weights,
                          dtype=str(lm.dtype).replace("torch.", "") if lm.model is not None else "")
    state = {"format": CHECKPOINT_FORMAT, "settings": s.to_dict(), "model": fingerprint.to_dict(),
             "domains": domains_digest(domains),
             "costs": cost_model.to_dict() if cost_model is not None else "measured"}
    work = calibration_workdir(out)
    watch = CpuWatch().start()  # how busy the machine was over the whole run (its races are timed too)
    with work.guarded(state, resume, "rerun with the same model, domains and settings, or delete it") as resumed:
        if resumed:
            log(f"resuming from {work.path}")
        names = sorted(domains)
        lengths = {n: [len(p) for p in encoded[n]] for n in names}
        worker.bars = Progress(progress, budgets(s, lengths, [*names, GLOBAL_TASK]))
        try:
            costs = cost_model if cost_model is not None else CostModel.from_dict(
                checkpointed(work.file("costs"), lambda: _measure_costs(lm, s, log)))
            worker.bars.finish("costs", "")
            records, index, choice = _run_phases(worker, lm, domains, costs, jobs, backend, scheduler, log)
        finally:
            worker.bars.close()
            worker.bars = None
        seconds = round(time.perf_counter() - started, 1)
        run = {"jobs": jobs, "backend": backend, "seconds": seconds, "pooling": choice}
        share = watch.stop()
        share = share if in_process(jobs, backend) else None  # else our own workers count as others
        run["others_share"] = None if share is None else round(share, 3)
        warning = busy_warning(f"the {lm.engine} engine's races", share)
        if warning:
            log(f"warning: {warning}")
        profile = _profile(fingerprint, s, costs, records, index, run, encoded)
        save_profile(profile, out)
    return profile


def _measure_costs(lm: LoadedModel, s: CalibrationSettings, log: Callable[[str], None]) -> dict:
    log("measuring the cost model ...")
    with CpuWatch() as watch:
        costs = measure_costs(lm.backbone, context=s.cost_context)
        prefill = measure_prefill(lm.backbone)
    warning = busy_warning(f"the {lm.engine} engine's cost model", watch.others_share)
    if warning:
        log(f"warning: {warning}")
    return replace(costs, prefill=prefill, others_share=watch.others_share).to_dict()


def _run_phases(worker: Worker, lm: LoadedModel, domains: dict[str, list[str]], costs: CostModel, jobs: int,
                backend: str, scheduler: str | None, log: Callable[[str], None]) -> tuple[list, AnchorIndex, dict]:
    """Phases 2 to 4: the domains' records (name order, then the global one), the anchor index and how
    its pooling was chosen (:func:`_choose_pooling`). ``lm``: the model loaded in this process (the
    global task runs on it)."""
    s = worker.settings
    names = sorted(domains)
    log(f"preparing {len(names)} domains ...")
    preps = run_parallel(prepare_domain, [(worker, n, domains[n]) for n in names], jobs, backend, scheduler)
    prep = {p.name: p for p in preps}
    for n in names:  # done in worker processes, or resumed: the bar catches up
        worker.bars.finish("prepare", n)
    pooling, embeddings, choice = _choose_pooling(prep, names, s, lm.backbone, log)
    index = AnchorIndex.build(embeddings, per_domain=s.anchors_per_domain, seed=s.seed, k=s.route_k, pooling=pooling)
    if lm.backbone.layer_skip:
        log(f"bounding and searching skip sets (up to {s.trials} trials each), racing drafters against ar ...")
    else:
        log(f"racing the statistical drafters against ar on the {worker.engine} engine (no layer skipping there) ...")
    tasks = _domain_tasks(prep, index, costs, s)
    *domain_tasks, global_task = tasks
    # the global set first, alone, in this process on its loaded model and all its threads (workers
    # would idle meanwhile); each domain then scores it (and its neighbours) beside its own search
    glob = calibrate_domain(replace(worker, lm=lm, threads=None), global_task)
    seed = glob.layer_skip.skip if glob.layer_skip.skip else None
    domain_tasks = [replace(t, seed=seed) for t in domain_tasks]
    records = run_parallel(calibrate_domain, [(worker, t) for t in domain_tasks], min(jobs, len(domain_tasks)),
                           backend, scheduler) + [glob]
    for t in tasks:
        for phase in ("verify", "search", "race"):
            worker.bars.finish(phase, t.name)
    return records, index, choice


def _choose_pooling(prep: dict[str, Prepared], names: list[str], s: CalibrationSettings, bb,
                    log: Callable[[str], None]) -> tuple[Pooling, dict, dict]:
    """The routing embedding the index keeps, its domains' embeddings, and the record of the choice
    (``{"chosen": key, "held_out_accuracy": {key: accuracy}}``): of the candidates every domain was
    prepared with (:func:`~adaptive.calibrate.prepare.candidate_poolings`), the default unless another
    routes the calibration's own prompts, held out in turn, clearly better
    (:func:`adaptive.index.choice.choose_pooling`). With no other candidate (``pool_choices=()``, or an
    engine that computes none, such as llama.cpp without layer inputs) the default is kept unscored."""
    poolings = candidate_poolings(bb, s)
    have = [p for p in poolings if all(pooling_key(p) in prep[n].candidates for n in names)]
    if len(have) < 2:
        return poolings[0], {n: prep[n].embeddings for n in names}, {"chosen": pooling_key(poolings[0])}
    tables = [{n: prep[n].candidates[pooling_key(p)] for n in names} for p in have]
    chosen, scores = choose_pooling(have, tables, per_domain=s.anchors_per_domain, k=s.route_k, seed=s.seed)
    key, default = pooling_key(chosen), pooling_key(have[0])
    log(f"routing embedding: {key} (held-out routing of the calibration prompts {scores[key]:.3f}; "
        f"the default {default} {scores[default]:.3f}; {len(have)} candidates)")
    return chosen, tables[have.index(chosen)], {"chosen": key, "held_out_accuracy": scores}


def calibrate_engines(models: dict[str, str | LoadedModel], domains: dict[str, list[str]], out: str | Path,
                      settings: CalibrationSettings | None = None, *, default: str | None = None,
                      resume: bool = False, log: Callable[[str], None] = lambda msg: None,
                      **kwargs) -> dict[str, Profile]:
    """Calibrate one model on several engines into a two-engine profile (:mod:`adaptive.profile.engines`):
    ``models`` maps each engine to the model to run there (a spec, loaded on that engine, or a loaded
    model), each calibrated by :func:`calibrate` into ``out/ENGINE``, one after the other (each uses
    the machine's cores); ``engines.json`` is written last, so ``out`` is a profile only once all
    are. With ``resume`` a member already written is kept and an interrupted one continues.
    ``default``: the member a reader of one profile gets (default: the first). ``kwargs``: as
    :func:`calibrate`'s."""
    out = Path(out)
    engines = EngineSet(tuple(models), default or next(iter(models)))
    ours = {name + suffix for name in engines.engines for suffix in ("", ".work")}
    if not (out.is_dir() and {p.name for p in out.iterdir()} <= ours):  # an interrupted run's members: continue
        check_writable(out)
    if (out / "profile.json").exists():
        raise ProfileError(f"{out} holds a one-engine profile: write the two-engine profile elsewhere, remove it, "
                           "or calibrate one engine with --engine llama.cpp or --engine torch")
    if not resume:  # a profile again only once every member is new
        (out / ENGINES_FILE).unlink(missing_ok=True)
    profiles = {}
    for engine, model in models.items():
        member = out / engine
        if resume and (member / "profile.json").is_file():
            try:
                profiles[engine] = load_profile(member)
                log(f"keeping the {engine} profile already in {member}")
                continue
            except ProfileError as exc:
                log(f"calibrating {engine} again: {exc}")
        log(f"calibrating on the {engine} engine into {member} ...")
        spec_engine = {} if isinstance(model, LoadedModel) else {"engine": engine}
        profiles[engine] = calibrate(model, domains, member, settings, resume=resume, log=log,
                                     **{**kwargs, **spec_engine})
    write_engines(out, engines)
    return profiles
