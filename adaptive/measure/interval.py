"""When a timed speedup may be believed: paired blocks, a bootstrap interval and a sequential race; the same
interval for a share of drafts kept.

Pure: numbers in, verdicts out (no model, no clock), so the logic is tested with scripted timings.

Terms, used the same way in :mod:`.timing` and :mod:`.decision`:

* a *block*: ``block_tokens`` tokens of one prompt, decoded from the same state once by plain
  decoding (``ar``) and once by each candidate drafter, back to back. Greedy speculative decoding is
  lossless, so every method produces the same tokens and the two times of a *pair* are directly
  comparable; drift of the machine (other load, clocks) hits both alike because they are seconds apart.
* a candidate's *speedup*: ``sum(ar seconds) / sum(candidate seconds)`` over its blocks (equal tokens).
* its *interval*: the percentile bootstrap of that ratio (:func:`bootstrap_speedup`), at ``level``
  (two-sided), resampling with replacement the *prompts* the blocks came from (each with all its
  blocks) once there are two or more, else the blocks. Blocks of one prompt move together (a prompt
  that repeats its context gives prompt lookup every block), so a speedup varies far more between
  prompts than between blocks: resampled blocks of two prompts read a precise figure where a third
  prompt could read another one (prompt lookup on the embedded model ran 1.26 to 3.0 tokens a
  step across RAG's six calibration prompts; the races settled most candidates after two).
* its *verdict* against a ``margin``: ``faster`` when the interval's low end is at least
  ``1 + margin``; ``not faster`` when even its high end is below ``1 + margin``; ``open`` otherwise
  (more blocks are needed, or the difference is too small to resolve).

Example: ar takes ``[1.0, 1.1, 0.9, 1.0]`` s and a candidate ``[0.8, 0.85, 0.75, 0.8]`` s on the
same four blocks: speedup ``4.0 / 3.2 = 1.25``, and every resample of these pairs lies between
1.2 and 1.3, so with margin 0.02 the verdict is ``faster``. With candidate times
``[0.9, 1.2, 0.8, 1.05]`` the speedup is ``4.0 / 3.95 = 1.01`` and the interval straddles 1.02: ``open``.
Two prompts of four blocks, ar ``1.0`` each, the candidate ``0.8`` on every block of the first and
``0.5`` on every block of the second: speedup ``8.0 / 5.2 = 1.54``; resampled blocks read about
[1.38, 1.74], resampled prompts [1.25, 2.0] (the first prompt twice, the second twice): what a third
prompt might read.

The same bootstrap measures a share of drafts kept (:func:`bootstrap_share`): a trained head's held-out
first drafts, resampled by *sequence* (one held-out prompt's answer each, with all its drafts), since
a head keeps far more of a text that repeats itself than of one that does not. Example: first drafts
kept ``[30, 50, 20]`` of ``[60, 60, 60]`` in three answers: share ``100 / 180 = 0.556``; resamples
lie between ``60 / 180 = 0.33`` (the third answer three times) and ``150 / 180 = 0.83``, and the
90% interval reads about [0.39, 0.72]: what another three prompts might keep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from adaptive.profile import Interval

FASTER, NOT_FASTER, OPEN = "faster", "not faster", "open"


def bootstrap_speedup(ar: Sequence[float], candidate: Sequence[float], level: float = 0.9, n_boot: int = 2000,
                      seed: int = 0, prompts: Sequence[int] | None = None) -> tuple[float, Interval]:
    """The speedup ``sum(ar) / sum(candidate)`` over paired blocks and its bootstrap :class:`Interval`.

    ``ar[i]`` and ``candidate[i]`` are the seconds of block ``i`` (the same tokens); ``prompts[i]``, if
    given, the prompt block ``i`` came from: with two or more prompts the bootstrap resamples prompts,
    each with all its blocks (module docstring), else blocks. Deterministic in ``seed``. With one
    block the interval is the point itself (nothing to resample).
    """
    a = np.asarray(ar, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    if a.shape != c.shape or a.ndim != 1 or not len(a):
        raise ValueError("need the same positive number of ar and candidate blocks")
    if (a <= 0).any() or (c <= 0).any():
        raise ValueError("block times must be positive")
    if not 0.5 <= level < 1.0:
        raise ValueError(f"level must be in [0.5, 1), got {level}")
    if prompts is not None and len(prompts) != len(a):
        raise ValueError(f"{len(prompts)} prompt ids for {len(a)} blocks")
    point = float(a.sum() / c.sum())
    if len(a) == 1:
        return point, Interval(round(point, 4), round(point, 4), level, 1)
    if prompts is not None and len(set(prompts)) > 1:  # resample prompts: each unit is a prompt's blocks summed
        _, unit = np.unique(np.asarray(prompts), return_inverse=True)
        a, c = np.bincount(unit, weights=a), np.bincount(unit, weights=c)
    low, high = _resampled_ratio(a, c, level, n_boot, seed)
    return point, Interval(low, high, level, len(ar))


def bootstrap_share(kept: Sequence[int], made: Sequence[int], level: float = 0.9, n_boot: int = 2000,
                    seed: int = 0) -> tuple[float, Interval]:
    """The share ``sum(kept) / sum(made)`` of drafts kept and its bootstrap :class:`Interval` over units
    (``kept[i]`` of ``made[i]`` drafts of held-out sequence ``i``), resampling units (module docstring);
    the interval's ``blocks``: the units with drafts. Units without drafts count for nothing. Deterministic
    in ``seed``; one unit's interval is the point itself."""
    k = np.asarray(kept, dtype=np.float64)
    m = np.asarray(made, dtype=np.float64)
    if k.shape != m.shape or k.ndim != 1:
        raise ValueError("need as many kept as made counts")
    if (k < 0).any() or (k > m).any():
        raise ValueError("each unit keeps between 0 and the drafts it made")
    if not 0.5 <= level < 1.0:
        raise ValueError(f"level must be in [0.5, 1), got {level}")
    k, m = k[m > 0], m[m > 0]
    if not len(m):
        raise ValueError("no unit made a draft")
    point = float(k.sum() / m.sum())
    if len(m) == 1:
        return point, Interval(round(point, 4), round(point, 4), level, 1)
    low, high = _resampled_ratio(k, m, level, n_boot, seed)
    return point, Interval(low, high, level, len(m))


