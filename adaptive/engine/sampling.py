"""Pure functions of speculative decoding: warping, greedy acceptance, speculative sampling.

Notation: ``p`` is the target (full model), ``q`` the draft. ``k`` drafted tokens are verified by
one target forward that yields ``k + 1`` rows of ``p`` (the last one for the bonus token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from adaptive.engine.batched import NOT_ACCEPTED, accept_greedy


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution(s) from ``logits`` (``[..., V]``) after temperature, top-k and top-p.

    Top-k keeps the ``top_k`` largest logits (0: all); top-p keeps the smallest set of most likely
    tokens whose mass reaches ``top_p`` (the token crossing the threshold is kept). Returns float32
    probabilities of the same shape. ``temperature`` must be > 0 here (0 means greedy, handled
    by the caller).

    Example: logits ``[2.0, 1.0, 0.0]``, T=1 -> ``[0.665, 0.245, 0.090]``; with ``top_k=1`` ->
    ``[1, 0, 0]``; with ``top_p=0.8`` -> the first two renormalised: ``[0.731, 0.269, 0]``.
    """
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from ``probs`` (``[V]``, non-negative, not necessarily normalised) by inverting its
    cumulative distribution (float64) at one uniform draw of ``generator``: the id ``i`` with
    ``cdf[i - 1] <= u * total < cdf[i]``, so a token of zero mass is never drawn. The distribution of
    ``torch.multinomial(probs, 1)``, at a tenth of its cost over a 49k vocabulary on the CPU (83 us
    against 1.0 ms on the 2-core EPYC: a sampled step on llama.cpp took ~10% longer than a greedy one).

    Example: ``probs = [0.1, 0.0, 0.6, 0.3]``: ``u = 0.05`` -> 0, ``u = 0.1`` -> 2 (token 1 has no mass),
    ``u = 0.95`` -> 3.
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(probs.shape[-1] - 1))


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix where draft == target argmax.

    ``draft``: ``[k]`` drafted ids; ``target_argmax``: ``[k + 1]`` argmax of ``p`` at each draft
    position and after the last. Returns ``(n_accepted, next_token)`` where ``next_token`` is the
    target's own token after the accepted prefix (the correction, or the bonus when all match).

    Example: draft ``[5, 7, 9]``, target argmax ``[5, 7, 2, 4]`` -> ``(2, 2)``: 5 and 7 are kept,
    9 is replaced by the target's 2. With target ``[5, 7, 9, 4]`` -> ``(3, 4)``: 4 is the bonus.
    """
    n, tokens = greedy_accept_ids(draft, target_argmax)
    return n, tokens[-1]


def greedy_accept_ids(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, list[int]]:
    """:func:`greedy_accept` with the step's new tokens: ``(n_accepted, ids)``, ``ids`` the ``n`` accepted
    drafts and the target's next token (``target_argmax[: n + 1]``, which equals them). The matching
    prefix is counted where the logits are (on the GPU) and one host read brings back the count and
    the argmax together. Example: draft ``[5, 7, 9]``, target ``[5, 7, 2, 4]`` -> ``(2, [5, 7, 2])``."""
    k = draft.shape[0]
    if k == 0:
        return 0, [int(target_argmax[0])]
    if draft.device.type == "cpu":  # a statistical draft: compared on the host after the one read
        return greedy_accept_host(draft.tolist(), target_argmax.tolist())
    match = (draft.to(target_argmax.device) == target_argmax[:k]).long().cumprod(0).sum().reshape(1)
    host = torch.cat([match, target_argmax]).tolist()  # the one read of the round
    n = host[0]
    return n, host[1:n + 2]


def greedy_accept_host(draft: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    """:func:`greedy_accept_ids` on host ints (a draft held on the host, the target's argmax read
    back): ``draft`` ``k`` ids, ``target_argmax`` ``k + 1``. Example: ``[5, 7, 9]``, ``[5, 7, 2, 4]`` ->
    ``(2, [5, 7, 2])``; ``[]``, ``[3]`` -> ``(0, [3])``."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafts need {len(draft) + 1} target rows, got {len(target_argmax)}")
    n = next((i for i, (d, t) in enumerate(zip(draft, target_argmax)) if d != t), len(draft))
    return n, target_argmax[:n + 1]


