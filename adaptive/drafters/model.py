"""A separate (smaller) draft model sharing the target's tokenizer: standard speculative decoding.

The draft model keeps its own KV cache. Before each proposal it feeds the tokens it has not seen
(after a verification: the accepted tail and the target's own token; at the start: the prompt) in
one forward, then drafts token by token. Keys it wrote for rejected drafts are overwritten: its
cache is valid up to the longest common prefix of what it has processed and the current tokens.
"""

from __future__ import annotations

import torch

from adaptive.engine.protocol import DecodeState, Draft, DraftChoice, Drafter
from adaptive.engine.sampling import warp_probs
from adaptive.errors import ConfigError


def check_same_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """:class:`ConfigError` unless both tokenizers map the same strings to the same ids and both
    models' output rows cover the same vocabulary (speculative decoding compares token ids)."""
    if target_vocab != draft_vocab:
        raise ConfigError(f"the draft model's vocabulary has {draft_vocab} rows, the target's {target_vocab}: "
                          "a drafter must share the target's tokenizer")
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError("the draft model's tokenizer differs from the target's (different token ids): "
                          "a drafter must share the target's tokenizer")


class ModelDrafter(Drafter):
    """Drafts with ``draft_backbone`` (a :class:`~adaptive.engine.backbone.Backbone` of another model)."""

    name = "draft-model"

    def __init__(self, draft_backbone, label: str = "draft-model"):
        self.bb = draft_backbone
        self.label = label
        self._cache = None
        self._seen: list[int] = []  # tokens whose keys are in self._cache, in order

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` not yet in the cache; returns the logits after the last one (``[V]``)."""
        need = len(tokens) + 64
        if self._cache is None or self._cache.max_len < need:
            self._cache = self.bb.new_cache(max(need, 2 * len(tokens)))
            self._seen = []
        n = 0
        for a, b in zip(self._seen, tokens):
            if a != b:
                break
            n += 1
        n = min(n, len(tokens) - 1)  # always feed at least the last token, for its logits
        ids = torch.tensor(tokens[n:], device=self.bb.device)
        logits = self.bb.forward(ids, self._cache, n, logits="last").logits[0]
        self._seen = list(tokens)
        return logits

    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        max_len = choice.length
        cfg = state.config
        if self.bb.max_positions < len(state.tokens) + max_len:
            raise ConfigError("the draft model's context is shorter than the request")
        logits = self._sync(state.tokens)
        tokens, qs = [], []
        for j in range(max_len):
            if cfg.greedy:
                tok = logits.argmax().reshape(1)
            else:
                q = warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                tok = torch.multinomial(q, 1, generator=state.generator)
                qs.append(q)
            tokens.append(tok)
            if j + 1 < max_len:
                pos = len(self._seen)
                logits = self.bb.forward(tok.to(self.bb.device), self._cache, pos, logits="last").logits[0]
                self._seen.append(int(tok))
        return Draft(torch.cat(tokens).to(state.backbone.device), torch.stack(qs) if qs else None)

    def describe(self) -> dict:
        return {"name": self.name, "model": self.label}


def build_draft_model(config: dict, weights: dict, device, dtype):
    """The Backbone of a draft model rebuilt from its config (``PretrainedConfig.to_dict()``) and weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from adaptive.engine.backbone import Backbone

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ValueError(f"draft model weights do not fit its config (missing {missing}, unexpected {unexpected})")
    return Backbone(model.to(device=device, dtype=dtype).eval())
