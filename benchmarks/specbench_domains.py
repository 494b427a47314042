"""Split a Spec-Bench-format file into one prompt file per group, for ``adaptive calibrate --domains``.

The eight MT-bench categories form one ``mt_bench`` group, as Spec-Bench reports them. Every
group keeps its file order, so ``--prompts-per-domain N`` calibrates on the first N prompts and
``benchmarks/routing_eval.py --skip N`` scores routing on the rest.

    python benchmarks/specbench_domains.py ../shared/data/spec_bench_dev.jsonl /tmp/sb-domains
    adaptive calibrate $(for f in /tmp/sb-domains/*.jsonl; do n=$(basename $f .jsonl); echo --domains $n=$f; done)

``--exclude A:B`` leaves out each group's prompts ``A .. B-1`` (0-based, in file order): the window
``adaptive bench --skip-first A --per-category B-A`` holds out, so that an eagle head can train on the
rest of the file (``adaptive distill --drafter eagle --data ...``) and still be measured on prompts it
never saw.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from adaptive.bench.data import group_of


def main() -> None:
    args = sys.argv[1:]
    lo = hi = 0
    if len(args) == 4 and args[0] == "--exclude":
        try:
            lo, hi = (int(x) for x in args[1].split(":"))
        except ValueError:
            sys.exit(f"--exclude takes A:B (two integers), got {args[1]!r}")
        args = args[2:]
    if len(args) != 2:
        sys.exit("usage: specbench_domains.py [--exclude A:B] SPEC_BENCH.jsonl OUT_DIR")
    src, out = Path(args[0]), Path(args[1])
    groups: dict[str, list[dict]] = defaultdict(list)
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            groups[group_of(row["category"])].append({"prompt": row["turns"][0], "category": row["category"],
                                                      "question_id": row["question_id"]})
    out.mkdir(parents=True, exist_ok=True)
    for g, rows in sorted(groups.items()):
        rows = [r for i, r in enumerate(rows) if not lo <= i < hi]
        (out / f"{g}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{g}: {len(rows)} prompts -> {out / (g + '.jsonl')}")


if __name__ == "__main__":
    main()
