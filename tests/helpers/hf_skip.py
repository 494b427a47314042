"""Hugging Face's own forward with a skip set: a test tool, to cross-check the backbone's
per-forward sublayer skipping (``tests/engine/test_skip.py``). Once ``adaptive.skipping``; the
package never needed it (its backbone takes the skip set per forward)."""

import contextlib
from collections.abc import Iterator

import torch

from adaptive.engine.backbone import decoder_layers
from adaptive.engine.skip import SkipSet


class _Identity0(torch.nn.Module):
    """Stands in for a skipped sublayer inside a Hugging Face decoder layer: adds nothing to the residual."""

    def __init__(self, returns_tuple: bool):
        super().__init__()
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states=None, *args, **kwargs):  # noqa: D401
        if hidden_states is None:
            hidden_states = args[0]
        out = torch.zeros_like(hidden_states)
        return (out, None) if self.returns_tuple else out


@contextlib.contextmanager
def skipping(model, skip: SkipSet) -> Iterator[None]:
    """Make a Hugging Face decoder model skip ``skip``'s sublayers inside the block; always restored.

    The engine never needs this (its backbone takes the skip set per forward); the tests use it
    to cross-check that forward against Hugging Face's own with sublayers skipped.
    No weights are copied: the sublayer modules are swapped for a zero-output stand-in and put back
    in ``finally``, so an exception inside the block leaves the model as it was.
    """
    layers = decoder_layers(model)
    skip.validate_for(len(layers))
    saved: list[tuple[object, str, object]] = []
    try:
        for i in skip.attn:
            saved.append((layers[i], "self_attn", layers[i].self_attn))
            layers[i].self_attn = _Identity0(returns_tuple=True)
        for i in skip.mlp:
            saved.append((layers[i], "mlp", layers[i].mlp))
            layers[i].mlp = _Identity0(returns_tuple=False)
        yield
    finally:
        for layer, name, module in reversed(saved):
            setattr(layer, name, module)
