"""Calibration of the cascade drafter: the statistical drafter's acceptance by position, and the split.

The statistical drafter costs no forward, so its acceptance can be measured teacher-forced on the
full model's own continuations for free: at each position of a continuation, draft from the
context so far and compare with what the model actually went on to write. The bigram table used
for a sequence is built from the *other* sequences (leave one out), so the figure is not inflated
by a table that has seen the very text it is scored on; the same holds where decoding is timed
(:func:`race_tables`).

*Background* text: ``(prompt, continuation)`` pairs that are in every table of a domain and never
scored, calibration's other domains' continuations (:mod:`adaptive.calibrate.runner`). A domain's own
dozen prompts leave most tokens without a successor, while much of what the model writes (function
words, formatting, its habits of phrasing) is the same in every domain.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptive.costs import STAT_DRAFT_COST, best_split, verify_table
from adaptive.drafters.cascade import CascadePlan
from adaptive.drafters.ngram import DEFAULT_BIGRAM_MIN_PROB, BigramTable, build_bigram_table, statistical_draft
from adaptive.engine.audit import first_difference
from adaptive.profile import StatisticalAcceptance


def accepted_prefix(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """How many leading tokens of ``proposal`` equal ``actual``'s. Example: ``[4, 5, 6]`` vs ``[4, 5, 9]`` -> 2."""
    i = first_difference(list(proposal), list(actual))
    return len(proposal) if i is None else i


Sequences = list[tuple[list[int], list[int]]]  # (prompt_ids, continuation_ids) pairs


def leave_one_out_table(sequences: Sequences, i: int, min_count: int, background: Sequences = ()) -> BigramTable:
    """The bigram table of every ``(prompt, continuation)`` pair but the ``i``-th (``i = -1``: all of
    them), and of every ``background`` pair: what scores pair ``i`` without having seen it."""
    return build_bigram_table([list(p) + list(c) for j, (p, c) in enumerate(sequences) if j != i]
                              + [list(p) + list(c) for p, c in background], min_count)


def race_tables(sequences: Sequences, prompts: Sequence[Sequence[int]], min_count: int,
                background: Sequences = ()) -> list[BigramTable]:
    """One table per raced prompt: :func:`leave_one_out_table` without every sequence of that prompt.

    Calibration times decoding on prompts whose greedy continuations are among ``sequences``; a
    table built from them would hold the very bigrams the race decodes, and measure the cascade
    faster than on any new prompt. Example: sequences ``[([1], [2, 3]), ([4], [5, 6])]``, prompts
    ``[[4]]``, ``min_count = 1``: the table of ``[1, 2, 3]`` alone (``1 -> 2``, ``2 -> 3``).
    """
    return [leave_one_out_table(sequences_without(sequences, prompt), -1, min_count, background) for prompt in prompts]


def sequences_without(sequences: Sequences, prompt: Sequence[int]) -> Sequences:
    """``sequences`` but those whose prompt is ``prompt``: what a race may build from when it times
    ``prompt``. Example: ``[([1], [2]), ([4], [5])]`` without ``[4]`` -> ``[([1], [2])]``."""
    return [pair for pair in sequences if list(pair[0]) != list(prompt)]


