"""Cascade drafting (CS Drafting): the statistical drafter under and after the layer-skip drafter.

Two ways of combining a cheap statistical drafter (prompt lookup + bigram table, no forward) with
the layer-skip drafter (the target with sublayers skipped):

* **vertical**: the layer-skip drafter does not decode its draft one token per forward. The
  statistical drafter proposes a continuation and the skipped model checks it in *one* forward,
  keeping the longest prefix it agrees with plus its own token at the first disagreement (or after
  the last). A forward of up to ~9 tokens costs about one token's on this hardware, so every
  agreed proposal is a draft token for free. ``lenience`` >= 1 loosens this intermediate check
  (a proposal is kept when ``lenience * q(x) >= max q`` in greedy mode); the top-level check by
  the full model stays exact, so the output does not change, only how much is accepted.
* **horizontal**: draft positions ``0 .. split-1`` come from the layer-skip level (vertical or
  token by token), the rest from the statistical drafter alone. Later positions are less likely to
  be accepted at all, so they go to the drafter that costs nothing.

Sampling stays exact: every draft token comes with the distribution it was actually drawn from
(``q'`` below), and the verifier's speculative sampling corrects against the target ``p``. At the
intermediate level a statistical proposal ``x`` (a point mass) is kept with probability
``a = min(1, lenience * q(x))``, otherwise a token is drawn from ``q`` without ``x``; the token
is then distributed as ``q'(x) = a``, ``q'(y) = (1 - a) q(y) / (1 - q(x))`` (``q' = q`` at
``lenience = 1``). Statistical tail tokens are point masses.
"""

from __future__ import annotations

import torch

from adaptive.codec import record
from adaptive.drafters.head import DraftHead
from adaptive.drafters.ngram import DEFAULT_BIGRAM_MIN_PROB, NgramDrafter
from adaptive.engine.protocol import LAYER_SKIP, STATISTICAL, DecodeState, Draft, DraftChoice, Drafter
from adaptive.engine.sampling import sample_token, warp_probs
from adaptive.engine.skip import SkipSet


@record
class CascadePlan:
    """How a domain's cascade drafts (chosen at calibration; the online bandit may move the split).

    ``split``: draft positions given to the layer-skip level (0: statistical drafter only).
    ``draft_len``: tokens per step when the draft length is fixed. ``vertical``: the layer-skip
    level checks statistical proposals in one forward. ``lenience``: >= 1, see the module doc.
    ``min_prob``: where a bigram chain stops. ``max_split``: the most positions the online
    bandit may give to the layer-skip level (0 when the domain's skip set cannot draft).
    """

    split: int = 0
    draft_len: int = 8
    vertical: bool = True
    lenience: float = 1.0
    min_prob: float = DEFAULT_BIGRAM_MIN_PROB
    max_split: int = 2

    def __post_init__(self):
        if self.draft_len < 1:
            raise ValueError(f"cascade draft_len must be >= 1, got {self.draft_len}")
        if not 0 <= self.split <= self.draft_len or not 0 <= self.max_split <= 64:
            raise ValueError("cascade split must be in 0 .. draft_len and max_split in 0 .. 64, "
                             f"got {self.split}, {self.max_split}")
        if not self.lenience >= 1.0:
            raise ValueError(f"lenience must be >= 1, got {self.lenience}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob}")


def lenient_greedy_accept(proposal: torch.Tensor, logits: torch.Tensor, lenience: float = 1.0) -> tuple[int, int]:
    """The intermediate (layer-skip) check of a statistical proposal, greedy.

    ``proposal``: ``[m]`` ids; ``logits``: ``[m + 1, V]`` the skipped model's logits at the position
    of each proposed token and after the last. Proposal ``j`` is kept while
    ``lenience * q_j(x_j) >= max q_j`` (``q = softmax(logits)``; at ``lenience = 1``: ``x_j`` is
    the argmax). Returns ``(n_kept, next_token)``, the next token being the argmax after the kept
    prefix.

    Example: ``q_0 = [0.6, 0.3, 0.1]``, ``q_1 = [0.2, 0.5, 0.3]``, ``q_2 = [0.1, 0.1, 0.8]``,
    proposal ``[1, 1]``: at lenience 1, 0.3 < 0.6 -> ``(0, 0)``; at lenience 2, 0.6 >= 0.6 and
    1.0 >= 0.5 -> ``(2, 2)``.
    """
    m = proposal.shape[0]
    if lenience == 1.0:
        ok = proposal == logits[:m].argmax(-1)
    else:
        q = torch.softmax(logits[:m].float(), -1)
        rows = torch.arange(m, device=logits.device)
        ok = lenience * q[rows, proposal] >= q.max(-1).values * (1 - 1e-6)  # a tie at the bound is kept
    bad = (~ok).nonzero()
    n = int(bad[0, 0]) if bad.numel() else m
    return n, int(logits[n].argmax())


