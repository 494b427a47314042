"""The hybrid llama.cpp engine: prompts prefilled on the prefill file's context, the sequence handed to the
decode file's context, which decodes and verifies (terms: :mod:`adaptive.engine.prefill_file`).

A key or value row of the KV cache is laid out by the architecture (layers, KV heads, head size, the
cache's float16), not by the weights' format, so a sequence prefilled over one file's weights can be
attended by another file's context of the same model. llama.cpp's sequence-state API writes a sequence's
cells (positions and every layer's key and value rows) to a buffer and reads them into another context's
sequence (``llama_state_seq_get_data`` / ``llama_state_seq_set_data``): the handover.

:class:`HybridPrefill` runs one forward of the decode backbone (:class:`~adaptive.engine.llamacpp.LlamaCppBackbone`,
under its lock) on the prefill backbone instead, when the forward is a prompt's (:meth:`HybridPrefill.takes`):
its logits asked for at the last position or none (a verification asks for every position, and a decoding
step feeds one token: both stay on the decode file), at least :data:`MIN_TOKENS` tokens, and no feature rows
kept (an eagle head's rows come from the decode file's graph).

1. **Staging.** The prefill context mirrors the sequence in a cache of its own (``LlamaCache.staged``).
   When it does not hold the sequence's first ``start`` positions (the first chunk after a restored prefix,
   a rewind), they are copied from the decode context first (its whole sequence: it was just rewound to
   ``start``). Consecutive chunks of one prompt stay staged, so a chunked prefill copies its prefix once.
2. **Prefill.** The prefill backbone's own forward over the staged cache: its logits, its routing pools and
   layer pools (so a request is routed on the prefill file's residual stream) are the forward's.
3. **Handover.** The new positions alone (``start ..``): shared into the prefill context's scratch sequence
   (no copy: the cells are tagged), written from it, read into the decode context's scratch sequence, shared
   into the request's sequence, the scratch sequences dropped. Positions the decode context already holds
   (a restored prefix's shared cells) are not copied again. Measured (AMD EPYC, 2 cores, the embedded
   model): 5.6 ms per 1,000 positions (23 MB of KV), against 1.5 s to prefill them on BF16.
4. A forward that asked for the last position's logits ends the prompt: the staged cache is given back.

Losslessness: the hybrid is an engine of its own. Its plain decoding and its speculative decoding prefill
the same prompt the same way (the rule reads only the forward's shape), so greedy speculative output equals
its plain greedy output as on any llama.cpp context; it parts from pure decode-file decoding where the two
files' prompt rows round apart (measured and documented in docs/design.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive.engine.llamacpp_host import load_seq_state, seq_state
from adaptive.errors import ConfigError, ContextFullError

if TYPE_CHECKING:  # the backbone module imports this one
    from adaptive.engine.llamacpp import LlamaCache, LlamaCppBackbone

# the fewest tokens a forward prefills on the prefill file: a 2-token forward is a verification's or a
# short chunk's; from 8 tokens BF16 is faster than Q4_1 on the embedded model (2 cores: 16 tokens 33 against
# 70 ms), and a prompt shorter than that costs little either way
MIN_TOKENS = 8


class HybridPrefill:
    """Prompts of ``decode``'s sequences prefilled on ``prefill`` (the same model in another file), handed back
    (see the module docstring). ``handed``: positions handed over so far; ``copied``: positions staged
    from the decode context; ``refused``: prompts prefilled on the decode file for want of room here."""

    def __init__(self, decode: LlamaCppBackbone, prefill: LlamaCppBackbone, min_tokens: int = MIN_TOKENS):
        if min_tokens < 2:
            raise ValueError(f"min_tokens must be >= 2 (a decoding step is one token), got {min_tokens}")
        self.decode, self.prefill, self.min_tokens = decode, prefill, min_tokens
        self.handed = self.copied = self.refused = 0

    def takes(self, tokens: int, cache: LlamaCache, logits: str) -> bool:
        """Whether a forward of ``tokens`` over ``cache`` asking for ``logits`` is a prompt's, prefilled here."""
        return tokens >= self.min_tokens and logits != "all" and cache.features is None

    def forward(self, ids: list[int], cache: LlamaCache, start: int, logits: str, pool_last: bool,
                pool_layers: tuple[int, ...]):
        """The decode backbone's forward of ``ids`` at ``start`` (already rewound there), prefilled here and
        handed over: the prefill backbone's :class:`~adaptive.engine.backbone.ForwardOutput`; ``None`` where the
        prefill context has no room or sequence for it now (the caller prefills on the decode file then)."""
        try:
            staged = self._staged(cache, start)
        except (ContextFullError, ConfigError):
            cache.staged = None
            self.refused += 1
            return None
        try:
            out = self.prefill.forward(ids, staged, start, logits=logits, pool_last=pool_last,
                                       pool_layers=pool_layers)
            self._hand_over(staged, cache, start, start + len(ids))
        except BaseException:
            cache.staged = None  # nothing staged after a failure (the decode side: rewound by its next forward)
            raise
        if logits != "none":
            cache.staged = None  # the prompt is prefilled: its decoding is the decode context's
        return out

    def _staged(self, cache: LlamaCache, start: int) -> LlamaCache:
        """The prefill context's cache holding ``cache``'s first ``start`` positions."""
        staged = cache.staged
        if staged is not None and staged.written == start:
            return staged
        if staged is None:
            staged = cache.staged = self.prefill.new_cache(cache.max_len)
        self.prefill.drop(staged.seq)
        staged.written = 0
        if start:
            dec = self.decode
            load_seq_state(self.prefill.lib, self.prefill.ctx, seq_state(dec.lib, dec.ctx, cache.seq), staged.seq)
            staged.written = start
            self.copied += start
        return staged

    def _hand_over(self, staged: LlamaCache, cache: LlamaCache, a: int, b: int) -> None:
        """Positions ``a .. b-1`` of ``staged`` into ``cache``'s sequence of the decode context."""
        src, dst = self.prefill, self.decode
        src.share(staged.seq, src.scratch, a, b)
        try:
            buf = seq_state(src.lib, src.ctx, src.scratch)
        finally:
            src.drop(src.scratch)
        try:
            load_seq_state(dst.lib, dst.ctx, buf, dst.scratch)
            dst.share(dst.scratch, cache.seq, a, b)
        finally:
            dst.drop(dst.scratch)
        cache.written = b
        self.handed += b - a
