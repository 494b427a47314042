"""Timed decoding of drafters against plain decoding (``ar``): what calibration decides on.

:func:`race_candidates` times the :class:`Candidate` drafters of a domain in paired blocks against
``ar`` (:func:`time_prompt`: same prompt state, same tokens, seconds apart) until each one's
bootstrap interval settles (:mod:`.interval`), and returns one typed
:class:`~adaptive.profile.Measurement` per candidate, its interval and verdict included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch

from adaptive.codec import record, text_field
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.factory import DrafterSpec, build_drafter, eagle_vocab
from adaptive.drafters.head import DraftHead
from adaptive.drafters.ngram import BigramTable
from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import GenerationStats, decode_steps, prefill
from adaptive.engine.protocol import DecodeState, FixedDraftLength
from adaptive.engine.skip import SkipSet
from adaptive.measure.interval import Race
from adaptive.models import LoadedModel
from adaptive.profile import Interval, Measurement, MeasureSettings


@record
class Candidate:
    """A drafter to time: ``ssd`` (``skip``; with ``draft_vocab``, drafting over that many of the
    domain's vocabulary ids joined with the prompt's, as the runtime does), ``pld``, ``cascade``
    (``skip`` and ``cascade``, drafting with the domain's bigram table), or ``eagle`` (the race's eagle
    head, over its rows joined with the prompt's); ``estimated_*``: the
    search's estimate, carried into the measurement. Its JSON (the race checkpoint's key) holds
    ``skip`` as text, as :class:`~adaptive.profile.Measurement` does."""

    drafter: str
    draft_len: int
    skip: SkipSet = text_field(default=SkipSet())
    cascade: CascadePlan | None = None
    draft_vocab: int | None = None
    estimated_acceptance: float | None = None
    estimated_draft_cost: float | None = None
    estimated_speedup: float | None = None
    copy_len: int | None = None  # an eagle candidate's copies of the context run to this (DraftChoice.copy)


@dataclass
class _Tally:
    """One candidate's decoding over its timed blocks: tokens and seconds (its own and ``ar``'s on
    the same blocks), drafted/accepted tokens, rejections, verification steps, blocks whose tokens
    equal ``ar``'s, and the prompts it was timed on."""

    tokens: int = 0
    seconds: float = 0.0
    ar_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    steps: int = 0
    same: int = 0
    blocks: int = 0
    prompts: int = 0

    def add(self, other: dict) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


def candidate_drafter(lm: LoadedModel, cand: Candidate, bigram: BigramTable | None, vocab, prompt: list[int],
                      eagle=None):
    """The drafter of ``cand`` for one prompt (``vocab``: the domain's draft vocabulary ids, best first;
    ``eagle``: the eagle head an ``eagle`` candidate drafts with)."""
    bb = lm.backbone
    if cand.drafter == "eagle":
        if eagle is None:
            raise ValueError("an eagle candidate is raced with its head (race_candidates(eagle=...))")
        return build_drafter(DrafterSpec("eagle", eagle=eagle, head=eagle_vocab(eagle, bb, prompt)), bb)
    if cand.drafter == "cascade":
        skip = cand.skip if cand.cascade.split else None
        return build_drafter(DrafterSpec("cascade", skip=skip, cascade=cand.cascade, bigram=bigram), bb)
    if cand.drafter == "ssd":
        head = None
        if cand.draft_vocab:
            ids = torch.as_tensor(np.asarray(vocab)[: cand.draft_vocab], dtype=torch.long, device=bb.device)
            head = DraftHead.build(bb, ids, extra=prompt)
        return build_drafter(DrafterSpec("ssd", skip=cand.skip, head=head), bb)
    return build_drafter(DrafterSpec(cand.drafter), bb)


