"""The one module that touches a Hugging Face model's internals.

:class:`Backbone` runs the decoder's own modules (embeddings, norms, projections, rotary
embedding, MLPs, LM head) in a forward of our own so that the engine can

* skip any attention or MLP sublayer per call (a skipped sublayer adds nothing to the residual);
* keep the KV cache in preallocated tensors written *by position* (gpt-fast style): rolling back
  a rejected draft is setting an integer, and the layers a draft skipped, which wrote no keys for
  the drafted positions, are simply overwritten by the verification forward that follows;
* compute LM-head logits only at the positions that need them.

Supported layouts: Llama, Qwen2 and Mistral families (``model.model.layers[i]`` with
``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp``), as in
transformers 5.x. Anything else is refused with :class:`UnsupportedModelError` at construction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptive.errors import PromptTooLongError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def decoder_layers(model) -> list:
    """The list of decoder layers of a causal LM (``model.model.layers``)."""
    try:
        return list(model.model.layers)
    except AttributeError:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no model.model.layers; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


@dataclass
class KVCache:
    """Keys and values of every layer, written by absolute position.

    ``k``, ``v``: ``[n_layers, n_kv_heads, max_len, head_dim]`` (batch size 1).
    ``length``: number of leading positions that hold the *full* model's keys. Positions beyond it
    may hold a draft's keys (from the layers the draft ran) and are overwritten before being trusted.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@dataclass
class ForwardOutput:
    """Result of :meth:`Backbone.forward`.

    ``logits``: ``[n_logit_positions, vocab]`` in float32 (``None`` if no logits were asked for).
    ``pooled``: ``[hidden]`` mean of the final-norm hidden states over the fed positions, float32
    (only when ``pool=True``; used as the prompt embedding for routing).
    """

    logits: torch.Tensor | None
    pooled: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # [T, hidden]: the residual stream before the adapter and final norm


