"""adaptive: lossless, domain-aware self-speculative decoding.

Main entry point: :func:`open` (the runtime a profile describes, as `adaptive serve` runs it).
Lower down: :class:`AdaptiveRuntime` (one engine), :func:`load_model`, :class:`Engine`,
:class:`GenerationConfig`, :class:`SkipSet`.
"""

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine, GenerationResult
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError
from adaptive.models import LoadedModel, load_model
from adaptive.runtime import AdaptiveRuntime, RuntimeResult, open_runtime


def open(profile, **kwargs):  # noqa: A001 - `adaptive.open(profile)`, the package's one obvious entry
    """The runtime a profile directory describes, as ``adaptive serve`` and ``adaptive generate`` load
    it: for a two-engine profile (what ``make demo`` and ``adaptive calibrate`` write on a CPU with
    llama.cpp) a :class:`~adaptive.runtime.TwoEngineRuntime` choosing the engine per request, else its
    :class:`AdaptiveRuntime`. Options as :func:`~adaptive.runtime.open_runtime` (``engine=`` one
    member, ``online=``, ``prefix_cache=``, ``model=``, ...). Example::

        import adaptive
        rt = adaptive.open("adaptive-profile")
        print(rt.generate("What is 17 * 23?", max_new_tokens=64).text)
    """
    return open_runtime(profile, **kwargs)


__all__ = ["AdaptiveError", "AdaptiveRuntime", "open", "RuntimeResult", "Engine", "GenerationConfig",
           "GenerationResult", "LoadedModel", "SkipSet", "load_model"]
__version__ = "0.1.0"