def _block(bb, cache, tokens: list[int], n: int, draft_len: int, drafter, copy: int | None = None
           ) -> tuple[float, list[int], GenerationStats]:
    """Decode ``n`` tokens from the state ``(cache, tokens)`` (the last token pending) with ``drafter``
    (``None``: plain decoding), ``draft_len`` tokens a draft and its copies ``copy`` (:attr:`Candidate.copy_len`);
    returns the seconds, the new tokens and the loop's statistics. The state is left after those tokens: the
    caller rewinds it (``cache.length`` and ``tokens``)."""
    k = max(draft_len, 1)
    cfg = GenerationConfig(max_new_tokens=n + 1, draft_len=max(k, copy or 0))
    stats = GenerationStats()
    state = DecodeState(bb, cache, tokens, cfg, None)
    start = len(tokens)
    t0 = time.perf_counter()
    for _ in decode_steps(bb, state, drafter, FixedDraftLength(k, copy), cfg, stats):
        pass
    if bb.device.type == "cuda":
        torch.cuda.synchronize(bb.device)
    return time.perf_counter() - t0, tokens[start:], stats


def _captures(bb) -> int:
    """CUDA graphs the backbone has captured so far (0 without graphs: the CPU, the llama.cpp engine)."""
    graphs = getattr(bb, "graphs", None)
    return graphs.captures if graphs is not None else 0


def _timed_block(bb, cache, tokens: list[int], n: int, draft_len: int, drafter, copy: int | None = None
                 ) -> tuple[float, list[int], GenerationStats]:
    """:func:`_block`, decoded again from the same state when it captured CUDA graphs: a capture is
    one-time work (~0.1 s against a block's ~10 ms on a GPU) that a server does at startup, so a block
    that paid one says nothing of the drafter's pace. Decodes at most twice (the second replays)."""
    pos, length, before = cache.length, len(tokens), _captures(bb)
    out = _block(bb, cache, tokens, n, draft_len, drafter, copy)
    if _captures(bb) == before:
        return out
    cache.length = pos
    del tokens[length:]
    return _block(bb, cache, tokens, n, draft_len, drafter, copy)


def time_prompt(lm: LoadedModel, prompt: list[int], candidates: dict[str, Candidate], active: Callable[[], list[str]],
                on_block: Callable[[float, dict[str, float]], None], *, block_tokens: int, max_tokens: int,
                eos: set[int], bigram=None, vocab=None, eagle=None,
                guard: Callable[[], AbstractContextManager] = nullcontext) -> dict[str, dict]:
    """Time ``ar`` and the still ``active()`` candidates block by block on one prompt.

    The prompt is prefilled once. Each block of ``block_tokens`` tokens is decoded from the same
    state by every active candidate (in turn, rotating their order) and then by ``ar``, whose tokens
    the next block continues from; ``on_block(ar_seconds, {name: seconds})`` gets each block's
    times. Stops after ``max_tokens`` tokens, after the block that produced an EOS, or when no
    candidate is active. Returns each candidate's decoding tally over this prompt (:class:`_Tally` fields).
    A block that captured CUDA graphs is timed again (:func:`_timed_block`). With an ``eagle`` candidate
    the cache keeps its head's feature rows (for every drafter and ``ar``: they pay the same small copy).
    ``guard()`` is entered around the prefill and around each block (its candidates and ``ar``
    together, so that their times are paired): the runtime's model lock, when a live server shares the model.
    """
    bb = lm.backbone
    longest = max((max(c.draft_len, c.copy_len or 0) for c in candidates.values()), default=1)
    positions = len(prompt) + max_tokens + longest + 1
    eagles = any(c.drafter == "eagle" for c in candidates.values())
    cache = bb.new_cache(positions, features=eagle.shape.layers) if eagles else bb.new_cache(positions)
    with guard():
        first = prefill(bb, prompt, cache, GenerationConfig(max_new_tokens=max_tokens), None).first
    tokens = list(prompt) + [first]
    drafters = {name: candidate_drafter(lm, c, bigram, vocab, prompt, eagle) for name, c in candidates.items()}
    tally = {name: _Tally() for name in candidates}
    made, block = 1, 0
    while made < max_tokens and active():
        n = min(block_tokens, max_tokens - made)
        pos, length = cache.length, len(tokens)
        names = active()
        names = names[block % len(names):] + names[: block % len(names)]
        seconds = {}
        outs = {}
        with guard():
            for name in names:
                cand = candidates[name]
                seconds[name], outs[name], st = _timed_block(bb, cache, tokens, n, cand.draft_len, drafters[name],
                                                             cand.copy_len)
                tally[name].add(dict(tokens=n, seconds=seconds[name], drafted=st.drafted, accepted=st.accepted,
                                     rejections=st.rejections, steps=st.steps, blocks=1))
                cache.length = pos
                del tokens[length:]
            ar_seconds, ar_out, _ = _timed_block(bb, cache, tokens, n, 1, None)  # last: the next continues from ar
        for name in names:
            tally[name].add(dict(ar_seconds=ar_seconds, same=int(outs[name] == ar_out)))
        on_block(ar_seconds, seconds)
        made += n
        block += 1
        if any(t in eos for t in ar_out):
            break
    for t in tally.values():
        t.prompts = int(t.blocks > 0)
    return {name: asdict(t) for name, t in tally.items()}


