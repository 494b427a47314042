"""The serving runtime: KNN routing to a domain's decision, Thompson-sampled draft lengths."""

from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength
from adaptive.runtime.online import OnlineSettings
from adaptive.runtime.policies import POLICIES, Policy, get_policy
from adaptive.runtime.runtime import AdaptiveRuntime, RoutedDecoding, RoutedPlan, RuntimeResult

__all__ = ["POLICIES", "AdaptiveRuntime", "OnlineSettings", "Policy", "RoutedDecoding", "RoutedPlan", "RuntimeResult",
           "ThompsonCascade", "ThompsonDraftLength", "get_policy"]
