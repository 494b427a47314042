"""JSON derived from record fields (adaptive/codec.py): round trips, defaults, and every error."""

from __future__ import annotations

from dataclasses import field
from typing import Any

import pytest

from adaptive.codec import from_json, record, text_field, to_json
from adaptive.engine.skip import SkipSet


@record
class Inner:
    a: float
    b: tuple[int, ...] = ()


@record
class Outer:
    name: str
    inner: Inner
    skip: SkipSet
    maybe: Inner | None = None
    table: dict[str, float] = field(default_factory=dict)
    free: dict[str, Any] = field(default_factory=dict)
    flag: bool = False
    hidden: int = field(default=7, metadata={"json": False})


def test_worked_example_round_trip():
    assert to_json(Inner(0.5, (1, 2))) == {"a": 0.5, "b": [1, 2]}
    assert from_json(Inner, {"a": 0.5, "b": [1, 2]}) == Inner(a=0.5, b=(1, 2))
    o = Outer("x", Inner(1.0), SkipSet((1, 3), (2,)), None, {"k": 0.25}, {"n": None, "s": [1]}, True, hidden=3)
    d = o.to_dict()
    assert d == {"name": "x", "inner": {"a": 1.0, "b": []}, "skip": {"attn": [1, 3], "mlp": [2]}, "maybe": None,
                 "table": {"k": 0.25}, "free": {"n": None, "s": [1]}, "flag": True}  # hidden is not in the JSON
    back = Outer.from_dict(d)
    assert back == Outer("x", Inner(1.0), SkipSet((1, 3), (2,)), None, {"k": 0.25}, {"n": None, "s": [1]}, True)
    assert back.hidden == 7  # the default, not what was written


def test_defaults_fill_missing_fields():
    assert Inner.from_dict({"a": 2}) == Inner(2.0, ())
    assert isinstance(Inner.from_dict({"a": 2}).a, float)


@pytest.mark.parametrize("data, message", [
    ({"a": 1.0, "c": 1}, "unknown field(s) c"),
    ({}, "missing field a"),
    ({"a": "x"}, "Inner.a: expected a number"),
    ({"a": True}, "Inner.a: expected a number"),
    ({"a": 1.0, "b": [1.5]}, "Inner.b[0]: expected an integer"),
    ({"a": 1.0, "b": 3}, "Inner.b: expected a list"),
    ({"a": None}, "Inner.a: null where a value is needed"),
    ([1], "expected an object"),
])
def test_bad_input_names_the_field(data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        Inner.from_dict(data)


def test_nested_errors_name_the_path():
    good = Outer("x", Inner(1.0), SkipSet()).to_dict()
    with pytest.raises(ValueError, match=r"Outer\.inner\.a: expected a number"):
        Outer.from_dict({**good, "inner": {"a": "no"}})
    with pytest.raises(ValueError, match=r"Outer\.flag: expected true or false"):
        Outer.from_dict({**good, "flag": 1})


@record
class Texts:
    skip: SkipSet = text_field(default=SkipSet())
    maybe: SkipSet | None = text_field(default=None)


def test_a_text_field_is_stored_as_its_text_form():
    t = Texts(SkipSet((1, 2, 3), (5,)), SkipSet())
    assert to_json(t) == {"skip": "attn=1-3;mlp=5", "maybe": "none"}
    assert from_json(Texts, to_json(t)) == t and isinstance(from_json(Texts, to_json(t)).skip, SkipSet)
    assert to_json(Texts()) == {"skip": "none", "maybe": None} and from_json(Texts, {}) == Texts()
    assert from_json(Texts, {"maybe": None}).maybe is None
    with pytest.raises(ValueError, match=r"Texts\.skip: expected a string \(the text form\)"):
        from_json(Texts, {"skip": {"attn": [1]}})
    with pytest.raises(ValueError, match=r"Texts\.maybe: cannot read skip set 'attn'"):
        from_json(Texts, {"maybe": "attn"})
