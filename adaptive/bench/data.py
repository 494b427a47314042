"""Benchmark prompts: Spec-Bench's format (``question_id``, ``category``, ``turns``) or plain JSONL.

The eight MT-bench categories form one ``mt_bench`` group, as Spec-Bench reports them, unless
``group_mt_bench=False``. ``per_category`` keeps the first N prompts of each group, in file order.
:func:`mixed_stream` reorders the selection into KNN-SSD's mixed-domain stream.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from adaptive.calibrate.prompts import builtin_domains
from adaptive.calibrate.sources import PromptFileError, read_prompt_rows

# ``--data builtin``: the shipped domains' prompts (adaptive/calibrate/prompts), each domain a group; `make demo`
# calibrates on the first of each, so ``--skip-first`` past them leaves held-out ones
BUILTIN = "builtin"

ORDERS = ("file", "mixed")  # `adaptive bench --order`: as read, or :func:`mixed_stream`
MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})


# `adaptive bench --shared-context N`: the questions asked, one request each, after a RAG or summarization
# prompt's own text (its document and instruction), so that the requests share that text as a prefix
SHARED_QUESTIONS = (
    "Answer the question above in one sentence.",
    "Which names, places or numbers does the text above mention?",
    "What is the text above mainly about? Answer in a few words.",
    "Give one fact the text above states, quoting it.",
    "Is there anything the text above leaves unclear? Say what, briefly.",
    "Write a title for the text above.",
)
SHARED_GROUPS = frozenset({"rag", "summarization"})


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: its user turns (one unless all turns were asked for). ``shared``: the
    turns are separate requests over one shared text (each a whole prompt), not a conversation
    (each after the earlier turns and replies)."""

    id: str
    group: str
    category: str
    turns: tuple[str, ...]
    shared: bool = False


def group_of(category: str, group_mt_bench: bool = True) -> str:
    """``"writing"`` -> ``"mt_bench"``; ``"qa"`` -> ``"qa"``; with ``group_mt_bench=False`` unchanged."""
    return "mt_bench" if group_mt_bench and category in MT_BENCH else category


def load_bench_prompts(path: str | Path, per_category: int | None = None, group_mt_bench: bool = True,
                       all_turns: bool = False, skip_first: int = 0, shared_context: int = 0) -> list[BenchPrompt]:
    """Read benchmark prompts (errors name the file and line).

    ``skip_first`` drops the first N prompts of each group (those a profile was calibrated on),
    then ``per_category`` keeps the next N. ``all_turns`` keeps every user turn of Spec-Bench rows
    (each later turn is answered after the earlier turns and the reference method's replies).
    ``shared_context`` N > 0: the shared-document workload, only the RAG and summarization groups,
    each prompt asked N times, each time followed by one of :data:`SHARED_QUESTIONS` (separate
    requests sharing the prompt's text). A plain JSONL row with no ``category`` is in group ``default``.
    ``path`` :data:`BUILTIN` (where no such file exists): the shipped domains' prompts, each domain a group.
    """
    if per_category is not None and per_category < 1:
        raise PromptFileError(f"per-category must be >= 1, got {per_category}")
    if not 0 <= shared_context <= len(SHARED_QUESTIONS):
        raise PromptFileError(f"shared-context must be from 0 to {len(SHARED_QUESTIONS)}, got {shared_context}")
    if shared_context and all_turns:
        raise PromptFileError("shared-context asks separate questions over one text; all-turns answers a "
                              "conversation: choose one")
    if skip_first < 0:
        raise PromptFileError(f"skip-first must be >= 0, got {skip_first}")
    path = Path(path)
    builtin = str(path) == BUILTIN and not path.exists()
    if builtin:
        rows = [{"prompt": p, "category": name, "question_id": f"{name}-{i}"}
                for name, prompts in builtin_domains().items() for i, p in enumerate(prompts)]
    else:
        rows = read_prompt_rows(path)
    all_rows = []
    if all_turns and path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        all_rows = [json.loads(line) for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    out: list[BenchPrompt] = []
    seen: dict[str, int] = defaultdict(int)
    for i, row in enumerate(rows):
        category = str(row.get("category", "default"))
        group = category if builtin else group_of(category, group_mt_bench)  # a shipped domain is its own group
        if shared_context and group not in SHARED_GROUPS:
            continue
        seen[group] += 1
        if seen[group] <= skip_first:
            continue
        if per_category is not None and seen[group] > skip_first + per_category:
            continue
        turns = (row["prompt"],)
        if all_rows and isinstance(all_rows[i].get("turns"), list):
            turns = tuple(str(t) for t in all_rows[i]["turns"] if str(t).strip()) or turns
        if shared_context:
            turns = tuple(f"{row['prompt']}\n\n{q}" for q in SHARED_QUESTIONS[:shared_context])
        out.append(BenchPrompt(str(row.get("question_id", i)), group, category, turns, shared=bool(shared_context)))
    if not out:
        where = f" in groups {', '.join(sorted(SHARED_GROUPS))}" if shared_context else ""
        raise PromptFileError(f"{path}: no prompts selected{where} (skip-first {skip_first}, "
                              f"per-category {per_category})")
    return out


def mixed_stream(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """The prompts interleaved round-robin over their groups (KNN-SSD's mixed-domain stream): the
    first prompt of each group, groups in sorted name order, then the second of each, and so on; a
    group that runs out is passed over. Within a group the given (file) order is kept.

    Example, in file order ``q1 q2 q3`` (group ``qa``), ``c1`` (``code``), ``m1 m2`` (``math``):
    the stream is ``c1 m1 q1 m2 q2 q3`` (``code < math < qa``; round 1 ``c1 m1 q1``, round 2
    ``m2 q2``, round 3 ``q3``), so consecutive requests come from different groups while more than
    one group is left.
    """
    by_group: dict[str, list[BenchPrompt]] = defaultdict(list)
    for p in prompts:
        by_group[p.group].append(p)
    queues = [by_group[g] for g in sorted(by_group)]
    return [q[i] for i in range(max((len(q) for q in queues), default=0)) for q in queues if i < len(q)]
