"""Built-in domain prompt sets (written for this project), one JSONL file per domain."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent


@lru_cache(maxsize=1)
def _load() -> dict[str, tuple[str, ...]]:
    out = {}
    for path in sorted(HERE.glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        out[path.stem] = tuple(json.loads(line)["prompt"] for line in lines if line.strip())
    return out


def builtin_domains() -> dict[str, list[str]]:
    """``{domain: [prompt, ...]}`` for the shipped domains.

    The domains: code, math, qa, rag, summarization, translation, writing.
    """
    return {k: list(v) for k, v in _load().items()}