def lenient_point_mass(
    q: torch.Tensor, x: int, lenience: float = 1.0
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """Keep a point-mass proposal ``x`` against the draft distribution ``q`` (``[V]``), leniently.

    Returns ``(a, q_eff, rest)``: ``x`` is kept with probability ``a = min(1, lenience * q(x))``;
    otherwise the token is drawn from ``rest`` (``q`` without ``x``, renormalised; ``None`` when
    ``q(x) = 1``). The token so produced is distributed as ``q_eff``, which the verifier needs.

    Example: ``q = [0.5, 0.3, 0.2]``, ``x = 1``: lenience 1 -> ``a = 0.3``, ``rest = [5/7, 0, 2/7]``,
    ``q_eff = q``; lenience 2 -> ``a = 0.6``, ``q_eff = [0.4/0.7 * 0.5, 0.6, 0.4/0.7 * 0.2] =
    [0.286, 0.6, 0.114]``.
    """
    qx = float(q[x])
    a = min(1.0, lenience * qx)
    if qx >= 1.0:
        return 1.0, q, None
    rest = q.clone()
    rest[x] = 0.0
    rest = rest / rest.sum()
    q_eff = rest * (1.0 - a)
    q_eff[x] = a
    return a, q_eff, rest


class CascadeDrafter(Drafter):
    """A horizontal cascade whose first level is a vertical cascade (see the module doc).

    ``statistical``: the bottom drafter (an :class:`NgramDrafter`, usually with the domain's bigram
    table). ``skip``: the layer-skip level's skip set (``None``: statistical only). ``split``: the
    layer-skip positions when the step's :class:`DraftChoice` names none (a policy such as
    :class:`~adaptive.runtime.bandit.ThompsonCascade` chooses it per step). Each draft says where
    each token came from (``Draft.sources``) and how many layer-skip forwards it took.
    ``head``: the layer-skip level's reduced-vocabulary head (:class:`DraftHead`), if any.
    The drafter keeps no state between proposals.
    """

    name = "cascade"

    def __init__(self, statistical: NgramDrafter, skip: SkipSet | None = None, n_layers: int | None = None,
                 split: int = 1, vertical: bool = True, lenience: float = 1.0, head: DraftHead | None = None):
        if skip is not None and not (skip.attn or skip.mlp):
            raise ValueError("the cascade's layer-skip level needs a non-empty skip set (or none at all)")
        if skip is not None and n_layers is None:
            raise ValueError("n_layers is needed to validate the skip set")
        if lenience < 1.0:
            raise ValueError(f"lenience must be >= 1, got {lenience}")
        if split < 0:
            raise ValueError(f"split must be >= 0, got {split}")
        self.statistical = statistical
        self.skip = skip.validate_for(n_layers) if skip is not None else None
        self.masks = skip.masks(n_layers) if skip is not None else None
        self.split = split if skip is not None else 0
        self.vertical = vertical
        self.lenience = float(lenience)
        self.head = head

    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        max_len = choice.length
        bb, cfg = state.backbone, state.config
        pos = state.position
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []
        sampling = not cfg.greedy
        split = self.split if choice.split is None else choice.split
        h = min(split, max_len) if self.masks is not None else 0
        forwards = 0
        while len(drafted) < h:
            ctx = state.tokens + drafted
            room = max_len - len(drafted) - 1  # one slot is the skipped model's own token
            guess = self.statistical.lookup(ctx, room) if self.vertical and room > 0 else []
            inp = torch.tensor([ctx[-1]] + guess, device=bb.device)
            logits = bb.forward(inp, state.cache, pos + len(drafted), skip_masks=self.masks, logits="all",
                                head=None if self.head is None else self.head.weight).logits
            if self.head is not None:
                logits = self.head.expand_logits(logits)
            forwards += 1
            if not sampling:
                n, nxt = lenient_greedy_accept(inp[1:], logits, self.lenience)
                new = guess[:n] + [nxt]
            else:
                new = self._sample_level(guess, logits, cfg, state.generator, q_rows)
            drafted += new
        drafted = drafted[:max_len]
        q_rows = q_rows[:max_len]
        n_layer_skip = len(drafted)
        if len(drafted) < max_len:
            drafted += self.statistical.lookup(state.tokens + drafted, max_len - len(drafted))
        sources = (LAYER_SKIP,) * n_layer_skip + (STATISTICAL,) * (len(drafted) - n_layer_skip)
        tokens = torch.tensor(drafted, dtype=torch.long, device=bb.device)
        if not sampling:
            return Draft(tokens, None, sources, forwards)
        vocab = bb.vocab_size
        for t in drafted[n_layer_skip:]:  # statistical tail: point masses
            row = torch.zeros(vocab, device=bb.device)
            row[t] = 1.0
            q_rows.append(row)
        return Draft(tokens, torch.stack(q_rows) if q_rows else None, sources, forwards)

    def _sample_level(self, guess: list[int], logits: torch.Tensor, cfg, gen, q_rows: list) -> list[int]:
        """Speculative sampling of the statistical ``guess`` against the skipped model's ``q``."""
        q = warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [m + 1, V]
        out = []
        for j, x in enumerate(guess):
            a, q_eff, rest = lenient_point_mass(q[j], x, self.lenience)
            q_rows.append(q_eff)
            if float(torch.rand((), generator=gen, device=q.device)) < a:
                out.append(x)
                continue
            out.append(sample_token(rest, gen))
            return out
        q_rows.append(q[len(guess)])  # every proposal kept: the skipped model's own next token
        out.append(sample_token(q[len(guess)], gen))
        return out

    def describe(self) -> dict:
        d = {"name": self.name, "split": self.split, "vertical": self.vertical, "lenience": self.lenience,
             "statistical": self.statistical.describe()}
        if self.skip is not None:
            d["skip"] = self.skip.to_dict()
        if self.head is not None:
            d["draft_vocab"] = len(self.head)
        return d
