"""Draft lengths for a batch: goodput pricing of speculation when several requests verify together.

Alone, a request drafts ``k`` tokens when ``E(k) / (k * draft_cost + verify[k])`` is best
(:func:`~adaptive.costs.model.best_draft_length`). In a batch the verification is one forward
over every request's rows, so a drafted token's price is what one more row adds to *that*
forward, and its worth is the tokens it is expected to add to the *batch*: where a forward's
cost is flat in its rows (a bf16 step on a CPU, up to ~8 rows) drafting is nearly free, where it
is steep (llama.cpp's quantized kernels on 2 cores: compute-bound from 2 rows) an extra row costs
almost a whole sequence's share and only a near-certain draft pays.

Terms: a request's ``gains[j]`` is the probability that its draft token ``j + 1`` is accepted
(reached and kept: ``a^(j+1)`` for one per-token acceptance ``a``), ``costs[j]`` that token's
drafting time, both in one-token steps; ``verify`` is a verify table measured on one sequence
(``verify[r]``: a forward over ``r + 1`` rows), extended linearly past its end. A batch of ``B``
requests drafting ``k_i`` tokens is expected to produce ``B + sum_i sum_{j<k_i} gains_i[j]`` tokens
in ``extrapolate(verify, B - 1 + sum k_i) + sum_i sum_{j<k_i} costs_i[j]`` steps; the *goodput* is
their ratio. Speculation is priced against the batch decoding plainly (every ``k_i = 0``), so it
is never expected to make a step slower than plain batched decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from adaptive.costs.model import extrapolate


def batch_draft_lengths(gains: Sequence[Sequence[float]], costs: Sequence[Sequence[float]],
                        verify: Sequence[float], fixed_rows: int = 0) -> list[int]:
    """Each request's draft length (``0 .. len(gains[i])``) for one batched verification.

    Greedy: starting from plain decoding, add the draft token with the most expected tokens per
    unit of added cost, as long as adding it raises the batch's goodput (module doc);
    ``fixed_rows``: rows of requests in the same forward that are not priced here (each counted
    as one token: what a plain step of theirs gives).

    Worked example, two requests, statistical drafts (cost 0), gains ``[0.9, 0.81]`` and
    ``[0.3, 0.09]``. On a flat table ``(1.0, 1.0, 1.0, 1.0, 1.1)`` (1 to 5 rows) plain decoding
    gives 2 tokens in 1.0; 0.9 and 0.81 ride in rows 3 and 4 for nothing (3.71 in 1.0); a fifth
    row costs 0.1 and its best token, 0.3, would give 4.01 / 1.1 = 3.65: ``[2, 0]``. On a steep
    table ``(1.0, 1.7, 2.5, 3.3)`` plain gives 2 / 1.7 = 1.18 and the first draft token
    2.9 / 2.5 = 1.16: ``[0, 0]``.
    """
    if len(gains) != len(costs):
        raise ValueError(f"gains and costs need one entry per request ({len(gains)} != {len(costs)})")
    if any(len(g) != len(c) for g, c in zip(gains, costs)):
        raise ValueError("each request needs one cost per drafted position")
    if fixed_rows < 0:
        raise ValueError(f"fixed_rows must be >= 0, got {fixed_rows}")
    k = [0] * len(gains)
    rows = len(gains) + fixed_rows
    if rows == 0:
        return k
    tokens, drafting = float(rows), 0.0  # every row's own token (an unpriced request's at least)
    step = extrapolate(verify, rows - 1)
    while True:
        row_cost = extrapolate(verify, rows) - step  # one more row in the forward
        best, best_ratio = None, -1.0
        for i, g in enumerate(gains):
            if k[i] < len(g):
                ratio = g[k[i]] / max(row_cost + costs[i][k[i]], 1e-12)
                if ratio > best_ratio:
                    best, best_ratio = i, ratio
        if best is None:
            return k
        gain, cost = gains[best][k[best]], row_cost + costs[best][k[best]]
        if (tokens + gain) * (step + drafting) <= tokens * (step + drafting + cost):
            return k  # the best addition would not raise the goodput
        tokens, drafting, rows = tokens + gain, drafting + costs[best][k[best]], rows + 1
        step += row_cost
        k[best] += 1


def padded_draft_lengths(gains: Sequence[Sequence[float]], costs: Sequence[Sequence[float]],
                         steps: Mapping[int, float], fixed_rows: int = 0) -> list[int]:
    """Each request's draft length for one batched verification replayed as a static step (CUDA graphs,
    :mod:`adaptive.engine.batched`): every request feeds the same ``R`` rows (the row bucket of the
    longest draft plus one), so a step's cost is that of its ``R``, whatever the drafts inside it.

    ``steps``: the batch's step cost by rows ``R`` (``{1: plain, 2: ..., 4: ..., 8: ...}``, for this
    batch's size, in one-token steps of a lone request), measured on the device; ``R = 1`` is the
    plain step and must be there. For each ``R`` every request drafts up to ``R - 1`` tokens (rows it
    pays for anyway), each token kept while its expected gain is worth its drafting cost at that
    ``R``'s goodput; the ``R`` with the best goodput ``(B + sum gains) / (steps[R] + sum drafting)``
    wins, so speculation is off (all 0) where no ``R`` beats plain decoding. ``fixed_rows``: requests
    in the step not priced here (one token each).

    Worked example, two requests, statistical drafts (cost 0), gains ``[0.9, 0.81, 0.73]`` and
    ``[0.3, 0.09, 0.03]``, steps ``{1: 1.0, 2: 1.05, 4: 1.2, 8: 2.0}``: plain gives 2 / 1.0 = 2.0;
    ``R = 2`` gives (2 + 1.2) / 1.05 = 3.05; ``R = 4``: (2 + 2.44 + 0.42) / 1.2 = 4.05; ``R = 8``
    can draft no more (3 gains each): 4.86 / 2.0 = 2.43: ``[3, 3]``. With steps ``{1: 1.0, 2: 2.0,
    4: 4.0, 8: 8.0}`` (a step that grows with its rows, as at a large batch) nothing beats plain: ``[0, 0]``.
    """
    if len(gains) != len(costs):
        raise ValueError(f"gains and costs need one entry per request ({len(gains)} != {len(costs)})")
    if any(len(g) != len(c) for g, c in zip(gains, costs)):
        raise ValueError("each request needs one cost per drafted position")
    if 1 not in steps or any(r < 1 or s <= 0 for r, s in steps.items()):
        raise ValueError(f"steps needs the plain step (R = 1) and positive costs, got {dict(steps)}")
    base = float(len(gains) + fixed_rows)
    best_k, best = [0] * len(gains), base / steps[1]
    for R in sorted(steps):
        if R == 1:
            continue
        k, tokens, drafting = [0] * len(gains), base, 0.0
        while True:  # add the draft token with the most gain per cost while it raises this R's goodput
            pick, pick_ratio = None, -1.0
            for i, g in enumerate(gains):
                if k[i] < min(R - 1, len(g)):
                    ratio = g[k[i]] / max(costs[i][k[i]], 1e-12)
                    if ratio > pick_ratio:
                        pick, pick_ratio = i, ratio
            if pick is None:
                break
            gain, cost = gains[pick][k[pick]], costs[pick][k[pick]]
            if (tokens + gain) * (steps[R] + drafting) <= tokens * (steps[R] + drafting + cost):
                break
            tokens, drafting = tokens + gain, drafting + cost
            k[pick] += 1
        goodput = tokens / (steps[R] + drafting)
        if any(k) and goodput > best:
            best_k, best = k, goodput
    return best_k
