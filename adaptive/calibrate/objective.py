"""The calibration objective: teacher-forced matchness of a skip set.

Matchness (SWIFT): feed the full model's own greedy continuation of a prompt to the model with a
skip set, in one forward, and count the positions where the skipped model's argmax equals the
continuation's next token. It estimates the per-token acceptance ``a`` of greedy drafting.

What a matchness is worth in speed is :mod:`adaptive.costs`' arithmetic.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def matchness(backbone, sequences: list[tuple[list[int], list[int]]], skip_masks) -> float:
    """Fraction of continuation tokens the skipped model predicts, teacher-forced.

    ``sequences``: ``(prompt_ids, continuation_ids)`` pairs, the continuation being the full
    model's own greedy output. One forward per sequence with ``skip_masks``
    (``SkipSet.masks(n_layers)``; ``None`` is the full model, whose matchness is 1 up to numerics).
    """
    hits = total = 0
    for prompt, cont in sequences:
        if not cont:
            continue
        ids = list(prompt) + list(cont)
        cache = backbone.new_cache(len(ids))
        logits = backbone.forward(torch.tensor(ids, device=backbone.device), cache, 0,
                                  skip_masks=skip_masks, logits="all").logits
        pred = logits[len(prompt) - 1: len(ids) - 1].argmax(-1)
        hits += int((pred == torch.tensor(cont, device=pred.device)).sum())
        total += len(cont)
    if total == 0:
        raise ValueError("no continuation tokens to score")
    return hits / total
