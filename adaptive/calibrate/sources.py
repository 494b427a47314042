"""Reading domain prompt sets: ``NAME=PATH`` arguments, JSONL and text files, the built-in sets.

JSONL lines carry the prompt in ``prompt``, ``turns`` (the first turn) or ``text``; a ``.txt`` file
has one prompt per line. Every problem is a :class:`PromptFileError` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaptive.errors import AdaptiveError

PROMPT_FIELDS = ("prompt", "turns", "text")


class PromptFileError(AdaptiveError, ValueError):
    """A prompt file is missing, unreadable, malformed or empty."""


def _prompt_of(row, where: str) -> str:
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object with a 'prompt', 'turns' or 'text' field")
    for key in PROMPT_FIELDS:
        if key in row:
            val = row[key]
            if key == "turns":
                if not isinstance(val, list) or not val:
                    raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
                val = val[0]
            if not isinstance(val, str) or not val.strip():
                raise PromptFileError(f"{where}: the {key!r} field must be a non-empty string")
            return val
    raise PromptFileError(f"{where}: no 'prompt', 'turns' or 'text' field (keys: {', '.join(map(str, row)) or 'none'})")


def read_prompt_rows(path: str | Path) -> list[dict]:
    """Rows ``{"prompt": str, **other fields}`` of a JSONL or text prompt file, in order.

    Example: a JSONL line ``{"turns": ["Hi", "More"], "category": "qa"}`` gives
    ``{"prompt": "Hi", "category": "qa"}``; a ``.txt`` line ``Hello`` gives ``{"prompt": "Hello"}``.
    Blank lines are skipped.
    """
    path = Path(path)
    if not path.exists():
        raise PromptFileError(f"{path}: no such file")
    if not path.is_file():
        raise PromptFileError(f"{path}: not a file")
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise PromptFileError(f"{path}: looks binary, expected UTF-8 text (JSONL or one prompt per line)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PromptFileError(f"{path}:{line}: not valid UTF-8") from None
    rows: list[dict] = []
    as_json = path.suffix.lower() in (".jsonl", ".json", ".ndjson")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if as_json:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            prompt = _prompt_of(row, where)
            rows.append({**{k: v for k, v in row.items() if k not in PROMPT_FIELDS}, "prompt": prompt})
        else:
            rows.append({"prompt": line.strip()})
    if not rows:
        raise PromptFileError(f"{path}: no prompts in the file")
    return rows


def parse_domain_args(items: list[str] | tuple[str, ...], option: str = "--domains",
                      bare: bool = False) -> dict[str, Path]:
    """``["code=a.jsonl", "maths=b.txt"]`` -> ``{"code": Path("a.jsonl"), "maths": Path("b.txt")}``.

    With ``bare=True`` a plain ``PATH`` is allowed too, named by the file's stem
    (``"x/maths.jsonl"`` -> ``"maths"``). Raises :class:`PromptFileError` for a missing ``=`` (unless
    ``bare``), an empty or repeated name; ``option`` names the option in the message.
    """
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep and bare:
            name, path = Path(item).stem, item
        name = name.strip()
        if not (sep or bare) or not name or not path.strip():
            raise PromptFileError(f"{option} takes {'[NAME=]PATH' if bare else 'NAME=PATH'}, got {item!r}")
        if name in out:
            raise PromptFileError(f"domain {name!r} is given twice")
        out[name] = Path(path.strip())
    return out


def load_domains(items: list[str] | tuple[str, ...] | None = None, option: str = "--domains",
                 bare: bool = False) -> dict[str, list[str]]:
    """Prompts per domain from ``NAME=PATH`` arguments (see :func:`parse_domain_args`), or the
    built-in sets when none are given."""
    if not items:
        from adaptive.calibrate.prompts import builtin_domains

        return builtin_domains()
    return {name: [r["prompt"] for r in read_prompt_rows(path)]
            for name, path in parse_domain_args(items, option, bare).items()}