def _resampled_ratio(num: np.ndarray, den: np.ndarray, level: float, n_boot: int, seed: int) -> tuple[float, float]:
    """The percentile bootstrap (two-sided, at ``level``) of ``sum(num) / sum(den)`` over units
    resampled with replacement (``den`` positive in every unit), rounded to 4 decimals."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    ratios = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return round(float(low), 4), round(float(high), 4)


def verdict(interval: Interval, margin: float) -> str:
    """``faster`` / ``not faster`` / ``open`` (module docstring) for ``interval`` against ``1 + margin``."""
    bar = 1.0 + margin
    if interval.low >= bar:
        return FASTER
    if interval.high < bar:
        return NOT_FASTER
    return OPEN


class Race:
    """A sequential paired comparison of candidates against ``ar``, block by block.

    Each :meth:`add` takes one block of one prompt: ``ar``'s seconds and those of the candidates
    still :attr:`active`. A candidate leaves the race once it has ``min_blocks`` blocks from at least
    ``min_prompts`` prompts and a verdict other than ``open``; the caller stops when none is active or
    its budget of blocks is spent (a candidate still ``open`` then is not declared faster:
    :meth:`verdict` stays ``open``).

    Example (margin 0.02, ``min_blocks`` 2, ``min_prompts`` 1): blocks ``ar 1.0, a 0.5, b 0.9`` then
    ``ar 1.0, a 0.5, b 1.1``: ``a`` is ``faster`` (2.0, interval [2.0, 2.0]) and leaves; ``b`` (1.0,
    interval about [0.91, 1.11]) stays ``open``; a third block ``ar 1.0, b 1.0`` leaves it open still.
    With ``min_prompts`` 2, ``a`` stays until a block of a second prompt.
    """

    def __init__(self, names: Sequence[str], margin: float, level: float = 0.9, min_blocks: int = 4,
                 n_boot: int = 2000, seed: int = 0, min_prompts: int = 1):
        if len(set(names)) != len(names) or "ar" in names:
            raise ValueError(f"candidates need distinct names other than 'ar', got {list(names)}")
        if min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
        if min_prompts < 1:
            raise ValueError(f"min_prompts must be >= 1, got {min_prompts}")
        self.names = list(names)
        self.margin, self.level, self.min_blocks, self.n_boot, self.seed = margin, level, min_blocks, n_boot, seed
        self.min_prompts = min_prompts
        self.blocks: dict[str, list[tuple[float, float]]] = {n: [] for n in self.names}
        self.prompts: dict[str, list[int]] = {n: [] for n in self.names}  # the prompt of each block
        self._settled: dict[str, str] = {}

    @property
    def active(self) -> list[str]:
        """Candidates that still need blocks (name order as given)."""
        return [n for n in self.names if n not in self._settled]

    def add(self, ar: float, seconds: Mapping[str, float], prompt: int = 0) -> None:
        """Record one block of ``prompt``: ``ar`` seconds and ``seconds[name]`` for every active candidate."""
        missing = [n for n in self.active if n not in seconds]
        if missing:
            raise ValueError(f"a block needs times of every active candidate; missing {', '.join(missing)}")
        for name in self.active:
            self.blocks[name].append((float(ar), float(seconds[name])))
            self.prompts[name].append(prompt)
        for name in self.active:
            if len(self.blocks[name]) >= self.min_blocks and len(set(self.prompts[name])) >= self.min_prompts:
                v = verdict(self.result(name)[1], self.margin)
                if v != OPEN:
                    self._settled[name] = v

    def result(self, name: str) -> tuple[float, Interval]:
        """``name``'s speedup and interval over its blocks so far (resampled by prompt)."""
        pairs = self.blocks[name]
        if not pairs:
            raise ValueError(f"{name} has no timed blocks")
        ar, cand = zip(*pairs)
        return bootstrap_speedup(ar, cand, self.level, self.n_boot, self.seed, self.prompts[name])

    def verdict(self, name: str) -> str:
        """``faster`` / ``not faster`` once settled, else ``open`` (also with no blocks)."""
        return self._settled.get(name, OPEN)
