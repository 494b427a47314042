"""Routing accuracy of a profile on prompts it was not calibrated on.

    python benchmarks/routing_eval.py --profile DIR --skip 16 /tmp/sb-domains/*.jsonl

Each file is one group (its stem is the expected domain); the first ``--skip`` prompts of each
(the ones ``adaptive calibrate --prompts-per-domain N`` used) are left out. Prints accuracy per
group and overall (optionally excluding groups with ``--exclude``; an out-of-domain decision
counts as wrong), and the out-of-domain count.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from adaptive.calibrate.sources import read_prompt_rows
from adaptive.engine.engine import Engine
from adaptive.index.router import route_prompt
from adaptive.models import DEFAULT_MODEL, load_model
from adaptive.profile import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--exclude", action="append", default=[], help="groups left out of the overall figure")
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    args = ap.parse_args()
    profile = load_profile(args.profile)
    lm = load_model(profile.model.spec or DEFAULT_MODEL, dtype=profile.model.dtype or "auto",
                    engine=profile.model.engine)
    profile.check_model(lm.fingerprint())
    engine = Engine(lm)
    ok, total, ood = Counter(), Counter(), Counter()
    confusion: Counter = Counter()
    t0 = time.perf_counter()
    for f in args.files:
        group = f.stem
        for row in read_prompt_rows(f)[args.skip:]:
            d = route_prompt(profile, engine, row["prompt"])
            got = d.route.domain  # out-of-domain (None) counts as wrong
            total[group] += 1
            ok[group] += got == group
            ood[group] += d.route.out_of_domain
            confusion[(group, got)] += 1
    counted = [g for g in total if g not in args.exclude]
    overall = sum(ok[g] for g in counted) / max(1, sum(total[g] for g in counted))
    print(f"{'group':16s} {'correct':>8s} {'ood':>4s}")
    for g in sorted(total):
        print(f"{g:16s} {ok[g]:>3d}/{total[g]:<4d} {ood[g]:>4d}")
    print(f"overall (excluding {', '.join(args.exclude) or 'none'}): {overall:.3f}; "
          f"{sum(total.values())} prompts in {time.perf_counter() - t0:.1f} s")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "profile": args.profile, "skip": args.skip, "overall": overall, "excluded": args.exclude,
            "per_group": {g: {"correct": ok[g], "total": total[g], "out_of_domain": ood[g]} for g in total},
            "confusion": {f"{a}->{b}": n for (a, b), n in sorted(confusion.items(), key=str)}}, indent=1))


if __name__ == "__main__":
    main()
