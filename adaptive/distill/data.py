"""Training data for distillation: token sequences and the hidden states the losses need.

A training sequence is a list of token ids and a ``start``: the positions ``start-1 .. len-2``
each predict the next token, and those are the positions trained on (the continuation after the
prompt, or the prompt itself for ``fixed`` data). Sources (DistillSpec's terms):

* ``fixed``: the prompt text itself (a fixed data set);
* ``teacher``: the target's own greedy continuations of the prompts (self-distillation);
* ``on-policy``: continuations sampled from the drafter being trained, scored by the target;
* ``mixed``: half the prompts teacher, half on-policy (alternating).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptive.engine.sampling import warp_probs

DATA_SOURCES = ("fixed", "teacher", "on-policy", "mixed")


@dataclass(frozen=True)
class TrainSequence:
    """``ids``: prompt and continuation; positions ``start-1 .. len(ids)-2`` are trained on."""

    ids: tuple[int, ...]
    start: int

    def __post_init__(self):
        if not 1 <= self.start < len(self.ids):
            raise ValueError(f"start {self.start} leaves no position to train on in {len(self.ids)} tokens")

    @property
    def n_positions(self) -> int:
        return len(self.ids) - self.start

    def to_list(self) -> list:
        return [list(self.ids), self.start]

    @classmethod
    def from_list(cls, item) -> TrainSequence:
        return cls(tuple(int(t) for t in item[0]), int(item[1]))


@torch.inference_mode()
def continue_ids(backbone, prompt: list[int], n: int, *, temperature: float = 0.0, generator=None,
                 skip_masks=None, adapter=None, eos: set[int] = frozenset()) -> list[int]:
    """Up to ``n`` tokens after ``prompt``, decoded by ``backbone`` alone, with its sublayers in
    ``skip_masks`` skipped and ``adapter`` applied (a drafter's own policy), or as the full model
    (``skip_masks=None``: the target's continuation). ``temperature 0`` is greedy; stops after an EOS."""
    cache = backbone.new_cache(len(prompt) + n)
    logits = backbone.forward(torch.tensor(prompt, device=backbone.device), cache, 0, skip_masks=skip_masks,
                              adapter=adapter).logits[0]
    out: list[int] = []
    pos = len(prompt)
    while True:
        if temperature == 0.0:
            tok = int(logits.argmax())
        else:
            tok = int(torch.multinomial(warp_probs(logits, temperature), 1, generator=generator))
        out.append(tok)
        if len(out) >= n or tok in eos:
            return out
        logits = backbone.forward(torch.tensor([tok], device=backbone.device), cache, pos, skip_masks=skip_masks,
                                  adapter=adapter).logits[0]
        pos += 1


@torch.inference_mode()
def capture_hidden(backbone, seq: TrainSequence, skip_masks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hidden states at the trained positions, from one full forward: ``(h_target, h_draft)``, each
    ``[n, H]`` float32. ``h_target`` is the target's residual stream before the final norm.
    ``h_draft`` (only with ``skip_masks``) is a layer-skip drafter's residual stream before its exit
    block, teacher-forced: each position attends to the *full* model's keys of the positions before
    it, as in decoding, where every accepted position's keys come from the verification forward.
    """
    ids = torch.tensor(seq.ids, device=backbone.device)
    cache = backbone.new_cache(len(seq.ids))
    rows = slice(seq.start - 1, len(seq.ids) - 1)
    h_target = backbone.forward(ids, cache, 0, logits="none", hidden=True).hidden[rows].float().clone()
    if skip_masks is None:
        return h_target, None
    h = backbone.forward(ids, cache, 0, skip_masks=skip_masks, logits="none", hidden=True, read_only=True).hidden
    return h_target, h[rows].float().clone()