def statistical_acceptance(sequences: Sequences, k: int, min_count: int = 2,
                           min_prob: float = DEFAULT_BIGRAM_MIN_PROB, bigram: bool = True,
                           table: BigramTable | None = None, background: Sequences = ()) -> StatisticalAcceptance:
    """Teacher-forced acceptance of the statistical drafter on ``(prompt_ids, continuation_ids)`` pairs.

    ``bigram=True`` builds each sequence's table from the other sequences and ``background``
    (leave one out) unless a fixed ``table`` (built from other text) is given; ``bigram=False``:
    prompt lookup alone.

    Returns (a :class:`~adaptive.profile.StatisticalAcceptance`) ``token_acceptance`` (accepted / (accepted + first
    rejections), the bandit's model), ``position_acceptance`` (``[k]``: accepted / reached at each draft position),
    ``available`` (share of positions with any proposal), ``accepted_per_step`` and ``drafted_per_step`` (means
    over all scored positions, a position without a proposal counting 0) and ``positions``. Positions whose
    proposal runs past the continuation's end are scored only up to that end.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    reached, accepted = [0] * k, [0] * k
    ok = rejections = positions = available = drafted = 0
    for i, (prompt, cont) in enumerate(sequences):
        used = None
        if bigram:
            used = table if table is not None else leave_one_out_table(sequences, i, min_count, background)
        for t in range(1, len(cont)):
            actual = cont[t:t + k]
            proposal = statistical_draft(list(prompt) + list(cont[:t]), k, used, min_prob=min_prob)[: len(actual)]
            positions += 1
            if not proposal:
                continue
            available += 1
            drafted += len(proposal)
            n = accepted_prefix(proposal, actual)
            for j in range(min(n + 1, len(proposal))):
                reached[j] += 1
                accepted[j] += j < n
            ok += n
            rejections += n < len(proposal)
    return StatisticalAcceptance(
        token_acceptance=round(ok / (ok + rejections), 4) if ok + rejections else 0.0,
        position_acceptance=tuple(round(a / r, 4) if r else 0.0 for a, r in zip(accepted, reached)),
        available=round(available / positions, 4) if positions else 0.0, positions=positions,
        accepted_per_step=round(ok / positions, 4) if positions else 0.0,
        drafted_per_step=round(drafted / positions, 4) if positions else 0.0)


def replay_speedup(sequences: Sequences, k: int, verify: Sequence[float], min_count: int = 2,
                   min_prob: float = DEFAULT_BIGRAM_MIN_PROB, bigram: bool = True, background: Sequences = ()) -> float:
    """The statistical drafter's expected speedup, by replaying greedy speculative decoding of each
    continuation (the full model's own greedy text) with it: exact acceptance, modelled cost.

    Step by step from the continuation's second token: draft up to ``k`` tokens from the context so
    far (leave-one-out bigram tables with ``background``, as :func:`statistical_acceptance`;
    ``bigram=False``: prompt lookup alone), accept the prefix that matches what the model wrote, add
    the model's own token and move on; each step costs ``verify[len(draft)]`` (a verify table) plus
    :data:`~adaptive.costs.STAT_DRAFT_COST` per drafted token. Returns tokens / cost. Unlike a mean
    over positions (:func:`statistical_acceptance`), steps start where decoding would start them,
    so a long copied span counts once, as one step, not once per position it covers.

    Example: continuation ``[7, 1, 2, 3, 9]`` after prompt ``[1, 2, 3, 4]``, ``k = 3``, verify
    ``(1, 1, 1, 1)``, prompt lookup: after ``[.., 4, 7]`` nothing repeats, a plain step gives ``1``;
    after ``[.., 7, 1]`` lookup drafts ``[2, 3, 4]``, 2 are accepted and the model adds 9: 4 tokens
    for a cost of ``1 + 1 + 3 * 0.005``: 1.985.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    table_v = verify_table(verify, k)
    tokens, cost = 0, 0.0
    for i, (prompt, cont) in enumerate(sequences):
        table = None
        if bigram:
            table = leave_one_out_table(sequences, i, min_count, background)
        context = list(prompt) + list(cont[:1])
        t = 1
        while t < len(cont):
            proposal = statistical_draft(context, k, table, min_prob=min_prob)[: len(cont) - t]
            n = accepted_prefix(proposal, cont[t:t + len(proposal)])
            step = min(n + 1, len(cont) - t)
            cost += table_v[len(proposal)] + len(proposal) * STAT_DRAFT_COST
            tokens += step
            context.extend(cont[t:t + step])
            t += step
    return tokens / cost if cost else 1.0


def choose_cascade(stat_acceptance, layer_skip_acceptance: float, layer_skip_cost: float, verify: Sequence[float],
                   max_len: int, max_split: int, lenience: float = 1.0,
                   min_prob: float = DEFAULT_BIGRAM_MIN_PROB) -> CascadePlan:
    """The cascade's starting split and draft length from measured acceptances and costs.

    ``stat_acceptance``: the statistical drafter's acceptance, one number or one per draft position
    (``position_acceptance``: a copied span tends to go on once its first token was right, which
    a single rate undervalues); ``verify``: costs of a full forward over 1, 2, ... tokens.
    Example: statistical acceptance 0.3, layer-skip acceptance 0.9 at a cost of 0.5 of a step, verify
    costs ``(1, 1, 1.05)``, ``max_len = 2``: :func:`best_split` gives ``(1, 2)``: one layer-skip
    token, then one statistical token. With a layer-skip cost of 0.95 it gives ``(0, 2)``.
    """
    if not isinstance(stat_acceptance, (int, float)):
        stat_acceptance = list(stat_acceptance) + [0.0] * max(0, max_len - len(stat_acceptance))
    h, k = best_split(layer_skip_acceptance, stat_acceptance, layer_skip_cost, STAT_DRAFT_COST,
                      verify_table(verify, max_len), max_len, max_split)
    return CascadePlan(split=h, draft_len=max(k, 1), vertical=True, lenience=lenience, min_prob=min_prob,
                         max_split=max_split)
