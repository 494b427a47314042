"""The serving runtime: KNN routing to a domain's skip set, Thompson-sampled draft lengths."""

from adaptive.runtime.bandit import ThompsonDraftLength, best_length
from adaptive.runtime.runtime import AdaptiveRuntime, RuntimeResult

__all__ = ["AdaptiveRuntime", "RuntimeResult", "ThompsonDraftLength", "best_length"]