class Backbone:
    """Functional forward over a Hugging Face decoder with per-call sublayer skipping."""

    def __init__(self, model):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {getattr(cfg, 'model_type', None)!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        self.config = cfg
        self.layers = decoder_layers(model)
        for i, layer in enumerate(self.layers):
            for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                if not hasattr(layer, name):
                    raise UnsupportedModelError(f"decoder layer {i} has no {name}: unsupported layout")
            if hasattr(layer.self_attn, "q_norm"):
                raise UnsupportedModelError("attention with q/k norms (Qwen3-style) is not supported yet")
        self.n_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scaling = attn0.scaling
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary = model.model.rotary_emb
        self._apply_rotary = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        window = getattr(cfg, "sliding_window", None)
        if window and (cfg.model_type != "qwen2" or getattr(cfg, "use_sliding_window", False)):
            self.max_positions = min(self.max_positions, int(window))
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._full = ((False,) * self.n_layers, (False,) * self.n_layers)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_len: int) -> KVCache:
        """A cache for ``max_len`` positions; :class:`PromptTooLongError` beyond the model's context."""
        if max_len > self.max_positions:
            raise PromptTooLongError(
                f"prompt plus new tokens need {max_len} positions but the model's context is {self.max_positions}"
            )
        shape = (self.n_layers, self.n_kv_heads, max_len, self.head_dim)
        return KVCache(
            k=torch.zeros(shape, dtype=self.dtype, device=self.device),
            v=torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions ``[start, end)``: ``[1, end-start, head_dim]`` each, from a table."""
        if self._rope_cache is None or self._rope_cache[0].shape[1] < end:
            have = 0 if self._rope_cache is None else self._rope_cache[0].shape[1]
            n = max(end, min(max(256, 2 * have), self.max_positions))  # grow geometrically
            pos = torch.arange(n, device=self.device).unsqueeze(0)
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            self._rope_cache = self.rotary(probe, pos)
        cos, sin = self._rope_cache
        return cos[:, start:end], sin[:, start:end]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        start: int,
        skip_masks: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None,
        logits: str = "last",
        pool: bool = False,
        head: torch.Tensor | None = None,
        read_only: bool = False,
        adapter=None,
        hidden: bool = False,
    ) -> ForwardOutput:
        """Run tokens ``input_ids`` (``[T]`` or ``[1, T]``) at positions ``start .. start+T-1``.

        Keys/values of the layers that run are written at those positions; the cache must hold
        valid keys for ``0 .. start-1``. ``skip_masks`` is ``SkipSet.masks(n_layers)`` (``None``:
        full model). ``logits`` is ``"last"``, ``"all"`` or ``"none"``. ``head`` optionally replaces
        the LM-head weight (``[V', hidden]``) for reduced-vocabulary drafting.
        Does not change ``cache.length``: the caller owns acceptance and rollback.
        ``read_only=True`` writes nothing: every query attends to the keys already in the cache at
        ``0 .. its own position`` (the calibrator scores drafts against full-model keys this way).
        ``adapter`` (a module ``[1, T, hidden] -> [1, T, hidden]``, e.g. an early-exit block) is applied
        to the residual stream before the final norm. ``hidden=True`` also returns that residual stream
        as it was before the adapter (``ForwardOutput.hidden``, ``[T, hidden]``; distillation data).
        """
        ids = input_ids.reshape(1, -1)
        T = ids.shape[1]
        end = start + T
        if end > cache.max_len:
            raise PromptTooLongError(f"positions up to {end} exceed the cache of {cache.max_len}")
        skip_attn, skip_mlp = skip_masks or self._full
        cos, sin = self._rope(start, end)
        mask = None
        if T > 1:
            # Query t (absolute start+t) may see keys 0..start+t.
            q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
            k_pos = torch.arange(end, device=self.device).unsqueeze(0)
            mask = k_pos <= q_pos
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            if not skip_attn[i]:
                h = h + self._attention(layer.self_attn, layer.input_layernorm(h), cache, i, start, end, cos, sin, mask,
                                        read_only)
            if not skip_mlp[i]:
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        residual = h[0] if hidden else None
        if adapter is not None:
            h = adapter(h)
        h = self.norm(h)
        pooled = h[0].float().mean(dim=0) if pool else None
        if logits == "none":
            return ForwardOutput(None, pooled, residual)
        hs = h[0, -1:] if logits == "last" else h[0]
        weight = self.lm_head.weight if head is None else head
        out = F.linear(hs, weight, self.lm_head.bias if head is None else None)
        return ForwardOutput(out.float(), pooled, residual)

    def _attention(self, attn, x, cache: KVCache, i: int, start: int, end: int, cos, sin, mask, read_only=False):
        T = x.shape[1]
        q = attn.q_proj(x).view(1, T, self.n_heads, self.head_dim).transpose(1, 2)
        if read_only:
            k = torch.zeros(1, self.n_kv_heads, T, self.head_dim, dtype=q.dtype, device=q.device)
            q, _ = self._apply_rotary(q, k, cos, sin)
        else:
            k = attn.k_proj(x).view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._apply_rotary(q, k, cos, sin)
            cache.k[i, :, start:end] = k[0]
            cache.v[i, :, start:end] = v[0]
        keys = cache.k[i, :, :end].unsqueeze(0)
        vals = cache.v[i, :, :end].unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, scale=self.scaling, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))

    @property
    def norm_eps(self) -> float:
        """The final RMSNorm's epsilon (for the functional norm distillation trains through)."""
        return float(getattr(self.norm, "variance_epsilon", getattr(self.norm, "eps", 1e-6)))

    def mlp_weights(self, i: int) -> dict:
        """Layer ``i``'s pre-MLP norm and gated MLP weights (``norm [H]``, ``gate``/``up [I, H]``,
        ``down [H, I]``) and activation name: what an early-exit block is initialised from."""
        layer = self.layers[i]
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not hasattr(mlp, name):
                raise UnsupportedModelError(f"decoder layer {i}'s MLP has no {name}: not a gated MLP")
        return {"norm": layer.post_attention_layernorm.weight, "gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight,
                "down": mlp.down_proj.weight, "act": str(getattr(self.config, "hidden_act", "silu"))}

    @torch.inference_mode()
    def sublayer_influence(self, input_ids: torch.Tensor, from_position: int = 0) -> torch.Tensor:
        """How much each sublayer changes the residual stream: ``[2, n_layers]`` float32.

        Row 0 is attention, row 1 the MLP; each value is ``1 - cos(h_in, h_in + f(h_in))`` averaged
        over positions ``from_position ..`` of one full-model forward of ``input_ids`` (``[T]``).
        A sublayer with a small value barely turns the hidden state: a cheap prior on which
        sublayers a draft can skip (the calibrator's ranked search space).
        """
        ids = input_ids.reshape(1, -1)
        T = ids.shape[1]
        cache = self.new_cache(T)
        cos, sin = self._rope(0, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril() if T > 1 else None
        out = torch.zeros(2, self.n_layers)

        def turn(a, b):
            cos = F.cosine_similarity(a[0, from_position:].float(), b[0, from_position:].float(), dim=-1)
            return float((1 - cos).mean())

        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            nh = h + self._attention(layer.self_attn, layer.input_layernorm(h), cache, i, 0, T, cos, sin, mask)
            out[0, i] = turn(h, nh)
            h = nh + layer.mlp(layer.post_attention_layernorm(nh))
            out[1, i] = turn(nh, h)
        return out
