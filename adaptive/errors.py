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
    """Impossible generation or calibration options."""


class PromptTooLongError(AdaptiveError, ValueError):
    """The prompt plus the requested tokens exceed the model's context."""
