"""A domain's reduced draft vocabulary (issue 9): which size of draft head, if any, drafts faster.

Tokens are ranked by frequency over the domain's prompts and continuations; for each size in
``vocab_sizes`` the leave-one-out coverage of the continuations and the measured cost of a draft
token over a head of that size give an estimated speedup at the best skip set's own draft length.
When the best size's estimate beats the full head's, the skip set drafting over it joins the
domain's race (:mod:`adaptive.measure.timing`; each raced prompt over a head ranked without its
own text, :func:`race_vocabs`), and the reduced head is used only where that measured faster than
the full head (:class:`~adaptive.profile.VocabChoice` ``use``, set by :mod:`.domain`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptive.calibrate.settings import CalibrationSettings
from adaptive.costs import expected_speedup, extrapolate, measure_head_costs
from adaptive.drafters.head import coverage_curve, rank_tokens
from adaptive.engine.skip import SkipSet
from adaptive.measure.statistical import sequences_without
from adaptive.models import LoadedModel
from adaptive.profile import VocabChoice
from adaptive.workdir import checkpointed


def size_estimates(acceptance: float, k: int, verify: Sequence[float], coverage: dict[int, float],
                   costs: dict[int, float], vocab_size: int) -> tuple[int, dict[int, float], float]:
    """``(best size, estimate per size, full head's estimate)``: expected tokens per unit of cost at
    draft length ``k``, the acceptance scaled by each size's ``coverage`` (``costs`` per size and
    for ``vocab_size``, the full head). Sizes are compared at equal ``k``: an optimised ``k`` would
    collapse to 0, "do not draft", wherever the model is pessimistic.

    Example: ``acceptance 0.5, k 2, verify (1.0, 1.0, 1.0)``, coverage ``{16: 1.0}``, costs
    ``{16: 0.25, 48: 0.5}``: 1.75 / (0.5 + 1) = 1.1667 against the full head's 1.75 / 2 = 0.875.
    """
    v_k = extrapolate(verify, k)

    def est(a: float, c: float) -> float:
        return round(expected_speedup(a, k, c, v_k), 4)

    ests = {v: est(acceptance * coverage[v], costs[v]) for v in coverage}
    return max(ests, key=ests.get), ests, est(acceptance, costs[vocab_size])


def _choose(lm: LoadedModel, s: CalibrationSettings, sequences: list, skip: SkipSet, draft_len: int, acceptance: float,
            verify: Sequence[float], sizes: list[int]) -> dict:
    bb = lm.backbone
    coverage = coverage_curve([list(p) + list(c) for p, c in sequences], [list(c) for _, c in sequences], sizes,
                              bb.vocab_size)
    masks = skip.masks(lm.n_layers)
    costs = measure_head_costs(bb, masks, [*sizes, bb.vocab_size], context=s.cost_context)
    size, ests, full = size_estimates(acceptance, draft_len, verify, coverage, costs, bb.vocab_size)
    choice = VocabChoice(size=size, vocab_size=bb.vocab_size, draft_len=draft_len,
                         coverage={str(v): float(c) for v, c in coverage.items()},
                         draft_cost={str(v): float(c) for v, c in costs.items()},
                         estimate={str(v): e for v, e in ests.items()}, full_estimate=full)
    return choice.to_dict()


def choose_vocab(lm: LoadedModel, s: CalibrationSettings, path, sequences: list, skip: SkipSet, draft_len: int,
                 acceptance: float, verify: Sequence[float]) -> tuple[VocabChoice | None, np.ndarray | None]:
    """The domain's :class:`VocabChoice` (``use`` still ``False``: the race decides it) for the skip
    set ``skip`` drafting ``draft_len`` tokens at ``acceptance``, and the chosen token ids (best
    first), checkpointed at ``path``; ``(None, None)`` when no skip set drafts or no size is below the
    vocabulary's."""
    bb = lm.backbone
    sizes = [v for v in s.vocab_sizes if v < bb.vocab_size]
    if not skip or not sizes:
        return None, None
    ranking = rank_tokens([list(p) + list(c) for p, c in sequences], bb.vocab_size)
    rec = checkpointed(path, lambda: _choose(lm, s, sequences, skip, draft_len, acceptance, verify, sizes))
    choice = VocabChoice.from_dict(rec)
    return choice, ranking[: choice.size]


def race_vocabs(sequences: list, prompts: Sequence[Sequence[int]], vocab_size: int, size: int) -> list[np.ndarray]:
    """One draft vocabulary of ``size`` ids per raced prompt, ranked without every sequence of that
    prompt: the race would otherwise draft a calibration prompt's continuation over a head ranked on
    that very continuation (every token of it covered, where a new prompt's are 87-97%).
    Example: sequences ``[([1], [2, 2]), ([4], [5])]``, prompts ``[[1]]``, ``vocab_size = 6``,
    ``size = 3``: ranked on ``[4, 5]`` -> ``[4, 5, 0]``."""
    return [rank_tokens([list(p) + list(c) for p, c in sequences_without(sequences, prompt)], vocab_size)[:size]
            for prompt in prompts]
