"""The eagle drafter: a trained :class:`~adaptive.drafters.eagle.EagleHead` drafting chains or trees from the
target's features in the request's cache, behind the drafter protocol (the terms: :mod:`adaptive.drafters.eagle`).
Where the target's steps replay CUDA graphs its head levels replay their own (:mod:`adaptive.drafters.eagle_static`).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from adaptive.drafters.eagle import COPY_MIN, DEFAULT_TREE, NO_LOOKUP, EagleHead, HeadCache, NgramIndex, TreeShape
from adaptive.drafters.eagle_static import head_graphs, level_banned
from adaptive.drafters.head import DraftHead
from adaptive.drafters.ngram import ngram_lookup
from adaptive.engine.protocol import STATISTICAL, DecodeState, Draft, DraftChoice, Drafter, tree_first_path
from adaptive.engine.sampling import sample_token, warp_probs
from adaptive.errors import ConfigError


class EagleDrafter(Drafter):
    """Drafts with a trained :class:`EagleHead` from the target's features in the request's cache.

    Before each proposal it feeds the rows the target has verified since the last one (the head's
    cache keeps the rows computed from the target's features: those never change), then drafts a
    token per head step, each step's input the previous step's output. Greedy: the argmax over the
    head's rows (``vocab``: the head's ids joined with the request's prompt tokens, a
    :class:`~adaptive.drafters.head.DraftHead` whose first rows are the head's own); sampling: the
    warped distribution over them. The head runs as :meth:`EagleHead.step` gives it for ``dtype`` and
    the target's weight ``mode``; ``embed(ids [T]) -> [T, H]`` is the target's token embedding. Where
    prompt lookup matches at least ``copy_min`` tokens it drafts the copy instead (a cascade: lookup
    first, the head where it has nothing; :data:`COPY_MIN`), up to :attr:`DraftChoice.copy` tokens (its
    tokens marked :data:`STATISTICAL`, so that a policy learns their acceptance apart from the head's).
    Its drafts on a backbone that verifies trees branch as ``tree`` says (:class:`TreeShape`; ``None``: chains).
    """

    name = "eagle"

    def __init__(self, head: EagleHead, vocab: DraftHead, embed, dtype: torch.dtype = torch.float32,
                 mode: str = "dense", copy_min: int = COPY_MIN, tree: TreeShape | None = DEFAULT_TREE):
        n = len(head.ids)
        if len(vocab) < n or not torch.equal(vocab.ids[:n].cpu(), head.ids.cpu()):
            raise ConfigError("an eagle drafter's vocabulary must start with its head's own rows (eagle_vocab)")
        self.head, self.vocab, self.embed = head, vocab, embed
        self.step = head.step(dtype, mode)
        self.extra = vocab.weight[n:].to(dtype)  # the prompt's rows beyond the head's own
        self.index_of = {int(t): i for i, t in enumerate(vocab.ids.tolist())}
        self.lookups = NgramIndex(head.shape.lookup)
        self.cache: HeadCache | None = None
        self._graphs = None  # the head's captured levels (HeadGraphs) where the target's steps are graphs
        self._slot_for = 0  # the target slot capacity its head slot was made for
        self.copy_min = copy_min
        self.tree = tree

    def _inputs(self, tokens: list[int], lookups: list[int], device):
        """The rows' token and lookup-token embeddings (one lookup of the table), which rows have a lookup
        token, and its index among the vocabulary's rows (-1: none there)."""
        m = len(tokens)
        emb = self.embed(torch.tensor(tokens + [max(t, 0) for t in lookups], dtype=torch.long, device=device))
        have = torch.tensor([t != NO_LOOKUP for t in lookups], device=device)
        index = torch.tensor([self.index_of.get(t, -1) for t in lookups], device=device)
        return emb[:m], emb[m:], have, index

    def _new_cache(self, state: DecodeState, length: int, device) -> HeadCache:
        """The head's cache for a request: over a pooled head slot whose levels replay captured graphs where the
        target's steps do (:mod:`adaptive.drafters.eagle_static`), else a growing one of its own."""
        self._graphs = head_graphs(self.step, state.backbone, self.embed)
        if self._graphs is not None and self.extra.shape[0] <= state.cache.k.shape[2]:
            self._slot_for = state.cache.k.shape[2]  # the target slot's capacity the head slot was made for
            return self._graphs.cache(self._slot_for, self.extra)
        self._graphs = None
        return HeadCache(self.head.shape, max(256, length + 64), device)

    def _level(self, u: torch.Tensor, tokens: list[int], lookups: list[int], at: int, committed: int | None = None,
               positions: list[int] | None = None, seen: list[list[int]] | None = None,
               last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One head level (its terms: :mod:`adaptive.drafters.eagle_static`): the rows of fused inputs ``u``
        (``[T, H]``), their next ``tokens`` and ``lookups``, written at the head cache's rows ``at ..``, each
        seeing the rows before ``committed`` (default ``at``: every earlier row) and the window rows its ``seen``
        names (default: causal), rotated at ``positions`` (default: their rows). Returns ``(g [T, H], logits
        [T, V' + E])``, the logits of the last row only with ``last``. Replays the captured level where it can."""
        committed = at if committed is None else committed
        if self._graphs is not None:
            index = [self.index_of.get(t, -1) for t in lookups]
            out = self._graphs.run(self.cache, u, tokens, lookups, index, self.extra.shape[0], committed, at,
                                   positions, seen, last)
            if out is not NotImplemented:
                return out
        device = u.device
        emb, lk, have, idx = self._inputs(tokens, lookups, device)
        banned = None if seen is None else level_banned(committed, at, seen, device)
        pos = None if positions is None else torch.tensor(positions, device=device)
        g = self.step.rows(u, emb, lk, have, self.cache, at, pos, banned)
        if last:
            return g, self.step.logits(g[-1:], idx[-1:], self.extra)
        return g, self.step.logits(g, idx, self.extra)

    @torch.inference_mode()
    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        cache, tokens, cfg, step = state.cache, state.tokens, state.config, self.step
        features = getattr(cache, "features", None)
        if features is None:
            raise ConfigError("the eagle drafter needs the target's features in the cache: the request's "
                              "config must name the head's feature layers")
        n = cache.length  # the pending token's position: the target's features exist for rows 0 .. n-1
        device = features.device
        copy = choice.length if choice.copy is None else choice.copy
        if self.copy_min and copy:  # prompt lookup first: a match of copy_min tokens or more drafts its continuation
            copied = ngram_lookup(tokens, copy, max(3, self.copy_min), self.copy_min)
            if copied:
                return Draft(torch.tensor(copied, dtype=torch.long), sources=(STATISTICAL,) * len(copied))
        if choice.length == 0:  # a copy alone was asked for, and there is none
            return Draft(torch.zeros(0, dtype=torch.long))
        if self.cache is None or (self._graphs is not None and self._slot_for != cache.k.shape[2]):
            self.cache = self._new_cache(state, len(tokens), device)
        start = min(self.cache.length, n - 1)  # rows start .. n-1 are new (the last one at least)
        if self.lookups.done > n:  # the target rewound past what was registered (a race's blocks): index again
            self.lookups = NgramIndex(self.head.shape.lookup)
        looks = []
        for j in range(start, n):  # row j sees the n-grams ending at 0 .. j, as in training
            self.lookups.register(tokens, j + 1)
            looks.append(self.lookups.lookup(tokens, j))
        g, logits = self._level(step.fuse(features[start:n]), tokens[start + 1:n + 1], looks, start, last=True)
        g = g[-1:]
        self.cache.length = n
        if self.tree is not None and getattr(state.backbone, "verifies_trees", False):
            return self._tree(state, g, logits, choice.length)
        drafted, qs = [], []
        threshold = cfg.confidence_threshold
        row = n - 1
        context = list(tokens)
        for j in range(choice.length):
            logits = logits[0]  # [V' + E]: the vocabulary's rows
            if cfg.greedy:
                tok = int(self.vocab.ids[int(logits.argmax())])
                conf = float(torch.softmax(logits, -1).max()) if threshold else None
            else:
                q = warp_probs(self.vocab.expand_logits(logits), cfg.temperature, cfg.top_k, cfg.top_p)
                tok = sample_token(q, state.generator)
                qs.append(q)
                conf = float(q.max()) if threshold else None
            drafted.append(tok)
            if j + 1 == choice.length or (threshold and conf < threshold):
                break
            context.append(tok)
            row += 1
            g, logits = self._level(g, [tok], [self.lookups.lookup(context, row)], row, last=True)
        return Draft(torch.tensor(drafted, dtype=torch.long, device=device), torch.stack(qs) if qs else None)

    def _tree(self, state: DecodeState, g: torch.Tensor, first: torch.Tensor, depth: int) -> Draft:
        """A tree draft of at most ``depth`` levels (:class:`TreeShape`) from the head's output ``g``
        (``[1, H]``) at the pending token's row and its logits ``first`` (``[1, V' + E]``).

        Every candidate is a token, its parent candidate (-1: the pending token) and its score, the
        log-probability of its path under the head. A level's ``width`` best candidates run through the
        head together (one step of ``width`` rows, each seeing the committed rows and its own ancestors'),
        and each row's ``width`` best next tokens become the next level's candidates. The ``nodes`` best
        candidates (ties: the earlier) are the draft, by level and, among siblings, best first."""
        width, budget = self.tree.width, self.tree.nodes
        tokens = state.tokens
        n = state.cache.length  # the pending token's position; the head's rows 0 .. n-1 are committed
        device = g.device
        toks: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        slot: dict[int, int] = {}  # a candidate whose row was computed -> its slot in the head's cache
        path: dict[int, list[int]] = {-1: []}  # a candidate -> the candidates from the first level to it

        def expand(logits: torch.Tensor, parents: list[int]) -> None:
            logp = torch.log_softmax(logits, -1)
            best = logp.topk(min(width, logp.shape[-1]), -1)
            ids = self.vocab.ids[best.indices.to(self.vocab.ids.device)].tolist()  # one read for the level
            for r, p in enumerate(parents):
                base = score[p] if p >= 0 else 0.0
                for lp, tok in zip(best.values[r].tolist(), ids[r]):
                    c = len(toks)
                    toks.append(tok)
                    parent.append(p)
                    score.append(base + lp)
                    path[c] = path[p] + [c]

        expand(first, [-1])
        frontier = list(range(len(toks)))
        at = n  # the next free slot of the head's cache
        outs: dict[int, torch.Tensor] = {-1: g[0]}
        for level in range(2, depth + 1):
            rows = len(frontier)
            contexts = [list(tokens) + [toks[c] for c in path[f]] for f in frontier]
            looks = [self.lookups.lookup(ctx, n - 2 + level) for ctx in contexts]
            for r, f in enumerate(frontier):
                slot[f] = at + r
            seen = [[slot[c] - n for c in path[f]] for f in frontier]  # each row: its ancestors and itself
            u = torch.stack([outs[parent[f]] for f in frontier])
            out, logits = self._level(u, [toks[f] for f in frontier], looks, at, n, [n - 2 + level] * rows, seen)
            at += rows
            for r, f in enumerate(frontier):
                outs[f] = out[r]
            made = len(toks)
            expand(logits, frontier)
            new = range(made, len(toks))
            frontier = sorted(sorted(new, key=lambda c: -score[c])[:width])
        best = sorted(range(len(toks)), key=lambda c: -score[c])[:budget]
        if self.tree.min_prob > 0:  # the main chain stays (the bandit chose its depth); unlikely alternatives go
            floor = math.log(self.tree.min_prob)
            main = set(tree_first_path(parent))
            best = [c for c in best if score[c] >= floor or c in main]
        kept = sorted(best, key=lambda c: (len(path[c]), c))  # by level, then as made (siblings best first)
        order = {c: i for i, c in enumerate(kept)}
        return Draft(torch.tensor([toks[c] for c in kept], dtype=torch.long, device=device),
                     parents=tuple(order[parent[c]] if parent[c] >= 0 else -1 for c in kept))

    def describe(self) -> dict:
        out = {"name": self.name, "layers": list(self.head.shape.layers), "draft_vocab": len(self.vocab)}
        if self.tree is not None:
            out["tree"] = asdict(self.tree)
        return out
