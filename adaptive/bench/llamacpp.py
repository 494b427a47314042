"""llama.cpp as a benchmark baseline: the same GGUF file, the same prompt tokens, greedy.

What a CPU user already has without us: ``llama-cpp-python`` (the optional extra ``llamacpp``)
decoding the very GGUF file our model was converted from, with the same thread count, the prompt
encoded by our tokenizer and chat template (the token ids are passed as they are, so both read the
same prompt), ``max_new_tokens`` tokens or up to EOS, prefill included in the time as for every
method. ``llama.cpp-pld`` is its prompt-lookup decoding (``LlamaPromptLookupDecoding``).

llama.cpp decodes with the file's own quantized weights (Q4_1 for the embedded model), not ours,
so its tokens are compared with ``ar`` as agreement, never as a lossless check.
"""

from __future__ import annotations

import importlib.util
import time
from contextlib import contextmanager
from pathlib import Path

from adaptive.engine import llamacpp
from adaptive.errors import ConfigError

INSTALL = "pip install 'adaptive[llamacpp]' (llama-cpp-python; it builds llama.cpp from source: minutes)"


def gguf_path(lm) -> Path:
    """The GGUF file ``lm`` was loaded from; a clear error when it came from elsewhere."""
    path = Path(lm.source)
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"the llama.cpp baseline needs the model's GGUF file, but {lm.name} was loaded from "
                          f"{lm.source or 'memory'}; load it by its embedded name or a .gguf path")
    return path


@contextmanager
def _extra_buffers(allowed: bool):
    """While a ``Llama`` loads: its model parameters with llama.cpp's extra buffer types on or off
    (:func:`adaptive.engine.llamacpp.extra_buffers_ok`); the high-level class takes no such argument,
    so the binding's default parameters are wrapped for the time of the call."""
    import llama_cpp.llama_cpp as low

    if allowed:
        yield
        return
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCpp:
    """One llama.cpp model kept loaded across prompts; :meth:`generate` resets its cache each time
    (no prompt-prefix reuse between runs: every run pays its prefill, as ours do)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, prompt_lookup: bool = False, draft_len: int = 10):
        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError(f"the llama.cpp baseline needs llama-cpp-python: {INSTALL}")
        from llama_cpp import Llama

        draft = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=draft_len)
        # prompt lookup verifies drafts against every position's logits: the binding needs logits_all
        with _extra_buffers(llamacpp.extra_buffers_ok(gguf)):
            self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=min(512, n_ctx), draft_model=draft, logits_all=prompt_lookup, verbose=False,
                             seed=0)

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
        """Greedy tokens after ``ids`` (up to and including an EOS) and the wall time in seconds."""
        self.llm.reset()
        out: list[int] = []
        t = time.perf_counter()
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t
