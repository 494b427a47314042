"""The calibration objective: teacher-forced matchness and the expected speedup it implies.

Matchness (SWIFT): feed the full model's own greedy continuation of a prompt to the model with a
skip set, in one forward, and count the positions where the skipped model's argmax equals the
continuation's next token. It estimates the per-token acceptance ``a`` of greedy drafting.

With per-token acceptance ``a`` and draft length ``k``, a verification step yields on average
``E = (1 - a^(k+1)) / (1 - a)`` tokens (accepted drafts plus the target's own token), and costs
``k * draft_cost + verify_cost`` in units of one full-model token step.
"""

from __future__ import annotations

import torch


def expected_tokens_per_step(a: float, k: int) -> float:
    """``E = 1 + a + ... + a^k``: mean tokens per step with i.i.d. per-token acceptance ``a``.

    Example: ``a = 0.5, k = 2`` -> ``1 + 0.5 + 0.25 = 1.75``; ``a = 1`` -> ``k + 1``; ``a = 0`` -> 1.
    """
    if not 0.0 <= a <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= a <= 1 and k >= 0, got a={a}, k={k}")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit time against plain decoding (one token per unit): ``E / (k*draft + verify)``.

    Example: ``a = 0.8, k = 2, draft_cost = 0.5, verify_cost = 1.05`` -> ``2.44 / 2.05 = 1.19``.
    ``k = 0`` is plain decoding with cost ``verify_cost``.
    """
    return expected_tokens_per_step(a, k) / (k * draft_cost + verify_cost)


def best_draft_length(a: float, draft_cost: float, verify_cost: float = 1.0, max_k: int = 8) -> tuple[int, float]:
    """The draft length in ``1 .. max_k`` with the highest expected speedup, and that speedup.

    Example: ``a = 0.8, draft_cost = 0.5`` -> ``(2, 1.22)``: k = 2 gives 2.44 / 2.0, beating
    k = 1 (1.8 / 1.5 = 1.2) and k = 3 (2.952 / 2.5 = 1.18).
    """
    best = max(range(1, max_k + 1), key=lambda k: expected_speedup(a, k, draft_cost, verify_cost))
    return best, expected_speedup(a, best, draft_cost, verify_cost)


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