def measurement(cand: Candidate, role: str, t: _Tally, speedup: float, interval: Interval, verdict: str) -> Measurement:
    """The typed record of one candidate's race (rates and speedup rounded as profiles store them)."""
    return Measurement(
        drafter=cand.drafter, role=role, draft_len=cand.draft_len, speedup=round(speedup, 4),
        acceptance=round(t.accepted / t.drafted, 4) if t.drafted else 0.0,
        # per token up to the first rejection (what the runtime's bandit models)
        token_acceptance=round(t.accepted / (t.accepted + t.rejections), 4) if t.accepted + t.rejections else 0.0,
        mean_accepted=round((t.accepted + t.steps) / t.steps, 4) if t.steps else 0.0,
        ar_tokens_per_s=round(t.tokens / t.ar_seconds, 3) if t.ar_seconds else 0.0,
        tokens_per_s=round(t.tokens / t.seconds, 3) if t.seconds else 0.0, identical_outputs=int(t.same),
        prompts=t.prompts, repeats=t.blocks, skip=cand.skip, estimated_acceptance=cand.estimated_acceptance,
        estimated_draft_cost=cand.estimated_draft_cost, estimated_speedup=cand.estimated_speedup,
        cascade=cand.cascade, draft_vocab=cand.draft_vocab, interval=interval, verdict=verdict)


@dataclass(frozen=True)
class RaceConfig:
    """How a domain's candidates are raced against ``ar``: blocks of ``block_tokens`` on up to
    ``prompts`` prompts, ``max_tokens`` each; a candidate settles after ``min_blocks`` blocks of
    ``min_prompts`` prompts once its interval (at ``level``, prompts resampled with ``seed``) clears or
    misses ``1 + margin``
    (:class:`~.interval.Race`). :meth:`of` builds it from a profile's (or a calibration's)
    :class:`~adaptive.profile.MeasureSettings`, where the defaults are."""

    block_tokens: int
    max_tokens: int
    prompts: int
    min_blocks: int
    margin: float
    level: float
    seed: int
    min_prompts: int

    @classmethod
    def of(cls, settings: MeasureSettings, prompts: int | None = None) -> RaceConfig:
        """The race ``settings`` describe, on up to ``prompts`` prompts (``None``: ``confirm_prompts``).

        Example: ``RaceConfig.of(MeasureSettings(block_tokens=8), prompts=2)`` ->
        ``RaceConfig(block_tokens=8, max_tokens=64, prompts=2, min_blocks=6, margin=0.02, level=0.9, seed=0,
        min_prompts=2)``."""
        return cls(block_tokens=settings.block_tokens, max_tokens=settings.confirm_tokens,
                   prompts=settings.confirm_prompts if prompts is None else prompts, min_blocks=settings.min_blocks,
                   margin=settings.min_gain, level=settings.interval_level, seed=settings.seed,
                   min_prompts=settings.min_prompts)


