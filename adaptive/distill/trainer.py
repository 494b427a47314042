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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from adaptive.distill.data import DATA_SOURCES, TrainSequence, continue_ids
from adaptive.distill.divergences import DIVERGENCES, divergence, greedy_agreement, sampling_acceptance
from adaptive.distill.students import Dataset, ExitStudent, ModelStudent, TargetHead
from adaptive.errors import AdaptiveError, ConfigError

KINDS = ("early-exit", "draft-model")


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
        for name in ("batch_size", "new_tokens", "prompts_per_domain", "refresh_every", "eval_every",
                     "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not 0.0 < self.held_out < 1.0:
            raise ConfigError(f"held_out must be in (0, 1), got {self.held_out}")
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
    from adaptive.calibrate.runner import _atomic_write

    buf = io.BytesIO()
    torch.save(obj, buf)
    _atomic_write(path, buf.getvalue())


@dataclass
class DistillResult:
    kind: str
    profile: Path
    meta: dict
    plot: Path | None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "profile": str(self.profile), "plot": str(self.plot) if self.plot else None,
                **{k: v for k, v in self.meta.items() if k not in ("history", "config_json")}}


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
    a1.plot([h["step"] for h in evals], [h["loss"] for h in evals], "o-", label="held out")
    a1.set_xlabel("step")
    a1.set_ylabel("divergence")
    a1.legend()
    a2.plot([h["step"] for h in evals], [h["greedy"] for h in evals], "o-", label="greedy agreement")
    a2.plot([h["step"] for h in evals], [h["sampling"] for h in evals], "s-", label="sampling acceptance (T=1)")
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


