"""The serving runtime: KNN routing to a domain's decision, Thompson-sampled draft lengths."""

from adaptive.runtime.bandit import ThompsonCascade, ThompsonDraftLength
from adaptive.runtime.engines import EngineChoice, EngineEstimate, TwoEngineRuntime, open_runtime
from adaptive.runtime.online import OnlineSettings
from adaptive.runtime.policies import POLICIES, Policy, get_policy
from adaptive.runtime.runtime import AdaptiveRuntime, RoutedDecoding, RoutedPlan, RuntimeResult

__all__ = ["POLICIES", "AdaptiveRuntime", "EngineChoice", "EngineEstimate", "OnlineSettings", "Policy",
           "RoutedDecoding", "RoutedPlan", "RuntimeResult", "ThompsonCascade", "ThompsonDraftLength",
           "TwoEngineRuntime", "get_policy", "open_runtime"]
