"""The front door (issue 63): a README a new user reads in five minutes, and results on one screen.

README.md: its first screen (60 lines) says what it is, the two commands, what to expect and where
to read on; no paragraph runs over 80 words. docs/results.md: under 150 lines, each table row short
enough to render in about three lines (its text, link targets aside, at most 300 characters). No
module in ``adaptive/`` runs past 600 lines unless its docstring says why.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
MAX_WORDS = 80
MAX_ROW_CHARS = 300
MAX_MODULE_LINES = 600


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs: blank-line separated blocks outside code fences, tables and headings."""
    out, block, fenced = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith(("|", "#")):
            continue
        if line.strip():
            block.append(line)
        elif block:
            out.append(" ".join(block))
            block = []
    return out


def rendered(row: str) -> str:
    """A table row's text as it renders: link targets and backticks left out."""
    return re.sub(r"\]\([^)]*\)", "]", row).replace("`", "")


def test_paragraphs_are_split_outside_code_and_tables():
    text = "# T\n\none two\nthree\n\n```\ncode words\n```\n| a | b |\n\nfour\n"
    assert paragraphs(text) == ["one two three", "four"]
    assert rendered("| [x](http://a.b/c) | `y` |") == "| [x] | y |"


def test_the_readme_first_screen_says_what_how_what_to_expect_and_where_next():
    head = "\n".join(README.read_text(encoding="utf-8").splitlines()[:60])
    for heading in ("## Two commands", "## What to expect"):
        assert heading in head, heading
    assert "make demo" in head and "make test" in head
    assert "docs/results.md" in head


def test_no_readme_paragraph_runs_over_80_words():
    long = [p[:60] for p in paragraphs(README.read_text(encoding="utf-8")) if len(p.split()) > MAX_WORDS]
    assert not long, f"README paragraphs over {MAX_WORDS} words: {long}"


def test_results_fit_one_screen_a_few_lines_a_row():
    lines = RESULTS.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150, f"docs/results.md has {len(lines)} lines"
    long = [row[:60] for row in lines if row.startswith("|") and len(rendered(row)) > MAX_ROW_CHARS]
    assert not long, f"results.md rows over {MAX_ROW_CHARS} rendered characters: {long}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: ``"## CPU default path"`` -> ``"cpu-default-path"``."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def test_the_readme_links_lead_somewhere():
    assert slug("## CPU default path") == "cpu-default-path" and slug("## `make demo`, then") == "make-demo-then"
    text = README.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target
        if anchor:
            headings = [line for line in (ROOT / target).read_text(encoding="utf-8").splitlines()
                        if line.startswith("#")]
            assert anchor in {slug(h) for h in headings}, f"{target}#{anchor}"


def silent_long_modules(package: Path) -> list[str]:
    """Modules under ``package`` over :data:`MAX_MODULE_LINES` lines whose docstring does not say why
    ("... past 600 lines ...")."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > MAX_MODULE_LINES and f"past {MAX_MODULE_LINES} lines" not in doc:
            out.append(path.relative_to(package).as_posix())
    return out


def test_a_module_past_600_lines_says_why(tmp_path):
    body = "x = 1\n" * MAX_MODULE_LINES
    (tmp_path / "short.py").write_text('"""Short."""\n' + "x = 1\n" * 10)
    (tmp_path / "silent.py").write_text('"""Long."""\n' + body)
    (tmp_path / "says.py").write_text('"""Long. Why it runs past 600 lines: one concern."""\n' + body)
    assert silent_long_modules(tmp_path) == ["silent.py"]
    assert silent_long_modules(ROOT / "adaptive") == []
