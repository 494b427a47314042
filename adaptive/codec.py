"""JSON for frozen dataclasses, derived from their fields: the field list of a record exists once.

:func:`to_json` and :func:`from_json` walk a dataclass's type hints. Supported field types: ``int``,
``float``, ``str``, ``bool``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses,
and classes with their own ``to_dict``/``from_dict`` (:class:`~adaptive.engine.skip.SkipSet`). A
field whose metadata has ``"json": False`` is left out (arrays stored beside the JSON); a
:func:`text_field` is stored as its value's text form (``to_text``/``from_text``, e.g. a skip set
as ``"attn=1,3;mlp=2"`` where a file has always held it so); a field missing from the input takes
its default. Unknown keys are an error: a typo or a file from another
version should not load silently.

Example::

    @dataclass(frozen=True)
    class P:
        a: float
        b: tuple[int, ...] = ()

    to_json(P(0.5, (1, 2)))                 -> {"a": 0.5, "b": [1, 2]}
    from_json(P, {"a": 0.5, "b": [1, 2]})   -> P(a=0.5, b=(1, 2))
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from functools import cache

_NONE = type(None)


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _json_fields(cls):
    return [f for f in dataclasses.fields(cls) if f.metadata.get("json", True)]


def text_field(**kwargs):
    """A record field whose JSON is its value's text form: ``to_text()`` writes it, the field type's
    ``from_text()`` reads it (``None`` stays ``null`` in an optional field). ``kwargs``: as
    :func:`dataclasses.field` (``default=...``)."""
    return dataclasses.field(metadata={"text": True}, **kwargs)


def _field_json(f, value):
    if f.metadata.get("text") and value is not None:
        return value.to_text()
    return to_json(value)


def _from_text(tp, value, where: str):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and _NONE in typing.get_args(tp):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not _NONE)
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string (the text form), got {value!r}")
    try:
        return tp.from_text(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def to_json(obj):
    """A JSON-able value for ``obj`` (a record, or a value a record holds)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict") and not getattr(type(obj), "_record", False):
            return obj.to_dict()
        return {f.name: _field_json(f, getattr(obj, f.name)) for f in _json_fields(type(obj))}
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return obj


def _convert(tp, value, where: str):
    if tp is typing.Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        if value is None:
            if _NONE in typing.get_args(tp):
                return None
            raise ValueError(f"{where}: null where a value is needed")
        return _convert(args[0], value, where) if len(args) == 1 else value
    if value is None:
        raise ValueError(f"{where}: null where a value is needed")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        return tuple(value)
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return {str(k): _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if hasattr(tp, "from_dict") and not getattr(tp, "_record", False):
            return tp.from_dict(value)
        return from_json(tp, value, where)
    if isinstance(tp, type) and hasattr(tp, "from_dict"):
        return tp.from_dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and value != int(value)):
            raise ValueError(f"{where}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_json(cls, data, where: str | None = None):
    """Build record class ``cls`` from ``data`` (what :func:`to_json` wrote). ``ValueError`` on
    unknown keys, missing required fields and wrong types, naming the field."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in _json_fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            convert = _from_text if f.metadata.get("text") else _convert
            kwargs[name] = convert(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}: missing field {name}")
    return cls(**kwargs)


def record(cls):
    """Class decorator: a frozen dataclass with ``to_dict``/``from_dict`` derived from its fields."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls._record = True
    cls.to_dict = lambda self: to_json(self)
    cls.from_dict = classmethod(lambda c, d: from_json(c, d))
    return cls