def distill(lm, profile_dir: str | Path, domains: dict[str, list[str]], config: DistillConfig | None = None, *,
            draft_lm=None, resume: bool = False, progress: bool = True, plot: str | Path | None = None,
            log: Callable[[str], None] = lambda m: None,
            on_step: Callable[[int], None] | None = None) -> DistillResult:
    """Distill a drafter for ``lm`` (the profile's model) and store it in the profile at ``profile_dir``.

    ``draft_lm`` ``None`` trains the early-exit block; a :class:`~adaptive.models.LoadedModel` (float32,
    sharing the target's tokenizer) is fine-tuned as a separate draft model. ``on_step(step)`` is
    called after every optimiser step (tests interrupt a run with it).
    """
    from adaptive.calibrate.runner import WorkDir, _write_json, check_room
    from adaptive.engine.engine import Engine, eos_ids
    from adaptive.profile import load_profile, save_profile

    cfg = config or DistillConfig()
    profile = load_profile(profile_dir)
    profile.check_model(lm.fingerprint())
    bb = lm.backbone
    if draft_lm is None:
        kind = "early-exit"
        exit_layer = cfg.exit_layer if cfg.exit_layer is not None else lm.n_layers // 2
        if exit_layer >= lm.n_layers:
            raise ConfigError(f"--exit-layer {exit_layer} leaves no layer to skip in a {lm.n_layers}-layer model")
        student = ExitStudent(lm, exit_layer)
    else:
        from adaptive.drafters.model import check_same_tokenizer

        kind = "draft-model"
        check_same_tokenizer(lm.tokenizer, draft_lm.tokenizer, bb.vocab_size, draft_lm.backbone.vocab_size)
        if draft_lm.dtype != torch.float32:
            raise ConfigError("a draft model is trained in float32: load it with dtype float32")
        student = ModelStudent(draft_lm)
    engine = Engine(lm)
    chat = profile.settings.get("chat")
    encoded = {n: [engine.encode(p, chat=chat) for p in ps] for n, ps in domains.items()}
    train_p, eval_p = split_prompts(encoded, cfg.prompts_per_domain, cfg.held_out)
    used = {n: ids[: cfg.prompts_per_domain] for n, ids in encoded.items()}
    check_room(used, cfg.new_tokens + 1, bb.max_positions, "distillation")
    eos = set(eos_ids(lm.model, lm.tokenizer))

    profile_dir = Path(profile_dir)
    work = WorkDir(Path(str(profile_dir) + f".distill-{kind}"), what="distillation")
    state = {"config": cfg.to_dict(), "kind": kind, "model": lm.fingerprint(),
             "student": _digest(student.meta()), "data": _digest([[n, p] for n, p in train_p + eval_p])}
    state_path = work.path / "state.json"
    had_work = work.path.exists()
    work.acquire()
    ckpt_path = work.path / "checkpoint.pt"
    try:
        if had_work and state_path.exists() and not resume:
            raise DistillError(f"an interrupted distillation left {work.path}: pass --resume to continue it, "
                               "or delete it to start over")
        if state_path.exists():
            old = json.loads(state_path.read_text())
            if old != state:
                diff = [k for k in state if old.get(k) != state[k]]
                raise DistillError(f"--resume: the checkpoint in {work.path} was made with different "
                                   f"{', '.join(diff)}; rerun with the same options, or delete it")
        else:
            _write_json(state_path, state)
        t_start = time.perf_counter()
        seq_path = work.path / "sequences.json"
        if seq_path.exists():
            cached = json.loads(seq_path.read_text())
            teacher = [TrainSequence.from_list(x) for x in cached["teacher"]]
            held = [TrainSequence.from_list(x) for x in cached["eval"]]
        else:
            log("generating the target's continuations of the prompts ...")
            held = [TrainSequence(tuple(p + continue_ids(bb, p, cfg.new_tokens, eos=eos)), len(p)) for _, p in eval_p]
            if cfg.steps == 0 or cfg.data_source == "on-policy":
                teacher = []  # not trained on
            elif cfg.data_source == "fixed":
                teacher = [TrainSequence(tuple(p), 1) for _, p in train_p if len(p) > 1]
            else:
                teacher = [TrainSequence(tuple(p + continue_ids(bb, p, cfg.new_tokens, eos=eos)), len(p))
                           for _, p in train_p]
            _write_json(seq_path, {"teacher": [s.to_list() for s in teacher], "eval": [s.to_list() for s in held]})
        head = TargetHead(bb)
        eval_ds = Dataset.build(bb, held, student)

        params = [p for p in student.parameters()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        gen = torch.Generator().manual_seed(cfg.seed)
        step, history, onpolicy, elapsed = 0, [], None, 0.0
        if ckpt_path.exists():
            ck = torch.load(ckpt_path, weights_only=False)
            student.load_state(ck["student"])
            opt.load_state_dict(ck["optimizer"])
            gen.set_state(ck["generator"])
            step, history, elapsed = ck["step"], ck["history"], ck["elapsed"]
            onpolicy = [TrainSequence.from_list(x) for x in ck["onpolicy"]] if ck["onpolicy"] is not None else None
            log(f"resuming from step {step} of {cfg.steps} ({work.path})")
        else:
            history.append({"step": 0, **evaluate(student, eval_ds, head, cfg)})

        def train_set(seqs_onpolicy):
            if cfg.data_source in ("fixed", "teacher"):
                return teacher
            if cfg.data_source == "on-policy":
                return seqs_onpolicy
            return [t if i % 2 == 0 else o for i, (t, o) in enumerate(zip(teacher, seqs_onpolicy))]

        def sample_onpolicy(refresh: int):
            g = torch.Generator(device=bb.device).manual_seed(cfg.seed * 100_003 + refresh)
            return [TrainSequence(tuple(p + student.sample(p, cfg.new_tokens, g, cfg.temperature, eos)), len(p))
                    for _, p in train_p]

        needs_onpolicy = cfg.data_source in ("on-policy", "mixed") and cfg.steps > 0
        if needs_onpolicy and onpolicy is None:
            onpolicy = sample_onpolicy(step // cfg.refresh_every)
        ds = Dataset.build(bb, train_set(onpolicy), student) if cfg.steps > 0 else None
        log(f"{kind}: {ds.rows if ds else 0} training positions ({cfg.data_source}), {eval_ds.rows} held-out positions")
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=step, desc=f"distill {kind}", unit="step", leave=False)
        t_run = time.perf_counter()
        while step < cfg.steps:
            if needs_onpolicy and step > 0 and step % cfg.refresh_every == 0 and history[-1].get("refreshed") != step:
                onpolicy = sample_onpolicy(step // cfg.refresh_every)
                ds = Dataset.build(bb, train_set(onpolicy), student)
                history.append({"step": step, "refreshed": step})
            rows = student.draw(ds, gen, cfg.batch_size)
            logp = head.logp(ds.h_target[rows])
            logq = student.logq(ds, rows)
            loss = divergence(cfg.divergence, logp, logq, cfg.jsd_beta).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            history.append({"step": step, "train_loss": round(float(loss.detach()), 5)})
            if bar is not None:
                bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
                bar.update(1)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                history.append({"step": step, **evaluate(student, eval_ds, head, cfg)})
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                _save_torch(ckpt_path, {"student": student.state(), "optimizer": opt.state_dict(),
                                        "generator": gen.get_state(), "step": step, "history": history,
                                        "elapsed": elapsed + time.perf_counter() - t_run,
                                        "onpolicy": None if onpolicy is None else [s.to_list() for s in onpolicy]})
            if on_step is not None:
                on_step(step)
        if bar is not None:
            bar.close()
        elapsed += time.perf_counter() - t_run
        for p in params:
            p.requires_grad_(False)

        evals = [h for h in history if "greedy" in h]
        meta = {"kind": kind, **student.meta(), "config": cfg.to_dict(), "before": evals[0], "after": evals[-1],
                "train_positions": ds.rows if ds else 0, "eval_positions": eval_ds.rows, "train_prompts": len(train_p),
                "eval_prompts": len(eval_p), "domains": sorted(domains), "train_seconds": round(elapsed, 1),
                "seconds": round(time.perf_counter() - t_start, 1), "model": lm.fingerprint(),
                "draft_cost": _draft_cost(lm, student), "history": history,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        profile = load_profile(profile_dir)  # re-read: write into the profile as it is now
        profile.check_model(lm.fingerprint())
        profile.distilled = {**profile.distilled, kind: meta}
        profile.distilled_weights = {**profile.distilled_weights, kind: student.state()}
        save_profile(profile, profile_dir)
        plot_path = Path(plot) if plot else Path(str(profile_dir) + f".{kind}-distill.png")
        title = (f"{kind} ({cfg.divergence}, {cfg.data_source}, {cfg.steps} steps): greedy agreement "
                 f"{evals[0]['greedy']:.3f} -> {evals[-1]['greedy']:.3f}")
        written = plot_curves(history, plot_path, title)
    except BaseException:
        work.release()
        raise
    work.remove()
    return DistillResult(kind, profile_dir, meta, written)


def _draft_cost(lm, student) -> float:
    """The trained drafter's cost per draft token, relative to a full step of the target (measured)."""
    from adaptive.costs import measure_draft_cost

    bb = lm.backbone
    if isinstance(student, ExitStudent):
        block = student.inference_block()
        return measure_draft_cost(bb, lambda one, pos, cache: bb.forward(one, cache, pos, skip_masks=student.masks,
                                                                         adapter=block))
    dbb, context = student.lm.backbone, 128
    own = dbb.new_cache(context + 1)  # the draft model's own cache, prefilled as the target's is
    dbb.forward(torch.zeros(context, dtype=torch.long, device=dbb.device), own, 0, logits="none")
    return measure_draft_cost(bb, lambda one, pos, cache: dbb.forward(one.to(dbb.device), own, pos), context=context)
