"""The distillation loop (``adaptive distill``): DistillSpec for an early-exit block or a draft model.

One run:

1. encodes each domain's prompts (the profile's chat setting) and keeps the last ``held_out``
   fraction of every domain for evaluation (never trained on);
2. builds the training sequences for ``data_source`` and the evaluation sequences (the target's
   greedy continuations of the held-out prompts, what greedy verification will see);
3. stores, per trained position, the target's hidden state (p is recomputed per batch from it) and
   what the student needs (the early-exit drafter's hidden state before its block);
4. trains with AdamW on the mean token-level ``divergence(p, q)``; on-policy data is resampled from
   the current student every ``refresh_every`` steps;
5. evaluates every ``eval_every`` steps: greedy agreement (argmax q = argmax p: what greedy
   verification accepts) and sampling acceptance ``sum min(p, q)`` at temperature 1;
6. checkpoints every ``checkpoint_every`` steps into ``PROFILE.distill-KIND.work/`` (student,
   optimiser, batch generator, on-policy sequences, history), so ``resume=True`` continues an
   interrupted run exactly where its last checkpoint left it;
7. measures the drafter's cost per token, then writes the result into the profile atomically.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from adaptive.costs import best_draft_length, measure_draft_cost
from adaptive.distill.data import DATA_SOURCES, TrainSequence, continue_ids
from adaptive.distill.divergences import DIVERGENCES, divergence, greedy_agreement, sampling_acceptance
from adaptive.distill.heads import (
    HeadConfig,
    HeadData,
    HeadTrainer,
    Pacer,
    check_training,
    choose_vocab,
    decode_with_features,
    head_shape,
    measure_head_cost,
)
from adaptive.distill.students import Dataset, ExitStudent, ModelStudent, TargetHead
from adaptive.drafters.model import check_same_tokenizer
from adaptive.engine.engine import Engine
from adaptive.errors import AdaptiveError, ConfigError
from adaptive.limits import check_room
from adaptive.measure.decision import ROLES, decide
from adaptive.measure.race import race_domain
from adaptive.measure.timing import Candidate
from adaptive.profile import DistilledRecord, Interval, load_profile, save_profile
from adaptive.progress import progress_bar
from adaptive.workdir import CHECKPOINT_FORMAT, WorkDir, atomic_write, checkpointed

KINDS = ("early-exit", "draft-model", "eagle")


class DistillError(AdaptiveError):
    """A distillation that cannot run: a leftover or mismatched checkpoint, a busy work directory."""


@dataclass(frozen=True)
class DistillConfig:
    """How to distill. ``batch_size`` counts token positions for the early-exit block and whole
    sequences for a draft model. ``exit_layer`` ``None``: half the model's layers."""

    divergence: str = "fkl"
    jsd_beta: float = 0.5
    data_source: str = "teacher"
    steps: int = 300
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0
    exit_layer: int | None = None
    new_tokens: int = 48
    prompts_per_domain: int = 16
    held_out: float = 0.25
    refresh_every: int = 100
    eval_every: int = 25
    checkpoint_every: int = 25
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ConfigError(f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCES)}")
        if self.data_source not in DATA_SOURCES:
            raise ConfigError(f"unknown data source {self.data_source!r}; choose one of {', '.join(DATA_SOURCES)}")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ConfigError(f"--jsd-beta must be in (0, 1), got {self.jsd_beta}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"steps must be an integer >= 0 (0 stores the untrained drafter), got {self.steps!r}")
        check_training(self, ("batch_size", "new_tokens", "prompts_per_domain", "refresh_every", "eval_every",
                              "checkpoint_every"))
        if self.weight_decay < 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.temperature <= 0:
            raise ConfigError(f"the sampling temperature of on-policy data must be > 0, got {self.temperature}")
        if self.exit_layer is not None and (not isinstance(self.exit_layer, int) or self.exit_layer < 1):
            raise ConfigError(f"--exit-layer must be a positive integer, got {self.exit_layer!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def split_prompts(domains: dict[str, list[list[int]]], per_domain: int, held_out: float):
    """``(train, eval)`` lists of ``(domain, ids)``: per domain the first ``per_domain`` prompts,
    the last ``ceil(held_out * n)`` of them (at least 1) held out.

    Example: 4 prompts, ``held_out=0.25`` -> 3 to train on, 1 to evaluate.
    """
    train, held = [], []
    for name in sorted(domains):
        ids = domains[name][:per_domain]
        if len(ids) < 2:
            raise ConfigError(f"domain {name!r} has {len(ids)} prompt(s); distillation needs at least 2 "
                              "(one to train on, one held out)")
        k = min(len(ids) - 1, max(1, math.ceil(held_out * len(ids))))
        train += [(name, p) for p in ids[:-k]]
        held += [(name, p) for p in ids[-k:]]
    return train, held


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _save_torch(path: Path, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


@dataclass
class DistillResult:
    """What :func:`distill` stored: the drafter's ``kind``, the ``profile`` directory, its typed
    ``record`` (also in the profile) and the ``plot`` of its curves (``None`` without matplotlib)."""

    kind: str
    profile: Path
    record: DistilledRecord
    plot: Path | None

    def to_dict(self) -> dict:
        rec = {k: v for k, v in self.record.to_dict().items() if k != "history" and v is not None}
        return {"kind": self.kind, "profile": str(self.profile), "plot": str(self.plot) if self.plot else None, **rec}


def evaluate(student, ds: Dataset, head: TargetHead, cfg: DistillConfig, chunk: int = 256) -> dict:
    """Mean loss, greedy agreement and sampling acceptance over every row of ``ds`` (no gradient)."""
    tot = {"loss": 0.0, "greedy": 0.0, "sampling": 0.0}
    with torch.no_grad():
        starts = [0]
        for end in ds.offsets[1:]:  # chunks of whole sequences (a draft model scores sequence by sequence)
            if end - starts[-1] >= chunk:
                starts.append(end)
        if starts[-1] != ds.rows:
            starts.append(ds.rows)
        for a, b in zip(starts, starts[1:]):
            rows = torch.arange(a, b)
            logp, logq = head.logp(ds.h_target[rows]), student.logq(ds, rows)
            tot["loss"] += float(divergence(cfg.divergence, logp, logq, cfg.jsd_beta).sum())
            tot["greedy"] += float(greedy_agreement(logp, logq).sum())
            tot["sampling"] += float(sampling_acceptance(logp, logq).sum())
    return {k: round(v / max(ds.rows, 1), 5) for k, v in tot.items()}


def plot_curves(history: list[dict], path: Path, title: str) -> Path | None:
    """Training loss and held-out acceptance against the step, as a PNG (``None`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [h for h in history if "train_loss" in h]
    evals = [h for h in history if "greedy" in h]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot([h["step"] for h in train], [h["train_loss"] for h in train], lw=0.8, label="train (batch)")
    if all("loss" in h for h in evals):
        a1.plot([h["step"] for h in evals], [h["loss"] for h in evals], "o-", label="held out")
    a1.set_xlabel("step")
    a1.set_ylabel("divergence")
    a1.legend()
    a2.plot([h["step"] for h in evals], [h["greedy"] for h in evals], "o-", label="greedy agreement")
    if all("sampling" in h for h in evals):
        a2.plot([h["step"] for h in evals], [h["sampling"] for h in evals], "s-", label="sampling acceptance (T=1)")
    for k in range(1, max((len(h.get("positions", ())) for h in evals), default=0)):
        a2.plot([h["step"] for h in evals], [h["positions"][k] for h in evals], ".--", lw=0.8,
                label=f"drafts 1..{k + 1} all kept")
    a2.set_xlabel("step")
    a2.set_ylabel("held-out acceptance")
    a2.set_ylim(0, 1)
    a2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def make_student(lm, cfg: DistillConfig, draft_lm=None):
    """``(kind, student)``: the early-exit block over ``lm``'s first layers (``draft_lm`` ``None``), or
    ``draft_lm`` as a separate draft model (float32, sharing the target's tokenizer)."""
    if draft_lm is None:
        exit_layer = cfg.exit_layer if cfg.exit_layer is not None else lm.n_layers // 2
        if exit_layer >= lm.n_layers:
            raise ConfigError(f"--exit-layer {exit_layer} leaves no layer to skip in a {lm.n_layers}-layer model")
        return "early-exit", ExitStudent(lm, exit_layer)
    check_same_tokenizer(lm.tokenizer, draft_lm.tokenizer, lm.backbone.vocab_size, draft_lm.backbone.vocab_size)
    if draft_lm.dtype != torch.float32:
        raise ConfigError("a draft model is trained in float32: load it with dtype float32")
    return "draft-model", ModelStudent(draft_lm)


def encode_prompts(lm, domains: dict[str, list[str]], cfg: DistillConfig, chat: bool | None):
    """``(train, eval)`` prompts (:func:`split_prompts`), encoded as calibration encoded them; a
    prompt without room for ``new_tokens`` in the model's context is refused."""
    engine = Engine(lm)
    encoded = {n: [engine.encode(p, chat=chat) for p in ps] for n, ps in domains.items()}
    train_p, eval_p = split_prompts(encoded, cfg.prompts_per_domain, cfg.held_out)
    used = {n: ids[: cfg.prompts_per_domain] for n, ids in encoded.items()}
    check_room(used, cfg.new_tokens + 1, lm.backbone.max_positions, "distillation")
    return train_p, eval_p


def make_sequences(bb, cfg: DistillConfig, train_p, eval_p, eos: set[int], path: Path, log):
    """``(teacher, held)``: the training sequences of the teacher/fixed data and the held-out
    evaluation sequences (the target's greedy continuations), checkpointed at ``path``."""

    def compute() -> dict:
        log("generating the target's continuations of the prompts ...")
        held = [TrainSequence(tuple(p + continue_ids(bb, p, cfg.new_tokens, eos=eos)), len(p)) for _, p in eval_p]
        if cfg.steps == 0 or cfg.data_source == "on-policy":
            teacher = []  # not trained on
        elif cfg.data_source == "fixed":
            teacher = [TrainSequence(tuple(p), 1) for _, p in train_p if len(p) > 1]
        else:
            teacher = [TrainSequence(tuple(p + continue_ids(bb, p, cfg.new_tokens, eos=eos)), len(p))
                       for _, p in train_p]
        return {"teacher": [s.to_list() for s in teacher], "eval": [s.to_list() for s in held]}

    cached = checkpointed(path, compute)
    return [TrainSequence.from_list(x) for x in cached["teacher"]], [TrainSequence.from_list(x) for x in cached["eval"]]


class Training:
    """The optimisation of one student: AdamW on the mean divergence, evaluation every ``eval_every``
    steps, on-policy data resampled every ``refresh_every``, checkpoints every ``checkpoint_every``."""

    def __init__(self, lm, student, cfg: DistillConfig, teacher: list[TrainSequence], held: list[TrainSequence],
                 train_p, eos: set[int]):
        self.bb, self.student, self.cfg = lm.backbone, student, cfg
        self.teacher, self.train_p, self.eos = teacher, train_p, eos
        self.head = TargetHead(self.bb)
        self.eval_ds = Dataset.build(self.bb, held, student)
        self.params = list(student.parameters())
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step, self.history, self.onpolicy, self.elapsed = 0, [], None, 0.0
        self.needs_onpolicy = cfg.data_source in ("on-policy", "mixed") and cfg.steps > 0
        self.ds = None

    def start(self, ckpt: Path, log) -> None:
        """Resume from ``ckpt`` when it exists (else evaluate the untrained student), then build the data."""
        if ckpt.exists():
            ck = torch.load(ckpt, weights_only=False)
            self.student.load_state(ck["student"])
            self.opt.load_state_dict(ck["optimizer"])
            self.gen.set_state(ck["generator"])
            self.step, self.history, self.elapsed = ck["step"], ck["history"], ck["elapsed"]
            self.onpolicy = [TrainSequence.from_list(x) for x in ck["onpolicy"]] if ck["onpolicy"] is not None else None
            log(f"resuming from step {self.step} of {self.cfg.steps} ({ckpt.parent})")
        else:
            self.history.append({"step": 0, **evaluate(self.student, self.eval_ds, self.head, self.cfg)})
        if self.needs_onpolicy and self.onpolicy is None:
            self.onpolicy = self._sample_onpolicy(self.step // self.cfg.refresh_every)
        self.ds = Dataset.build(self.bb, self._train_set(), self.student) if self.cfg.steps > 0 else None

    def _train_set(self) -> list[TrainSequence]:
        if self.cfg.data_source in ("fixed", "teacher"):
            return self.teacher
        if self.cfg.data_source == "on-policy":
            return self.onpolicy
        return [t if i % 2 == 0 else o for i, (t, o) in enumerate(zip(self.teacher, self.onpolicy))]

    def _sample_onpolicy(self, refresh: int) -> list[TrainSequence]:
        cfg = self.cfg
        g = torch.Generator(device=self.bb.device).manual_seed(cfg.seed * 100_003 + refresh)
        return [TrainSequence(tuple(p + self.student.sample(p, cfg.new_tokens, g, cfg.temperature, self.eos)), len(p))
                for _, p in self.train_p]

    def _one_step(self) -> float:
        cfg, step = self.cfg, self.step
        refresh = step > 0 and step % cfg.refresh_every == 0 and self.history[-1].get("refreshed") != step
        if self.needs_onpolicy and refresh:
            self.onpolicy = self._sample_onpolicy(step // cfg.refresh_every)
            self.ds = Dataset.build(self.bb, self._train_set(), self.student)
            self.history.append({"step": step, "refreshed": step})
        rows = self.student.draw(self.ds, self.gen, cfg.batch_size)
        loss = divergence(cfg.divergence, self.head.logp(self.ds.h_target[rows]), self.student.logq(self.ds, rows),
                          cfg.jsd_beta).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        self.history.append({"step": self.step, "train_loss": round(float(loss.detach()), 5)})
        return float(loss.detach())

    def run(self, ckpt: Path, bar, on_step) -> None:
        """Train up to ``steps``, evaluating and checkpointing on schedule; ``on_step(step)`` after each."""
        cfg = self.cfg
        t_run = time.perf_counter()
        while self.step < cfg.steps:
            loss = self._one_step()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update(1)
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                self.history.append({"step": self.step, **evaluate(self.student, self.eval_ds, self.head, cfg)})
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                _save_torch(ckpt, {"student": self.student.state(), "optimizer": self.opt.state_dict(),
                                   "generator": self.gen.get_state(), "step": self.step, "history": self.history,
                                   "elapsed": self.elapsed + time.perf_counter() - t_run,
                                   "onpolicy": None if self.onpolicy is None else [s.to_list() for s in self.onpolicy]})
            if on_step is not None:
                on_step(self.step)
        self.elapsed += time.perf_counter() - t_run
        for p in self.params:
            p.requires_grad_(False)


def _record(lm, kind: str, run: Training, train_p, eval_p, domains, seconds: float) -> DistilledRecord:
    evals = [h for h in run.history if "greedy" in h]
    return DistilledRecord(
        kind=kind, model=lm.fingerprint(), acceptance=evals[-1]["greedy"], draft_cost=_draft_cost(lm, run.student),
        **run.student.meta(), config=run.cfg.to_dict(), before=evals[0], after=evals[-1],
        train_positions=run.ds.rows if run.ds else 0, eval_positions=run.eval_ds.rows, train_prompts=len(train_p),
        eval_prompts=len(eval_p), domains=tuple(sorted(domains)), train_seconds=round(run.elapsed, 1),
        seconds=round(seconds, 1), history=tuple(run.history), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _store(lm, profile_dir: Path, record: DistilledRecord, weights: dict) -> None:
    """Write the drafter into the profile as it is now (re-read: another writer may have changed it)."""
    profile = load_profile(profile_dir)
    profile.check_model(lm.fingerprint())
    profile.distilled = {**profile.distilled, record.kind: record}
    profile.distilled_weights = {**profile.distilled_weights, record.kind: weights}
    save_profile(profile, profile_dir)


def distill(lm, profile_dir: str | Path, domains: dict[str, list[str]], config: DistillConfig | None = None, *,
            draft_lm=None, resume: bool = False, progress: bool = True, plot: str | Path | None = None,
            log: Callable[[str], None] = lambda m: None,
            on_step: Callable[[int], None] | None = None) -> DistillResult:
    """Distill a drafter for ``lm`` (the profile's model) and store it in the profile at ``profile_dir``.

    ``draft_lm`` ``None`` trains the early-exit block; a :class:`~adaptive.models.LoadedModel` (float32,
    sharing the target's tokenizer) is fine-tuned as a separate draft model. ``on_step(step)`` is
    called after every optimiser step (tests interrupt a run with it).
    """
    cfg = config or DistillConfig()
    profile_dir = Path(profile_dir)
    profile = load_profile(profile_dir)
    profile.check_model(lm.fingerprint())
    kind, student = make_student(lm, cfg, draft_lm)
    train_p, eval_p = encode_prompts(lm, domains, cfg, profile.runtime.chat)
    eos = set(lm.eos_ids())
    work = WorkDir(Path(str(profile_dir) + f".distill-{kind}.work"), "distillation", DistillError)
    state = {"format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "kind": kind, "model": lm.fingerprint().to_dict(),
             "student": _digest(student.meta()), "data": _digest([[n, p] for n, p in train_p + eval_p])}
    with work.guarded(state, resume, "rerun with the same options, or delete it"):
        t_start = time.perf_counter()
        teacher, held = make_sequences(lm.backbone, cfg, train_p, eval_p, eos, work.file("sequences"), log)
        run = Training(lm, student, cfg, teacher, held, train_p, eos)
        run.start(work.file("checkpoint", ext="pt"), log)
        log(f"{kind}: {run.ds.rows if run.ds else 0} training positions ({cfg.data_source}), "
            f"{run.eval_ds.rows} held-out positions")
        bar = None
        if progress:
            bar = progress_bar(cfg.steps, f"distill {kind}", unit="step", initial=run.step, leave=False)
        run.run(work.file("checkpoint", ext="pt"), bar, on_step)
        if bar is not None:
            bar.close()
        record = _record(lm, kind, run, train_p, eval_p, domains, time.perf_counter() - t_start)
        _store(lm, profile_dir, record, student.state())
        title = (f"{kind} ({cfg.divergence}, {cfg.data_source}, {cfg.steps} steps): greedy agreement "
                 f"{record.before['greedy']:.3f} -> {record.after['greedy']:.3f}")
        plot_path = Path(plot) if plot else Path(str(profile_dir) + f".{kind}-distill.png")
        written = plot_curves(run.history, plot_path, title)
    return DistillResult(kind, profile_dir, record, written)


def _draft_cost(lm, student) -> float:
    """The trained drafter's cost per draft token, relative to a full step of the target (measured)."""
    bb = lm.backbone
    if isinstance(student, ExitStudent):
        block = student.inference_block()
        return measure_draft_cost(bb, lambda one, pos, cache: bb.forward(one, cache, pos, skip_masks=student.masks,
                                                                         adapter=block))
    dbb, context = student.lm.backbone, 128
    own = dbb.new_cache(context + 1)  # the draft model's own cache, prefilled as the target's is
    dbb.forward(torch.zeros(context, dtype=torch.long, device=dbb.device), own, 0, logits="none")
    return measure_draft_cost(bb, lambda one, pos, cache: dbb.forward(one.to(dbb.device), own, pos), context=context)


def _torch_load(path: Path):
    return torch.load(path, weights_only=False)


def distill_head(lm, profile_dir: str | Path, domains: dict[str, list[str]], config: HeadConfig | None = None, *,
                 resume: bool = False, progress: bool = True, plot: str | Path | None = None, race: bool = True,
                 log: Callable[[str], None] = lambda m: None,
                 on_step: Callable[[int], None] | None = None) -> DistillResult:
    """Train an eagle head for ``lm`` (the profile's model, torch engine) and store it in the profile at
    ``profile_dir`` (:mod:`adaptive.distill.heads` says how); with ``race``, then race it in every
    calibrated domain it has held-out prompts of (:func:`race_head`). ``on_step(step)`` after every
    optimiser step."""
    cfg = config or HeadConfig()
    kind = "eagle"
    profile_dir = Path(profile_dir)
    profile = load_profile(profile_dir)
    profile.check_model(lm.fingerprint())
    bb = lm.backbone
    shape = head_shape(bb, cfg)
    if not bb.keeps_features(shape.layers):
        raise ConfigError(f"the {bb.engine} engine gives no hidden states of this model after layers "
                          f"{list(shape.layers)}: train the head with --engine torch")
    engine = Engine(lm)
    encoded = {n: [engine.encode(p, chat=profile.runtime.chat) for p in ps] for n, ps in domains.items()}
    per = cfg.prompts_per_domain or max(len(v) for v in encoded.values())
    train_p, eval_p = split_prompts(encoded, per, cfg.held_out)
    check_room({n: ids[:per] for n, ids in encoded.items()}, cfg.new_tokens + 1, bb.max_positions, "distillation")
    eos = set(lm.eos_ids())
    work = WorkDir(Path(str(profile_dir) + f".distill-{kind}.work"), "distillation", DistillError)
    state = {"format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "kind": kind, "model": lm.fingerprint().to_dict(),
             "shape": shape.to_dict(), "data": _digest([[n, p] for n, p in train_p + eval_p])}
    with work.guarded(state, resume, "rerun with the same options, or delete it"):
        t_start = time.perf_counter()
        everything = train_p + eval_p

        def decode() -> list:
            log(f"decoding the target's continuations of {len(everything)} prompts ({cfg.new_tokens} tokens each) ...")
            return decode_with_features(bb, [p for _, p in everything], cfg.new_tokens, eos, shape.layers,
                                        cfg.generate_batch, log)

        decoded = checkpointed(work.file("sequences", ext="pt"), decode, load=_torch_load, save=_save_torch)
        starts, names, n = [len(p) for _, p in everything], [d for d, _ in everything], len(train_p)
        for k in range(1, cfg.samples):  # sampled continuations of the training prompts, each set checkpointed

            def sample(k=k) -> list:
                log(f"sampling continuation {k + 1} of {cfg.samples} of {len(train_p)} training prompts (temperature "
                    f"{cfg.temperature:g}) ...")
                return decode_with_features(bb, [p for _, p in train_p], cfg.new_tokens, eos, shape.layers,
                                            cfg.generate_batch, log, temperature=cfg.temperature, seed=cfg.seed + k)

            more = checkpointed(work.file(f"sampled-{k}", ext="pt"), sample, load=_torch_load, save=_save_torch)
            decoded, starts, names = (more + decoded, [len(p) for _, p in train_p] + starts,
                                      [d for d, _ in train_p] + names)
            n += len(train_p)
        data_seconds = time.perf_counter() - t_start
        train = HeadData.build(decoded[:n], starts[:n], names[:n], shape.lookup)
        held = HeadData.build(decoded[n:], starts[n:], names[n:], shape.lookup)
        vocab_ids, coverage = choose_vocab(train, held, min(cfg.vocab, bb.vocab_size), bb.vocab_size)
        run = HeadTrainer(bb, shape, vocab_ids, cfg)
        ckpt = work.file("checkpoint", ext="pt")
        eval_seconds = 0.0  # one held-out evaluation's time: the budget pays for those to come too
        if ckpt.exists():
            run.load(_torch_load(ckpt))
            log(f"resuming from step {run.step} of {run.total} ({ckpt.parent})")
        else:
            t_eval = time.perf_counter()
            run.history.append(run.evaluation(held, 0.0))
            eval_seconds = time.perf_counter() - t_eval
        log(f"eagle head: {train.rows} training positions, {held.rows} held-out; {len(vocab_ids)} rows covering "
            f"{coverage:.1%} of the held-out answers' tokens")
        bar = None
        if progress:
            bar = progress_bar(run.total, "distill eagle", unit="step", initial=run.step, leave=False)
        t_run = time.perf_counter()
        pacer = Pacer(cfg.minutes, cfg.eval_every, eval_seconds, t_run, run.elapsed, run.step)
        while run.total is None or run.step < run.total:
            loss = run.train_step(train)
            run.history.append({"step": run.step, "train_loss": round(loss, 5)})
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}")
                bar.update(1)
            last = run.total is not None and run.step >= run.total
            evaluated = run.step % cfg.eval_every == 0 or last
            if evaluated:
                t_eval = time.perf_counter()
                run.history.append(run.evaluation(held, run.elapsed + t_eval - t_run))
                pacer.evaluated(time.perf_counter() - t_eval)
            if cfg.steps is None and not last:  # the schedule's length: paced, then re-paced (Pacer)
                total = pacer.length(run.step, run.total, time.perf_counter(), evaluated)
                if total != run.total and (run.total is None or abs(total - run.total) > 0.05 * run.total):
                    log(f"{pacer.pace:.2f} s a step: {total} steps in {cfg.minutes:g} minutes"
                        + (f" (not {run.total})" if run.total else "")
                        + f", {pacer.eval_seconds:.0f} s an evaluation every {cfg.eval_every}")
                run.total = total
                if bar is not None:
                    bar.total = run.total
            if run.step % cfg.checkpoint_every == 0 or last:
                ck = run.state()
                ck["elapsed"] = run.elapsed + time.perf_counter() - t_run
                _save_torch(ckpt, ck)
            if on_step is not None:
                on_step(run.step)
        run.elapsed += time.perf_counter() - t_run
        if bar is not None:
            bar.close()
        head = run.head.requires_grad_(False).eval()
        evals = [h for h in run.history if "positions" in h]
        after = evals[-1]
        record = DistilledRecord(
            kind=kind, model=lm.fingerprint(), acceptance=after["greedy"], draft_cost=measure_head_cost(bb, head),
            shape=shape.to_dict(), positions=tuple(after["positions"]), tau=after["tau"],
            by_domain={d: list(v) for d, v in after["by_domain"].items()},
            interval=Interval.from_dict(after["interval"]) if after["interval"] else None,
            domain_intervals={d: Interval.from_dict(v) for d, v in after["domain_intervals"].items() if v},
            vocab=int(len(vocab_ids)),
            coverage=coverage, config=cfg.to_dict(), before={"greedy": evals[0]["greedy"], "tau": evals[0]["tau"]},
            after={"greedy": after["greedy"], "tau": after["tau"]}, train_positions=train.rows,
            eval_positions=held.rows, train_prompts=len(train_p), eval_prompts=len(eval_p),
            domains=tuple(sorted(domains)), train_seconds=round(run.elapsed, 1),
            seconds=round(time.perf_counter() - t_start, 1),
            history=tuple(run.history) + ({"data_seconds": round(data_seconds, 1)},),
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _store(lm, profile_dir, record, head.state())
        if race:
            held_by_domain: dict[str, list[list[int]]] = {}
            for name, ids in eval_p:
                held_by_domain.setdefault(name, []).append(ids)
            race_head(lm, profile_dir, head, record, held_by_domain, log)
        plot_path = Path(plot) if plot else Path(str(profile_dir) + f".{kind}-distill.png")
        written = plot_curves([h for h in run.history if "step" in h], plot_path,
                              f"eagle head ({run.total} steps, {run.elapsed / 60:.1f} min): first draft kept "
                              f"{record.before['greedy']:.3f} -> {record.acceptance:.3f}, tau {record.tau:.2f}")
    return DistillResult(kind, profile_dir, record, written)


def race_head(lm, profile_dir: str | Path, head, record: DistilledRecord, held: dict[str, list[list[int]]],
              log: Callable[[str], None] = lambda m: None) -> dict[str, tuple[str, str]]:
    """Race the eagle ``head`` against ``ar`` in each calibrated domain named in ``held`` (its prompts
    there: held out of the head's training, as the calibration's races use prompts no drafter was fit
    to), and the global record on all of them; decide each again with the head's measurement beside
    its calibrated ones (:func:`~adaptive.measure.decision.decide`), and write the profile. The head
    drafts the length its acceptance in that domain and its cost give (at least 1), and its copies of the
    context the length prompt lookup's calibrated acceptance gives (:meth:`DomainRecord.copy_length`). Returns
    ``{domain: (old drafter, new drafter)}`` of the records raced."""
    profile = load_profile(profile_dir)
    settings, maxlen = profile.settings, profile.runtime.max_draft_len
    changed: dict[str, tuple[str, str]] = {}
    targets = [(n, held[n]) for n in sorted(profile.domains) if held.get(n)]
    if not targets:
        log("no calibrated domain among the distillation's domains: the head is not raced (policy eagle uses it)")
        return changed
    everyone = [p for _, ps in targets for p in ps]
    for name, prompts in [*targets, (None, everyone)]:
        dp = profile.domain(name)
        acc = record.by_domain.get(name, [record.acceptance])[0] if name else record.acceptance
        k = max(1, best_draft_length(acc, record.draft_cost, dp.verify_table(maxlen), maxlen)[0])
        cand = Candidate("eagle", k, estimated_acceptance=acc, estimated_draft_cost=record.draft_cost,
                         copy_len=dp.copy_length(maxlen))
        timed = race_domain(lm, prompts, {"eagle": cand}, settings, prompts=len(prompts), eagle=head).timed
        if "eagle" not in timed:
            continue
        kept = {m.role: m for m in dp.measurements if m.role in ROLES and m.role != "eagle"}
        kept["eagle"] = timed["eagle"]
        decision = decide(kept, settings.acceptance_floor)
        others = tuple(m for m in dp.measurements if m.role not in ROLES)
        new = replace(dp, decision=decision, measurements=tuple(kept[r] for r in ROLES if r in kept) + others)
        if name is None:
            profile.global_set = new
        else:
            profile.domains[name] = new
        m = timed["eagle"]
        log(f"eagle in {dp.name}: {m.speedup:.2f}x {m.interval.to_text() if m.interval else ''} ({m.verdict}), "
            f"{m.mean_accepted:.2f} tokens a step; decision {dp.decision.drafter} -> {decision.drafter}")
        changed[dp.name] = (dp.decision.drafter, decision.drafter)
    save_profile(profile, profile_dir)
    return changed
