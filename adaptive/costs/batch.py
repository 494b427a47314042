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

from collections.abc import Sequence

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
