"""adaptive: lossless, domain-aware self-speculative decoding.

Main entry points: :class:`AdaptiveRuntime` (serving), :func:`load_model`, :class:`Engine`,
:class:`GenerationConfig`, :class:`SkipSet`.
"""

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine, GenerationResult
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError
from adaptive.models import LoadedModel, load_model
from adaptive.runtime import AdaptiveRuntime, RuntimeResult

__all__ = ["AdaptiveError", "AdaptiveRuntime", "RuntimeResult", "Engine", "GenerationConfig", "GenerationResult",
           "LoadedModel", "SkipSet", "load_model"]
__version__ = "0.1.0"
