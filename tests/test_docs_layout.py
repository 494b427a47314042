"""docs/design.md's layout table cannot drift from the package: every path it names exists, and
every module under adaptive/ is named in it.

The table is the Markdown table of the ``## Layout`` section, ``| path | what |``. A row's first
cell names paths in backticks, relative to the repository (``adaptive/engine/loop.py``, or a
directory such as ``adaptive/drafters/``); in its second cell, a backticked ``name.py`` or
``name/`` is a module or package in that row's directory. Other backticked words (functions,
classes, commands) are not paths.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adaptive"
DESIGN = ROOT / "docs" / "design.md"
LOCAL = re.compile(r"^[A-Za-z_]\w*(\.py|/)$")  # a module or package named in its directory's row


def layout_rows(text: str) -> list[tuple[str, str]]:
    """The (path, what) cells of the layout table, header and separator left out."""
    section = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "docs/design.md has no '## Layout' section"
    rows = []
    for line in section.group(1).splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # not on an escaped \|
        assert len(cells) == 2, f"a layout row should have two cells (path, what): {line!r}"
        if cells[0] == "path" or set(cells[0]) <= set("-: "):
            continue
        rows.append((cells[0], cells[1]))
    assert rows, "the '## Layout' section of docs/design.md has no table rows"
    return rows


def named_paths(rows: list[tuple[str, str]]) -> set[Path]:
    """Every path the table names, resolved against the repository root."""
    named = set()
    for path_cell, what in rows:
        heads = re.findall(r"`([^`]+)`", path_cell)
        assert heads and all(h.startswith("adaptive/") for h in heads), \
            f"a layout row's first cell names paths under adaptive/ in backticks: {path_cell!r}"
        for head in heads:
            path = ROOT / head
            named.add(path)
            folder = path if head.endswith("/") else path.parent
            named.update(folder / word for word in re.findall(r"`([^`]+)`", what) if LOCAL.match(word))
    return named


def modules() -> list[Path]:
    """Every module of the package (``__init__.py`` aside) and every package holding no other module."""
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    out = [p for p in files if p.name != "__init__.py"]
    out += [p.parent for p in files if p.name == "__init__.py" and p.parent != PACKAGE
            and not any(q.parent == p.parent for q in out)]
    return sorted(out)


def test_the_parse_reads_the_table():
    rows = layout_rows(DESIGN.read_text(encoding="utf-8"))
    named = named_paths(rows)
    assert ROOT / "adaptive/engine/loop.py" in named and ROOT / "adaptive/measure/timing.py" in named
    sample = ("## Layout\n\n| path | what |\n| --- | --- |\n"
              "| `adaptive/x/` | `a.py` (`f()`), `b/`, `c.json` |\n\n## Next\n| `adaptive/y.py` | not the table |\n")
    assert named_paths(layout_rows(sample)) == {ROOT / "adaptive/x", ROOT / "adaptive/x/a.py", ROOT / "adaptive/x/b"}


def test_every_path_in_the_layout_table_exists():
    named = named_paths(layout_rows(DESIGN.read_text(encoding="utf-8")))
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"docs/design.md's layout table names paths that do not exist: {missing}"


def test_every_module_is_in_the_layout_table():
    named = named_paths(layout_rows(DESIGN.read_text(encoding="utf-8")))
    absent = [str(p.relative_to(ROOT)) for p in modules() if p not in named]
    assert not absent, f"modules missing from docs/design.md's layout table: {absent}"
