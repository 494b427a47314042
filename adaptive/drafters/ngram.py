"""Statistical drafting: prompt lookup (CS Drafting's max-gram), at almost no cost per token.

The drafter looks for the longest suffix of the context (prompt + generated tokens) that occurred
earlier in it and proposes the tokens that followed that earlier occurrence. Summaries, answers
over a passage and translations copy a lot of their input, so such drafts are often right, and
proposing them costs a search over token ids, not a forward pass.
"""

from __future__ import annotations

import numpy as np
import torch

from adaptive.drafters.base import DecodeState, Draft, Drafter

DEFAULT_PLD_DRAFT_LEN = 8  # prompt-lookup drafts cost no forward: long drafts are cheap to try


def ngram_lookup(context, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix.

    Tries suffix lengths ``max_ngram`` down to ``min_ngram``; the first length that occurred
    earlier wins, and among its occurrences the latest one (recent text predicts best).

    Example: context ``[5, 6, 7, 8, 5, 6]``, ``k = 3``: the suffix ``[5, 6]`` occurred at 0, and
    ``[7, 8, 5]`` followed it -> ``[7, 8, 5]``. Context ``[1, 2, 3]``: nothing repeats -> ``[]``.
    """
    if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got {k}, {min_ngram}, {max_ngram}")
    arr = np.asarray(context, dtype=np.int64)
    n_tok = arr.shape[0]
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = arr[n_tok - n:]
        # windows starting at 0 .. n_tok-n-1 (the suffix's own position excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafts (a point mass on each proposed token; ``q`` is ``None``)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state: DecodeState, max_len: int) -> Draft:
        found = ngram_lookup(state.tokens, max_len, self.max_ngram, self.min_ngram)
        return Draft(torch.tensor(found, dtype=torch.long, device=state.backbone.device))

    def describe(self) -> dict:
        return {"name": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
