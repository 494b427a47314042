"""A two-engine profile: one directory with a profile of the same model on each engine.

On a CPU with llama-cpp-python, ``adaptive calibrate`` (``--engine auto``) calibrates a GGUF model
on both engines: llama.cpp decodes faster, the torch engine prefills faster, so each request is
decoded on the engine expected to finish it first (:mod:`adaptive.runtime.engines`). Layout::

    PROFILE/
      engines.json          {"format": "adaptive-engines", "engines": ["llama.cpp", "torch"], "default": "llama.cpp"}
      llama.cpp/            a complete profile (profile.json, anchors, ...) calibrated on llama.cpp
      torch/                the same domains calibrated on the torch engine

Each member is an ordinary profile (its own decisions, cost model with prefill times, anchors and
online overlay beside it), so everything that reads one profile reads a member:
:func:`member_dir` resolves ``PROFILE`` and an engine (``None``: the default member) to its directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adaptive.profile.records import ProfileError
from adaptive.workdir import atomic_write

ENGINES_FILE = "engines.json"
ENGINES_FORMAT = "adaptive-engines"
TRAINING_ENGINE = "torch"  # the member distilled drafters are trained into and drafted on (its hidden states)


@dataclass(frozen=True)
class EngineSet:
    """The members of a two-engine profile: ``engines`` (each a subdirectory of that name) and the
    ``default`` one (what a reader of one profile gets, e.g. ``adaptive profile show``'s first)."""

    engines: tuple[str, ...]
    default: str

    def __post_init__(self):
        if len(self.engines) < 2 or len(set(self.engines)) != len(self.engines):
            raise ValueError(f"a two-engine profile needs two different engines, got {self.engines}")
        if self.default not in self.engines:
            raise ValueError(f"the default engine {self.default!r} is not one of {self.engines}")
        for e in self.engines:
            if not e or "/" in e or e.startswith("."):
                raise ValueError(f"not an engine name: {e!r}")

    def to_dict(self) -> dict:
        return {"format": ENGINES_FORMAT, "engines": list(self.engines), "default": self.default}


def is_two_engine(path: str | Path) -> bool:
    """Whether ``path`` is a two-engine profile directory (it has ``engines.json``)."""
    return (Path(path) / ENGINES_FILE).is_file()


def read_engines(path: str | Path) -> EngineSet:
    """The :class:`EngineSet` of a two-engine profile; :class:`ProfileError` naming the file otherwise."""
    f = Path(path) / ENGINES_FILE
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != ENGINES_FORMAT:
            raise ValueError("not an adaptive engines file")
        return EngineSet(tuple(data["engines"]), str(data["default"]))
    except FileNotFoundError:
        raise ProfileError(f"{f}: missing; {path} is not a two-engine profile") from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{f}: malformed ({exc})") from None


def write_engines(path: str | Path, engines: EngineSet) -> Path:
    """Write ``engines.json`` into ``path`` atomically (after its members are written)."""
    f = Path(path) / ENGINES_FILE
    atomic_write(f, (json.dumps(engines.to_dict(), indent=1) + "\n").encode())
    return f


def member_dir(path: str | Path, engine: str | None = None) -> Path:
    """The profile directory to load for ``engine`` (``None``: the default member): ``path`` itself
    unless it is a two-engine profile. :class:`ProfileError` for an engine it has no member of."""
    path = Path(path)
    if not is_two_engine(path):
        return path
    members = read_engines(path)
    engine = engine or members.default
    if engine not in members.engines:
        raise ProfileError(f"{path} was calibrated on {' and '.join(members.engines)}, not on {engine}")
    return path / engine


def training_member(path: str | Path) -> Path:
    """The profile directory a distilled drafter of ``path`` is trained into (distillation runs the torch
    engine's layers): ``path`` itself unless it is a two-engine profile, else its :data:`TRAINING_ENGINE`
    member (:class:`ProfileError` where it has none)."""
    return member_dir(path, TRAINING_ENGINE)


def member_online_path(online_path: str | Path, engine: str) -> Path:
    """Where a two-engine profile's ``engine`` member keeps its online overlay when an explicit
    ``--online-path PATH`` is given: ``PATH.ENGINE`` (each member learns apart; beside the
    profile each member's own overlay is already apart)."""
    return Path(f"{online_path}.{engine}")
