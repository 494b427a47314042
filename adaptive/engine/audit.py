"""Divergence audit: is a difference from plain greedy decoding only a near-tie, or a real violation?

In bf16 a forward over several tokens does not round exactly like one-token steps, so a
speculative method's greedy output may part from ``ar``'s where the two best tokens are within
rounding of each other. At the first position where the two outputs differ, the audit recomputes
the full model's logits for the prompt plus the common prefix (one forward) and measures the
margin between the two tokens. A margin above the tolerance of the dtype is a *lossless
violation*: a bug, not numerics.

Tolerances (logits), from measurement on the embedded model (docs/design.md, "bf16 numerics"):
between one-token steps, 3/5/9-token verification forwards and a whole-sequence forward, the
margin between the top two tokens moved by median 0.06, p99 0.25, max 0.50 logits over 3,456
positions of 12 Spec-Bench prompts in bf16. The bf16 tolerance is 1.5x that maximum. In float32
every tested output was identical, and the tolerance is set at rounding level.

With int8/int4 weights the packed kernels take and return bf16 activations whatever the model's
dtype, and a verification's rows do not round exactly like one-token steps: the backbone's
:attr:`~adaptive.engine.backbone.Backbone.numerics` is then bf16 and so is the tolerance. Measured
on 24 held-out Spec-Bench prompts with int4 weights: every difference from ``ar`` was at a margin
of 0, 0.125 or 0.25 (ties at bf16's resolution of the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

MARGIN_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.75, torch.float16: 0.75}


@dataclass(frozen=True)
class AuditResult:
    identical: bool
    position: int | None = None  # index into the generated tokens of the first difference
    ref_token: int | None = None
    other_token: int | None = None
    margin: float | None = None  # |logit(ref_token) - logit(other_token)| recomputed by the full model
    tolerance: float | None = None

    @property
    def violation(self) -> bool:
        return not self.identical and self.margin is not None and self.margin > self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "violation": self.violation}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ, or ``None`` if equal.

    Example: ``first_difference([1, 2, 3], [1, 2, 4]) == 2``; ``[1, 2]`` vs ``[1, 2, 5]`` -> ``2``
    (one ended, e.g. on EOS, where the other went on); ``[1, 2]`` vs ``[1, 2]`` -> ``None``.
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: ``common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2``,
    ``common_prefix([7, 8], [7, 8]) == 2`` (the prefix cache's match, the bench's agreement)."""
    i = first_difference(a, b)
    return len(a) if i is None else i


@torch.inference_mode()
def audit_divergence(backbone, prompt_ids: list[int], ref_ids: list[int], other_ids: list[int],
                     tolerance: float | None = None) -> AuditResult:
    """Audit ``other_ids`` (a speculative method's greedy output) against ``ref_ids`` (``ar``'s)."""
    i = first_difference(ref_ids, other_ids)
    if i is None:
        return AuditResult(True)
    tol = MARGIN_TOLERANCE.get(backbone.numerics, 0.75) if tolerance is None else tolerance
    if i >= len(ref_ids) or i >= len(other_ids):
        # One is a strict prefix of the other: under the same settings only a bug stops one early.
        return AuditResult(False, i, None, None, float("inf"), tol)
    context = list(prompt_ids) + list(ref_ids[:i])
    cache = backbone.new_cache(len(context))
    logits = backbone.forward(torch.tensor(context, device=backbone.device), cache, 0, logits="last").logits[0]
    a, b = ref_ids[i], other_ids[i]
    margin = abs(float(logits[a]) - float(logits[b]))
    return AuditResult(False, i, a, b, margin, tol)
