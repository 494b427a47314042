"""Early-exit drafting (EESD): the target's first N layers, a small trained exit block, then the
model's own final norm and LM head.

The drafter is a :class:`~adaptive.drafters.layerskip.LayerSkipDrafter` whose skip set is every
sublayer from layer N on (:func:`early_exit_skip`), with an :class:`ExitBlock` applied to the
residual stream before the final norm. It shares the target's KV cache for layers ``0..N-1`` (the
verification forward rewrites every layer at the drafted positions), so the full model verifies
the draft in one pass and the output is exactly the target's.

The exit block is a pre-norm gated MLP added to the residual stream. It has no attention: it
needs no KV cache of its own, and it acts on each position independently, so distillation
(:mod:`adaptive.distill`) can train it on stored hidden states without running the model again.
It starts as a copy of layer N's MLP with its output projection zeroed: the untrained block is
the identity, i.e. a plain early exit, the baseline distillation improves on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaptive.drafters.head import DraftHead
from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError


def early_exit_skip(exit_layer: int, n_layers: int) -> SkipSet:
    """The skip set of an exit after ``exit_layer`` layers: both sublayers of layers ``exit_layer ..``.

    Example: ``early_exit_skip(2, 4)`` skips attention and MLP of layers 2 and 3 (text ``"attn=2-3;mlp=2-3"``).
    """
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < n_layers:
        raise ConfigError(f"the exit layer must be an integer in 1..{n_layers - 1} for a {n_layers}-layer model, "
                          f"got {exit_layer!r}")
    rest = tuple(range(exit_layer, n_layers))
    return SkipSet(rest, rest)


def _act(name: str):
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ConfigError(f"unknown activation {name!r} for an exit block")
    return ACT2FN[name]


class ExitBlock(nn.Module):
    """``h + down(act(gate(n)) * up(n))`` with ``n = rms_norm(h)``: ``[..., H] -> [..., H]``."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", eps: float = 1e-5):
        super().__init__()
        self.hidden, self.intermediate, self.act_name, self.eps = int(hidden), int(intermediate), str(act), float(eps)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        nn.init.zeros_(self.down.weight)
        self.act = _act(self.act_name)

    @classmethod
    def from_backbone(cls, backbone, layer: int) -> ExitBlock:
        """A block initialised from layer ``layer``'s MLP (float32, on the model's device), output zeroed."""
        w = backbone.mlp_weights(layer)
        block = cls(w["gate"].shape[1], w["gate"].shape[0], w["act"], backbone.norm_eps).to(backbone.device)
        with torch.no_grad():
            block.norm.copy_(w["norm"].float())
            block.gate.weight.copy_(w["gate"].float())
            block.up.weight.copy_(w["up"].float())
        return block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = F.rms_norm(h, (self.hidden,), self.norm.to(h.dtype), self.eps)
        return h + self.down(self.act(self.gate(n)) * self.up(n))

    def meta(self) -> dict:
        return {"hidden": self.hidden, "intermediate": self.intermediate, "act": self.act_name, "eps": self.eps}

    @classmethod
    def from_state(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> ExitBlock:
        """Rebuild a block from :meth:`meta` and its ``state_dict`` (``ValueError`` when they disagree)."""
        block = cls(int(meta["hidden"]), int(meta["intermediate"]), str(meta["act"]), float(meta["eps"]))
        try:
            block.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"exit block weights do not fit {meta}: {exc}") from None
        return block.requires_grad_(False)


class EarlyExitDrafter(LayerSkipDrafter):
    """Drafts with layers ``0 .. exit_layer-1`` and ``block`` (converted to the model's dtype once)."""

    name = "early-exit"

    def __init__(self, exit_layer: int, n_layers: int, block: ExitBlock, head: DraftHead | None = None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__(early_exit_skip(exit_layer, n_layers), n_layers, head)
        self.exit_layer = exit_layer
        self.adapter = block.to(device=device, dtype=dtype).eval() if (dtype or device) else block.eval()
        for p in self.adapter.parameters():
            p.requires_grad_(False)

    def describe(self) -> dict:
        d = {"name": self.name, "exit_layer": self.exit_layer}
        if self.head is not None:
            d["draft_vocab"] = len(self.head)
        return d
