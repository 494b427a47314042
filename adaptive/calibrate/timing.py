"""Timed decoding of drafters against plain decoding (``ar``): what calibration decides on.

:func:`measure_candidates` times each :class:`Candidate` interleaved with ``ar`` on the same prompts
and returns one typed :class:`~adaptive.profile.Measurement` per candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.drafters.ngram import BigramTable
from adaptive.drafters.vocab import DraftHead
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from adaptive.profile import Measurement
from adaptive.records import record


@record
class Candidate:
    """A drafter to time: ``ssd`` (``skip``; with ``draft_vocab``, drafting over that many of the
    domain's vocabulary ids joined with the prompt's, as the runtime does), ``pld``, or ``cascade``
    (``skip`` and ``cascade``, drafting with the domain's bigram table); ``estimated_*``: the
    search's estimate, carried into the measurement."""

    drafter: str
    draft_len: int
    skip: str = "none"
    cascade: CascadePlan | None = None
    draft_vocab: int | None = None
    estimated_acceptance: float | None = None
    estimated_draft_cost: float | None = None
    estimated_speedup: float | None = None

    @classmethod
    def of(cls, m: Measurement) -> Candidate:
        """The candidate that ``m`` timed (to time it again)."""
        return cls(m.drafter, m.draft_len, m.skip, m.cascade, m.draft_vocab, m.estimated_acceptance,
                   m.estimated_draft_cost, m.estimated_speedup)


@dataclass
class _Counts:
    """Sums over the timed runs of one candidate: ``ar`` and drafted tokens and seconds (decode
    phase), the drafter's drafted/accepted tokens, rejections, steps, and identical outputs."""

    n_ar: int = 0
    t_ar: float = 0.0
    n_sd: int = 0
    t_sd: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    steps: int = 0
    same: int = 0


def _decode_rate(stats) -> tuple[int, float]:
    """Tokens decoded after the prefill and the time they took (the prefill is the same for every
    drafter, and on long prompts its noise would swamp the difference being measured)."""
    return max(stats.tokens - 1, 0), max(stats.total_time - stats.prefill_time, 1e-9)


def candidate_drafter(lm: LoadedModel, cand: Candidate, bigram: BigramTable | None, vocab, prompt: list[int]):
    """The drafter of ``cand`` for one prompt (``vocab``: the domain's draft vocabulary ids, best first)."""
    bb = lm.backbone
    if cand.drafter == "cascade":
        skip = SkipSet.from_text(cand.skip, lm.n_layers) if cand.cascade.split else None
        return build_drafter(DrafterSpec("cascade", skip=skip, cascade=cand.cascade, bigram=bigram), bb)
    if cand.drafter == "ssd":
        head = None
        if cand.draft_vocab:
            ids = torch.as_tensor(np.asarray(vocab)[: cand.draft_vocab], dtype=torch.long, device=bb.device)
            head = DraftHead.build(bb.lm_head.weight, ids, extra=prompt)
        return build_drafter(DrafterSpec("ssd", skip=SkipSet.from_text(cand.skip, lm.n_layers), head=head), bb)
    return build_drafter(DrafterSpec(cand.drafter), bb)


def _time(engine: Engine, lm: LoadedModel, cand: Candidate, prompt_ids: list[list[int]], tokens: int, repeats: int,
          bigram, vocab) -> _Counts:
    c = _Counts()
    cfg = GenerationConfig(max_new_tokens=tokens, draft_len=cand.draft_len)
    for _ in range(repeats):
        for p in prompt_ids:  # ar right before the drafter on every prompt: drift hits both alike
            a = engine.generate(p, cfg)
            b = engine.generate(p, cfg, drafter=candidate_drafter(lm, cand, bigram, vocab, p))
            n, t = _decode_rate(a.stats)
            c.n_ar, c.t_ar = c.n_ar + n, c.t_ar + t
            n, t = _decode_rate(b.stats)
            c.n_sd, c.t_sd = c.n_sd + n, c.t_sd + t
            c.drafted += b.stats.drafted
            c.accepted += b.stats.accepted
            c.rejections += b.stats.rejections
            c.steps += b.stats.steps
            c.same += a.token_ids == b.token_ids
    return c


def measurement(cand: Candidate, role: str, c: _Counts, prompts: int, repeats: int) -> Measurement:
    """The typed record of one candidate's timed runs (rates and speedup rounded as profiles store them)."""
    ar, sd = c.n_ar / c.t_ar, c.n_sd / c.t_sd
    return Measurement(
        drafter=cand.drafter, role=role, draft_len=cand.draft_len,
        speedup=round(sd / ar, 4) if c.n_ar else 0.0,
        acceptance=round(c.accepted / c.drafted, 4) if c.drafted else 0.0,
        # per token up to the first rejection (what the runtime's bandit models)
        token_acceptance=round(c.accepted / (c.accepted + c.rejections), 4) if c.accepted + c.rejections else 0.0,
        mean_accepted=round((c.accepted + c.steps) / c.steps, 4) if c.steps else 0.0,
        ar_tokens_per_s=round(ar, 3), tokens_per_s=round(sd, 3), identical_outputs=int(c.same), prompts=prompts,
        repeats=repeats, skip=cand.skip, estimated_acceptance=cand.estimated_acceptance,
        estimated_draft_cost=cand.estimated_draft_cost, estimated_speedup=cand.estimated_speedup,
        cascade=cand.cascade, draft_vocab=cand.draft_vocab)


def measure_candidates(lm: LoadedModel, prompt_ids: list[list[int]], candidates: Sequence[Candidate], tokens: int, *,
                       role: str = "candidate", done: Sequence[Measurement] = (),
                       on_done: Callable[[Measurement], None] | None = None, repeats: int = 1,
                       bigram: BigramTable | None = None, vocab=None) -> list[Measurement]:
    """Timed plain vs speculative decoding of each candidate on the same prompts, as ``role``.

    Plain decoding runs right before each candidate on every prompt (``repeats`` times), so drift
    hits both alike. Speedup = (candidate tokens/s) / (plain tokens/s), decode phase only, each
    over all prompts. The first ``len(done)`` candidates were measured already (``done``, kept);
    ``on_done`` receives each new measurement (the checkpoint hook).
    """
    engine = Engine(lm)
    out = list(done)
    if len(out) < len(candidates):
        engine.generate(prompt_ids[0], GenerationConfig(max_new_tokens=4))  # warm-up
    for cand in candidates[len(out):]:
        counts = _time(engine, lm, cand, prompt_ids, tokens, repeats, bigram, vocab)
        rec = measurement(cand, role, counts, len(prompt_ids), repeats)
        out.append(rec)
        if on_done is not None:
            on_done(rec)
    return out
