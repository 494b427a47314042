"""A domain's reduced draft vocabulary (issue 9): which size of draft head, if any, drafts faster.

Tokens are ranked by frequency over the domain's prompts and continuations; for each size in
``vocab_sizes`` the leave-one-out coverage of the continuations and the measured cost of a draft
token over a head of that size give an estimated speedup at the best skip set's own draft length.
When the best size's estimate beats the full head's, the skip set is timed drafting over it, and
the reduced head is used only where that measured faster (:class:`~adaptive.profile.VocabChoice`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptive.calibrate.settings import CalibrationSettings
from adaptive.calibrate.timing import Candidate, measure_candidates
from adaptive.costs import expected_speedup, extrapolate, measure_head_costs
from adaptive.drafters.vocab import coverage_curve, rank_tokens
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from adaptive.profile import Measurement, VocabChoice
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


def _choose(lm: LoadedModel, s: CalibrationSettings, sequences: list, best: Measurement, verify: Sequence[float],
            confirm_ids: list[list[int]], sizes: list[int], ranking: np.ndarray) -> dict:
    bb = lm.backbone
    coverage = coverage_curve([list(p) + list(c) for p, c in sequences], [list(c) for _, c in sequences], sizes,
                              bb.vocab_size)
    masks = SkipSet.from_text(best.skip, lm.n_layers).masks(lm.n_layers)
    costs = measure_head_costs(bb, masks, [*sizes, bb.vocab_size], context=s.cost_context)
    k = best.draft_len
    size, ests, full = size_estimates(best.token_acceptance, k, verify, coverage, costs, bb.vocab_size)
    timed = None
    if ests[size] > full:
        cand = Candidate("ssd", k, skip=best.skip, draft_vocab=size)
        timed = measure_candidates(lm, confirm_ids, [cand], s.confirm_tokens, role="vocab", vocab=ranking[:size])[0]
    choice = VocabChoice(size=size, vocab_size=bb.vocab_size, draft_len=k,
                         coverage={str(v): float(c) for v, c in coverage.items()},
                         draft_cost={str(v): float(c) for v, c in costs.items()},
                         estimate={str(v): e for v, e in ests.items()}, full_estimate=full,
                         use=timed is not None and timed.speedup > best.speedup)
    return {"choice": choice.to_dict(), "timed": timed.to_dict() if timed is not None else None}


def choose_vocab(lm: LoadedModel, s: CalibrationSettings, path, sequences: list, best: Measurement,
                 verify: Sequence[float], confirm_ids: list[list[int]]
                 ) -> tuple[VocabChoice | None, Measurement | None, np.ndarray | None]:
    """The domain's :class:`VocabChoice`, the timed run over the reduced head (``None`` when its
    estimate did not beat the full head's) and the chosen token ids, checkpointed at ``path``;
    ``(None, None, None)`` when the best skip set drafts nothing or no size is below the vocabulary's."""
    bb = lm.backbone
    sizes = [v for v in s.vocab_sizes if v < bb.vocab_size]
    if best.skip in ("none", "") or not sizes:
        return None, None, None
    ranking = rank_tokens([list(p) + list(c) for p, c in sequences], bb.vocab_size)
    rec = checkpointed(path, lambda: _choose(lm, s, sequences, best, verify, confirm_ids, sizes, ranking))
    choice = VocabChoice.from_dict(rec["choice"])
    timed = Measurement.from_dict(rec["timed"]) if rec["timed"] is not None else None
    return choice, timed, ranking[: choice.size]
