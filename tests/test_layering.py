"""The package's layers point down only: every import (function-local ones included) goes from a
subpackage to a lower layer or stays inside its own subpackage, and no module reaches into another
module's private names. The table below is the architecture (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import adaptive

ROOT = Path(adaptive.__file__).parent
LAYERS = [
    {"errors", "codec", "workdir", "limits", "progress", "resources"},  # no adaptive imports but each other's, one way
    {"engine"},
    {"models"},
    {"drafters"},
    {"costs", "index"},
    {"profile"},
    {"measure"},
    {"calibrate", "runtime", "distill"},  # siblings: none imports another
    {"bench", "serve"},  # siblings
    {"cli"},
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# inside the bottom layer, imports go leftwards
BOTTOM_ORDER = ["errors", "codec", "workdir", "limits", "progress", "resources"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """``(line, imported module, imported names)`` for every import in the file, resolved to absolute."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target, [a.name for a in node.names]


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "adaptive" and len(parts) > 1 else None


def _files():
    return sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")  # the facade re-exports


def test_every_subpackage_has_a_layer():
    units = {_unit(_module_name(p)) for p in _files()}
    assert units <= set(RANK), f"add {sorted(units - set(RANK))} to LAYERS (and docs/design.md)"


def test_imports_point_down_only():
    bad = []
    for path in _files():
        me = _unit(_module_name(path))
        for line, target, _names in _imports(path):
            other = _unit(target)
            if other is None or other == me:
                continue
            ok = RANK[other] < RANK[me] or (
                RANK[other] == RANK[me] == 0 and BOTTOM_ORDER.index(other) < BOTTOM_ORDER.index(me))
            if not ok:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports {target} ({other})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_cycles_between_subpackages():
    edges: dict[str, set[str]] = {}
    for path in _files():
        me = _unit(_module_name(path))
        for _line, target, _names in _imports(path):
            other = _unit(target)
            if other is not None and other != me:
                edges.setdefault(me, set()).add(other)

    def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
        return any(x == b or (x not in seen and reaches(x, b, seen | {x})) for x in edges.get(a, ()))

    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reaches(b, a)})
    assert not cycles, f"import cycles between subpackages: {cycles}"


def test_no_private_names_across_modules():
    bad = []
    for path in _files():
        me = _module_name(path)
        for line, target, names in _imports(path):
            if not target.startswith("adaptive") or target == me:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {target} {private}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {a.asname or a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("adaptive") for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)
