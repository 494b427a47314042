"""An engine backbone over llama.cpp's own CPU kernels. With :mod:`adaptive.engine.llamacpp_host` (loading
the binding, probing this machine), the only modules that touch llama-cpp-python.

:class:`LlamaCppBackbone` answers the same calls as :class:`~adaptive.engine.backbone.Backbone` that
the decoding loop, the statistical drafters, calibration's race and the server make (``forward``,
``forward_batch``, ``new_cache``, the pooled prompt embedding), over one ``llama_context`` of the
GGUF file, with the file's own quantized weights: no float copy of the model is ever built.

* A verification is one ``llama_decode`` of the pending token and the draft with logits at every
  fed position; several sequences' segments go into one ``llama_batch`` (a sequence id each).
* The KV cache is llama.cpp's, one sequence id per :class:`LlamaCache`. Its ``length`` is the
  engine's (positions holding accepted tokens); rolling back is setting it, as with the torch
  cache: the next forward at ``start`` first drops the sequence's positions from ``start`` on
  (``llama_memory_seq_rm``), because llama.cpp, unlike a cache written by position, would
  otherwise attend to a stale cell and a new one at the same position.
* Threads are set explicitly (llama.cpp's own default is 4, too many on a 2-core machine) and run
  in a thread pool attached to the context for its lifetime, as llama-server does (without one,
  ggml starts its threads anew for every decode; llama-cpp-python does not bind the call).
* The routing embedding is any of the torch backbone's poolings (:class:`~adaptive.engine.config.Pooling`):
  the residual stream after ``L`` layers, through the model's final RMSNorm, at the prompt's last
  position or its mean, taken during the prompt's own prefill at no extra forward. llama.cpp
  copies a layer's input rows out of the graph it computes when asked
  (``llama_set_embeddings_layer_inp``: the input of layer ``L`` is the residual after ``L``
  layers), for every fed token, from its C++ extension API (``llama-ext.h``, found in the library
  by its mangled name); asked for only while a prompt that pools is prefilled, so a decoding step
  never pays for it. The final norm's weight and epsilon are read from the GGUF file once. Some
  architectures' graphs never record a layer's input, and llama.cpp then aborts the process (Qwen2
  in 0.3.36), so an architecture is first probed in a child process, its answer kept per
  llama-cpp-python version (:func:`_layer_inputs_safe`). Where
  the build lacks that API or the architecture's graph gives no rows, the engine falls back to the
  final layer's last position, saying so once (:meth:`routing_pooling`): the prompt is prefilled
  as without it, then its last token is decoded once more, alone and with llama.cpp's embedding
  output on, in a scratch sequence that shares the prompt's cached cells (``llama_memory_seq_cp``,
  no copy) and is dropped after. (llama.cpp's per-node eval callback, ``cb_eval``, was the other
  way: set for a context's lifetime, it calls into Python at each of a step's ~940 graph nodes,
  every decoding step included; the scheduler's own setter is reset by every graph rebuild.)

* An eagle head's feature rows (:attr:`LlamaCache.features`, what the torch cache keeps too): a cache
  made with ``features`` has every forward over it write the residual stream after those layers at its
  positions, the layers under the top one from the layer-input rows (asked for while any cache keeps
  them, so the graph is not rebuilt per forward), the top one from llama.cpp's output rows (embeddings on
  for that decode, every fed row an output): the final norm's output over the norm's weight, the
  residual scaled to unit RMS (:data:`~adaptive.engine.config.FEATURE_TOPS` "unit"; the API gives no
  residual after the last layer). A prefill keeping them computes the LM head at every row, in micro-batches
  of 512 (with the rows copied out: a prefill +13-15%, a step +4% on the embedded model). The head's own
  inputs (the token embedding, the LM head's rows, the final norm, its sizes) are read from the GGUF file.

* The hybrid engine (``prefill``: a copy of the model in another format, :mod:`adaptive.engine.prefill_file`):
  prompts are prefilled on a second context over that file and their cells handed to this one
  (:mod:`adaptive.engine.llamacpp_hybrid`; the sequence-state calls it makes are :meth:`share`, :meth:`drop`
  and :attr:`ctx`).

Its one concern, decoding on llama.cpp (caches, forwards, verification batches, the routing pools, the
feature rows, the prefix cache's sequences), is why it runs past 600 lines; loading the binding and
probing the host are :mod:`adaptive.engine.llamacpp_host`'s.

What it cannot do: skip sublayers, swap the LM head, exit early or return hidden states to the caller;
those stay with the torch backbone (``layer_skip = False`` says so to the drafter factory and calibration).
Tested with llama-cpp-python 0.3.36 (the ``llamacpp`` extra pins ``>=0.3.36,<0.4``).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaptive.engine.backbone import ForwardOutput, Segment
from adaptive.engine.config import check_feature_layers
from adaptive.engine.formulas import rms_norm
from adaptive.engine.gguf_file import GGUFFormatError, read_gguf
from adaptive.engine.llamacpp_host import (
    default_threads,
    extra_buffers_ok,
    init_backend,
    layer_input_api,
    library,
    probe,
    release_mapped_file,
    say_once,
    threadpool_api,
)
from adaptive.engine.llamacpp_hybrid import HybridPrefill
from adaptive.engine.prefill_file import RATE_TOKENS, PrefillFile
from adaptive.engine.prefix import PrefixStore
from adaptive.engine.quant import packing_supported
from adaptive.engine.rows import HEAD_TABLE, TOKEN_TABLE, FileRows
from adaptive.errors import ConfigError, ContextFullError, ModelNotFoundError, PromptTooLongError

ENGINE = "llama.cpp"
DEFAULT_CONTEXT = 8192  # positions per sequence, at most the model's training context
DEFAULT_SEQUENCES = 16  # sequences (KV caches) alive at once: a server's batch, calibration's race, spares
N_BATCH = 2048  # tokens per llama_decode call (a longer prefill is fed in chunks), as llama-server
N_UBATCH = 512
# a kept prefix-cache entry not restored within this many rows fed to the context is given back: every decode
# attends over every cell in use, kept ones included. Measured (AMD EPYC, 2 cores, the embedded Q4_1 model,
# 2026-11-28): 12 kept sequences, 3,396 cells, took plain decoding from 100.9 to 83.2 tok/s, ~0.6 us a cell a
# token, against ~3 ms a token to prefill (330 tok/s): an entry unused for ~4,800 rows has cost more than it saves
STALE_ROWS = 4096
# the horizon follows the traffic (stale_horizon): the break-even scaled by the share of entries that were reused
# (for at least half their cells: a shared chat template alone does not make a long entry worth its cells), and,
# once REUSE_SAMPLES reuses were seen, at most twice the 90th percentile of the rows between an entry's keeping and
# its reuse (a conversation's next turn comes well before the break-even); at least MIN_STALE_ROWS
REUSE_SAMPLES, MIN_STALE_ROWS = 8, 256


@dataclass(frozen=True)
class GGUFModelConfig:
    """What an eagle head's shape reads of a model's configuration, from its GGUF metadata."""

    intermediate_size: int
    rope_theta: float


@dataclass(eq=False)
class LlamaCache:
    """One sequence of the backbone's llama.cpp context: its id ``seq``, room for ``max_len``
    positions, ``length`` positions holding accepted tokens (the engine's, as
    :class:`~adaptive.engine.backbone.KVCache`'s), ``written``: positions llama.cpp holds for it
    (``>= length`` after a verification; the rest is dropped by the next forward)."""

    seq: int
    max_len: int
    length: int = 0
    written: int = 0
    _release: object = field(default=None, repr=False)
    # [max_len, len(feature_layers), hidden] float32 (``None``: none kept), as the torch cache's
    # (:class:`~adaptive.engine.backbone.KVCache`), written by every forward over the sequence: the
    # residual stream after each of ``feature_layers`` layers, the top one scaled to unit RMS ("unit",
    # :data:`~adaptive.engine.config.FEATURE_TOPS`)
    features: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()
    # the hybrid engine's cache of the prefill context mirroring this sequence while its prompt is prefilled
    # (:class:`~adaptive.engine.llamacpp_hybrid.HybridPrefill`)
    staged: LlamaCache | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the sequence and its cells back to the context now (done anyway when the cache is
        collected, which a reference cycle may delay while other sequences need the cells)."""
        if self._release is not None:
            self._release()


@dataclass(eq=False)
class _KeptSequence:
    """A prefix-cache entry's handle on llama.cpp: the sequence holding its cells (given back on release)."""

    backbone: object  # weakref.ref to the LlamaCppBackbone: the entry does not keep the model alive
    seq: int
    used_at: int = 0  # the backbone's rows fed (LlamaCppBackbone.rows) when kept or last restored
    tokens: int = 0  # the cells it holds
    reused: bool = False  # restored for at least half its cells since kept
    released: bool = False
    features: torch.Tensor | None = None  # the kept cache's feature rows of its cells (LlamaCache.features)
    feature_layers: tuple[int, ...] = ()

    def release(self) -> None:
        bb = self.backbone()
        if not self.released and bb is not None:
            self.released = True
            bb._kept_reused.append(self.reused)
            bb._release(self.seq)


class LlamaCppBackbone:
    """The engine's backbone over a GGUF file run by llama.cpp (see the module docstring).

    ``threads``: llama.cpp's threads for decoding and prefill (default: the CPUs this process may
    use). ``context``: positions per sequence (default: the model's training context, at most
    :data:`DEFAULT_CONTEXT`; never beyond the training context); the KV cache holds ``context`` cells
    shared by all live sequences (llama.cpp's unified cache). ``sequences``: the most caches alive at once.
    """

    engine = ENGINE
    layer_skip = False  # sublayers cannot be skipped: layer-skip and early-exit drafters need the torch engine
    # Prompt chunks are not carried by a server's decoding steps: in one llama_decode with 8 decoding
    # sequences, a 128-token chunk and the 8 rows took 1.4x the time of the two apart (the unified KV
    # cache's attention over every sequence's cells; 0.95-1.0x with a cache per sequence), measured
    # with the embedded model on 2 cores (docs/history/2026-11-25-serving-under-load.md)
    carry_chunks = False
    shared_cache = True  # live caches share the context's max_positions cells (llama.cpp's unified KV cache)
    feature_top = "unit"  # the top feature row from the final norm's output (FEATURE_TOPS; keeps_features)

    def __init__(self, gguf: str | Path, threads: int | None = None, context: int | None = None,
                 sequences: int = DEFAULT_SEQUENCES, prefill: PrefillFile | str | Path | None = None,
                 threadpool=None, repack: bool = True):
        lib = library()
        path = Path(gguf)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        if sequences < 1:
            raise ConfigError(f"sequences must be >= 1, got {sequences}")
        init_backend(lib)
        self._lib = lib
        self.path = path
        self.threads = threads or default_threads()
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack and extra_buffers_ok(path)
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelNotFoundError(f"llama.cpp cannot load {path} (not a GGUF model it supports)")
        self._model = model
        release_mapped_file(path)  # the file's pages (those of weights llama.cpp repacked: read no more)
        self.n_layers = int(lib.llama_model_n_layer(model))
        self.hidden_size = int(lib.llama_model_n_embd(model))
        self.vocab = lib.llama_model_get_vocab(model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        train = int(lib.llama_model_n_ctx_train(model)) or DEFAULT_CONTEXT
        self.max_positions = min(int(context), train) if context else min(train, DEFAULT_CONTEXT)
        if self.max_positions < 16:
            raise ConfigError(f"context must be at least 16 positions, got {self.max_positions}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.max_positions
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_UBATCH
        cparams.n_seq_max = sequences + 1  # and a scratch sequence for the routing embedding
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.embeddings = False
        cparams.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        cparams.kv_unified = True  # every sequence may use the whole context
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise ConfigError(f"llama.cpp could not create a context of {self.max_positions} positions for {path}")
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(N_BATCH, 0, 1)
        new_pool, free_pool, attach, detach = threadpool_api(lib)
        # a hybrid's prefill context shares its decode context's pool (``threadpool``): two pools' idle
        # threads would spin against the working ones on the same cores
        pool = threadpool or new_pool(self.threads)
        if pool:
            attach(ctx, pool, None)
        self._pool = pool
        self._free_seqs = list(range(sequences - 1, -1, -1))
        self._reserved: dict[int, int] = {}  # live sequence -> the positions its cache was made for
        self._kept: dict[int, int] = {}  # a prefix-cache entry's sequence -> the cells it holds
        self.prefixes = PrefixStore(0)  # finished requests' cells (:mod:`adaptive.engine.prefix`; no budget: off)
        # every store that has held one of this context's sequences (one swapped out, e.g. a benchmark's
        # per-method store, still holds cells a new cache may need: it is asked to evict too)
        self._holders: weakref.WeakSet = weakref.WeakSet()
        self.rows = 0  # token rows fed to this context so far (each paid attention over every cell in use)
        self._reuse_ages: deque[int] = deque(maxlen=64)  # rows between an entry's keeping (or reuse) and its reuse
        self._kept_reused: deque[bool] = deque(maxlen=64)  # of the entries given back: whether each was reused
        self._scratch = sequences  # the routing embedding's sequence (see the module docstring)
        self.sequences = sequences
        self._lock = threading.RLock()  # llama.cpp's context is not thread-safe: one call at a time
        self._first: list = []  # closed before this context (the hybrid's prefill context, on its pool)
        self._closer = weakref.finalize(self, _free_native, lib, model, ctx, self._batch,
                                        (pool, free_pool, detach) if pool and not threadpool else None, self._first)
        self.eos = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(self.vocab, t))
        self._layers = None  # the layer-input calls and the final norm, once probed (layer_pools)
        self._final_norm = None  # (final_norm(),) once read
        self._taps: dict[int, int] = {}  # layer -> users of its input rows (llama.cpp copies them while any)
        self._rows = None  # (token embedding, LM head) rows read from the file, once asked for (embed_rows)
        self.prefill_file = PrefillFile(Path(prefill), "file") if isinstance(prefill, (str, Path)) else prefill
        self.hybrid = None if self.prefill_file is None else self._hybrid(self.prefill_file.path)

    def _hybrid(self, path: Path) -> HybridPrefill:
        """The hybrid engine's prefill side: a context over ``path`` of this context's size, sequences and pool."""
        other = LlamaCppBackbone(path, threads=self.threads, context=self.max_positions, sequences=self.sequences,
                                 threadpool=self._pool, repack=self.prefill_file.repack)
        same = (other.n_layers, other.hidden_size, other.vocab_size, other.max_positions, other.kv_bytes_per_token())
        if same != (self.n_layers, self.hidden_size, self.vocab_size, self.max_positions, self.kv_bytes_per_token()):
            other.close()
            raise ConfigError(f"the prefill file {path} is not a copy of {self.path.name} (another shape or context)")
        self._first.append(other._closer)
        say_once(f"llama.cpp: prompts prefilled on {path.name} ({self.prefill_file.kind}, "
                 f"{path.stat().st_size / 2**20:.0f} MiB mapped beside {self.path.name}'s "
                 f"{self.path.stat().st_size / 2**20:.0f} MiB), decoded on {self.path.name}")
        return HybridPrefill(self, other)

    # -- what the engine reads ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the logits handed out (the weights are the GGUF file's own)."""
        return torch.float32

    @property
    def draft_dtype(self) -> torch.dtype:
        """The dtype a torch drafter beside llama.cpp computes in (an eagle head's step): bf16 where oneDNN
        computes it on this CPU (with :attr:`weight_mode` packed), else float32. Measured (AMD EPYC, 2 cores,
        the embedded model's head of 8,192 rows, ``measure_head_cost``): a draft token 0.18 of a llama.cpp step in
        packed bf16, 0.44 in float32."""
        return torch.bfloat16 if packing_supported(torch.bfloat16) else torch.float32

    @property
    def weight_mode(self) -> str:
        """How a torch drafter's weights beside llama.cpp are laid out (:attr:`draft_dtype`)."""
        return "packed" if self.draft_dtype == torch.bfloat16 else "dense"

    @property
    def numerics(self) -> torch.dtype:
        """Quantized kernels over float32 activations, whose rounding differs with the batch shape
        (a verification of several tokens against one-token steps): the audit's bf16-like tolerance."""
        return torch.bfloat16

    def _meta(self, key: str) -> str | None:
        """A metadata value of the model as llama.cpp read it (``None``: the file has no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode() if n > 0 else None

    def final_norm(self) -> tuple[torch.Tensor, float] | None:
        """The model's final RMSNorm, read from the GGUF file once (llama.cpp's API gives no tensor):
        ``output_norm.weight`` (``[hidden]`` float32) and its epsilon; ``None`` if the file holds no
        such weight in float form or no epsilon."""
        if self._final_norm is None:
            self._final_norm = (self._read_final_norm(),)
        return self._final_norm[0]

    def _read_final_norm(self) -> tuple[torch.Tensor, float] | None:
        key = f"{self.describe()['architecture']}.attention.layer_norm_rms_epsilon"
        try:
            values, weight = read_gguf(self.path, (key,), "output_norm.weight")
        except GGUFFormatError:  # llama.cpp read the file, so not expected: routing falls back, said once
            return None
        if key not in values or weight is None or weight.shape != (self.hidden_size,):
            return None
        return torch.from_numpy(weight), float(values[key])

    def describe(self) -> dict:
        """What llama.cpp read of the model: its architecture and shape (the fingerprint's config)."""
        return {"architecture": self._meta("general.architecture") or "unknown", "n_layers": self.n_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "n_params": int(self._lib.llama_model_n_params(self._model))}

    @property
    def n_heads(self) -> int:
        return int(self._lib.llama_model_n_head(self._model))

    @property
    def n_kv_heads(self) -> int:
        return int(self._lib.llama_model_n_head_kv(self._model))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def config(self) -> GGUFModelConfig:
        """The sizes an eagle head over this model takes that llama.cpp's API does not give (its metadata)."""
        arch = self.describe()["architecture"]
        width = self._meta(f"{arch}.feed_forward_length")
        theta = self._meta(f"{arch}.rope.freq_base")
        if width is None:
            raise ConfigError(f"{self.path.name} does not give its MLP width ({arch}.feed_forward_length)")
        return GGUFModelConfig(int(width), float(theta) if theta is not None else 10000.0)

    def _norm(self) -> tuple[torch.Tensor, float]:
        norm = self.final_norm()
        if norm is None:
            raise ConfigError(f"{self.path.name} holds no final norm weight in float form and its epsilon")
        return norm

    @property
    def final_norm_weight(self) -> torch.Tensor:
        """``[hidden]``: the final RMSNorm's weight, read from the file (:meth:`final_norm`)."""
        return self._norm()[0]

    @property
    def norm_eps(self) -> float:
        return self._norm()[1]

    def _tables(self) -> tuple[FileRows, FileRows]:
        """The token embedding's and the LM head's rows, read from the GGUF file when asked for
        (:class:`~adaptive.engine.rows.FileRows`, float32; the head is the embedding where the model ties them)."""
        if self._rows is None:
            embed = FileRows.open(self.path, TOKEN_TABLE, torch.float32)
            if embed is None:
                raise ConfigError(f"{self.path.name} holds no {TOKEN_TABLE}")
            self._rows = (embed, FileRows.open(self.path, HEAD_TABLE, torch.float32) or embed)
        return self._rows

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` float32: the token embeddings of ``ids`` (``[T]``), as the file holds them (an
        eagle head's inputs; llama.cpp embeds its own)."""
        return self._tables()[0](ids)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), hidden]`` float32: the LM head's rows of ``ids``, as the file holds them."""
        return self._tables()[1](ids)

    def close(self) -> None:
        """Free llama.cpp's model and context now (also done when the backbone is collected)."""
        self._closer()

    # -- sequences, as the hybrid's handover moves them -------------------------------------------

    @property
    def lib(self):
        """llama-cpp-python's binding."""
        return self._lib

    @property
    def ctx(self):
        """The ``llama_context`` pointer (calls on it are made under this backbone's lock)."""
        return self._ctx

    @property
    def scratch(self) -> int:
        """The sequence id no cache takes (the routing embedding's and the handover's, one call at a time)."""
        return self._scratch

    def share(self, src: int, dst: int, a: int, b: int) -> None:
        """Tag sequence ``src``'s cells at positions ``a .. b-1`` with ``dst`` as well (no key is copied)."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, a, b)

    def drop(self, seq: int, a: int = -1, b: int = -1) -> None:
        """Drop sequence ``seq``'s cells at positions ``a .. b-1`` (all of them by default)."""
        self._lib.llama_memory_seq_rm(self._mem, seq, a, b)

    # -- caches ---------------------------------------------------------------------------------

    def keeps_features(self, layers: Sequence[int]) -> bool:
        """Whether a cache can keep the feature rows of ``layers``: those under the top one from llama.cpp's
        layer inputs (:attr:`layer_pools`), the top one from its output rows through the final norm, over the
        norm's weight (:attr:`feature_top` "unit": where no weight is 0)."""
        layers = check_feature_layers(tuple(layers), self.n_layers)
        if self.n_layers in layers and (self.final_norm() is None or bool((self.final_norm()[0] == 0).any())):
            return False
        return all(x == self.n_layers for x in layers) or self.layer_pools

    def _tap(self, layers: Sequence[int], users: int) -> None:
        """Add ``users`` (+1, -1) to the users of each layer's input rows; llama.cpp copies them out of every
        forward while a layer has any (turned on or off, the graph is rebuilt once, ~3 ms)."""
        if not layers:
            return
        set_fn = self._layers[0][0]
        with self._lock:
            for layer in layers:
                n = self._taps.get(layer, 0)
                self._taps[layer] = max(0, n + users)
                if (n == 0) != (self._taps[layer] == 0) and self._closer.alive:
                    set_fn(self._ctx, layer, self._taps[layer] > 0)

    def new_cache(self, max_len: int, shared: int = 0, features: Sequence[int] = ()) -> LlamaCache:
        """A sequence for ``max_len`` positions; :class:`PromptTooLongError` beyond the context,
        :class:`ContextFullError` when live caches hold so many of its positions that this one could
        overflow it mid-request (:meth:`free_positions`), and :class:`ConfigError` when ``sequences``
        caches are already alive. Prefix-cache entries give their cells and sequences back, least recently
        used first, as far as this one needs them; ``shared``: positions it will share with a kept
        prefix (:meth:`restore_prefix`: those cells are held already). ``features``: layer counts whose rows
        every forward over the sequence keeps (:attr:`LlamaCache.features`; :meth:`keeps_features`, else a
        :class:`ConfigError`)."""
        layers = check_feature_layers(tuple(features), self.n_layers)
        if layers and not self.keeps_features(layers):
            raise ConfigError(f"this llama.cpp build gives no hidden states of {self.path.name} before its last "
                              "layer (or its final norm has a zero weight): use --engine torch for an eagle head")
        if max_len > self.max_positions:
            raise PromptTooLongError(
                f"prompt plus new tokens need {max_len} positions but the llama.cpp context is {self.max_positions}")
        self._evict_stale()
        while True:  # entries are evicted outside the lock (an eviction takes the store's lock, then this one)
            with self._lock:
                short = max_len - shared > self._cells_free() or not self._free_seqs
            if not short or not any(store.evict_one() for store in (self.prefixes, *self._holders)):
                break
        with self._lock:  # checked and reserved under one lock: two callers cannot both take the last room
            if not self.room_for(max_len) or max_len - shared > self._cells_free():
                raise ContextFullError(f"{max_len} positions are needed and live requests leave "
                                       f"{self.free_positions()} of the llama.cpp context's {self.max_positions}: "
                                       "retry when one has finished")
            if not self._free_seqs:
                gc.collect()  # caches of finished requests that a reference cycle still holds
            if not self._free_seqs:
                raise ConfigError(f"all {self.sequences} llama.cpp sequences are in use: "
                                  "finish a request first, or load the model with more sequences")
            seq = self._free_seqs.pop()
            self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._reserved[seq] = max_len
        cache = LlamaCache(seq, max_len)
        cache._release = weakref.finalize(cache, self._release, seq)
        if layers:
            cache.features = torch.zeros(max_len, len(layers), self.hidden_size)
            cache.feature_layers = layers
            below = tuple(x for x in layers if x < self.n_layers)
            self._tap(below, +1)
            # the taps end with the cache (a prefix kept from it holds a copy of its rows, no taps)
            weakref.finalize(cache, self._tap, below, -1)
        return cache

    def free_positions(self, collect: bool = False) -> int:
        """Positions of the shared context no live cache was made for: what a new request may take
        and be sure to decode to its end (a cache's cells fill as it decodes; caches made for more than
        the context together overflow it mid-request). ``collect``: first collect finished requests'
        caches that a reference cycle still holds (a full garbage collection: only when it matters)."""
        if collect and self._reserved:
            gc.collect()
        with self._lock:
            return self.max_positions - sum(self._reserved.values())

    def room_for(self, positions: int) -> bool:
        """Whether a cache of ``positions`` can be made now without overflowing the shared context: they
        are free (:meth:`free_positions`), after collecting finished requests' caches where they are not."""
        return positions <= self.free_positions() or positions <= self.free_positions(collect=True)

    def _cells_free(self) -> int:
        """Cells neither a live cache was made for nor a prefix-cache entry holds."""
        return self.max_positions - sum(self._reserved.values()) - sum(self._kept.values())

    def _release(self, seq: int) -> None:
        if not self._closer.alive:
            return
        with self._lock:
            self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seqs.append(seq)
            self._reserved.pop(seq, None)
            self._kept.pop(seq, None)

    def keep_prefix(self, cache: LlamaCache, ids: Sequence[int]) -> bool:
        """Keep a finished request's sequence (its first ``cache.length`` cells, of tokens ``ids``) in
        :attr:`prefixes`: the sequence becomes the entry's, its cells beyond them dropped, and its
        reservation shrinks to the cells it holds (an entry is evicted when a new cache needs the room)."""
        n = min(cache.length, len(ids))
        if not self.prefixes.enabled or n < 1 or cache._release is None or not cache._release.alive:
            return False
        with self._lock:
            self._rewind(cache, n)
            cache.staged = None
            cache._release.detach()  # the sequence is the entry's now
            self._reserved.pop(cache.seq, None)
            self._kept[cache.seq] = n
        self._holders.add(self.prefixes)
        features = None if cache.features is None else cache.features[:n].clone()
        kept = _KeptSequence(weakref.ref(self), cache.seq, self.rows, n, features=features,
                             feature_layers=cache.feature_layers)
        return self.prefixes.add(ids[:n], kept, n * self.kv_bytes_per_token())

    def stale_rows(self) -> int:
        """Rows fed after which an entry not restored is given back (:func:`stale_horizon` of the reuses seen)."""
        return stale_horizon(self._reuse_ages, self._kept_reused)

    def _evict_stale(self) -> None:
        """Give back the kept entries (of every store that held this context's) not restored within the
        last :meth:`stale_rows` rows fed: every decode attends over the cells in use, kept ones
        included, so an entry not reused that long has cost more than prefilling it again would."""
        horizon = self.stale_rows()

        def stale(handle) -> bool:
            return (isinstance(handle, _KeptSequence) and handle.backbone() is self
                    and self.rows - handle.used_at > horizon)

        for store in {id(s): s for s in (self.prefixes, *self._holders)}.values():
            store.evict_stale(stale)

    def restore_prefix(self, entry, cache: LlamaCache, n: int) -> int:
        """Share a kept entry's first ``n`` cells with a new sequence (llama.cpp copies no keys: the
        cells are tagged with both sequences): ``n``; 0 for a cache keeping feature rows the entry has not."""
        with self._lock:
            if cache.written:
                raise ValueError("a prefix is restored into a new sequence only")
            if cache.features is not None:
                kept = entry.handle.features
                if kept is None or entry.handle.feature_layers != cache.feature_layers:
                    return 0
                cache.features[:n] = kept[:n]
            self._lib.llama_memory_seq_cp(self._mem, entry.handle.seq, cache.seq, 0, n)
            cache.written = n
            handle = entry.handle
            if 2 * n >= handle.tokens:  # a reuse of the entry, not only of a start it shares with others
                self._reuse_ages.append(self.rows - handle.used_at)
                handle.used_at, handle.reused = self.rows, True
        return n

    def kv_bytes_per_token(self) -> int:
        """Bytes a cached position holds: every layer's key and value in float16 (llama.cpp's default cache type)."""
        lib, model = self._lib, self._model
        head_dim = self.hidden_size // int(lib.llama_model_n_head(model))
        return 2 * 2 * self.n_layers * int(lib.llama_model_n_head_kv(model)) * head_dim

    # -- forwards -------------------------------------------------------------------------------

    def forward(self, input_ids, cache: LlamaCache, start: int, skip_masks=None, logits: str = "last",
                pool: bool = False, head=None, read_only: bool = False, adapter=None, hidden: bool = False,
                pool_layers: tuple[int, ...] = (), pool_last: bool = False) -> ForwardOutput:
        """Run tokens ``input_ids`` (``[T]``) at positions ``start .. start+T-1`` of ``cache``'s sequence.

        ``logits``: ``"last"``, ``"all"`` or ``"none"``; ``pool_last``: also return the final-normed
        hidden state at the last position as ``pooled`` (``[hidden]``, float32; :meth:`pool_args`).
        ``pool_layers``: as the torch backbone's, the residual stream after each of these many layers
        (``0 .. n_layers - 1``) through the final norm, its mean over the fed positions and its last
        one (``ForwardOutput.layer_pools``, ``{layer: [2, hidden]}``), taken from this forward's own
        graph (:attr:`layer_pools` says whether this build and model give them).
        The torch backbone's other options (sublayer skipping, another head, early-exit adapters,
        hidden states, read-only forwards, the final layer's mean) are refused with :class:`ConfigError`.
        Does not change ``cache.length``.
        """
        with self._lock:
            return self._forward(input_ids, cache, start, logits, pool_last, tuple(pool_layers),
                                 skip_masks is not None or head is not None or read_only or adapter is not None
                                 or hidden or pool)

    def forward_argmax(self, input_ids: Sequence[int] | torch.Tensor, cache: LlamaCache, start: int) -> list[int]:
        """The argmax of the logits at every fed position (``T`` ints), taken in place in llama.cpp's
        buffer: no row of the vocabulary copied and no torch operation (between two decodes each
        cost ~0.1 ms here, the Python overhead that separated our plain decoding from
        ``llama-server``'s). As :meth:`forward` with ``logits="all"``; greedy verification needs no more."""
        with self._lock:
            ids = self._checked(input_ids, cache, start, "all")
            return self._feed(ids, cache, start, "all", None, argmax=True)

    def _forward(self, input_ids, cache: LlamaCache, start: int, logits: str, pool_last: bool,
                 pool_layers: tuple[int, ...], torch_only: bool) -> ForwardOutput:
        if torch_only:
            raise ConfigError("the llama.cpp engine runs the whole model only (no skipped sublayers, other heads, "
                              "exits or hidden states): use --engine torch for that")
        ids = self._checked(input_ids, cache, start, logits)
        T = len(ids)
        if self.hybrid is not None and self.hybrid.takes(T, cache, logits):
            out = self.hybrid.forward(ids, cache, start, logits, pool_last, pool_layers)
            if out is not None:
                return out
        taps = _LayerTaps(self, pool_layers) if pool_layers else None  # capture on: closed below, whatever happens
        try:
            rows = self._feed(ids, cache, start, logits, taps)
        finally:
            if taps is not None:
                taps.close()
        pooled = self._last_hidden(cache, ids[-1], start + T - 1) if pool_last else None
        return ForwardOutput(torch.cat(rows) if len(rows) > 1 else (rows[0] if rows else None), pooled,
                             layer_pools=taps.pools(T) if taps is not None else None)

    def _checked(self, input_ids, cache: LlamaCache, start: int, logits: str) -> list[int]:
        """A forward's ids as ints, its arguments checked and the sequence rewound to ``start``."""
        ids = _ids(input_ids)
        if not ids:
            raise ValueError("a forward needs at least one token")
        if start + len(ids) > cache.max_len:
            raise PromptTooLongError(f"positions up to {start + len(ids)} exceed the cache of {cache.max_len}")
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
        self._rewind(cache, start)
        return ids

    def _feed(self, ids: list[int], cache: LlamaCache, start: int, logits: str, taps: _LayerTaps | None,
              argmax: bool = False) -> list:
        """Decode ``ids`` at ``start ..`` in llama.cpp batches: the logits rows of each batch
        (``[n, V]`` tensors), or with ``argmax`` the argmax of every row (one list of ints)."""
        rows = []
        # a cache keeping feature rows takes every fed row's output (its top row): a micro-batch at a time,
        # so that llama.cpp's output buffer stays at 512 rows of the vocabulary
        size = N_BATCH if cache.features is None else N_UBATCH
        for a in range(0, len(ids), size):
            chunk = ids[a:a + size]
            last = a + size >= len(ids)
            flags = True if logits == "all" else ("last" if logits == "last" and last else False)
            cache.written = start + a + len(chunk)  # before the decode: a failed one is dropped by the next
            r, _ = self._decode([(chunk, cache.seq, start + a, flags)], argmax=argmax, keep=[cache])
            if r is not None and argmax:
                rows.extend(r)
            elif r is not None:
                rows.append(r)
            if taps is not None:
                taps.read(len(chunk))
        return rows

    def _last_hidden(self, cache: LlamaCache, token: int, pos: int) -> torch.Tensor:
        """``[hidden]``: the final-normed hidden state of ``token`` at ``pos`` over the sequence's cached
        positions ``0 .. pos - 1``, decoded in the scratch sequence (sharing those cells), then dropped."""
        lib = self._lib
        lib.llama_memory_seq_cp(self._mem, cache.seq, self._scratch, 0, pos)
        try:
            return self._decode([([token], self._scratch, pos, True)], embeddings=True)[1]
        finally:
            lib.llama_memory_seq_rm(self._mem, self._scratch, -1, -1)

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """Several sequences' forwards in one ``llama_decode``: each segment's logits at every fed
        position (``[T_i, vocab]`` float32; ``None`` for a segment with ``logits=False``), in order;
        ragged, nothing padded. As
        :meth:`~adaptive.engine.backbone.Backbone.forward_batch` (each segment its own cache and start)."""
        if not segments:
            return []
        with self._lock:
            return self._forward_batch(segments)

    def _forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        parts, total = [], 0
        for s in segments:
            ids = _ids(s.ids)
            if not ids:
                raise ValueError("a segment of a batched forward has no tokens")
            if s.start + len(ids) > s.cache.max_len:
                raise PromptTooLongError(f"positions up to {s.start + len(ids)} exceed the cache of {s.cache.max_len}")
            self._rewind(s.cache, s.start)
            s.cache.written = s.start + len(ids)
            parts.append((ids, s.cache.seq, s.start, bool(s.logits)))
            total += len(ids)
        if total > N_BATCH:
            raise ValueError(f"a batched forward of {total} tokens exceeds llama.cpp's batch of {N_BATCH}")
        rows = self._decode(parts, keep=[s.cache for s in segments])[0]
        out, row = [], 0
        for ids, _, _, wanted in parts:
            out.append(rows[row:row + len(ids)] if wanted else None)
            row += len(ids) if wanted else 0
        return out

    def _rewind(self, cache: LlamaCache, start: int) -> None:
        """Drop the sequence's positions from ``start`` on (rejected drafts, a rewound race block)."""
        if start > cache.written:
            raise ValueError(f"a forward at position {start} of a sequence that holds {cache.written} positions")
        if cache.written > start:
            self._lib.llama_memory_seq_rm(self._mem, cache.seq, start, -1)
            cache.written = start

    def _decode(self, parts, embeddings: bool = False, argmax: bool = False,
                keep: Sequence[LlamaCache] = ()) -> tuple[torch.Tensor | list[int] | None, torch.Tensor | None]:
        """One ``llama_decode`` of ``parts`` (``(ids, seq, start, logits)``, ``logits`` True for every
        row, ``"last"`` for the last, False for none); returns the logits rows (``[n, V]``, a copy: the
        next decode overwrites llama.cpp's buffer), or with ``argmax`` each row's argmax (``n`` ints,
        read in place), and, with ``embeddings``, the last row's hidden state. ``keep``: each part's cache,
        whose feature rows (where it keeps them) this decode writes (:meth:`_keep_features`)."""
        lib, b = self._lib, self._batch
        keeps = [c is not None and c.features is not None for c in keep] + [False] * (len(parts) - len(keep))
        keeping = any(keeps)
        n = n_out = 0
        wanted: list[int] = []  # the output rows asked for, where a part keeping features outputs every row
        for (ids, seq, start, flags), kept in zip(parts, keeps):
            T = len(ids)
            for j in range(T):
                b.token[n + j] = ids[j]
                b.pos[n + j] = start + j
                b.n_seq_id[n + j] = 1
                b.seq_id[n + j][0] = seq
                b.logits[n + j] = kept or flags is True or (flags == "last" and j == T - 1)
            if keeping:
                asked = range(T) if flags is True else ([T - 1] if flags == "last" else [])
                wanted.extend(n_out + j for j in asked)
            n += T
            n_out += T if kept or flags is True else int(flags == "last")
        b.n_tokens = n
        self.rows += n
        top = any(kept and self.n_layers in c.feature_layers for c, kept in zip(keep, keeps))
        if embeddings or top:
            lib.llama_set_embeddings(self._ctx, True)
        try:
            rc = lib.llama_decode(self._ctx, b)
        finally:
            if embeddings or top:
                lib.llama_set_embeddings(self._ctx, False)
        if rc == 1:
            raise PromptTooLongError(f"llama.cpp could not decode {n} tokens: its KV cache is full "
                                     "(all live sequences share the context)")
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not decode {n} tokens: error {rc}")
        rows = None
        handed = len(wanted) if keeping else n_out  # rows output for the feature rows alone are not handed out
        if handed:
            ptr = lib.llama_get_logits(self._ctx)
            view = np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size))
            if handed != n_out:
                view = view[wanted]
            rows = view.argmax(axis=1).tolist() if argmax else torch.from_numpy(np.array(view))
        if keeping:
            self._keep_features(parts, keep, keeps, n_out)
        hidden = None
        if embeddings:
            ptr = lib.llama_get_embeddings_ith(self._ctx, -1)
            hidden = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.hidden_size,)).copy())
        return rows, hidden

    def _keep_features(self, parts, keep, keeps, n_out: int) -> None:
        """Write the feature rows of the parts whose caches keep them (``keeps``) from the decode just run:
        a layer's input rows (every fed row, in the batch's order) and the top layer's from the output rows
        (every row of such a part is one) through the final norm, over its weight (:attr:`feature_top`)."""
        H = self.hidden_size
        n = sum(len(p[0]) for p in parts)
        layers = sorted({x for c, k in zip(keep, keeps) if k for x in c.feature_layers})
        rows = {}
        for x in layers:
            if x < self.n_layers:
                ptr = self._layers[0][1](self._ctx, x)
                if not ptr:
                    raise ConfigError(f"llama.cpp gave no rows for the input of layer {x} of this model")
                rows[x] = np.ctypeslib.as_array(ptr, shape=(n, H))
            else:
                ptr = self._lib.llama_get_embeddings(self._ctx)
                if not ptr:
                    raise ConfigError("llama.cpp gave no output rows of this model's final norm")
                rows[x] = np.ctypeslib.as_array(ptr, shape=(n_out, H)) / self.final_norm()[0].numpy()
        row = out = 0
        for (ids, _, start, flags), k, c in zip(parts, keeps, list(keep) + [None] * (len(parts) - len(keep))):
            T = len(ids)
            if k:
                for i, x in enumerate(c.feature_layers):
                    at = out if x == self.n_layers else row
                    c.features[start:start + T, i] = torch.from_numpy(np.asarray(rows[x][at:at + T], np.float32))
            row += T
            out += T if k or flags is True else int(flags == "last")

    # -- the prompt embedding (routing) ---------------------------------------------------------

    @property
    def layer_pools(self) -> bool:
        """Whether forwards give the residual stream after any layer (``pool_layers``): this build has
        llama.cpp's layer-input API and this model's graph fills it (probed once, on a two-token
        decode in the scratch sequence; the final norm read from the GGUF file)."""
        with self._lock:
            if self._layers is None:
                try:
                    self._layers = self._probe_layers() or False
                except PromptTooLongError:  # no cell free for the probe now: ask again later
                    return False
            return bool(self._layers)

    def _probe_layers(self):
        api = layer_input_api(self._lib)
        arch = self.describe()["architecture"]
        norm = self.final_norm() if api is not None else None
        if api is None or norm is None or not _layer_inputs_safe(self.path, arch):
            return None
        return self._probe_here(api, norm)

    def _probe_here(self, api, norm):
        """The probe itself, in this process: a two-token decode with one layer's input asked for."""
        set_fn, get_fn = api
        layer = max(1, self.n_layers // 3)
        set_fn(self._ctx, layer, True)
        try:
            self._decode([([1, 2], self._scratch, 0, "last")])
            ptr = get_fn(self._ctx, layer)
            rows = np.ctypeslib.as_array(ptr, shape=(2, self.hidden_size)) if ptr else None
            # filled by this forward: finite, not zero, one row per token
            ok = rows is not None and bool(np.isfinite(rows).all() and rows.any() and (rows[0] != rows[1]).any())
        finally:
            set_fn(self._ctx, layer, False)
            self._lib.llama_memory_seq_rm(self._mem, self._scratch, -1, -1)
        return (api, norm) if ok else None

    def pool_args(self, pooling) -> dict:
        """The :meth:`forward` arguments that compute ``pooling``: the final layer's last position as
        before layer pools existed here (a decode of the last token in the scratch sequence: profiles
        calibrated with it route on the same numbers), any other from the prefill's own graph
        (:attr:`layer_pools`; without them, a :class:`ConfigError`)."""
        layer = self.n_layers if pooling.layer is None else pooling.layer
        if layer > self.n_layers:
            raise ValueError(f"pooling after layer {layer} of a {self.n_layers}-layer model")
        if layer == self.n_layers and pooling.mode == "last":
            return {"pool_last": True}
        if layer == self.n_layers:  # the input of no layer: llama.cpp gives the last one's output at one position only
            raise ConfigError("the llama.cpp engine pools the final layer at the last position only, not its mean: "
                              "use --engine torch, or a pooling of an earlier layer")
        if not self.layer_pools:
            raise ConfigError(f"this llama.cpp build gives no hidden state before the last layer of this model, so "
                              f"not the {pooling.mode} after {layer} of {self.n_layers} layers: use --engine torch")
        return {"pool_layers": (layer,)}

    def pooled(self, out: ForwardOutput, pooling) -> torch.Tensor:
        """``[hidden]`` float32: the embedding a forward with :meth:`pool_args` computed (alone or merged
        with other poolings')."""
        layer = self.n_layers if pooling.layer is None else pooling.layer
        if layer == self.n_layers and pooling.mode == "last":
            return out.pooled
        return out.layer_pools[layer][0 if pooling.mode == "mean" else 1]

    def routing_pooling(self, pooling):
        """The pooling this engine computes for ``pooling``: as asked where :attr:`layer_pools`, else
        the final layer's last position (said once on stderr)."""
        final = pooling.layer in (None, self.n_layers)
        if (final and pooling.mode == "last") or (not final and self.layer_pools):
            return pooling
        if not final:
            say_once(f"this llama.cpp build gives no hidden state before the last layer of {self.path.name}: "
                      "routing on the final layer's last position")
        return type(pooling)(None, "last")

    def sublayer_influence(self, input_ids, from_position: int = 0):
        raise ConfigError("sublayer influence needs the torch engine (llama.cpp runs the whole model)")


LAYER_INPUTS_FILE = "layer-inputs.json"  # per llama-cpp-python version and architecture: probed safe or not


def _layer_inputs_safe(path: Path, arch: str) -> bool:
    """Whether asking llama.cpp for a layer's input is safe for this architecture: some graph builders
    (Qwen2's in llama-cpp-python 0.3.36) never record it, and llama.cpp then aborts the whole
    process (``GGML_ASSERT(t_layer_inp[il] != nullptr)``), which no Python code can catch. So the
    first time an architecture is met it is probed in a child process (:func:`_probe_child`), and the
    answer is kept in ``$ADAPTIVE_CACHE/llama.cpp/layer-inputs.json`` (default ``~/.cache/adaptive``)."""
    version = importlib.import_module("llama_cpp").__version__
    return bool(probe(LAYER_INPUTS_FILE, f"{version}:{arch}", "_probe_child", path,
                       f"llama.cpp's layer inputs for {arch}", (signal.SIGABRT,)))


def prefill_rate(path: str | Path, repack: bool = True, tokens: int = RATE_TOKENS, repeats: int = 2) -> float:
    """Tokens per second of a ``tokens``-token prompt prefilled on ``path`` with this machine's threads (the best
    of ``repeats`` after a short warm-up; token ids spread over the vocabulary), with llama.cpp's repacked layouts
    where ``repack`` and this machine allows them: what :func:`~adaptive.engine.prefill_file.measured_rates`
    compares."""
    bb = LlamaCppBackbone(path, context=max(16, tokens + 1), sequences=1, repack=repack)
    try:
        ids = [(i * 7919 + 13) % bb.vocab_size for i in range(tokens)]
        cache = bb.new_cache(tokens + 1)
        bb.forward(ids[:16], cache, 0, logits="last")
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            bb.forward(ids, cache, 0, logits="last")
            best = min(best, time.perf_counter() - t)
        return tokens / best
    finally:
        bb.close()


def extra_buffers_child(path: str) -> None:
    """In a child process: decode a prompt and a step of ``path`` with the extra buffers on, then print
    ``ok`` (a fault kills the process first). A 64-token prompt multiplies matrices as a prefill does,
    the single token as a decoding step."""
    bb = LlamaCppBackbone(path, threads=1, context=128, sequences=1)
    ids = [i % bb.vocab_size for i in range(1, 65)]
    cache = bb.new_cache(80)
    bb.forward(ids, cache, 0, logits="last")
    bb.forward(ids[:1], cache, 64, logits="last")
    print("ok")


def _probe_child(path: str) -> None:
    """In a child process: try a layer input on ``path`` and print ``ok`` (llama.cpp may abort instead)."""
    bb = LlamaCppBackbone(path, threads=1, context=64, sequences=1)
    api = layer_input_api(bb._lib)
    norm = bb.final_norm()
    print("ok" if api is not None and norm is not None and bb._probe_here(api, norm) else "none")


class _LayerTaps:
    """The residual stream after some layers, read from llama.cpp's layer-input rows while one forward
    runs (``read`` after each decode), through the final norm: :meth:`pools`, as the torch backbone's."""

    def __init__(self, bb: LlamaCppBackbone, layers: tuple[int, ...]):
        if not bb.layer_pools:
            raise ConfigError("this llama.cpp build gives no hidden state before the last layer of this model: "
                              "use --engine torch for layer pools")
        (self.set_fn, self.get_fn), (self.weight, self.eps) = bb._layers
        self.bb, self.layers = bb, layers
        bad = [layer for layer in layers if not 0 <= layer < bb.n_layers]  # the input of layer L: L < n_layers
        if bad:
            raise ValueError(f"pooling after layer(s) {bad} of a {bb.n_layers}-layer model")
        self.sums = {layer: torch.zeros(bb.hidden_size) for layer in layers}
        self.last: dict[int, torch.Tensor] = {}
        bb._tap(layers, +1)

    def read(self, n: int) -> None:
        """Take the rows of the ``n`` tokens the last decode fed."""
        for layer in self.layers:
            ptr = self.get_fn(self.bb._ctx, layer)
            if not ptr:
                raise ConfigError(f"llama.cpp gave no rows for the input of layer {layer} of this model")
            rows = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n, self.bb.hidden_size)).copy())
            normed = rms_norm(rows, self.weight, self.eps)
            self.sums[layer] += normed.sum(dim=0)
            self.last[layer] = normed[-1]

    def close(self) -> None:
        self.bb._tap(self.layers, -1)

    def pools(self, n: int) -> dict[int, torch.Tensor]:
        """``{layer: [2, hidden]}``: the mean over the ``n`` fed positions and the last one."""
        return {layer: torch.stack([self.sums[layer] / n, self.last[layer]]) for layer in self.layers}


def stale_horizon(ages: Sequence[int], reused: Sequence[bool] = ()) -> int:
    """Rows fed after which a kept entry not restored is given back. ``reused``: of the entries given back
    lately, whether each had been reused (for half its cells or more); ``ages``: the rows between an
    entry's keeping or last reuse and its reuse, of the reuses seen. The break-even :data:`STALE_ROWS`,
    scaled by the share reused once :data:`REUSE_SAMPLES` entries went (an entry is worth its cells only
    as likely as it is reused); once as many reuses were seen, at most twice their 90th percentile; at
    least :data:`MIN_STALE_ROWS`. Examples: nothing seen -> 4,096; eight entries, two reused -> 1,024;
    eight, none reused (a single-turn mix) -> 256; every entry reused, ages 100 .. 800 by 100 -> 1,600."""
    horizon = STALE_ROWS
    if len(reused) >= REUSE_SAMPLES:
        horizon = int(STALE_ROWS * sum(map(bool, reused)) / len(reused))
    ordered = sorted(ages)
    if len(ordered) >= REUSE_SAMPLES:
        horizon = min(horizon, 2 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])
    return max(MIN_STALE_ROWS, min(STALE_ROWS, horizon))


def _ids(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(t) for t in x.reshape(-1).tolist()]
    return [int(t) for t in x]


def _free_native(lib, model, ctx, batch, pool, first) -> None:
    for close in first:
        close()
    lib.llama_batch_free(batch)
    if pool is not None:
        threadpool, free_pool, detach = pool
        detach(ctx)
    lib.llama_free(ctx)
    if pool is not None:
        free_pool(threadpool)
    lib.llama_model_free(model)