def _of_prompt(given, i: int):
    """Prompt ``i``'s item of a per-prompt list, or ``given`` itself when it is one for every prompt."""
    return given[i] if isinstance(given, (list, tuple)) else given


def race_candidates(lm: LoadedModel, prompt_ids: list[list[int]], candidates: dict[str, Candidate], rc: RaceConfig, *,
                    done: Sequence[dict] = (), on_prompt: Callable[[dict], None] | None = None,
                    bigram: BigramTable | Sequence[BigramTable | None] | None = None, vocab=None, eagle=None,
                    on_block: Callable[[], None] | None = None,
                    guard: Callable[[], AbstractContextManager] = nullcontext) -> dict[str, Measurement]:
    """Race ``candidates`` (``{role: Candidate}``) against ``ar`` on ``prompt_ids`` (:func:`time_prompt`
    per prompt, :class:`~.interval.Race` deciding when a candidate has been timed enough).

    ``done``: the records of prompts already timed (a checkpoint), replayed into the race;
    ``on_prompt`` receives each newly timed prompt's record (``{"blocks": [[ar, {name: s}], ...],
    "tally": {name: {...}}}``). Returns each candidate's :class:`Measurement`, its role being its name.
    ``bigram`` (the cascade's table) and ``vocab`` (the draft vocabulary's ids): one for every prompt,
    or a list of one per prompt of ``prompt_ids`` (calibration's: each without its prompt's own text,
    :func:`~.statistical.race_tables`). ``eagle``: the head an ``eagle`` candidate drafts with.
    ``guard``: see :func:`time_prompt`.
    """
    raced = min(rc.prompts, len(prompt_ids))
    for what, given in (("bigram tables", bigram), ("draft vocabularies", vocab)):
        if isinstance(given, (list, tuple)) and len(given) < raced:
            raise ValueError(f"{len(given)} {what} for {raced} raced prompts")
    race = Race(list(candidates), rc.margin, rc.level, rc.min_blocks, seed=rc.seed, min_prompts=rc.min_prompts)
    totals = {name: _Tally() for name in candidates}

    def replay(rec: dict, prompt: int) -> None:
        for ar, secs in rec["blocks"]:
            race.add(ar, secs, prompt)
        for name, t in rec["tally"].items():
            totals[name].add(t)

    for i, rec in enumerate(done):  # a checkpoint holds one record per prompt, in order
        replay(rec, i)
    eos = lm.eos_ids()
    for i, p in enumerate(prompt_ids[: rc.prompts]):
        if i < len(done):
            continue
        if not race.active:
            break
        blocks: list = []

        def block(ar: float, secs: dict[str, float], blocks: list = blocks, prompt: int = i) -> None:
            race.add(ar, secs, prompt)
            blocks.append([ar, secs])
            if on_block is not None:
                on_block()

        tally = time_prompt(lm, p, candidates, lambda: race.active, block, block_tokens=rc.block_tokens,
                            max_tokens=rc.max_tokens, eos=eos,
                            bigram=_of_prompt(bigram, i), vocab=_of_prompt(vocab, i), eagle=eagle, guard=guard)
        rec = {"blocks": blocks, "tally": tally}
        for name, t in tally.items():
            totals[name].add(t)
        if on_prompt is not None:
            on_prompt(rec)
    out = {}
    for name, cand in candidates.items():
        if race.blocks[name]:
            speedup, iv = race.result(name)
            out[name] = measurement(cand, name, totals[name], speedup, iv, race.verdict(name))
    return out
