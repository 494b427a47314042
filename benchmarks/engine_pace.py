"""Does learning from traffic make the two-engine choice faster? One process, interleaved.

Loads a two-engine profile's members once (online learning of domains off, so only the choice's
prices differ) and two :class:`~adaptive.runtime.TwoEngineRuntime` over them: ``calibrated`` (prices
as calibrated, each request priced for its cap) and ``learned``, with the learners ``--learn`` names:
``pace`` (a :class:`~adaptive.runtime.pace.PaceLearner` correcting each engine's pace from the
requests it served: posterior means, or Thompson draws with ``--explore``), ``lengths`` (a
:class:`~adaptive.runtime.lengths.LengthLearner`: each request priced for the tokens its domain's
answers were seen to decode), or ``both``. Each held-out prompt is decoded by both runtimes, the
order alternating, for ``--passes`` passes (the learners keep what they learned) over the same
prompts, or, with ``--new-prompts``, over the next ``--per-category`` prompts of each group each pass
(nothing learned from the very prompts it is measured on). Prints, per pass, each runtime's total
seconds (prefill included, exploration's cost included), the requests each engine got, the seconds
by group, and the learners' state.

    python benchmarks/engine_pace.py --profile /tmp/twolex --data ../shared/data/spec_bench_dev.jsonl \\
        --per-category 8 --passes 3
    python benchmarks/engine_pace.py --profile /tmp/twolex --data ../shared/data/spec_bench_dev.jsonl \\
        --learn lengths --max-new-tokens 256 --per-category 8 --passes 2 --new-prompts
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from adaptive.bench.data import load_bench_prompts
from adaptive.runtime import AdaptiveRuntime, TwoEngineRuntime
from adaptive.runtime.lengths import LengthLearner
from adaptive.runtime.pace import PaceLearner, PaceSettings
from adaptive.runtime.turns import TurnLock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a two-engine profile directory")
    ap.add_argument("--data", required=True, help="a Spec-Bench-format JSONL file")
    ap.add_argument("--skip-first", type=int, default=16, help="prompts per group left out (calibration's)")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--explore", action=argparse.BooleanOptionalAction, default=PaceSettings().explore,
                    help="Thompson draws in the learned runtime's choices (--no-explore: posterior means)")
    ap.add_argument("--learn", default="pace", help="what the learned runtime learns: pace, lengths, or both "
                                                     "(also written pace,lengths)")
    ap.add_argument("--new-prompts", action="store_true", help="each pass on the next prompts of each group")
    args = ap.parse_args()
    learn = {"pace", "lengths"} if args.learn == "both" else set(args.learn.split(","))
    if learn - {"pace", "lengths"}:
        ap.error(f"--learn takes pace, lengths, or both (pace,lengths), not {args.learn!r}")

    base = TwoEngineRuntime.from_profile(args.profile, online=False, prefix_cache=0)
    lock = TurnLock()
    members = {e: AdaptiveRuntime(rt.profile, rt.lm, online=False, model_lock=lock, seed=args.seed, prefix_cache=0)
               for e, rt in base.runtimes.items()}
    pace = PaceLearner(PaceSettings(explore=args.explore), seed=args.seed) if "pace" in learn else None
    lengths = LengthLearner() if "lengths" in learn else None
    runtimes = {"calibrated": TwoEngineRuntime(members, base.default),
                "learned": TwoEngineRuntime(members, base.default, pace, lengths)}
    runtimes["calibrated"].generate("warm up", max_new_tokens=8)
    for p in range(args.passes):
        skip = args.skip_first + (p * args.per_category if args.new_prompts else 0)
        prompts = load_bench_prompts(args.data, skip_first=skip, per_category=args.per_category)
        seconds = collections.Counter()
        groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        engines: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for k, prompt in enumerate(prompts):
            order = ["calibrated", "learned"] if (k + p) % 2 == 0 else ["learned", "calibrated"]
            for name in order:
                t = time.perf_counter()
                r = runtimes[name].generate(prompt.turns[0], max_new_tokens=args.max_new_tokens)
                dt = time.perf_counter() - t
                seconds[name] += dt
                groups[prompt.group][name] += dt
                engines[name][r.engine] += 1
        print(json.dumps({"pass": p + 1, "prompts": len(prompts),
                          "seconds": {k: round(v, 2) for k, v in seconds.items()},
                          "learned_over_calibrated": round(seconds["calibrated"] / seconds["learned"], 4),
                          "engines": {k: dict(v) for k, v in engines.items()},
                          "groups": {g: round(c["calibrated"] / c["learned"], 3) for g, c in groups.items()},
                          "pace": pace.state() if pace else None,
                          "lengths": lengths.state() if lengths else None}), flush=True)


if __name__ == "__main__":
    main()
