"""Phase 2 of a calibration, per domain: encode the prompts, continue each greedily with the full
model (its prefill yields the prompt embedding, exactly as at run time) and measure sublayer
influence on that text. Checkpointed as ``prep-<domain>.pt``."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaptive.calibrate.parallel import Worker
from adaptive.calibrate.settings import CalibrationSettings
from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.engine import Engine
from adaptive.engine.loop import cache_positions
from adaptive.index.choice import pooling_key
from adaptive.index.embedding import pooled_to_numpy
from adaptive.limits import check_room
from adaptive.models import LoadedModel
from adaptive.workdir import atomic_write, checkpointed

MAX_TOGETHER = 16  # continuations stepped together at most (calibration uses 6-16 prompts per domain)


@dataclass
class Prepared:
    """One domain's calibration text: ``ids`` (encoded prompts), ``embeddings`` (``[prompts, hidden]``
    prefill embeddings, the default pooling's), ``sequences`` (``(prompt_ids, continuation_ids)``
    pairs), the mean sublayer ``influence`` (``[2, n_layers]``) over the continuations, and
    ``candidates``: every candidate pooling's embeddings from the same prefills (``{pooling_key:
    [prompts, hidden]}``, :func:`candidate_poolings`, the default's included)."""

    name: str
    ids: list[list[int]]
    embeddings: np.ndarray
    sequences: list[tuple[list[int], list[int]]]
    influence: torch.Tensor
    candidates: dict = field(default_factory=dict)


def candidate_poolings(bb, s: CalibrationSettings) -> tuple[Pooling, ...]:
    """The routing embeddings this calibration compares (:meth:`CalibrationSettings.pooling_candidates`)
    that ``bb`` computes: the default first (or what the engine gives in its place)."""
    default = bb.routing_pooling(s.pooling(bb.n_layers))
    others = [p for p in s.pooling_candidates(bb.n_layers)[1:] if p != default and bb.routing_pooling(p) == p]
    return (default, *others)


def _save(path: Path, prep: Prepared) -> None:
    buf = io.BytesIO()
    torch.save(asdict(prep), buf)  # plain containers: a checkpoint does not pickle this class
    atomic_write(path, buf.getvalue())


def _load(path: Path) -> Prepared:
    return Prepared(**torch.load(path, weights_only=False))


def prepare_domain(worker: Worker, name: str, prompts: list[str]) -> Prepared:
    """Encode, embed, continue greedily and measure influence for one domain (checkpointed)."""
    path = worker.work.file("prep", name, "pt")
    return checkpointed(path, lambda: _prepare(worker, name, prompts), load=_load, save=_save)


def _prepare(worker: Worker, name: str, prompts: list[str]) -> Prepared:
    s = worker.settings
    lm = worker.model()
    engine = Engine(lm)
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=s.continuation_tokens)
    poolings = candidate_poolings(bb, s)
    bar = worker.phase("prepare", name, len(prompts))
    ids = [engine.encode(prompt, chat=s.chat) for prompt in prompts]
    conts, pooled = continue_together(engine, ids, cfg, poolings, on_done=lambda: bar.update(1))
    influence = torch.zeros(2, bb.n_layers)
    if bb.layer_skip:  # what the skip-set search ranks sublayers by (none is searched on llama.cpp)
        for p, cont in zip(ids, conts):
            tail = (p + cont)[-(len(cont) + 64):]
            influence += bb.sublayer_influence(torch.tensor(tail, device=bb.device),
                                               from_position=len(tail) - len(cont))
    bar.close()
    candidates = {pooling_key(p): np.stack([pooled_to_numpy(v[j]) for v in pooled]) for j, p in enumerate(poolings)}
    return Prepared(name, ids, candidates[pooling_key(poolings[0])], list(zip(ids, conts)), influence / len(prompts),
                    candidates)


def continue_together(engine: Engine, prompts: list[list[int]], cfg: GenerationConfig, pooling,
                      on_done: Callable[[], None] = lambda: None,
                      max_together: int = MAX_TOGETHER) -> tuple[list[list[int]], list]:
    """Each prompt's greedy continuation (through its first EOS or ``cfg.max_new_tokens``) and its
    prefill's ``pooling`` embedding (as the runtime routes on; a tuple of poolings gives a tuple of
    embeddings, all from the one prefill), the unfinished ones stepped together,
    one forward per step: where verifying several rows costs about one step (a memory-bound model),
    ``n`` continuations cost about what one did alone.

    Prompts join in order as room allows (as a server's batch): at most ``max_together`` at once,
    at most the backbone's ``sequences`` where it has a limit, and where caches share one context
    (llama.cpp's unified KV cache) only while the live ones' positions and the newcomer's fit in
    ``max_positions`` (its routing embedding's one token included: decoded in a scratch sequence that
    shares the prompt's cells). ``on_done`` is called as each one finishes."""
    bb = engine.backbone
    limit = min(max_together, getattr(bb, "sequences", max_together))
    need = [cache_positions(len(p), cfg.max_new_tokens, cfg.draft_len) + 1 for p in prompts]
    conts: list[list[int] | None] = [None] * len(prompts)
    pooled: list[torch.Tensor | None] = [None] * len(prompts)
    pending, running = list(range(len(prompts))), {}
    while pending or running:
        used = sum(need[i] for i in running)
        while pending and len(running) < limit and (
                not bb.shared_cache or not running or used + need[pending[0]] <= bb.max_positions):
            i = pending.pop(0)
            session = engine.start(prompts[i], cfg, pool=pooling)
            pooled[i] = session.pooled
            running[i] = engine.begin(session)
            used += need[i]
        live = [d for d in running.values() if not d.done]
        if live:
            engine.step(live)
        for i, d in list(running.items()):
            if d.done:
                conts[i] = d.result().token_ids
                d.session.state.cache.release()  # its cells, for the next prompt (llama.cpp's shared context)
                del running[i]
                on_done()
    return conts, pooled


def check_prompt_lengths(lm: LoadedModel, domains: dict[str, list[str]],
                         settings: CalibrationSettings) -> dict[str, list[list[int]]]:
    """:func:`~adaptive.limits.check_room` for calibration: each prompt encoded as calibration
    encodes it, with room for the continuation and the timed decoding. Returns the encodings."""
    engine = Engine(lm)
    room = max(settings.continuation_tokens, settings.confirm_tokens) + settings.max_draft_len + 1
    encoded = {name: [engine.encode(p, chat=settings.chat) for p in prompts] for name, prompts in domains.items()}
    check_room(encoded, room, lm.backbone.max_positions, "calibration")
    return encoded
