"""The per-row formulas the eager step (:mod:`adaptive.engine.backbone`), the static CUDA step
(:mod:`adaptive.engine.graphs`) and the llama.cpp engine's pools share: one place for each."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it, over the last dimension: in float32, scaled by ``weight``
    in the input's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (``[..., head_dim]``) with a position's ``cos`` and *signed* ``sin``
    (the first half negated, :meth:`Backbone._rope`'s table): Llama's rotate-half as one expression.
    Example, head_dim 2, angle 90 degrees (cos ``[0, 0]``, signed sin ``[-1, 1]``): ``[1, 0]`` -> ``[0, 1]``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def gated(gate_up: torch.Tensor, act) -> torch.Tensor:
    """A gated MLP's hidden rows: ``act(gate) * up`` of ``[T, 2 I]`` (gate and up side by side)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
