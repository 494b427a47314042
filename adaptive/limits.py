"""Context-length checks of encoded prompts, shared by calibration and distillation (bottom layer)."""

from __future__ import annotations

from adaptive.errors import PromptTooLongError


def check_room(encoded: dict[str, list[list[int]]], room: int, limit: int, what: str) -> None:
    """Refuse (:class:`PromptTooLongError`, naming the domain and prompt) any encoded prompt that
    leaves fewer than ``room`` positions in a context of ``limit`` for ``what`` to generate.
    Prompts are not truncated: a cut prompt would tune for text nobody sends.

    Example: ``check_room({"a": [[1, 2, 3]]}, room=10, limit=12, what="x")`` raises "domain 'a',
    prompt 1: 3 tokens, and x needs 10 more, but the model's context is 12; ...".
    """
    for name, prompts in encoded.items():
        for i, ids in enumerate(prompts, 1):
            if len(ids) + room > limit:
                raise PromptTooLongError(
                    f"domain {name!r}, prompt {i}: {len(ids)} tokens, and {what} needs {room} more, but the "
                    f"model's context is {limit}; shorten or remove that prompt")
