"""Typed exceptions. Every error a user can cause derives from :class:`AdaptiveError`.

The CLI turns any ``AdaptiveError`` into one readable line and a non-zero exit;
library callers can catch the specific subclass.
"""


class AdaptiveError(Exception):
    """Base class of every error that bad input or a bad environment can cause."""


class ModelNotFoundError(AdaptiveError):
    """The model spec names nothing that can be loaded offline."""


class UnsupportedModelError(AdaptiveError):
    """The model's architecture lacks the attention/MLP decoder layout the engine needs."""


class SkipSetError(AdaptiveError, ValueError):
    """A skip set is malformed or out of range for the model."""


class ConfigError(AdaptiveError, ValueError):
    """Impossible generation or calibration options. ``key``: the field at fault, where one is
    (e.g. ``"block_tokens"``), so that a caller reading the value from a file can name it there."""

    def __init__(self, message: str = "", key: str | None = None):
        super().__init__(message)
        self.key = key


class PromptTooLongError(AdaptiveError, ValueError):
    """The prompt plus the requested tokens exceed the model's context."""


class ContextFullError(AdaptiveError):
    """The positions a cache needs are held by live caches that share one context (llama.cpp's):
    free now, they will be once those requests finish."""


class StepFailed(Exception):
    """A batch step failed for some of its requests only: ``cause`` is the error; ``decodings`` and
    ``riders`` are the indices, in the lists given to the step, of the requests whose forward it was
    (a two-engine runtime steps one engine's requests: the other engine's did not run and go on)."""

    def __init__(self, cause: BaseException, decodings: tuple[int, ...], riders: tuple[int, ...] = ()):
        super().__init__(str(cause))
        self.cause = cause
        self.decodings = tuple(decodings)
        self.riders = tuple(riders)
