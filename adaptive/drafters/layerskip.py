"""Self-speculative drafting: the target model itself with some sublayers skipped."""

from __future__ import annotations

import torch

from adaptive.drafters.head import DraftHead
from adaptive.engine.protocol import DecodeState, Draft, DraftChoice, Drafter
from adaptive.engine.sampling import warp_probs
from adaptive.engine.skip import SkipSet


class LayerSkipDrafter(Drafter):
    """Drafts token by token with ``skip``'s sublayers left out, sharing the target's KV cache.

    Each draft forward writes keys for the layers it runs at the drafted positions; the
    verification forward rewrites all layers there. With ``confidence_threshold`` set in the
    generation config, drafting stops after a token whose top draft probability is below it.
    With ``head`` (a :class:`DraftHead`), logits are computed over that vocabulary subset only.
    """

    name = "ssd"
    adapter = None  # a module applied before the final norm (the early-exit drafter's exit block)

    def __init__(self, skip: SkipSet, n_layers: int, head: DraftHead | None = None):
        self.skip = skip.validate_for(n_layers)
        self.masks = skip.masks(n_layers)  # precomputed once: no per-step list building
        self.head = head

    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        max_len = choice.length
        bb, cfg = state.backbone, state.config
        pos = state.position
        token = torch.tensor([state.tokens[-1]], device=bb.device)
        tokens, qs = [], []
        threshold = cfg.confidence_threshold
        for j in range(max_len):
            logits = bb.forward(token, state.cache, pos + j, skip_masks=self.masks, logits="last",
                                head=None if self.head is None else self.head.weight,
                                adapter=self.adapter).logits[0]
            if self.head is not None:
                logits = self.head.expand_logits(logits)
            if cfg.greedy:
                token = logits.argmax().reshape(1)
                conf = torch.softmax(logits, -1).max() if threshold else None
            else:
                q = warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                token = torch.multinomial(q, 1, generator=state.generator)
                qs.append(q)
                conf = q.max() if threshold else None
            tokens.append(token)
            if threshold and float(conf) < threshold:
                break
        return Draft(torch.cat(tokens), torch.stack(qs) if qs else None)

    def describe(self) -> dict:
        d = {"name": self.name, "skip": self.skip.to_dict()}
        if self.head is not None:
            d["draft_vocab"] = len(self.head)
        return d
