"""How fast layer skipping could possibly be in a domain, before searching it.

The ranked search space (:class:`~adaptive.calibrate.search.RankedSpace`) is a grid of points
``(n_attn, n_mlp)``: skip that many of the least influential attention and MLP sublayers. Two facts
bound every point of a cell of a coarse grid without scoring it:

* its draft cost is at least the cost at the cell's far corner (more skipped is cheaper; the cost
  model gives any point's cost exactly, without a forward);
* its acceptance is at most the acceptance at the cell's near corner, *assuming acceptance never
  rises when more sublayers are skipped* (the orders skip the least influential first; measured
  violations are small, see docs/design.md).

So a cell can reach at most the expected speedup of the near corner's acceptance at the far
corner's cost, at its best draft length. :func:`layer_skip_bound` visits the cells nearest the
full model first, scores a near corner only when the cell's bound with the best acceptance that
corner could have (that of a scored corner it contains) still beats the ``reference``, and drops
every cell whose near corner is below the acceptance ``floor`` (with all cells beyond it).

Example (2 layers: near corners ``[0, 1]`` per axis, far edge 2; cost ``1 - 0.2 * (n_attn + n_mlp)``;
verify costs ``(1, 1, 1)``; draft lengths up to 2; floor 0.2; reference 1.5):

* cell ``(0, 0)``: acceptance 1 (nothing skipped), far corner ``(1, 1)`` costs 0.6: at most
  ``3 / (2 * 0.6 + 1) = 1.36``;
* cell ``(0, 1)``: at acceptance 1 its far corner's cost 0.4 would allow 1.67, so ``(0, 1)`` is
  scored: 0.5 gives at most ``1.5 / 1.4 = 1.07``; likewise ``(1, 0)`` scores 0.4: at most 1.0;
* cell ``(1, 1)``: its acceptance is at most 0.4 (it skips more than ``(1, 0)``), which at cost 0.2
  allows 1.17 < 1.5: not scored.

The bound is 1.36 < 1.5 after two scorings: the search is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from adaptive.costs import best_draft_length

GRID_FRACTIONS = (1 / 15, 2 / 15, 4 / 15, 8 / 15)  # near corners, as fractions of the layers: finer near the full model


def grid(n_layers: int) -> list[int]:
    """Near-corner coordinates per axis: ``0`` and the :data:`GRID_FRACTIONS` of ``n_layers``
    (distinct, at least 1). Example: 30 layers -> ``[0, 2, 4, 8, 16]``; 4 layers -> ``[0, 1, 2]``."""
    if n_layers < 1:
        raise ValueError(f"need at least one layer, got {n_layers}")
    near = {max(1, round(n_layers * f)) for f in GRID_FRACTIONS}
    return sorted({0} | {c for c in near if c < n_layers})


@dataclass(frozen=True)
class Bound:
    """The most any point of the space could reach (``speedup``) against what it must beat
    (``reference``); ``cell``: the near corner of the best cell (``None`` when every cell fell below
    the floor); ``scored``: corners scored to find it; ``pays``: ``speedup >= reference``."""

    speedup: float
    reference: float
    cell: tuple[int, int] | None
    scored: int

    @property
    def pays(self) -> bool:
        return self.speedup >= self.reference


def cell_bound(acceptance: float, cost: float, verify: Sequence[float], max_len: int) -> float:
    """The best expected speedup of drafts with at most ``acceptance`` and at least ``cost``."""
    return best_draft_length(min(max(acceptance, 0.0), 1.0), cost, verify, max_len, min_len=1)[1]


def layer_skip_bound(n_layers: int, score: Callable[[int, int], float], cost: Callable[[int, int], float],
                     verify: Sequence[float], max_len: int, floor: float, reference: float) -> Bound:
    """Bound layer skipping's speedup over the ranked space (module docstring).

    ``score(n_attn, n_mlp)``: teacher-forced acceptance of that point (called lazily, at most once
    per near corner); ``cost(n_attn, n_mlp)``: its draft cost; ``verify``: a verify table up to
    ``max_len``; ``reference``: the speedup layer skipping must beat (plain decoding's 1.0, or the
    domain's statistical drafters' estimate, times ``1 + margin``).
    """
    coords = grid(n_layers)
    far = coords[1:] + [n_layers]
    accept: dict[tuple[int, int], float] = {(0, 0): 1.0}
    best, best_cell = 0.0, None
    for i, j in sorted(((i, j) for i in range(len(coords)) for j in range(len(coords))), key=lambda c: (sum(c), c)):
        na, nm = coords[i], coords[j]
        # the best acceptance this corner could have: that of the scored corners it contains (monotone)
        inner = [a for (x, y), a in accept.items() if x <= na and y <= nm]
        optimistic = min(inner)
        if optimistic < floor:
            continue
        c = cost(far[i], far[j])
        if (na, nm) != (0, 0):
            ceiling = cell_bound(optimistic, c, verify, max_len)
            if ceiling < reference:  # cannot pay even at the best acceptance it could have: not scored
                if ceiling > best:
                    best, best_cell = ceiling, (na, nm)
                continue
            accept[(na, nm)] = min(float(score(na, nm)), optimistic)
        a = accept[(na, nm)]
        if a < floor:
            continue
        b = cell_bound(a, c, verify, max_len)
        if b > best:
            best, best_cell = b, (na, nm)
    return Bound(round(best, 4), round(reference, 4), best_cell, len(accept) - 1)
