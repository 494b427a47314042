"""The serving runtime: KNN routing to a domain's skip set, Thompson-sampled draft lengths."""

from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength
from adaptive.runtime.runtime import AdaptiveRuntime, RuntimeResult

__all__ = ["AdaptiveRuntime", "RuntimeResult", "ThompsonCascade", "ThompsonDraftLength"]
