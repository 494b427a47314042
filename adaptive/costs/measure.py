"""Measuring the cost model on this machine: timed forwards of the backbone at a context length.

Every decoder layer of a model has the same shape, so one attention sublayer costs the same as
any other (and likewise MLPs); what differs between machines and dtypes is the split between
attention, MLP and the fixed rest (embeddings, final norm, LM head, framework overhead), which
every draft token pays whatever is skipped. :func:`measure_costs` times one-token forwards with
all attention, all MLP, or nothing skipped, and multi-token verification forwards;
:func:`measure_prefill` times whole-prompt prefills at a few lengths (what choosing an engine per
request weighs against decoding).
"""

from __future__ import annotations

import statistics
import time

import torch

from adaptive.costs.model import CostModel


def _verify_ratios(backbone, ids, cache, context: int, full: float, max_verify: int, repeats: int, sync) -> list[float]:
    """Cost of a full forward over 1..max_verify tokens relative to ``full`` (one token), at ``context``."""
    verify = [1.0]
    for n in range(2, max_verify + 1):
        t = _time(lambda n=n: backbone.forward(ids[context:context + n], cache, context, logits="all"), repeats, sync)
        verify.append(max(t / full, verify[-1]))  # a longer forward never counts as cheaper
    return verify


@torch.inference_mode()
def measure_verify_costs(backbone, context: int, max_verify: int = 13, repeats: int = 7) -> list[float]:
    """Verification costs (a full forward over ``n`` = 1..``max_verify`` tokens, relative to one token)
    at ``context`` cached positions: a domain with long prompts pays relatively less for long drafts
    than the cost model's 128 positions say, so calibration measures this at each domain's length."""
    sync, context, ids, cache = _timing_setup(backbone, context, max_verify)
    one = lambda: backbone.forward(ids[context:context + 1], cache, context, logits="last")  # noqa: E731
    for _ in range(2):
        one()
    full = _time(one, repeats, sync)
    return [round(v, 4) for v in _verify_ratios(backbone, ids, cache, context, full, max_verify, repeats, sync)]


def _sync(dev: torch.device):
    """What waits for ``dev``'s queued work before a clock is read (nothing on the CPU)."""
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def _timing_setup(backbone, context: int, extra: int):
    """``(sync, context, ids, cache)`` for timing forwards after ``context`` cached positions: random
    ids (fixed seed) for ``context + extra`` positions, the first ``context`` already prefilled."""
    dev = backbone.device
    sync = _sync(dev)
    context = max(1, min(context, backbone.max_positions - extra - 1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, backbone.vocab_size, (context + extra,), generator=gen).to(dev)
    cache = backbone.new_cache(context + extra)
    backbone.forward(ids[:context], cache, 0, logits="none")
    return sync, context, ids, cache


def _time(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(backbone, context: int = 128, max_verify: int = 9, repeats: int = 15) -> CostModel:
    """Time the forwards the cost model needs at ``context`` cached positions (median of ``repeats``).

    On an engine that cannot skip sublayers (llama.cpp) only the full step and the verifications are
    timed; the sublayer costs are 0 and every draft token of the whole model costs a full step."""
    L = backbone.n_layers
    sync, context, ids, cache = _timing_setup(backbone, context, max_verify)
    none = (False,) * L
    every = (True,) * L
    one = ids[context:context + 1]

    def step(masks):
        return lambda: backbone.forward(one, cache, context, skip_masks=masks, logits="last")

    for _ in range(3):  # warm-up
        step(None)()
    full = _time(step(None), repeats, sync)
    if not backbone.layer_skip:
        verify = _verify_ratios(backbone, ids, cache, context, full, max_verify, max(5, repeats // 3), sync)
        return CostModel((0.0,) * L, (0.0,) * L, 1.0, tuple(verify), step_ms=full * 1e3, context=context)
    no_attn = _time(step((every, none)), repeats, sync)
    no_mlp = _time(step((none, every)), repeats, sync)
    verify = _verify_ratios(backbone, ids, cache, context, full, max_verify, max(5, repeats // 3), sync)
    c_attn = max(full - no_attn, 0.0) / full / L
    c_mlp = max(full - no_mlp, 0.0) / full / L
    base = max(1.0 - L * (c_attn + c_mlp), 0.02)
    return CostModel((c_attn,) * L, (c_mlp,) * L, base, tuple(verify), step_ms=full * 1e3, context=context)


@torch.inference_mode()
def measure_head_costs(backbone, skip_masks, sizes, context: int = 128, repeats: int = 15) -> dict[int, float]:
    """Cost of one draft token with ``skip_masks`` and an LM head of each size in ``sizes`` (rows),
    relative to a full one-token step; the model's own vocabulary size gives the full-head cost.

    The rows are the first ``size`` of the LM head, copied contiguously as a :class:`DraftHead`'s
    are: the cost depends on the size, not on which rows.
    """
    sync, context, ids, cache = _timing_setup(backbone, context, 1)
    one = ids[context:context + 1]
    first = torch.arange(max(sizes, default=0), device=backbone.device)
    heads = {v: (None if v >= backbone.vocab_size else backbone.head_rows(first[:v]).contiguous()) for v in sizes}

    def step(masks, head):
        return lambda: backbone.forward(one, cache, context, skip_masks=masks, logits="last", head=head)

    for _ in range(3):
        step(None, None)()
    full = _time(step(None, None), repeats, sync)
    return {v: round(_time(step(skip_masks, h), repeats, sync) / full, 4) for v, h in heads.items()}


@torch.inference_mode()
def measure_draft_cost(backbone, draft_step, context: int = 128, repeats: int = 15) -> float:
    """Cost of one token of any drafter relative to a full one-token step of ``backbone``.

    ``draft_step(token, position, cache)`` runs the drafter on one token (``[1]``) at ``position``
    after ``context`` positions of random ids in ``cache`` (a drafter with a cache of its own uses
    that instead).
    """
    sync, context, ids, cache = _timing_setup(backbone, context, 1)
    one = ids[context:context + 1]
    full_step = lambda: backbone.forward(one, cache, context, logits="last")  # noqa: E731
    for _ in range(3):
        full_step()
        draft_step(one, context, cache)
    full = _time(full_step, repeats, sync)
    return round(_time(lambda: draft_step(one, context, cache), repeats, sync) / full, 4)


PREFILL_LENGTHS = (32, 128, 512, 1024)  # prompt lengths a prefill is timed at (those that fit the context)


@torch.inference_mode()
def measure_prefill(backbone, lengths: tuple[int, ...] = PREFILL_LENGTHS, repeats: int = 3
                    ) -> tuple[tuple[int, float], ...]:
    """``((tokens, ms), ...)``: the median time of prefilling a prompt of each length into a fresh
    cache (random ids, fixed seed; the last position's logits, as a request's prefill), for the
    lengths that fit the backbone's context with room to decode. A first prefill of the shortest
    length warms the engine up untimed."""
    dev = backbone.device
    sync = _sync(dev)
    fits = [n for n in lengths if n <= backbone.max_positions // 2] or [max(1, backbone.max_positions // 2)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, backbone.vocab_size, (fits[-1],), generator=gen).to(dev)

    def prefill(n: int):
        cache = backbone.new_cache(n + 1)
        try:
            backbone.forward(ids[:n], cache, 0, logits="last")
        finally:
            cache.release()  # a llama.cpp sequence goes back to the context now

    prefill(fits[0])
    return tuple((n, round(_time(lambda n=n: prefill(n), repeats, sync) * 1e3, 3)) for n in fits)
