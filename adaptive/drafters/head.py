"""Reduced-vocabulary draft heads (FR-Spec, made domain-aware): the drafter's LM head over a subset.

Every draft token pays the LM head over the whole vocabulary (49k rows on the embedded model),
whatever sublayers are skipped. A domain's text uses a small part of the vocabulary, so the
drafter computes logits only over the domain's most frequent tokens, joined with the request's
own prompt tokens (the likeliest to be copied). Verification keeps the full vocabulary: a token
outside the subset is simply never drafted, so greedy output is unchanged, and in sampling the
draft distribution ``q`` is zero outside the subset, which speculative sampling handles exactly.

Pure functions (:func:`rank_tokens`, :func:`coverage_curve`) serve calibration; :class:`DraftHead`
is what a drafter uses at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def rank_tokens(sequences: Sequence[Sequence[int]], vocab_size: int | None = None) -> np.ndarray:
    """Token ids by descending frequency over ``sequences`` (ties: smaller id first), then, with
    ``vocab_size``, every other id of the vocabulary in id order.

    A domain's calibration text is small (a few thousand tokens), so its own counts rank only
    the few hundred ids it contains; the rest are ordered by id, which for byte-level BPE
    vocabularies (Llama, Qwen, SmolLM) is merge order: roughly frequency in the tokenizer's own
    training corpus, a sensible prior for the ids the domain's sample did not show.
    Example: ``[[5, 3, 5], [3, 5, 9]]``: 5 three times, 3 twice, 9 once -> ``[5, 3, 9]``; with
    ``vocab_size = 8`` -> ``[5, 3, 9, 0, 1, 2, 4, 6, 7]``.
    """
    flat = np.concatenate([np.asarray(list(s), dtype=np.int64) for s in sequences] or [np.zeros(0, np.int64)])
    ranked = np.zeros(0, np.int64)
    if flat.size:
        ids, counts = np.unique(flat, return_counts=True)  # ids ascending
        ranked = ids[np.argsort(-counts, kind="stable")]  # stable: equal counts keep ascending ids
    if vocab_size is None:
        return ranked
    rest = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), ranked, assume_unique=False)  # sorted
    return np.concatenate([ranked, rest])


def coverage_curve(texts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], sizes: Sequence[int],
                   vocab_size: int | None = None) -> dict:
    """Leave-one-out coverage: the share of ``targets[i]``'s tokens among the top ``V`` of a ranking
    built from every ``texts[j]``, ``j != i``; pooled over ``i``, for each ``V`` in ``sizes``.

    ``texts[i]`` is what the ranking may learn from (a prompt and the model's continuation of
    it); ``targets[i]`` what a drafter would have to produce (the continuation); ``vocab_size``
    fills the ranking as :func:`rank_tokens` does. Example: texts
    ``[[1, 1, 2], [1, 3]]``, targets ``[[1, 2], [3]]``, ``V = 1``: for 0 the ranking of ``[1, 3]``
    is ``[1, 3]`` and covers 1 of ``[1, 2]``; for 1 the ranking of ``[1, 1, 2]`` is ``[1, 2]`` and
    covers none of ``[3]``: 1 of 3 -> ``{1: 0.333}``.
    """
    if len(texts) != len(targets):
        raise ValueError("one target sequence per text")
    hit = {v: 0 for v in sizes}
    total = 0
    for i, tgt in enumerate(targets):
        ranking = rank_tokens([t for j, t in enumerate(texts) if j != i], vocab_size)
        tgt = np.asarray(list(tgt), dtype=np.int64)
        total += tgt.size
        # position of each target token in the ranking (absent: beyond any size)
        pos = {int(t): r for r, t in enumerate(ranking)}
        where = np.array([pos.get(int(t), 1 << 62) for t in tgt], dtype=np.int64)
        for v in sizes:
            hit[v] += int((where < v).sum())
    return {v: round(hit[v] / total, 4) if total else 0.0 for v in sizes}


@dataclass(frozen=True, eq=False)
class DraftHead:
    """A drafter's LM head restricted to ``ids`` (``[V']``, distinct): ``weight`` is ``[V', hidden]``.

    Built once per request from the domain's precomputed rows plus the prompt's extra tokens;
    :meth:`expand_logits` turns logits over the subset into logits over the full vocabulary (``-inf``
    elsewhere: probability zero).
    """

    ids: torch.Tensor
    weight: torch.Tensor
    vocab_size: int

    @classmethod
    def build(cls, lm_head, domain_ids: torch.Tensor, domain_rows: torch.Tensor | None = None,
              extra: Sequence[int] = ()) -> DraftHead:
        """``lm_head``: ``[V, hidden]``, or a backbone, whose ``head_rows(ids)`` gives the rows (read from
        its GGUF file where it holds no table) and ``vocab_size`` the ``V``; ``domain_ids``: ``[Vd]`` the
        domain's subset (``domain_rows`` its rows, precomputed, or gathered here); ``extra``: further ids
        (the prompt's), deduplicated."""
        if isinstance(lm_head, torch.Tensor):
            rows_of, vocab = lm_head.__getitem__, int(lm_head.shape[0])
        else:
            rows_of, vocab = lm_head.head_rows, int(lm_head.vocab_size)
        rows = domain_rows if domain_rows is not None else rows_of(domain_ids)
        if len(extra):
            extra_t = torch.unique(torch.as_tensor(list(extra), dtype=torch.long, device=domain_ids.device))
            extra_t = extra_t[~torch.isin(extra_t, domain_ids)]
            if extra_t.numel():
                domain_ids = torch.cat([domain_ids, extra_t])
                rows = torch.cat([rows, rows_of(extra_t).to(rows.dtype)])
        return cls(domain_ids, rows.contiguous(), vocab)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def expand_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V']`` logits over the subset -> ``[..., V]`` with ``-inf`` outside it.

        Everything downstream (argmax, warping, speculative sampling) then works on the full
        vocabulary unchanged: tokens outside the subset get probability 0 in ``q``. The scatter
        costs about 0.05 ms against a ~20 ms draft forward; the head itself is never gathered per step.
        """
        full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        full[..., self.ids] = logits
        return full
