"""The one module that touches a Hugging Face model's internals.

:class:`Backbone` runs the decoder's own modules (embeddings, norms, projections, rotary
embedding, MLPs, LM head) in a forward of our own so that the engine can

* skip any attention or MLP sublayer per call (a skipped sublayer adds nothing to the residual);
* keep the KV cache in preallocated tensors written *by position* (gpt-fast style): rolling back
  a rejected draft is setting an integer, and the layers a draft skipped, which wrote no keys for
  the drafted positions, are simply overwritten by the verification forward that follows;
* compute LM-head logits only at the positions that need them.

Supported layouts: Llama, Qwen2, Qwen3 and Mistral families (``model.model.layers[i]`` with
``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` (and Qwen3's per-head ``q_norm``/``k_norm``),
``post_attention_layernorm``, ``mlp``), as in transformers 5.x. Anything else is refused with
:class:`UnsupportedModelError` at construction.

On CUDA, forwards of up to 32 tokens that ask for logits only (plain, draft and verification
steps, short prefills) replay CUDA graphs of a static-shape step (:mod:`adaptive.engine.graphs`)
over caches from a pool of fixed-capacity slots; longer inputs, ``logits="none"``, pooled, hidden
or read-only forwards, another head and an adapter run this module's eager forward.

Why it runs past 600 lines: its one concern, the torch step over transformers' modules, takes a
forward, its batched form, the cache (with eagle feature rows and the prefix cache's copies), the
weights' layouts (dense, packed, int8/int4, rows read from a GGUF file) and the pooled embeddings
routing reads, all of which must see the same modules; the static CUDA step is :mod:`graphs`'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from adaptive.engine.batched import BATCH_BUCKETS, SlabSlot, batch_bucket
from adaptive.engine.config import check_feature_layers
from adaptive.engine.formulas import gated, rms_norm, rotate
from adaptive.engine.gguf_file import GGUFFormatError
from adaptive.engine.graphs import StepGraphs, zeros_kv
from adaptive.engine.prefix import KeptRows, PrefixStore
from adaptive.engine.quant import FLOAT_MODES, Linear, check_weights
from adaptive.engine.rows import HEAD_TABLE, TOKEN_TABLE, FileRows
from adaptive.engine.skip import SkipSet
from adaptive.errors import PromptTooLongError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


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

    ``k``, ``v``: ``[n_layers, n_kv_heads, max_len, head_dim]`` (batch size 1) in
    :attr:`Backbone.cache_dtype` (float32 on the CPU, where bf16 attention kernels are slow).
    ``length``: number of leading positions that hold the *full* model's keys. Positions beyond it
    may hold a draft's keys (from the layers the draft ran) and are overwritten before being trusted.
    ``limit``: the positions a request may use when the tensors are a larger pooled slot (CUDA
    graphs, :mod:`adaptive.engine.graphs`); 0: all of the tensors' positions. ``features``: see below.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    limit: int = 0
    # [max_len, len(feature_layers), hidden] (``None``: none kept): the residual stream after each of
    # ``feature_layers`` decoder layers (0: the embeddings), written at its positions by every
    # full-model forward over this cache (an eagle head drafts from them; a rollback costs nothing)
    features: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()
    # where the tensors live in a slab of a server's batch (CUDA graphs with slabs: adaptive.engine.batched),
    # so a batched step addresses this cache by index; None: tensors of their own, or a slot pool's
    slot: SlabSlot | None = None

    def release(self) -> None:
        """Nothing to give back early: the tensors go with the object, or back to the slot pool when it is
        collected (CUDA graphs); a llama.cpp cache frees its cells here."""

    @property
    def max_len(self) -> int:
        return self.limit or self.k.shape[2]


ATTN_BLOCK = 128  # queries per attention block in a long forward (a prefill); fewer attend at once
# queries from which a forward of a bf16 model on the CPU attends in bf16 over its float32 cache (a prefill,
# a prompt chunk): bf16 products ran 2.3-2.8x float32's there (128 queries over 1,000 keys: 1.39 against
# 3.68 ms; AVX512-BF16), where a verification's few rows run faster in float32 (Backbone.cache_dtype)
WIDE_ATTN_ROWS = 32


@dataclass(frozen=True)
class Segment:
    """One sequence's share of :meth:`Backbone.forward_batch`: token ids ``ids`` (``[T]``) fed at
    positions ``start .. start + T - 1`` of that sequence's own ``cache``; ``logits``: whether the
    forward returns its logits (a verification's segment does; a chunk of a prompt being prefilled
    beside the verifications, which only writes its keys, does not)."""

    ids: torch.Tensor
    cache: KVCache
    start: int
    logits: bool = True


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
    # {layer: [2, hidden]}: the final-normed residual stream after that many layers, mean over the
    # fed positions (row 0) and at the last one (row 1), float32 (``pool_layers``; routing studies)
    layer_pools: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the engine's step uses them, fused once at load.

    ``qkv``: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]`` (rows: queries, keys, values), so a
    step projects with one matrix product instead of three; ``gate_up``: ``[2 * intermediate, hidden]``
    likewise. The Hugging Face modules' own parameters are re-pointed at row slices of these, so
    the model holds one copy of its dense weights and ``model.generate`` still works. With
    quantized weights (:mod:`adaptive.engine.quant`) each :class:`Linear` holds the packed copy; with
    ``packed`` weights it holds the only copy (the modules' own tensors are released).
    """

    attn_norm: torch.Tensor  # [hidden]
    attn_eps: float
    qkv: Linear  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim, with Qwen2's biases
    o: Linear  # n_heads * head_dim -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    mlp_eps: float
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    act: object  # the MLP's activation module (SiLU for the supported families)
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's per-head RMSNorm of queries (None: none)
    k_norm: torch.Tensor | None = None  # [head_dim]: of keys
    qk_eps: float = 1e-6


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linear layers' weights (and biases) by rows and make each layer's parameters a
    view into the result: one copy in memory, one matrix product per step."""
    weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
    biases = [m.bias for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype,
                                                                          device=weight.device)
                          for m, b in zip(linears, biases)]).contiguous()
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None and m.bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    return weight, bias


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class Backbone:
    """Functional forward over a Hugging Face decoder with per-call sublayer skipping (the ``torch``
    engine; :class:`~adaptive.engine.llamacpp.LlamaCppBackbone` is the other one)."""

    engine = "torch"
    layer_skip = True  # sublayers can be skipped: layer-skip, early-exit and reduced-head drafters run here
    # A server's decoding steps carry its prompt chunks (forward_batch with logits=False segments):
    # measured 8% less time for a 128-token chunk and an 8-row step together than apart (bf16, CPU)
    carry_chunks = True
    shared_cache = False  # each cache holds its own positions (llama.cpp's share one context)
    # the top feature row (the residual stream after every layer) as it is, not scaled (FEATURE_TOPS)
    feature_top = "residual"

    def __init__(self, model, weights: str = "dense", graphs: bool = True, source: str | Path | None = None):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {getattr(cfg, 'model_type', None)!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # an inference engine: no weight records autograd, whatever the caller's grad mode (a step captured
        # with grad on recorded it: a cache that required grad, training graphs from Inductor, and on an H100
        # the embedded model's ar at ~600 instead of ~700 tok/s)
        model.requires_grad_(False)
        self.model = model
        self.config = cfg
        self.layers = decoder_layers(model)
        for i, layer in enumerate(self.layers):
            for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                if not hasattr(layer, name):
                    raise UnsupportedModelError(f"decoder layer {i} has no {name}: unsupported layout")
            if hasattr(layer.self_attn, "q_norm") != hasattr(layer.self_attn, "k_norm"):
                raise UnsupportedModelError(f"decoder layer {i} normalises only one of queries and keys")
            for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
                if not hasattr(layer.mlp, name):
                    raise UnsupportedModelError(f"decoder layer {i}'s MLP has no {name}: not a gated MLP")
        self.n_layers = len(self.layers)
        self.hidden_size = int(cfg.hidden_size)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scaling = attn0.scaling
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary = model.model.rotary_emb
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        window = getattr(cfg, "sliding_window", None)
        if window and (cfg.model_type not in ("qwen2", "qwen3") or getattr(cfg, "use_sliding_window", False)):
            self.max_positions = min(self.max_positions, int(window))
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._full = ((False,) * self.n_layers, (False,) * self.n_layers)
        self.weight_mode = check_weights(weights, self.device)
        self.weights = [self._layer_weights(layer, weights) for layer in self.layers]
        self.head = Linear.build(self.lm_head.weight, self.lm_head.bias, weights)
        # where the tables' rows come from: the tables, or (packed weights, a GGUF source) the file
        self._token_rows = self._head_rows = None
        if source is not None and self.weight_mode == "packed":
            self._rows_from_file(source)
        self.graphs = StepGraphs(self) if self.device.type == "cuda" and graphs else None
        self.prefixes = PrefixStore(0)  # finished requests' keys (:mod:`adaptive.engine.prefix`; no budget: off)
        # a wide forward (WIDE_ATTN_ROWS queries or more) attends in bf16 where the step's numerics are bf16 and
        # the cache float32 (the CPU): what a prefill's attention costs, 43% of a 1,100-token one in float32
        wide = self.numerics == torch.bfloat16 and self.cache_dtype != torch.bfloat16
        self.wide_attention = torch.bfloat16 if wide else None

    def _rows_from_file(self, source: str | Path) -> None:
        """Read the token embedding's (and the LM head's) rows from the GGUF file ``source`` and let the
        plain tables go, where every row there equals the loaded table's (:mod:`adaptive.engine.rows`);
        otherwise keep the tables. The head multiplies by its packed copy either way."""
        tied = self.lm_head.weight is self.embed.weight
        tables = [(TOKEN_TABLE, self.embed.weight)] + ([] if tied else [(HEAD_TABLE, self.lm_head.weight)])
        found = []
        for name, table in tables:
            try:
                rows = FileRows.open(source, name, table.dtype) if table.device.type == "cpu" else None
            except (GGUFFormatError, ValueError, OSError):  # a file or a tensor type this reader cannot take
                return
            if rows is None or not rows.matches(table.detach()):
                return
            found.append(rows)
        self._token_rows = found[0]
        self._head_rows = found[0] if tied else found[1]
        with torch.no_grad():
            for module in (self.embed, self.lm_head):
                module.weight.data = module.weight.data.new_empty(0)

    @property
    def rows_from_file(self) -> bool:
        """Whether the token embedding's and the head's rows are read from the model's GGUF file (the plain
        tables let go, :mod:`adaptive.engine.rows`)."""
        return self._token_rows is not None

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]``: the token embeddings of ``ids`` (``[T]``)."""
        if self._token_rows is not None:
            return self._token_rows(ids)
        return F.embedding(ids, self.embed.weight)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), hidden]``: the LM head's rows of ``ids`` (``[N]``), as a reduced draft head takes them."""
        if self._head_rows is not None:
            return self._head_rows(ids)
        return self.lm_head.weight[ids]

    def head_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the whole LM head, plain (a new tensor where the plain table was let go)."""
        return self.head.plain() if self._head_rows is not None else self.lm_head.weight

    @staticmethod
    def _layer_weights(layer, mode: str) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            qkv = Linear.build(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), mode)
            gate_up = Linear.build(*_fuse([mlp.gate_proj, mlp.up_proj]), mode)
            o = Linear.build(attn.o_proj.weight, attn.o_proj.bias, mode)
            down = Linear.build(mlp.down_proj.weight, mlp.down_proj.bias, mode)
            if mode == "packed":  # the packed copies are the only ones kept: one copy in memory
                for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                          mlp.down_proj):
                    m.weight.data = m.weight.data.new_empty(0)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return LayerWeights(
            attn_norm=layer.input_layernorm.weight, attn_eps=_eps(layer.input_layernorm), qkv=qkv, o=o,
            mlp_norm=layer.post_attention_layernorm.weight, mlp_eps=_eps(layer.post_attention_layernorm),
            gate_up=gate_up, down=down, act=mlp.act_fn,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            qk_eps=_eps(q_norm) if q_norm is not None else 1e-6)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device  # kept by a table let go (an empty tensor of its dtype and device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def numerics(self) -> torch.dtype:
        """The precision the step's products round to: the model's dtype (dense or packed), or bf16 with quantized
        weights (the packed kernels take and return bf16 activations). The audit's tolerance follows it."""
        return self.dtype if self.weight_mode in FLOAT_MODES else torch.bfloat16

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's and attention's dtype: float32 on the CPU (its bf16 batched products and
        attention kernels cost 3-4x float32's at decoding sizes, measured), the model's elsewhere."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def keeps_features(self, layers: Sequence[int]) -> bool:
        """Whether a cache can keep the feature rows of ``layers`` (here any, up to the top one)."""
        return all(0 <= x <= self.n_layers for x in layers)

    def new_cache(self, max_len: int, features: Sequence[int] = (), shared: int = 0) -> KVCache:
        """A cache for ``max_len`` positions; :class:`PromptTooLongError` beyond the model's context.
        With CUDA graphs its tensors are a pooled slot of a larger capacity (``limit`` = ``max_len``).
        ``features``: layer counts whose residual stream every full-model forward keeps in the cache
        (:attr:`KVCache.features`, in the cache dtype); with CUDA graphs the slot (a slab's, after
        :meth:`reserve_batch`) holds them, and the full model's captured steps write them.
        ``shared``: positions a kept prefix will fill (llama.cpp's context counts them; here each cache is its own)."""
        if max_len > self.max_positions:
            raise PromptTooLongError(
                f"prompt plus new tokens need {max_len} positions but the model's context is {self.max_positions}"
            )
        layers = check_feature_layers(tuple(features), self.n_layers)
        if layers and self.graphs is not None and self.graphs.enabled:
            return self.graphs.new_cache(max_len, KVCache, layers)
        if layers:
            k, v = self.allocate_kv(max_len)
            rows = torch.zeros(max_len, len(layers), self.hidden_size, dtype=self.cache_dtype, device=self.device)
            return KVCache(k=k, v=v, features=rows, feature_layers=layers)
        if self.graphs is not None and self.graphs.enabled:
            return self.graphs.new_cache(max_len, KVCache)
        k, v = self.allocate_kv(max_len)
        return KVCache(k=k, v=v)

    def room_for(self, positions: int) -> bool:
        """Always: each cache holds its own positions (llama.cpp's backbone answers for its shared context)."""
        return True

    def keep_prefix(self, cache: KVCache, ids: Sequence[int]) -> bool:
        """Keep a finished request's keys (its first ``cache.length`` positions, of tokens ``ids``) in
        :attr:`prefixes`, copied out of the cache (whose tensors or slot go on to other requests)."""
        n = min(cache.length, len(ids))
        if not self.prefixes.enabled or n < 1:
            return False
        rows = KeptRows.of(cache, n)
        return self.prefixes.add(ids[:n], rows, rows.nbytes)

    @torch.inference_mode()
    def restore_prefix(self, entry, cache: KVCache, n: int) -> int:
        """Fill a new cache's first ``n`` positions from a :meth:`keep_prefix` entry: ``n``, or 0 where it cannot.
        In inference mode, as every write into a cache: a pooled slot made while warming is an inference tensor."""
        return entry.handle.restore(cache, n)

    def kv_bytes_per_token(self, features: Sequence[int] = ()) -> int:
        """Bytes a cached position holds: keys and values of every layer (and the feature rows of ``features``)."""
        size = torch.empty((), dtype=self.cache_dtype).element_size()
        return size * (2 * self.n_layers * self.n_kv_heads * self.head_dim + len(features) * self.hidden_size)

    @torch.inference_mode()
    def warm_graphs(self, pooling=None, max_len: int = 1, skips: Sequence[SkipSet] = (),
                    features: Sequence[int] = (), trees: bool = False) -> int:
        """With CUDA graphs: capture the steps a request of up to ``max_len`` positions replays (decode,
        verify and prefill buckets; the routing prefill's with ``pooling``, a
        :class:`~adaptive.engine.config.Pooling`; the drafting steps of each skip set of ``skips``; on a slot
        keeping the feature rows of ``features``, what a runtime with an eagle head gives every request; with
        ``trees``, the tree steps its tree drafts are verified by) now, as a
        server does at startup, instead of inside the first requests; after :meth:`reserve_batch`, the batched
        steps too (:meth:`StepGraphs.warm_batches <adaptive.engine.graphs.StepGraphs.warm_batches>`). Returns
        the graphs captured (0 without graphs, or when all were). In inference mode, as :meth:`forward`
        captures lazily: the compiled pieces are guarded on the grad mode, so both share one compiled
        variant of each."""
        if self.graphs is None or not self.graphs.enabled:
            return 0
        layer = None
        if pooling is not None:
            layers = self.pool_args(pooling).get("pool_layers", ())
            layer = layers[0] if len(layers) == 1 else None
        cache = self.new_cache(max_len, features=features)
        n = self.graphs.warm(cache, self._full, layer, trees=trees)
        for skip in dict.fromkeys(s for s in skips if s):  # each distinct non-empty skip set once
            n += self.graphs.warm(cache, skip.masks(self.n_layers), drafting=True)
        # after reserve_batch: the batched steps, on the slab of caches like this one
        return n + self.graphs.warm_batches(self.graphs.slab_slots, self._full, max_len, layers=tuple(features))

    def reserve_batch(self, requests: int) -> bool:
        """Lay out the caches made from now on for batches of up to ``requests`` (a server's ``max_batch``):
        with CUDA graphs, slots of slabs of that many (:mod:`adaptive.engine.batched`), so that
        :meth:`forward_batch` replays one batched graph per step instead of running eagerly. ``False``
        (nothing changes) without graphs: the CPU's batch stays the eager, ragged forward."""
        if requests < 1:
            raise ValueError(f"a batch holds at least one request, not {requests}")
        if self.graphs is None or not self.graphs.enabled:
            return False
        self.graphs.slab_slots = max(self.graphs.slab_slots, requests)
        return True

    def batch_step_costs(self, requests: int) -> dict[int, float] | None:
        """What one batched step of ``requests`` costs by the rows each request feeds (``{R: cost}``, ``R``
        in :data:`~adaptive.engine.batched.ROW_BUCKETS`), in plain steps of a lone request, as the batched
        graphs were timed when warmed (:meth:`warm_graphs` after :meth:`reserve_batch`); ``None`` where
        no batched graphs run or they were not timed (the eager batch is priced by the profile's table)."""
        graphs = self.graphs
        if graphs is None or not graphs.enabled or graphs.slab_slots < 1 or requests > BATCH_BUCKETS[-1]:
            return None
        table = graphs.batch_seconds.get(batch_bucket(requests))
        unit = graphs.batch_seconds.get(1, {}).get(1)
        if not table or 1 not in table or not unit:
            return None
        return {r: s / unit for r, s in sorted(table.items())}

    @torch.inference_mode()
    def decode_chain(self, token: int, cache: KVCache, start: int, n: int) -> list[int] | None:
        """Plain greedy decoding of ``n`` tokens (up to :data:`~adaptive.engine.static.CHAIN_MAX`) after
        feeding ``token`` at ``start``, replayed on the device with one read at the end
        (:meth:`StepGraphs.chain <adaptive.engine.graphs.StepGraphs.chain>`): the tokens plain decoding gives,
        keys written up to ``start + n - 1``, ``cache.length`` unchanged. ``None`` without CUDA graphs (the
        caller decodes step by step). Plain greedy decoding at batch 1 runs in chains of
        :data:`~adaptive.engine.loop.CHAIN_TOKENS` (:meth:`Lane.chain <adaptive.engine.loop.Lane.chain>`);
        the device check measures it beside the step-by-step loop."""
        if self.graphs is None:
            return None
        if start + n > cache.max_len:
            raise PromptTooLongError(f"positions up to {start + n} exceed the cache of {cache.max_len}")
        out = self.graphs.chain(token, cache, start, n, self._full)
        return None if out is NotImplemented else out

    def allocate_kv(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value tensors, ``[n_layers, n_kv_heads, positions, head_dim]`` in the cache dtype."""
        return zeros_kv((self.n_layers, self.n_kv_heads), self.head_dim, self.cache_dtype, self.device, positions)

    def rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions ``0 .. n-1`` (``[n, 1, head_dim]``, :meth:`_rope`'s layout),
        as new tensors of their own (a static step's tables must not move)."""
        cos, sin = self._rope(0, n)
        return cos.clone(), sin.clone()

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions ``[start, end)``: ``[end-start, 1, head_dim]`` each, in the
        cache dtype, from a table grown geometrically. The sign of the first half of ``sin`` is folded
        in, so that rotating is ``x * cos + x.roll(head_dim // 2) * sin`` (Llama's rotate_half)."""
        if self._rope_cache is None or self._rope_cache[0].shape[0] < end:
            have = 0 if self._rope_cache is None else self._rope_cache[0].shape[0]
            n = max(end, min(max(256, 2 * have), self.max_positions))
            pos = torch.arange(n, device=self.device).unsqueeze(0)
            probe = torch.empty(1, dtype=torch.float32, device=self.device)
            cos, sin = self.rotary(probe, pos)  # [1, n, head_dim], float32
            half = self.head_dim // 2
            sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            dt = self.cache_dtype
            self._rope_cache = (cos[0].unsqueeze(1).to(dt).contiguous(), sin[0].unsqueeze(1).to(dt).contiguous())
        cos, sin = self._rope_cache
        return cos[start:end], sin[start:end]

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
        pool_layers: tuple[int, ...] = (),
        tree: Sequence[int] | None = None,
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
        ``pool_layers``: also pool the residual stream after each of these many layers (0: the
        embeddings), through the final norm, as the mean over positions and at the last one
        (``ForwardOutput.layer_pools``); the layer count ``n_layers`` is what ``pool`` gives as the mean.
        ``tree``: the fed rows form a tree (a tree draft's verification, :meth:`tree_layout`): each row's
        parent row (``-1`` for row 0, the pending token); a row sits at the position of its depth and
        attends to the cache before ``start`` and to its own ancestors. Its keys are written at the
        slots ``start .. start+T-1`` by row; :meth:`keep_rows` then moves the kept path's together.
        """
        ids = input_ids.reshape(-1)
        T = ids.shape[0]
        end = start + T
        if end > cache.max_len:
            raise PromptTooLongError(f"positions up to {end} exceed the cache of {cache.max_len}")
        keep = self._kept(cache, skip_masks, read_only)  # [(slot, layer count)] of the cache's feature rows
        if (self.graphs is not None and head is None and adapter is None and not (pool or hidden or read_only)
                and len(pool_layers) <= 1):
            layer = pool_layers[0] if pool_layers else None
            out = self.graphs.forward(ids, cache, start, skip_masks or self._full, logits, layer,
                                      None if tree is None else list(tree))
            if out is not NotImplemented:
                return ForwardOutput(out) if layer is None else ForwardOutput(out[0], layer_pools={layer: out[1]})
        ids = ids.to(self.device)
        skip_attn, skip_mlp = skip_masks or self._full
        if tree is None:
            cos, sin = self._rope(start, end)
            banned = self._banned(T, start)
        else:
            positions, banned = self.tree_layout(tree, start)
            cos, sin = self._rope(0, int(positions.max()) + 1)
            cos, sin = cos[positions], sin[positions]
        h = self.embed_rows(ids)  # [T, hidden]
        pools = {} if pool_layers else None  # a decoding step asks for none: nothing below runs then
        if pools is not None and 0 in pool_layers:
            pools[0] = self._pool(h)
        keep_at = dict((n, slot) for slot, n in keep)
        if 0 in keep_at:
            cache.features[start:end, keep_at[0]] = h
        for i, w in enumerate(self.weights):
            if not skip_attn[i]:
                h = h + self._attention(w, rms_norm(h, w.attn_norm, w.attn_eps), cache, i, start, end, cos, sin,
                                        banned, read_only)
            if not skip_mlp[i]:
                h = h + self.mlp(w, h)
            if pools is not None and i + 1 in pool_layers:
                pools[i + 1] = self._pool(h)
            if i + 1 in keep_at:
                cache.features[start:end, keep_at[i + 1]] = h
        residual = h if hidden else None
        if adapter is not None:
            h = adapter(h.unsqueeze(0))[0]
        if logits == "last" and not pool:
            h = h[-1:]
        h = self.final_norm(h)
        pooled = h.float().mean(dim=0) if pool else None
        if logits == "none":
            return ForwardOutput(None, pooled, residual, pools)
        hs = h[-1:] if logits == "last" else h
        out = self.head(hs) if head is None else F.linear(hs, head)
        return ForwardOutput(out.float(), pooled, residual, pools)

    def _kept(self, cache: KVCache, skip_masks, read_only: bool) -> list[tuple[int, int]]:
        """``[(slot, layer count)]``: the feature rows a forward over ``cache`` writes: the cache's own
        feature layers for a full-model forward that writes (none for a draft or a read-only forward)."""
        if cache.features is None or read_only or (skip_masks is not None and skip_masks != self._full):
            return []
        return list(enumerate(cache.feature_layers))

    def _pool(self, h: torch.Tensor) -> torch.Tensor:
        """``[2, hidden]`` float32: the residual stream ``h`` (``[T, hidden]``) through the final norm,
        its mean over positions and its last position."""
        x = self.final_norm(h).float()
        return torch.stack([x.mean(dim=0), x[-1]])

    def pool_args(self, pooling) -> dict:
        """The :meth:`forward` arguments that compute ``pooling`` (a :class:`~adaptive.engine.config.Pooling`)."""
        layer = self.n_layers if pooling.layer is None else pooling.layer
        if layer > self.n_layers:
            raise ValueError(f"pooling after layer {layer} of a {self.n_layers}-layer model")
        if layer == self.n_layers and pooling.mode == "mean":
            return {"pool": True}
        return {"pool_layers": (layer,)}

    def routing_pooling(self, pooling):
        """The pooling this engine computes for ``pooling``: any of them, as asked."""
        return pooling

    def pooled(self, out: ForwardOutput, pooling) -> torch.Tensor:
        """``[hidden]`` float32: ``pooling``'s embedding from a forward run with :meth:`pool_args` (its
        arguments alone or merged with other poolings', :func:`adaptive.engine.loop.merge_pool_args`)."""
        layer = self.n_layers if pooling.layer is None else pooling.layer
        if layer == self.n_layers and pooling.mode == "mean":
            return out.pooled
        return out.layer_pools[layer][0 if pooling.mode == "mean" else 1]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm of the residual stream ``h`` (``[T, hidden]``)."""
        return rms_norm(h, self.norm.weight, self.norm_eps)

    @staticmethod
    def mlp(w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """One gated MLP sublayer on the residual ``h`` (``[T, hidden]``): its output, ``[T, hidden]``."""
        return w.down(gated(w.gate_up(rms_norm(h, w.mlp_norm, w.mlp_eps)), w.act))

    def _attention(self, w: LayerWeights, x: torch.Tensor, cache: KVCache, i: int, start: int, end: int,
                   cos: torch.Tensor, sin: torch.Tensor, banned: torch.Tensor | None, read_only: bool = False):
        """One attention sublayer on ``x`` (``[T, hidden]``, normed): its output, ``[T, hidden]``.

        Queries, keys and values come from one product with the fused weight (:meth:`project_qkv`); then
        :meth:`_attend` writes the keys and attends over the cache's positions ``0 .. end-1``.
        """
        qkv = self.project_qkv(w, x, cache.k.dtype, cos, sin, rotate_keys=not read_only)
        return w.o(self._attend(qkv, cache, i, start, end, banned, write=not read_only).to(x.dtype))

    def _banned(self, T: int, start: int) -> torch.Tensor | None:
        """The causal mask of ``T`` queries at positions ``start .. start+T-1`` over keys ``0 .. start+T-1``:
        ``[T, start + T]``, True where query t (absolute ``start + t``) may not look; ``None`` for one
        query, which may see every key. Example: ``T=2, start=1`` -> ``[[F, F, T], [F, F, F]]``."""
        if T <= 1:
            return None
        return torch.ones(T, start + T, dtype=torch.bool, device=self.device).triu_(start + 1)

    def tree_layout(self, tree: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions (``[T]``) and the mask (``[T, start + T]``, True: may not look) of a tree's rows fed
        at ``start``; ``tree``: each row's parent row, ``-1`` for row 0 (the pending token, whose parent is
        the cache). Example: ``tree=[-1, 0, 0, 1]`` at ``start=5``: positions ``[5, 6, 6, 7]``; row 3 sees
        the cache's 5 positions and rows 0, 1 and itself, not row 2."""
        T = len(tree)
        if not tree or tree[0] != -1 or any(not 0 <= p < i for i, p in enumerate(tree) if i):
            raise ValueError(f"a tree's rows need row 0 as the root and each other row's parent before it: {tree}")
        depth = [0] * T
        seen = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            if i:
                depth[i] = depth[tree[i]] + 1
                seen[i] = seen[tree[i]]
            seen[i, i] = True
        banned = torch.zeros(T, start + T, dtype=torch.bool)
        banned[:, start:] = ~seen
        return (torch.tensor(depth, device=self.device) + start, banned.to(self.device))

    @property
    def verifies_trees(self) -> bool:
        """Whether :meth:`forward` verifies tree drafts here: always (eagerly, or by replaying a captured tree
        step, :class:`~adaptive.engine.static.StaticStep` with ``tree=True``, for up to 32 rows)."""
        return True

    @torch.inference_mode()
    def keep_rows(self, cache: KVCache, start: int, rows: Sequence[int]) -> None:
        """After a tree's verification fed at ``start``: move the keys, values and feature rows of the fed
        rows ``rows`` (ascending, the kept path from row 0) to positions ``start, start + 1, ...``, where a
        chain's would be; they were computed at those positions (:meth:`tree_layout`), so they move as they are."""
        if list(rows) == list(range(len(rows))):
            return
        src = torch.tensor([start + r for r in rows], device=cache.k.device)
        end = start + len(rows)
        cache.k[:, :, start:end] = cache.k[:, :, src]
        cache.v[:, :, start:end] = cache.v[:, :, src]
        if cache.features is not None:
            cache.features[start:end] = cache.features[src]

    def project_qkv(self, w: LayerWeights, x: torch.Tensor, dtype: torch.dtype, cos: torch.Tensor,
                    sin: torch.Tensor, rotate_keys: bool = True) -> torch.Tensor:
        """``[T, n_heads + 2 * n_kv_heads, head_dim]`` in ``dtype``: the projected queries, keys and values
        of ``x`` (``[T, hidden]``), rotary embedding applied to the queries (and the keys unless
        ``rotate_keys=False``, when they will not be written) with ``cos``/``sin`` of each row's position.
        Qwen3's per-head norms of queries and keys come first, in the model's dtype, as its attention has them."""
        T = x.shape[0]
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        raw = w.qkv(x).view(T, H + 2 * KV, D)
        if w.q_norm is not None:
            raw = torch.cat([rms_norm(raw[:, :H], w.q_norm, w.qk_eps), rms_norm(raw[:, H:H + KV], w.k_norm, w.qk_eps),
                             raw[:, H + KV:]], dim=1)
        qkv = raw.to(dtype)  # a fresh tensor: rotated in place below
        rot = H + KV if rotate_keys else H
        qkv[:, :rot] = rotate(qkv[:, :rot], cos, sin)
        return qkv

    def _attend(self, qkv: torch.Tensor, cache: KVCache, i: int, start: int, end: int,
                banned: torch.Tensor | None, write: bool = True) -> torch.Tensor:
        """One sequence's attention in layer ``i``: ``qkv`` (``[T, H + 2 * KV, D]``, from :meth:`project_qkv`) at
        positions ``start .. end-1``; its keys and values are written there first (``write``); queries
        attend over ``0 .. end-1`` with grouped heads as a batch (``[KV, G * T, D]``). Returns
        ``[T, H * D]`` in the cache dtype (or the wide attention's, below).

        More than :data:`ATTN_BLOCK` queries (a prefill) attend in blocks of that many, each over the
        keys up to its own last position only: the same scores without the masked half of the work,
        and blocks small enough to stay in cache (a 1,000-token prefill's attention ran 2-3x faster).
        :data:`WIDE_ATTN_ROWS` queries or more attend in :attr:`wide_attention`'s dtype where it is set (a
        bf16 model on the CPU: its queries, keys and values rounded to bf16, the output then in bf16).
        """
        T = qkv.shape[0]
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        if write:
            cache.k[i, :, start:end] = qkv[:, H:H + KV].transpose(0, 1)
            cache.v[i, :, start:end] = qkv[:, H + KV:].transpose(0, 1)
        q, keys, values = qkv[:, :H], cache.k[i, :, :end], cache.v[i, :, :end]
        if T >= WIDE_ATTN_ROWS and self.wide_attention is not None:
            q, keys, values = (x.to(self.wide_attention) for x in (q, keys, values))
        q = q.reshape(T, KV, H // KV, D).permute(1, 2, 0, 3)  # [KV, G, T, D]
        if T <= ATTN_BLOCK:
            out = self._attend_block(q, keys, values, banned)
        else:
            blocks = []
            for a in range(0, T, ATTN_BLOCK):
                b = min(a + ATTN_BLOCK, T)  # queries a .. b-1 see keys up to position start + b - 1
                blocks.append(self._attend_block(q[:, :, a:b], keys[:, :start + b], values[:, :start + b],
                                                 banned[a:b, :start + b]))
            out = torch.cat(blocks, dim=2)
        return out.permute(2, 0, 1, 3).reshape(T, H * D)

    def _attend_block(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      banned: torch.Tensor | None) -> torch.Tensor:
        """Queries ``q`` (``[KV, G, t, D]``) over ``keys``/``values`` (``[KV, n, D]``), ``banned``
        (``[t, n]``, True: may not look; ``None``: all may): ``[KV, G, t, D]``."""
        KV, G, t, D = q.shape
        n = keys.shape[1]
        # the queries scaled, not the scores (t*D values, not t*n; the order the CUDA graphs' step computes too)
        scores = torch.bmm(q.reshape(KV, G * t, D) * self.scaling, keys.transpose(1, 2))  # [KV, G*t, n]
        if banned is not None:
            # a query at position p may not see keys after p, and every such key is among the block's own
            # last t: only those columns are masked (a whole row was ~7% of a batched step at 1,000 positions)
            scores.view(KV, G, t, n)[..., n - t:].masked_fill_(banned[:, n - t:], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), values).view(KV, G, t, D)

    def forward_argmax(self, input_ids: Sequence[int] | torch.Tensor, cache: KVCache, start: int,
                       tree: Sequence[int] | None = None) -> list[int]:
        """The argmax of the full model's logits at every fed position (``T`` ints, one host read),
        all that greedy verification of a draft held on the host needs. As :meth:`forward` with
        ``logits="all"`` (and its ``tree``)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)  # on the host: the forward makes the one copy
        return self.forward(ids, cache, start, logits="all", tree=tree).logits.argmax(-1).tolist()

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment],
                      skip_masks: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None,
                      read_only: bool = False) -> list[torch.Tensor | None]:
        """A forward of several sequences at once; each segment's logits at every fed position,
        ``[T_i, vocab]`` float32, in order (``None`` for a segment with ``logits=False``).

        Segment ``s`` feeds ``s.ids`` (``[T_i]``) at positions ``s.start .. s.start + T_i - 1`` of its
        own ``s.cache`` (which must hold that sequence's keys for ``0 .. s.start - 1``), exactly as
        :meth:`forward` would with ``logits="all"``; the linear layers and the LM head multiply all
        segments' rows together (one product per weight for the whole batch: what makes verifying
        several requests cheaper than one after another), attention runs per sequence over its own
        cache. Ragged: segments may differ in length, start and cache size; nothing is padded.
        Does not change any ``cache.length``. ``skip_masks`` and ``read_only`` are :meth:`forward`'s,
        for every segment (the calibrator scores a skip set on all its sequences in one batch).

        Example: segments of 1 and 3 tokens at starts 7 and 20 -> logits ``[1, V]`` and ``[3, V]``;
        add a 128-token prompt chunk at start 256 with ``logits=False`` -> ``[1, V]``, ``[3, V]``, ``None``
        (the chunk's keys written, no LM head computed for its rows).
        """
        if not segments:
            return []
        if self.graphs is not None and not read_only:  # a server's batch on a GPU: batched graphs where they serve
            out = self.graphs.forward_batch(segments, skip_masks or self._full)
            if out is not NotImplemented:
                return out
        spans, cos, sin, row = [], [], [], 0
        for s in segments:
            T = int(s.ids.numel())
            if T == 0:
                raise ValueError("a segment of a batched forward has no tokens")
            end = s.start + T
            if end > s.cache.max_len:
                raise PromptTooLongError(f"positions up to {end} exceed the cache of {s.cache.max_len}")
            c, sn = self._rope(s.start, end)
            cos.append(c)
            sin.append(sn)
            spans.append((row, row + T, end, self._banned(T, s.start)))
            row += T
        cos_all, sin_all = torch.cat(cos), torch.cat(sin)
        ids = [s.ids.reshape(-1) for s in segments]
        if all(i.device == ids[0].device for i in ids):  # one copy to the device (drafts built on the host)
            ids = torch.cat(ids).to(self.device)
        else:
            ids = torch.cat([i.to(self.device) for i in ids])
        h = self.embed_rows(ids)
        dtype = segments[0].cache.k.dtype
        skip_attn, skip_mlp = skip_masks or self._full
        keeps = [(s, a, b, dict((n, slot) for slot, n in self._kept(s.cache, skip_masks, read_only)))
                 for s, (a, b, _, _) in zip(segments, spans)]
        keeps = [k for k in keeps if k[3]]

        def keep(n: int) -> None:  # the feature rows of the segments whose caches keep layer count n
            for s, a, b, at in keeps:
                if n in at:
                    s.cache.features[s.start:s.start + b - a, at[n]] = h[a:b]

        keep(0)
        for i, w in enumerate(self.weights):
            if not skip_attn[i]:
                x = rms_norm(h, w.attn_norm, w.attn_eps)
                qkv = self.project_qkv(w, x, dtype, cos_all, sin_all, rotate_keys=not read_only)
                out = torch.cat([self._attend(qkv[a:b], s.cache, i, s.start, end, banned, write=not read_only)
                                 for s, (a, b, end, banned) in zip(segments, spans)])
                h = h + w.o(out.to(x.dtype))
            if not skip_mlp[i]:
                h = h + self.mlp(w, h)
            if keeps:
                keep(i + 1)
        wanted = [(a, b) for s, (a, b, _, _) in zip(segments, spans) if s.logits]
        rows = torch.cat([h[a:b] for a, b in wanted]) if wanted else h[:0]
        logits = self.head(self.final_norm(rows)).float()
        out, row = [], 0
        for s, (a, b, _, _) in zip(segments, spans):
            out.append(logits[row:row + b - a] if s.logits else None)
            row += b - a if s.logits else 0
        return out

    @contextmanager
    def module_weights(self) -> Iterator[None]:
        """Within this block the Hugging Face model runs by itself (``model.generate``): with
        ``packed`` weights its layers' released tensors are unpacked again for the block (one more
        copy of the layers' weights meanwhile), and the tables read from the file again where
        :attr:`rows_from_file`, and released after it; other modes hold them anyway."""
        if self.weight_mode != "packed":
            yield
            return
        modules = []
        with torch.no_grad():
            if self._token_rows is not None:
                for module, rows in ((self.embed, self._token_rows), (self.lm_head, self._head_rows)):
                    if module.weight.numel() == 0:  # tied: the head's table is the embedding's, read once
                        module.weight.data = rows.table()
                        modules.append(module)
            for layer, w in zip(self.layers, self.weights):
                attn, mlp = layer.self_attn, layer.mlp
                for group, lin in (((attn.q_proj, attn.k_proj, attn.v_proj), w.qkv), ((attn.o_proj,), w.o),
                                   ((mlp.gate_proj, mlp.up_proj), w.gate_up), ((mlp.down_proj,), w.down)):
                    plain, row = lin.plain(), 0
                    for m in group:
                        n = m.out_features
                        m.weight.data = plain[row:row + n]
                        modules.append(m)
                        row += n
        try:
            yield
        finally:
            for m in modules:
                m.weight.data = m.weight.data.new_empty(0)

    @property
    def embed_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the token embedding table (the static step's lookup, on CUDA, where it is
        always held: rows are read from a file only with packed weights, which are the CPU's)."""
        if self._token_rows is not None:
            raise RuntimeError("the token embedding's rows are read from the GGUF file: no table is held")
        return self.embed.weight

    @property
    def final_norm_weight(self) -> torch.Tensor:
        """``[hidden]``: the final RMSNorm's weight (with :attr:`norm_eps`)."""
        return self.norm.weight

    @property
    def norm_eps(self) -> float:
        """The final RMSNorm's epsilon (for the functional norm distillation trains through)."""
        return _eps(self.norm)

    def mlp_weights(self, i: int) -> dict:
        """Layer ``i``'s pre-MLP norm and gated MLP weights (``norm [H]``, ``gate``/``up [I, H]``,
        ``down [H, I]``, as the step multiplies by them) and activation name: what an early-exit
        block is initialised from."""
        w = self.weights[i]
        gate, up = w.gate_up.plain().chunk(2, dim=0)
        return {"norm": w.mlp_norm, "gate": gate, "up": up, "down": w.down.plain(),
                "act": str(getattr(self.config, "hidden_act", "silu"))}

    @torch.inference_mode()
    def sublayer_influence(self, input_ids: torch.Tensor, from_position: int = 0) -> torch.Tensor:
        """How much each sublayer changes the residual stream: ``[2, n_layers]`` float32.

        Row 0 is attention, row 1 the MLP; each value is ``1 - cos(h_in, h_in + f(h_in))`` averaged
        over positions ``from_position ..`` of one full-model forward of ``input_ids`` (``[T]``).
        A sublayer with a small value barely turns the hidden state: a cheap prior on which
        sublayers a draft can skip (the calibrator's ranked search space).
        """
        ids = input_ids.reshape(-1)
        T = ids.shape[0]
        cache = self.new_cache(T)
        cos, sin = self._rope(0, T)
        banned = self._banned(T, 0)
        out = torch.zeros(2, self.n_layers)

        def turn(a, b):
            cos = F.cosine_similarity(a[from_position:].float(), b[from_position:].float(), dim=-1)
            return float((1 - cos).mean())

        h = self.embed_rows(ids)
        for i, w in enumerate(self.weights):
            nh = h + self._attention(w, rms_norm(h, w.attn_norm, w.attn_eps), cache, i, 0, T, cos, sin, banned)
            out[0, i] = turn(h, nh)
            h = nh + self.mlp(w, nh)
            out[1, i] = turn(nh, h)
        return out
