"""Fixtures shared by the command-line tests."""

import json

import pytest

from tests.conftest import TINY_DOMAINS

CATEGORY = {"math": "math_reasoning"}


@pytest.fixture
def data_file(tmp_path):
    """A Spec-Bench-style question file: the last two tiny prompts of each domain, two turns each."""
    f = tmp_path / "sb.jsonl"
    # "math" is an MT-bench category (grouped as mt_bench): use Spec-Bench's math_reasoning
    rows = [{"question_id": f"{n}{i}", "category": CATEGORY.get(n, n), "turns": [p, "and then?"]}
            for n, ps in TINY_DOMAINS.items() for i, p in enumerate(ps[-2:])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f
