"""Skip sets: which attention and MLP sublayers the drafter leaves out.

A skipped sublayer leaves the residual stream unchanged (Self-SD's granularity):
``h = h + attn(norm(h))`` becomes ``h = h``. Layer indices are 0-based.

Text form (CLI and logs): ``"attn=3,5,10-14;mlp=7"``; an empty set is ``"none"``.
Layer lists use ranges: ``parse_layer_list("3,5,10-12") == (3, 5, 10, 11, 12)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from adaptive.errors import SkipSetError


def parse_layer_list(text: str) -> tuple[int, ...]:
    """Parse ``"3,5,10-12"`` into ``(3, 5, 10, 11, 12)`` (sorted, deduplicated).

    Example: ``parse_layer_list("4-6,1")`` -> ``(1, 4, 5, 6)``; ``parse_layer_list("")`` -> ``()``.
    """
    text = text.strip()
    if text in ("", "none", "-"):
        return ()
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise SkipSetError(f"empty item in layer list {text!r}")
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if hi < lo:
                    raise SkipSetError(f"range {part!r} runs backwards in layer list {text!r}")
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError as exc:
            if isinstance(exc, SkipSetError):
                raise
            raise SkipSetError(
                f"cannot read {part!r} in layer list {text!r}: use numbers and ranges like 3,5,10-14"
            ) from None
    if any(i < 0 for i in out):
        raise SkipSetError(f"negative layer index in {text!r}")
    return tuple(sorted(out))


def format_layer_list(layers: Iterable[int]) -> str:
    """Inverse of :func:`parse_layer_list`, compressing runs: ``(1, 4, 5, 6)`` -> ``"1,4-6"``."""
    layers = sorted(layers)
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class SkipSet:
    """Attention and MLP sublayers to skip while drafting (0-based layer indices).

    ``n_layers``, when given, is validated against; ``SkipSet.validate_for(n)`` checks later.
    """

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()
    n_layers: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("attn", "mlp"):
            raw = getattr(self, name)
            try:
                vals = tuple(sorted(set(int(i) for i in raw)))
            except (TypeError, ValueError):
                raise SkipSetError(f"skip set {name} must be a list of integers, got {raw!r}") from None
            if any(i < 0 for i in vals):
                raise SkipSetError(f"skip set {name} has a negative layer index: {vals}")
            object.__setattr__(self, name, vals)
        if self.n_layers is not None:
            self.validate_for(self.n_layers)

    def validate_for(self, n_layers: int) -> SkipSet:
        """Raise :class:`SkipSetError` unless every index is below ``n_layers``."""
        for name in ("attn", "mlp"):
            bad = [i for i in getattr(self, name) if i >= n_layers]
            if bad:
                raise SkipSetError(
                    f"skip set {name} names layer(s) {bad} but the model has {n_layers} layers (0-{n_layers - 1})"
                )
        return self

    @property
    def size(self) -> int:
        return len(self.attn) + len(self.mlp)

    def __bool__(self) -> bool:
        return self.size > 0

    def to_text(self) -> str:
        if not self:
            return "none"
        parts = []
        if self.attn:
            parts.append("attn=" + format_layer_list(self.attn))
        if self.mlp:
            parts.append("mlp=" + format_layer_list(self.mlp))
        return ";".join(parts)

    @classmethod
    def from_text(cls, text: str, n_layers: int | None = None) -> SkipSet:
        """Parse the text form, e.g. ``"attn=3,5-7;mlp=2"`` or ``"none"``."""
        text = text.strip()
        if text in ("", "none"):
            return cls(n_layers=n_layers)
        fields: dict[str, tuple[int, ...]] = {}
        for part in text.split(";"):
            if "=" not in part:
                raise SkipSetError(f"cannot read skip set {text!r}: expected 'attn=LIST;mlp=LIST'")
            key, val = part.split("=", 1)
            key = key.strip()
            if key not in ("attn", "mlp") or key in fields:
                raise SkipSetError(f"cannot read skip set {text!r}: unknown or repeated part {key!r}")
            fields[key] = parse_layer_list(val)
        return cls(n_layers=n_layers, **fields)

    def to_dict(self) -> dict:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}

    @classmethod
    def from_dict(cls, data: dict, n_layers: int | None = None) -> SkipSet:
        if not isinstance(data, dict) or set(data) - {"attn", "mlp"}:
            raise SkipSetError(f"a skip set is an object with 'attn' and 'mlp' lists, got {data!r}")
        return cls(attn=tuple(data.get("attn", ())), mlp=tuple(data.get("mlp", ())), n_layers=n_layers)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def masks(self, n_layers: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """Per-layer booleans ``(skip_attn, skip_mlp)``, precomputed once per drafter."""
        self.validate_for(n_layers)
        a, m = set(self.attn), set(self.mlp)
        return tuple(i in a for i in range(n_layers)), tuple(i in m for i in range(n_layers))

