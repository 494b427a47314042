"""Split a Spec-Bench-format file into one prompt file per group, for ``adaptive calibrate --domains``.

The eight MT-bench categories form one ``mt_bench`` group, as Spec-Bench reports them. Every
group keeps its file order, so ``--prompts-per-domain N`` calibrates on the first N prompts and
``benchmarks/routing_eval.py --skip N`` scores routing on the rest.

    python benchmarks/specbench_domains.py ../shared/data/spec_bench_dev.jsonl /tmp/sb-domains
    adaptive calibrate $(for f in /tmp/sb-domains/*.jsonl; do n=$(basename $f .jsonl); echo --domains $n=$f; done)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from adaptive.bench.data import group_of


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: specbench_domains.py SPEC_BENCH.jsonl OUT_DIR")
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    groups: dict[str, list[dict]] = defaultdict(list)
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            groups[group_of(row["category"])].append({"prompt": row["turns"][0], "category": row["category"],
                                                      "question_id": row["question_id"]})
    out.mkdir(parents=True, exist_ok=True)
    for g, rows in sorted(groups.items()):
        (out / f"{g}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{g}: {len(rows)} prompts -> {out / (g + '.jsonl')}")


if __name__ == "__main__":
    main()
