"""Generation settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.errors import ConfigError

# How a cache keeps its top feature row, the residual stream after every layer: "residual" as it is (the torch
# engine), "unit" divided by its root mean square (llama.cpp, whose API gives the final norm's output and not the
# residual: that output over the norm's weight). A head reads features kept as they were when it was trained.
FEATURE_TOPS = ("residual", "unit")


def check_feature_layers(layers, n_layers: int | None = None) -> tuple[int, ...]:
    """``layers`` (layer counts: the residual stream after that many decoder layers, 0 the embeddings)
    as a tuple, distinct and ascending, each at most ``n_layers`` where given; else a :class:`ConfigError`.
    Example: ``check_feature_layers([3, 15, 30], 30) == (3, 15, 30)``; ``[15, 3]`` or ``[31]`` of 30 are refused."""
    out = tuple(layers)
    if (any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in out) or list(out) != sorted(set(out))
            or (n_layers is not None and any(x > n_layers for x in out))):
        top = "" if n_layers is None else f" and at most {n_layers}"
        raise ConfigError(f"feature layers must be distinct ascending integers >= 0{top}, got {list(layers)}")
    return out


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate.

    ``temperature == 0`` means greedy decoding. ``draft_len`` is the most tokens drafted per step
    (the fixed draft length, or the upper bound for an adaptive policy). ``confidence_threshold``
    stops drafting early once the draft's top probability falls below it (``None``: off).
    ``stop``: strings that end generation; the text is cut before the stop string.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    draft_len: int = 4
    confidence_threshold: float | None = None
    ignore_eos: bool = False
    features: tuple[int, ...] = ()  # layer counts whose residual stream the request's cache keeps (an eagle head's)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.draft_len, int) or self.draft_len < 1:
            raise ConfigError(f"draft_len must be an integer >= 1, got {self.draft_len!r}")
        if self.draft_len > 64:
            raise ConfigError(f"draft_len {self.draft_len} is beyond any useful draft (at most 64)")
        if self.confidence_threshold is not None and not 0.0 < self.confidence_threshold < 1.0:
            raise ConfigError(f"confidence_threshold must be in (0, 1), got {self.confidence_threshold}")
        object.__setattr__(self, "features", check_feature_layers(self.features))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


POOL_MODES = ("mean", "last")


@dataclass(frozen=True)
class Pooling:
    """Which hidden state of a prompt's prefill is its embedding (what routing compares).

    ``layer``: the residual stream after that many decoder layers, through the final norm
    (``None``: after all of them); ``mode``: its ``mean`` over the prompt's positions, or its value
    at the ``last`` one (with a chat template, the end of the assistant header: the model's summary
    of the prompt so far). ``Pooling()`` is the final mean, what profiles before issue 17 used;
    calibration's default is ``last`` at a third of the depth, chosen by
    ``benchmarks/routing_study.py`` (docs/history/2026-11-23-calibration-in-minutes.md).
    """

    layer: int | None = None
    mode: str = "mean"

    def __post_init__(self) -> None:
        if self.mode not in POOL_MODES:
            raise ConfigError(f"pooling mode must be one of {', '.join(POOL_MODES)}, got {self.mode!r}")
        if self.layer is not None and (not isinstance(self.layer, int) or isinstance(self.layer, bool)
                                       or self.layer < 0):
            raise ConfigError(f"pooling layer must be an integer >= 0 or None, got {self.layer!r}")

    def to_dict(self) -> dict:
        return {"layer": self.layer, "mode": self.mode}

    @classmethod
    def from_dict(cls, d: dict) -> Pooling:
        return cls(d.get("layer"), d.get("mode", "mean"))
