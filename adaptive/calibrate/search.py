"""The skip-set search: a Bayesian optimisation (``bayesian-optimization``) of the expected speedup.

Two parameterisations of a skip set:

* ``sublayer`` (Self-SD's): one variable in ``[0, 1]`` per attention and per MLP sublayer, the
  sublayer being skipped where its variable exceeds 0.5 (``2 * n_layers`` dimensions);
* ``ranked`` (ours, the default): sublayers are ordered by their measured influence on the residual
  stream over the domain's own text (:meth:`Backbone.sublayer_influence`, least influential
  first) and the search is over two integers, how many attention and how many MLP sublayers to
  skip from the front of those orders. Two dimensions are what a Bayesian optimiser can model
  with the few dozen trials a CPU affords. Measured at 30 trials on maths (docs/results.md):
  ranked reached a median best estimate of 0.95 in 57 s, sublayer 0.79 in 484 s.

Each trial scores a candidate by teacher-forced matchness (one forward per calibration
sequence) turned into an expected speedup with the measured cost model. Trials are a pure
function of the seed, the trial number and the history, so a resumed search proposes exactly
what an uninterrupted one would have.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from adaptive.costs import CostModel, best_draft_length
from adaptive.engine.backbone import Segment
from adaptive.engine.skip import SkipSet

SPACES = ("ranked", "sublayer")


class RankedSpace:
    """Skip the ``n_attn`` / ``n_mlp`` least influential sublayers (``influence``: ``[2, n_layers]``)."""

    name = "ranked"

    def __init__(self, influence: torch.Tensor | np.ndarray):
        inf = np.asarray(influence, dtype=np.float64)
        if inf.ndim != 2 or inf.shape[0] != 2:
            raise ValueError("influence must be [2, n_layers]")
        self.n_layers = inf.shape[1]
        # stable sort: equal influence keeps layer order, so the space is deterministic
        self.attn_order = [int(i) for i in np.argsort(inf[0], kind="stable")]
        self.mlp_order = [int(i) for i in np.argsort(inf[1], kind="stable")]
        self.pbounds = {"n_attn": (0, self.n_layers, int), "n_mlp": (0, self.n_layers, int)}

    def decode(self, params: dict) -> SkipSet:
        na = int(round(float(params["n_attn"])))
        nm = int(round(float(params["n_mlp"])))
        return SkipSet(attn=self.attn_order[:na], mlp=self.mlp_order[:nm], n_layers=self.n_layers)


class SublayerSpace:
    """One ``[0, 1]`` variable per sublayer; skipped where above 0.5 (Self-SD)."""

    name = "sublayer"

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.pbounds = {**{f"a{i}": (0.0, 1.0) for i in range(n_layers)},
                        **{f"m{i}": (0.0, 1.0) for i in range(n_layers)}}

    def decode(self, params: dict) -> SkipSet:
        L = self.n_layers
        return SkipSet(attn=[i for i in range(L) if float(params[f"a{i}"]) > 0.5],
                       mlp=[i for i in range(L) if float(params[f"m{i}"]) > 0.5], n_layers=L)


def make_space(name: str, n_layers: int, influence=None):
    if name == "ranked":
        if influence is None:
            raise ValueError("the ranked space needs sublayer influence")
        return RankedSpace(influence)
    if name == "sublayer":
        return SublayerSpace(n_layers)
    raise ValueError(f"unknown search space {name!r}; choose one of {', '.join(SPACES)}")


class MatchnessScorer:
    """Teacher-forced matchness of skip sets on fixed ``(prompt_ids, continuation_ids)`` sequences.

    Two modes, both one batched forward (:meth:`Backbone.forward_batch`) per candidate over all
    sequences (in groups of at most ``max_rows`` fed tokens):

    * ``"context"`` (default): the full model's keys are computed once for the prompt *and* the
      continuation; a candidate runs ``[prompt[-1]] + continuation[:-1]`` with its sublayers
      skipped, reading those keys without writing any (``read_only``). Each position is then
      drafted as the first token of a draft is at run time, after a verification has written
      full-model keys for everything before it (only the key at its own position differs: the
      full model's rather than the candidate's). It estimates the per-token acceptance.
    * ``"chain"`` (SWIFT's): the prompt's keys are the full model's but the continuation's are
      the candidate's own, so errors compound over the whole continuation: a pessimistic bound.

    The score is the fraction of positions where the candidate's argmax is the continuation's
    next token. Batching is what makes a trial cheap where a forward's cost is mostly reading the
    weights (bf16 on a CPU): 12 sequences of 24 tokens scored in 0.62-0.63x the time of one forward
    each (Qwen2.5-Coder-1.5B, 2 cores: docs/benchmarks.md, "Batched matchness scoring").
    """

    MODES = ("context", "chain")

    def __init__(self, backbone, sequences: list[tuple[list[int], list[int]]], mode: str = "context",
                 max_rows: int = 512):
        if mode not in self.MODES:
            raise ValueError(f"unknown matchness mode {mode!r}; choose one of {', '.join(self.MODES)}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        self.backbone = backbone
        self.mode = mode
        self.items: list[tuple[Segment, torch.Tensor]] = []  # (the fed continuation, its targets)
        prefill = []
        dev = backbone.device
        for prompt, cont in sequences:
            if not prompt or not cont:
                continue
            P, C = len(prompt), len(cont)
            cache = backbone.new_cache(P - 1 + C)
            feed = torch.tensor([prompt[-1]] + list(cont[:-1]), device=dev)
            known = list(prompt[:-1]) + (list(prompt[-1:]) + list(cont[:-1]) if mode == "context" else [])
            if known:
                prefill.append(Segment(torch.tensor(known, device=dev), cache, 0, logits=False))
            self.items.append((Segment(feed, cache, P - 1), torch.tensor(cont, device=dev)))
        if not self.items:
            raise ValueError("no sequences with a continuation to score")
        for group in row_groups(prefill, max_rows):
            backbone.forward_batch(group)
        self.groups = row_groups(self.items, max_rows, key=lambda item: item[0])
        self.total = sum(len(t) for _, t in self.items)

    @torch.inference_mode()
    def __call__(self, skip_masks) -> float:
        hits = 0
        read_only = self.mode == "context"
        for group in self.groups:
            logits = self.backbone.forward_batch([seg for seg, _ in group], skip_masks=skip_masks, read_only=read_only)
            hits += sum(int((lg.argmax(-1) == target).sum()) for lg, (_, target) in zip(logits, group))
        return hits / self.total


def row_groups(items: list, max_rows: int, key: Callable = lambda seg: seg) -> list[list]:
    """``items`` in order, in consecutive groups of at most ``max_rows`` fed tokens (``key(item)``'s
    :class:`Segment`); a longer item is a group of its own.
    Example: segments of 300, 200, 100 and 600 tokens, ``max_rows=512`` -> ``[[300, 200], [100], [600]]``."""
    groups: list[list] = []
    rows = max_rows
    for item in items:
        n = int(key(item).ids.numel())
        if rows + n > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(item)
        rows += n
    return groups


@dataclass(frozen=True)
class Estimate:
    """A candidate's score: matchness ``a``, draft cost, best draft length and expected speedup."""

    matchness: float
    draft_cost: float
    draft_len: int
    speedup: float


def estimate(skip: SkipSet, scorer: Callable, costs: CostModel, max_draft_len: int = 8, floor: float = 0.0) -> Estimate:
    """Score ``skip``: matchness from ``scorer(masks)``, speedup from the cost model at the best k.
    A matchness below ``floor`` scores a speedup of 0: such a skip set is never a candidate."""
    masks = skip.masks(costs.n_layers)
    a = float(scorer(masks)) if skip.size else 1.0
    c = costs.draft_cost(masks)
    best_k, best = best_draft_length(min(a, 1.0), c, costs.verify_table(max_draft_len), max_draft_len, min_len=1)
    return Estimate(a, c, best_k, best if a >= floor else 0.0)


def _random_params(pbounds: dict, rng: np.random.RandomState) -> dict:
    out = {}
    for name, b in pbounds.items():
        lo, hi = b[0], b[1]
        out[name] = int(rng.randint(lo, hi + 1)) if len(b) > 2 and b[2] is int else float(rng.uniform(lo, hi))
    return out


def suggest(space, history: list[dict], trial: int, seed: int, n_init: int) -> dict:
    """Parameters for trial ``trial`` given the scored ``history`` (``[{"params", "target"}]``).

    The first ``n_init`` trials are uniform random; later ones maximise the acquisition of a
    Gaussian process fitted to the history. Deterministic in ``(seed, trial, history)``.
    """
    rng = np.random.RandomState((seed * 7919 + trial) % (2**32))
    if trial < n_init or len(history) < 2:
        return _random_params(space.pbounds, rng)
    from bayes_opt import BayesianOptimization

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # integer parameters are flagged "experimental"; tested here
        opt = BayesianOptimization(f=None, pbounds=space.pbounds, random_state=rng, verbose=0,
                                   allow_duplicate_points=True)
        registered = set()
        for h in history:
            if not h["params"]:  # a seeded trial (another task's skip set): not a point of this space
                continue
            key = tuple(sorted((k, round(float(v), 9)) for k, v in h["params"].items()))
            if key not in registered:  # bayes_opt prints a line for every duplicate
                registered.add(key)
                opt.register(params=h["params"], target=h["target"])
        params = opt.suggest()
    return {k: (int(round(float(v))) if len(space.pbounds[k]) > 2 else float(v)) for k, v in params.items()}


def trial_record(trial: int, params: dict, skip: SkipSet, est: Estimate, seconds: float) -> dict:
    """One line of a search's history (``trials-<domain>.jsonl``; the skip set as its text form)."""
    return {"trial": trial, "params": params, "skip": skip.to_text(), "n_attn": len(skip.attn),
            "n_mlp": len(skip.mlp), "matchness": round(est.matchness, 6), "draft_cost": round(est.draft_cost, 6),
            "draft_len": est.draft_len, "target": round(est.speedup, 6), "seconds": round(seconds, 3)}


def trial_skip(rec: dict) -> SkipSet:
    """The skip set of a :func:`trial_record` (as read back from ``trials-<domain>.jsonl``)."""
    return SkipSet.from_text(rec["skip"])


def trial_estimate(rec: dict) -> Estimate:
    """The estimate a :func:`trial_record` holds (reused where the same skip set comes up again)."""
    return Estimate(rec["matchness"], rec["draft_cost"], rec["draft_len"], rec["target"])


def run_search(space, score: Callable[[SkipSet], Estimate], trials: int, seed: int = 0, n_init: int = 5,
               history: list[dict] | None = None, on_trial: Callable[[dict], None] | None = None) -> list[dict]:
    """Run trials ``len(history) .. trials-1``; returns the full history (one dict per trial).

    ``on_trial`` receives each new record right after it is scored (the checkpoint hook). When
    the optimiser proposes a skip set already scored, a random unseen one is tried instead (a
    converged optimiser would otherwise spend the remaining trials on one point). The empty skip
    set is not a drafter (it is plain decoding at twice the cost): it scores 0 without a forward.
    """
    history = list(history or [])
    seen = {trial_skip(h): h for h in history}
    for t in range(len(history), trials):
        params = suggest(space, history, t, seed, n_init)
        skip = space.decode(params)
        if skip in seen:
            rng = np.random.RandomState((seed * 7919 + t + 104729) % (2**32))
            for _ in range(200):
                alt = _random_params(space.pbounds, rng)
                alt_skip = space.decode(alt)
                if alt_skip not in seen and alt_skip.size:
                    params, skip = alt, alt_skip
                    break
        t0 = time.perf_counter()
        if skip in seen:
            est = trial_estimate(seen[skip])
        elif not skip.size:
            est = Estimate(1.0, 1.0, 1, 0.0)
        else:
            est = score(skip)
        rec = trial_record(t, params, skip, est, time.perf_counter() - t0)
        history.append(rec)
        seen.setdefault(skip, rec)
        if on_trial is not None:
            on_trial(rec)
    return history


def top_candidates(history: list[dict], n: int, floor: float = 0.0) -> list[dict]:
    """The ``n`` best distinct skip sets of a history by expected speedup (ties: fewer skipped first),
    leaving out those whose matchness is below ``floor``. ``history``: trial records (their ``skip``
    text is only a key here)."""
    best: dict[str, dict] = {}
    for h in history:
        if not h["n_attn"] + h["n_mlp"] or h["matchness"] < floor:  # not a drafter, or almost never accepted
            continue
        if h["skip"] not in best or h["target"] > best[h["skip"]]["target"]:
            best[h["skip"]] = h
    ranked = sorted(best.values(), key=lambda h: (-h["target"], h["n_attn"] + h["n_mlp"], h["trial"]))
    return ranked[:n]


def neighbours(skip: SkipSet, space) -> list[SkipSet]:
    """``skip`` and its neighbours in a domain's space: each set with one of its sublayers kept, and
    with the domain's next least influential attention or MLP sublayer skipped too (ranked space;
    none added in others). Order: ``skip``, the smaller sets (layer order), the larger ones.

    Example: ``mlp=13-14`` where the domain ranks MLPs ``[15, 13, 14, ...]`` and attention
    ``[2, ...]``: ``mlp=13-14``, ``mlp=14``, ``mlp=13``, ``attn=2;mlp=13-14``, ``mlp=13-15``.
    """
    out = [skip]
    out += [SkipSet(attn=[a for a in skip.attn if a != i], mlp=skip.mlp) for i in skip.attn]
    out += [SkipSet(attn=skip.attn, mlp=[m for m in skip.mlp if m != i]) for i in skip.mlp]
    if isinstance(space, RankedSpace):
        extra_attn = next((i for i in space.attn_order if i not in skip.attn), None)
        extra_mlp = next((i for i in space.mlp_order if i not in skip.mlp), None)
        if extra_attn is not None:
            out.append(SkipSet(attn=[*skip.attn, extra_attn], mlp=skip.mlp))
        if extra_mlp is not None:
            out.append(SkipSet(attn=skip.attn, mlp=[*skip.mlp, extra_mlp]))
    seen, unique = set(), []
    for s in out:
        if s and s not in seen:
            seen.add(s)
            unique.append(s)
    return unique
