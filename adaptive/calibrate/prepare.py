"""Phase 2 of a calibration, per domain: encode the prompts, continue each greedily with the full
model (its prefill yields the prompt embedding, exactly as at run time) and measure sublayer
influence on that text. Checkpointed as ``prep-<domain>.pt``."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from adaptive.calibrate.parallel import Worker
from adaptive.calibrate.settings import CalibrationSettings
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.index.embedding import pooled_to_numpy
from adaptive.limits import check_room
from adaptive.models import LoadedModel
from adaptive.workdir import atomic_write, checkpointed


@dataclass
class Prepared:
    """One domain's calibration text: ``ids`` (encoded prompts), ``embeddings`` (``[prompts, hidden]``
    prefill embeddings), ``sequences`` (``(prompt_ids, continuation_ids)`` pairs) and the mean
    sublayer ``influence`` (``[2, n_layers]``) over the continuations."""

    name: str
    ids: list[list[int]]
    embeddings: np.ndarray
    sequences: list[tuple[list[int], list[int]]]
    influence: torch.Tensor


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
    pooling = bb.routing_pooling(s.pooling(bb.n_layers))
    ids, embs, seqs = [], [], []
    influence = torch.zeros(2, bb.n_layers)
    bar = worker.phase("prepare", name, len(prompts))
    for prompt in prompts:
        p = engine.encode(prompt, chat=s.chat)
        session = engine.start(p, cfg, pool=pooling)  # the prefill's embedding, as the runtime routes on
        cont = list(engine.decode(session))[-1].token_ids  # greedy, through the first EOS
        if bb.layer_skip:  # what the skip-set search ranks sublayers by (none is searched on llama.cpp)
            tail = (p + cont)[-(len(cont) + 64):]
            influence += bb.sublayer_influence(torch.tensor(tail, device=bb.device),
                                               from_position=len(tail) - len(cont))
        ids.append(p)
        embs.append(pooled_to_numpy(session.pooled))
        seqs.append((p, cont))
        bar.update(1)
    bar.close()
    return Prepared(name, ids, np.stack(embs), seqs, influence / len(prompts))


def check_prompt_lengths(lm: LoadedModel, domains: dict[str, list[str]],
                         settings: CalibrationSettings) -> dict[str, list[list[int]]]:
    """:func:`~adaptive.limits.check_room` for calibration: each prompt encoded as calibration
    encodes it, with room for the continuation and the timed decoding. Returns the encodings."""
    engine = Engine(lm)
    room = max(settings.continuation_tokens, settings.confirm_tokens) + settings.max_draft_len + 1
    encoded = {name: [engine.encode(p, chat=settings.chat) for p in prompts] for name, prompts in domains.items()}
    check_room(encoded, room, lm.backbone.max_positions, "calibration")
    return encoded