def greedy_accept_tree(draft: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]
                       ) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree draft (:attr:`~adaptive.engine.protocol.Draft.parents`) on host ints:
    from the pending token, follow the child whose token is the target's argmax at its parent, as far as
    one exists. ``target_argmax``: ``k + 1`` ids, row 0 the pending token's, row ``i + 1`` node ``i``'s.
    Returns the kept nodes (the path, in order) and the step's new tokens (the path's tokens, then the
    target's own token after it), as :func:`greedy_accept_host` for a chain.

    Example: tokens ``[5, 6, 7, 8]``, parents ``[-1, -1, 0, 1]`` (5 and 6 both follow the pending token,
    7 follows 5, 8 follows 6), argmax ``[6, 1, 2, 9, 4]``: the target wants 6 (node 1), then at node 1
    it wants 2, which no child of node 1 is -> nodes ``[1]``, new tokens ``[6, 2]``.
    """
    if len(target_argmax) != len(draft) + 1 or len(parents) != len(draft):
        raise ValueError(f"{len(draft)} tree drafts need {len(draft)} parents and {len(draft) + 1} target rows")
    children: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(draft, parents)):
        children.setdefault(p, {}).setdefault(int(tok), i)  # a repeated token: the first node stands
    path, at = [], -1
    while True:
        nxt = children.get(at, {}).get(int(target_argmax[at + 1]))
        if nxt is None:
            return path, [int(draft[i]) for i in path] + [int(target_argmax[at + 1])]
        path.append(nxt)
        at = nxt


def speculative_accept_tree(draft: Sequence[int], parents: Sequence[int], p: torch.Tensor,
                            generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Speculative sampling of a tree draft (SpecInfer's multi-candidate verification, each candidate a
    point mass): the output is distributed exactly as the target's ``p``. ``p``: ``[k + 1, V]`` the
    target distributions (warped), row 0 the pending token's, row ``i + 1`` node ``i``'s.

    At a node (first the pending token) its children are tried in order: child ``x`` is accepted with
    probability ``r(x)``, ``r`` the node's row of ``p`` at first; a rejected ``x`` leaves
    ``r = norm(r with x set to 0)`` for the next child (speculative sampling's residual for a point-mass
    proposal). An accepted child becomes the node; when none is, the next token is drawn from ``r``.
    Returns the kept nodes and the new tokens, as :func:`greedy_accept_tree`.

    Example: children ``[0, 1]`` of the pending token, ``p_0 = [0.5, 0.25, 0.25]``: token 0 is kept half
    the time; otherwise ``r = [0, 0.5, 0.5]`` and token 1 is kept half of those times; otherwise token 2
    is drawn: each a quarter or a half of the time, as ``p_0`` says.
    """
    if p.shape[0] != len(draft) + 1 or len(parents) != len(draft):
        raise ValueError(f"{len(draft)} tree drafts need {len(draft)} parents and {len(draft) + 1} target rows")
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path, at = [], -1
    while True:
        r, kept = p[at + 1].clone(), None
        for c in children.get(at, ()):
            x = int(draft[c])
            if float(torch.rand((), generator=generator, device=r.device)) < float(r[x]):
                kept = c
                break
            r[x] = 0.0
            total = r.sum()
            if total <= 0:  # all of r's mass was on rejected tokens (rounding): draw from p itself
                r = p[at + 1].clone()
                break
            r /= total
        if kept is None:
            return path, [int(draft[i]) for i in path] + [sample_token(r, generator)]
        path.append(kept)
        at = kept


def greedy_accept_batch(drafts: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[tuple[int, list[int]]]:
    """:func:`greedy_accept_ids` of several requests at once, with one host read for all of them:
    ``drafts[i]`` ``[k_i]`` ids (on any device), ``targets[i]`` the target's argmax at its ``k_i + 1``
    rows (all on one device); the matching prefixes are counted there for the whole batch
    (:func:`~adaptive.engine.batched.accept_greedy`). Example: drafts ``[5, 7, 9]`` and ``[]``, targets
    ``[5, 7, 2, 4]`` and ``[3]`` -> ``[(2, [5, 7, 2]), (0, [3])]``."""
    if len(drafts) != len(targets) or not targets:
        raise ValueError(f"{len(drafts)} drafts for {len(targets)} targets")
    dev = targets[0].device
    target = pad_sequence(list(targets), batch_first=True)  # [B, R]
    B, R = target.shape
    if R > 1:
        draft = pad_sequence([d.to(dev) for d in drafts] + [torch.zeros(R - 1, dtype=torch.long, device=dev)],
                             batch_first=True)[:B]  # [B, R - 1]: the zeros row makes every row R - 1 wide
    else:
        draft = torch.zeros(B, 0, dtype=torch.long, device=dev)
    counts = torch.tensor([d.numel() for d in drafts], device=dev)
    rows = accept_greedy(target, draft, counts).tolist()  # the one read
    out = []
    for row in rows:
        ids = row[:row.index(NOT_ACCEPTED)] if NOT_ACCEPTED in row else row
        out.append((len(ids) - 1, ids))
    return out


def speculative_accept(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al.; Chen et al.): the output is distributed exactly as ``p``.

    ``draft``: ``[k]`` ids sampled from ``q``; ``q``: ``[k, V]`` the draft distributions they were
    sampled from; ``p``: ``[k + 1, V]`` the target distributions (same warping). Draft token ``x_i``
    is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the next
    token is drawn from the residual ``norm(max(0, p_i - q_i))``; if all ``k`` are accepted the bonus
    is drawn from ``p_k``. Returns ``(n_accepted, next_token)``.

    Example: ``q_0 = [0.5, 0.5]``, ``p_0 = [1.0, 0.0]``, draft ``[1]``: ``p/q = 0`` so token 1 is
    always rejected and the residual ``[0.5, 0] / 0.5 = [1, 0]`` yields token 0: ``(0, 0)``.
    """
    k = draft.shape[0]
    if k:
        rows = torch.arange(k, device=draft.device)
        p_x = p[rows, draft]
        q_x = q[rows, draft]
        u = torch.rand(k, generator=generator, device=p.device)
        # accept iff u * q(x) <= p(x), i.e. u <= p/q without dividing by a zero q.
        rejected = (u * q_x > p_x).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
            residual = (p[n] - q[n]).clamp_min(0.0)
            total = residual.sum()
            if total <= 0:  # p == q up to rounding: the residual is empty, fall back to p itself
                residual = p[n]
            return n, sample_token(residual, generator)
    return k, sample_token(p[k], generator)
