"""RMSNorm as the Llama family computes it: the one formula the eager and the static (graph) steps share."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension: in float32, scaled by ``weight`` in the input's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
