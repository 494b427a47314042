"""Raw token-id decoding on a given backbone, for tests that need no text: the package's public
:func:`~adaptive.engine.loop.prefill` then :func:`~adaptive.engine.loop.decode_steps`, as
:meth:`adaptive.Engine.decode` drives them, but with no EOS or stop strings (exactly
``cfg.max_new_tokens`` tokens) and on any backbone (a llama.cpp one included)."""

from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import (
    Acceptor,
    GenerationStats,
    decode_steps,
    default_acceptor,
    new_cache,
    new_generator,
    prefill,
)
from adaptive.engine.protocol import DecodeState, Drafter, DraftLengthPolicy


def decode_ids(backbone, prompt_ids: list[int], cfg: GenerationConfig, drafter: Drafter | None = None,
               policy: DraftLengthPolicy | None = None, stats: GenerationStats | None = None,
               acceptor: Acceptor = default_acceptor) -> list[int]:
    """The generated ids: the prefill's token, then every step's (accepted drafts and the target's
    own token). ``drafter=None`` decodes plainly; ``stats`` (when given) is filled in."""
    stats = stats if stats is not None else GenerationStats()
    gen = new_generator(cfg, backbone.device)
    cache = new_cache(backbone, len(prompt_ids), cfg)
    pre = prefill(backbone, prompt_ids, cache, cfg, gen)
    stats.prompt_tokens, stats.prefill_time = len(prompt_ids), pre.time
    state = DecodeState(backbone, cache, list(prompt_ids) + [pre.first], cfg, gen)
    return [pre.first] + [t for new in decode_steps(backbone, state, drafter, policy, cfg, stats, acceptor)
                          for t in new]
