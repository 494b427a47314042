"""docs/cli.md cannot drift from the commands: every option of every command is documented in
that command's section, and every option documented there exists."""

import re
from pathlib import Path

import click
import pytest

from tests.helpers.cli import commands

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")


def _section(name: str) -> str:
    m = re.search(rf"^## `adaptive {re.escape(name)}\b.*?$(.*?)(?=^## |\Z)", DOC, flags=re.M | re.S)
    assert m, f"docs/cli.md has no section for `adaptive {name}`"
    return m.group(1)


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_option_is_documented(name):
    cmd = commands()[name]
    text = _section(name)
    options = {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)
               if o.startswith("--")}
    missing = sorted(o for o in options if not re.search(rf"`{re.escape(o)}[ `\\|=]", text))
    assert not missing, f"adaptive {name}: options missing from docs/cli.md: {missing}"
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))
    unknown = sorted(documented - options - {"--help"})
    assert not unknown, f"adaptive {name}: docs/cli.md documents options that do not exist: {unknown}"


def test_every_name_of_each_vocabulary_is_documented():
    from adaptive.bench.runner import BENCH_METHODS
    from adaptive.cli.generate import DECODE_DRAFTERS
    from adaptive.runtime.policies import POLICIES

    for command, names in (("decode", DECODE_DRAFTERS), ("generate", POLICIES), ("bench", BENCH_METHODS)):
        text = _section(command)
        missing = [n for n in names if f"`{n}`" not in text and f"{n}\\|" not in text and f"|{n}`" not in text]
        assert not missing, f"adaptive {command}: docs/cli.md does not name {missing}"
