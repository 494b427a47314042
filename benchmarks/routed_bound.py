"""How fast the routed runtime could be with the drafters a calibration raced: a bound from a profile and a bench run.

For each group of an ``adaptive bench --json`` report, the best speedup any drafter reached in that
domain's calibration race (``profile.json``'s measurements: the point estimate and its interval's
upper end), and the overall figure the bench would report if every held-out prompt of the group ran
at that speedup: ``sum(ar tok/s * best) / sum(ar tok/s)`` over the ar runs (the bench's overall
speedup is the mean tokens/s of a method over the mean of ``ar``'s). The race times decoding only,
after the prefill, while the bench's tokens/s include it, so the bound is optimistic where prompts
are long (rag). Beside it, what ``--method`` (default ``knn-ssd``) measured.

    python benchmarks/routed_bound.py --profile /tmp/q15-prof --bench /tmp/q15-bench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def best_raced(domain: dict) -> tuple[str, float, float]:
    """``(role, speedup, interval high)`` of the fastest drafter raced in a domain record (JSON);
    ``("ar", 1.0, 1.0)`` where none beat plain decoding."""
    best = ("ar", 1.0, 1.0)
    for m in domain.get("measurements", []):
        if m["speedup"] > best[1]:
            best = (m["role"], float(m["speedup"]), float((m.get("interval") or {}).get("high", m["speedup"])))
    return best


def bound(ar_runs: list[dict], speedups: dict[str, float]) -> float:
    """The bench's overall speedup if each ar run's group ran at ``speedups[group]``.
    Example: ar at 10 tok/s (group a, 2x) and 2 tok/s (group b, 1x): ``(20 + 2) / 12 = 1.833``."""
    ref = sum(r["tokens_per_s"] for r in ar_runs)
    return sum(r["tokens_per_s"] * speedups.get(r["group"], 1.0) for r in ar_runs) / ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, type=Path, help="a profile directory (or its profile.json)")
    ap.add_argument("--bench", required=True, type=Path, help="an adaptive bench --json report")
    ap.add_argument("--method", default="knn-ssd")
    args = ap.parse_args()
    path = args.profile / "profile.json" if args.profile.is_dir() else args.profile
    domains = json.loads(path.read_text())["domains"]
    report = json.loads(args.bench.read_text())
    ar = [r for r in report["runs"] if r["method"] == "ar"]
    measured = report["results"].get(args.method, {})
    point, high = {}, {}
    print(f"{'group':16s} {'ar tok/s':>8s} {args.method:>8s}  best raced in calibration")
    for g in sorted({r["group"] for r in ar}):
        role, point[g], high[g] = best_raced(domains.get(g, {}))
        tps = sum(r["tokens_per_s"] for r in ar if r["group"] == g) / sum(r["group"] == g for r in ar)
        got = measured.get("by_category", {}).get(g, {}).get("speedup")
        print(f"{g:16s} {tps:8.2f} {got if got is not None else float('nan'):7.2f}x  "
              f"{role} {point[g]:.2f}x (interval up to {high[g]:.2f}x)")
    got = measured.get("speedup")
    print(f"{'overall':16s} {'':8s} {got if got is not None else float('nan'):7.2f}x  "
          f"bound {bound(ar, point):.2f}x at the races' speedups, "
          f"{bound(ar, high):.2f}x at their intervals' upper ends")


if __name__ == "__main__":
    main()
