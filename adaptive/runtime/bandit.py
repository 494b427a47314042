"""Thompson sampling of the draft length (EESD's mechanism) over a Beta posterior on acceptance.

Model: each drafted token is accepted with probability ``a`` until the first rejection, so a
verification that accepted ``n`` of ``k`` drafts observed ``n`` successes and, if ``n < k``, one
failure (tokens after the first rejection say nothing). With ``a ~ Beta(alpha, beta)``, each step
samples ``a`` and drafts the ``k`` in ``0 .. max_len`` with the highest expected tokens per unit
cost, ``E(a, k) / (k * draft_cost + verify_cost(k))`` (``k = 0`` is a plain step of cost 1), so a
domain whose drafts stop paying falls back to plain decoding on its own and keeps exploring.
"""

from __future__ import annotations

import threading

import numpy as np

from adaptive.costs import best_draft_length, best_split
from adaptive.engine.protocol import LAYER_SKIP, STATISTICAL, Draft, DraftChoice, DraftLengthPolicy, DraftPlan


def temperature_class(temperature: float) -> str:
    """The suffix of a bandit's key for requests sampled at ``temperature``: ``""`` for greedy
    decoding, else ``"@t"`` and the temperature to one decimal (``0.7`` -> ``"@t0.7"``, ``1.0`` ->
    ``"@t1"``). Acceptance falls as the temperature rises (a sampled draft is kept with probability
    ``sum_x min(p(x), q(x))``, not when the target's argmax agrees), so each class learns its own
    posterior: a domain's greedy traffic never teaches its sampled requests to draft, and the other
    way round."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return "" if temperature == 0 else f"@t{round(float(temperature), 1):g}"


class BetaPosterior:
    """A Beta posterior on a per-token acceptance, with a bounded memory (``window``).

    When ``alpha + beta`` exceeds ``window`` both are scaled down, keeping their ratio: memory stays
    bounded and the posterior follows drift. Not thread-safe on its own (its owner locks).

    *Evidence* is what the observations added beyond the ``prior``: ``own`` (this process's, scaled
    down with the rest) and ``others`` (other replicas', :meth:`rebase`). The posterior is the prior
    plus both, window-bounded; a replica saves only its own evidence, so adding the replicas' up
    counts each observation once (issue 45).
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), window: float = 500.0):
        if min(prior) <= 0 or window <= 2:
            raise ValueError("prior counts must be positive and the window above 2")
        self.prior = tuple(map(float, prior))
        self.alpha, self.beta = self.prior
        self.window = float(window)
        self.own = [0.0, 0.0]
        self.others = [0.0, 0.0]

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.beta(self.alpha, self.beta))

    def update(self, successes: float, failures: float) -> None:
        self.alpha += successes
        self.beta += failures
        self.own[0] += successes
        self.own[1] += failures
        total = self.alpha + self.beta
        if total > self.window:
            scale = self.window / total
            self.alpha *= scale
            self.beta *= scale
            self.own = [x * scale for x in self.own]

    def evidence_of(self, counts, evidence=None) -> list[float]:
        """The evidence of a saved state: its ``evidence`` if it kept one, else what its ``counts`` hold
        beyond this prior (a state saved before replicas: all of it that replica's)."""
        if evidence is not None:
            return [max(0.0, float(x)) for x in evidence]
        return [max(0.0, float(c) - p) for c, p in zip(counts, self.prior)]

    def evidence(self) -> list[float]:
        """This process's evidence (what a replica saves as its own)."""
        return list(self.own)

    def rebase(self, others: list[tuple]) -> None:
        """Take the other replicas' saved states (``(counts, evidence or None)`` each) in place of those
        taken before: the posterior becomes prior + their evidence + its own, window-bounded. Idempotent."""
        ev = [self.evidence_of(c, e) for c, e in others]
        self.others = [sum(x[0] for x in ev), sum(x[1] for x in ev)]
        alpha = self.prior[0] + self.others[0] + self.own[0]
        beta = self.prior[1] + self.others[1] + self.own[1]
        scale = min(1.0, self.window / (alpha + beta))
        self.alpha, self.beta = alpha * scale, beta * scale

    def state(self) -> dict:
        return {"alpha": round(self.alpha, 3), "beta": round(self.beta, 3), "mean_acceptance": round(self.mean, 4)}

    def counts(self) -> list[float]:
        """``[alpha, beta]``: what :meth:`restore` takes back (an overlay saves it)."""
        return [self.alpha, self.beta]

    def restore(self, counts, evidence=None) -> None:
        """Continue from saved :meth:`counts` (and this process's saved :meth:`evidence`; without it,
        what the counts hold beyond the prior is taken as its own)."""
        alpha, beta = (float(x) for x in counts)
        if min(alpha, beta) <= 0:
            raise ValueError(f"saved Beta counts must be positive, got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self.own = self.evidence_of(counts, evidence)
        self.others = [0.0, 0.0]


def is_copy(draft: Draft) -> bool:
    """Whether every token of ``draft`` is :data:`STATISTICAL` (a copy of the context, or a bigram's)."""
    return bool(draft.sources) and all(src == STATISTICAL for src in draft.sources)


def _chain_observation(drafted: int, accepted: int) -> tuple[int, int]:
    """Successes and failures of one verification under the until-first-rejection model."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} of {drafted} drafts")
    return accepted, int(accepted < drafted)


class ThompsonDraftLength(DraftLengthPolicy):
    """A thread-safe bandit for one domain; plugs into the engine as its draft-length policy.

    ``prior``: Beta pseudo-counts (from the calibration's measured acceptance). ``window`` bounds
    memory and lets the posterior follow drift: when ``alpha + beta`` exceeds it, both are
    scaled down to keep their ratio. ``verify`` is a verify table (costs of 0 .. ``max_len`` drafts).

    ``copy_prior``: for a drafter that copies from the context where it can and drafts with a model
    where it cannot (the eagle drafter), a second posterior, on the acceptance of its copies (drafts
    whose every token is :data:`STATISTICAL`), which learns from those alone, while the first learns
    from the model's drafts alone; each step then also chooses the copy's length from it at
    ``copy_cost`` a token (:attr:`DraftChoice.copy`). A copy's tokens cost next to nothing, so where
    copies are kept it runs as long as the verify table pays for, not as long as the model's drafts.
    Measured on the embedded model (torch bf16, 24 held-out Spec-Bench prompts, the eagle policy, one
    interleaved run on a 2-core AMD EPYC; docs/history/2026-11-28-eagle-heads.md, ninth session): 1.08x
    the decoding speed of copies at the model's length that also taught the model's posterior.
    """

    def __init__(self, draft_cost: float, verify: list[float] | tuple[float, ...], max_len: int,
                 prior: tuple[float, float] = (1.0, 1.0), window: float = 500.0, seed: int | None = 0,
                 allow_zero: bool = True, copy_prior: tuple[float, float] | None = None, copy_cost: float = 0.0):
        if max_len < 1 or len(verify) < max_len + 1:
            raise ValueError("need max_len >= 1 and a verify cost for 0 .. max_len drafts")
        self.draft_cost = float(draft_cost)
        self.verify = tuple(float(v) for v in verify)
        self.max_len = int(max_len)
        self.posterior = BetaPosterior(prior, window)
        self.copies = None if copy_prior is None else BetaPosterior(copy_prior, window)
        self.copy_cost = float(copy_cost)
        self.allow_zero = allow_zero
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.chosen: dict[int, int] = {}
        self.copy_chosen: dict[int, int] = {}

    @property
    def alpha(self) -> float:
        return self.posterior.alpha

    @property
    def beta(self) -> float:
        return self.posterior.beta

    @property
    def mean(self) -> float:
        return self.posterior.mean

    def choose(self, max_len: int) -> DraftChoice:
        with self._lock:
            a = self.posterior.sample(self._rng)
            a_copy = None if self.copies is None else self.copies.sample(self._rng)
        n = min(max_len, self.max_len)
        k, _ = best_draft_length(a, self.draft_cost, self.verify, n)
        if k == 0 and not self.allow_zero:
            k = 1
        copy = self._copy_length(a_copy, n)
        with self._lock:
            self.chosen[k] = self.chosen.get(k, 0) + 1
            if copy is not None:
                self.copy_chosen[copy] = self.copy_chosen.get(copy, 0) + 1
        return DraftChoice(k, copy=copy)

    def plan(self, max_len: int) -> DraftPlan | None:
        """A Thompson sample of the acceptance, as the gains of ``1 .. max_len`` draft tokens (``None``
        when a draft is compulsory: this policy must choose)."""
        if not self.allow_zero:
            return None
        with self._lock:
            a = self.posterior.sample(self._rng)
            a_copy = None if self.copies is None else self.copies.sample(self._rng)
        n = min(max_len, self.max_len)
        copy = self._copy_length(a_copy, n)
        return DraftPlan(tuple(a ** (j + 1) for j in range(n)), (self.draft_cost,) * n, copy=copy)

    def _copy_length(self, a_copy: float | None, n: int) -> int | None:
        """The copy length that pays best at a sampled copy acceptance ``a_copy`` (``None``: no copies posterior)."""
        return None if a_copy is None else best_draft_length(a_copy, self.copy_cost, self.verify, n)[0]

    def update(self, draft: Draft, accepted: int) -> None:
        if len(draft) == 0:
            return
        ok, bad = _chain_observation(draft.depth, accepted)  # a tree: its longest path
        copied = self.copies is not None and is_copy(draft)
        with self._lock:
            (self.copies if copied else self.posterior).update(ok, bad)

    def state(self) -> dict:
        with self._lock:
            out = {**self.posterior.state(), "chosen": dict(sorted(self.chosen.items()))}
            if self.copies is not None:
                out["copies"] = {**self.copies.state(), "chosen": dict(sorted(self.copy_chosen.items()))}
            return out

    def posteriors(self) -> dict:
        """What the bandit learned, as :meth:`restore` takes it back (saved in the online overlay):
        its posterior's counts and this process's evidence (what a replica contributes), and its copies'."""
        with self._lock:
            out = {"kind": "length", "acceptance": self.posterior.counts(), "evidence": self.posterior.evidence()}
            if self.copies is not None:
                out["copies"] = {"acceptance": self.copies.counts(), "evidence": self.copies.evidence()}
            return out

    def restore(self, saved: dict) -> None:
        """Continue from :meth:`posteriors` (a bandit of another kind: ``ValueError``). A bandit with copies
        skips a state saved without them: it was saved before copies had a posterior of their own, when
        they taught the model's, whose acceptance they would inflate (the posteriors start from their priors)."""
        if saved.get("kind") != "length":
            raise ValueError(f"not a draft-length bandit's state: {saved.get('kind')!r}")
        copies = saved.get("copies")
        if self.copies is not None and copies is None:
            return
        with self._lock:
            self.posterior.restore(saved["acceptance"], saved.get("evidence"))
            if self.copies is not None:
                self.copies.restore(copies["acceptance"], copies.get("evidence"))

    def rebase(self, others: list[dict]) -> None:
        """Fold in other replicas' saved :meth:`posteriors` (their evidence, summed; states of another
        kind are skipped, and, by a bandit with copies, states without them, as :meth:`restore` skips them):
        prior + theirs + this process's own. Idempotent."""
        mine = [o for o in others if o.get("kind") == "length" and (self.copies is None or o.get("copies"))]
        with self._lock:
            self.posterior.rebase([(o["acceptance"], o.get("evidence")) for o in mine])
            if self.copies is not None:
                self.copies.rebase([(o["copies"]["acceptance"], o["copies"].get("evidence")) for o in mine])


class ThompsonCascade(DraftLengthPolicy):
    """Thompson sampling of a cascade's draft length *and* split (EESD's bandit, extended).

    Beta posteriors per level: one on the per-token acceptance of layer-skip tokens, and one per
    tail position on the acceptance of statistical tokens (a copied span tends to go on being
    right once its first token was: calibration measured about 0.5 at the first position and
    0.65-0.7 at later ones, so one shared rate would undervalue long tails). Each step samples
    them all and picks the ``(split, k)`` of :func:`~adaptive.costs.best_split` (the layer-skip
    cost scaled by the layer-skip forwards per layer-skip token seen so far, below 1 when vertical
    drafting gets several tokens from one forward). After the verification each drafted token up
    to the first rejection is credited to its level and position (``Draft.sources``).
    ``stat_prior`` is one ``(alpha, beta)`` for every tail position or a list, one per position.
    ``max_split`` 0: the cascade has no layer-skip level.
    """

    def __init__(self, layer_skip_cost: float, verify: list[float] | tuple[float, ...], max_len: int,
                 max_split: int, layer_skip_prior: tuple[float, float] = (1.0, 1.0),
                 stat_prior: tuple[float, float] | list[tuple[float, float]] = (1.0, 1.0), stat_cost: float = 0.005,
                 window: float = 500.0, seed: int | None = 0):
        if max_len < 1 or len(verify) < max_len + 1:
            raise ValueError("need max_len >= 1 and a verify cost for 0 .. max_len drafts")
        if max_split < 0:
            raise ValueError(f"max_split must be >= 0, got {max_split}")
        priors = list(stat_prior) if isinstance(stat_prior[0], (tuple, list)) else [stat_prior]
        priors += [priors[-1]] * (max_len - len(priors))  # positions beyond those measured: the last one's
        self.layer_skip_cost = float(layer_skip_cost)
        self.stat_cost = float(stat_cost)
        self.verify = tuple(float(v) for v in verify)
        self.max_len = int(max_len)
        self.max_split = int(max_split)
        self.layer_skip = BetaPosterior(layer_skip_prior, window)
        self.tail = [BetaPosterior(p, window) for p in priors[:max_len]]
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.chosen: dict[str, int] = {}
        self._forwards = 0  # layer-skip forwards and the layer-skip tokens they produced, so far
        self._layer_skip_tokens = 0

    @property
    def forwards_per_token(self) -> float:
        """Layer-skip forwards per layer-skip token drafted so far (1.0 before any)."""
        return self._forwards / self._layer_skip_tokens if self._layer_skip_tokens else 1.0

    def _sample(self) -> tuple[float, list[float], float]:
        """A Thompson sample of both levels' acceptance (layer skip, each tail position) and the
        layer-skip token's cost as drafting has gone so far."""
        with self._lock:
            return (self.layer_skip.sample(self._rng), [b.sample(self._rng) for b in self.tail],
                    self.layer_skip_cost * min(1.0, self.forwards_per_token))

    def choose(self, max_len: int) -> DraftChoice:
        a_l, a_s, cost = self._sample()
        h, k = best_split(a_l, a_s, cost, self.stat_cost, self.verify, min(max_len, self.max_len), self.max_split)
        with self._lock:
            key = f"{h}+{k - h}"
            self.chosen[key] = self.chosen.get(key, 0) + 1
        return DraftChoice(k, h)

    def plan(self, max_len: int) -> DraftPlan:
        """Thompson samples of both levels: the split alone's best (:func:`~adaptive.costs.best_split`),
        then the gains of ``1 .. max_len`` tokens drafted with it (layer-skip tokens first)."""
        a_l, a_s, cost = self._sample()
        n = min(max_len, self.max_len)
        h, _ = best_split(a_l, a_s, cost, self.stat_cost, self.verify, n, self.max_split)
        gains, p = [], 1.0
        for j in range(n):
            p *= a_l if j < h else a_s[min(j - h, len(a_s) - 1)]
            gains.append(p)
        return DraftPlan(tuple(gains), tuple(cost if j < h else self.stat_cost for j in range(n)), h)

    def update(self, draft: Draft, accepted: int) -> None:
        if len(draft) == 0:
            return
        _chain_observation(len(draft), accepted)
        with self._lock:
            self._forwards += draft.forwards
            self._layer_skip_tokens += sum(src == LAYER_SKIP for src in draft.sources)
            j = 0  # position within the statistical tail
            for i, src in enumerate(draft.sources[: accepted + 1]):
                post = self.layer_skip if src == LAYER_SKIP else self.tail[min(j, len(self.tail) - 1)]
                post.update(*((1.0, 0.0) if i < accepted else (0.0, 1.0)))  # i == accepted: the first rejection
                j += src != LAYER_SKIP

    def state(self) -> dict:
        with self._lock:
            return {"layer_skip": self.layer_skip.state(),
                    "statistical": [round(b.mean, 4) for b in self.tail],
                    "forwards_per_token": round(self.forwards_per_token, 3),
                    "chosen": dict(sorted(self.chosen.items()))}

    def posteriors(self) -> dict:
        """What the bandit learned, as :meth:`restore` takes it back (saved in the online overlay), with
        this process's evidence per posterior (what a replica contributes)."""
        with self._lock:
            return {"kind": "cascade", "layer_skip": self.layer_skip.counts(),
                    "tail": [b.counts() for b in self.tail], "forwards": self._forwards,
                    "layer_skip_tokens": self._layer_skip_tokens,
                    "evidence": {"layer_skip": self.layer_skip.evidence(), "tail": [b.evidence() for b in self.tail]}}

    def restore(self, saved: dict) -> None:
        """Continue from :meth:`posteriors` (another kind, or another number of tail positions: ``ValueError``)."""
        if saved.get("kind") != "cascade" or len(saved["tail"]) != len(self.tail):
            raise ValueError("not this cascade bandit's state (kind or tail length differs)")
        ev = saved.get("evidence") or {}
        with self._lock:
            self.layer_skip.restore(saved["layer_skip"], ev.get("layer_skip"))
            for i, (b, c) in enumerate(zip(self.tail, saved["tail"])):
                b.restore(c, ev["tail"][i] if "tail" in ev else None)
            self._forwards, self._layer_skip_tokens = int(saved["forwards"]), int(saved["layer_skip_tokens"])

    def rebase(self, others: list[dict]) -> None:
        """Fold in other replicas' saved :meth:`posteriors` (their evidence per posterior, summed; states of
        another kind or tail length are skipped). Idempotent."""
        states = [o for o in others if o.get("kind") == "cascade" and len(o.get("tail", ())) == len(self.tail)]
        kept = [o.get("evidence") or {} for o in states]  # absent: a state saved before replicas
        with self._lock:
            self.layer_skip.rebase([(o["layer_skip"], e.get("layer_skip")) for o, e in zip(states, kept)])
            for i, b in enumerate(self.tail):
                b.rebase([(o["tail"][i], e["tail"][i] if "tail" in e else None) for o, e in zip(states, kept)])
