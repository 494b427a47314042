"""The prefix cache's cost where it cannot help, and its memory: single turns with it on and off, and
the budget over many requests (issue 62).

1. ``single``: the held-out single-turn prompts (``--skip-first``, ``--per-category`` of each group),
   decoded by the profile's runtime (routed, greedy, ``--max-new-tokens``) with its prefix cache on
   (``--budget`` MiB, kept across the prompts as a server keeps it, emptied between repeats so that no
   prompt meets its own earlier run) and off, interleaved per prompt (the order alternating), repeated.
   Reports the aggregate tokens/s of each (all tokens over all seconds, prefill included), their
   ratio (issue target: >= 0.98), the prompt tokens the cache held (the chat template's start and
   whatever the prompts share) and whether the outputs are equal.
2. ``memory``: ``--requests`` requests (held-out prompts in turn, every fourth a second turn over an
   earlier one's reply, so entries are replaced and evicted) with a small budget (``--memory-budget``
   MiB): the store's bytes after each request never above the budget, and the process's resident set
   before and after.

Both engines of a two-engine profile are measured through the two-engine runtime (each keeps its own
cache). Progress on stderr, the JSON report on stdout (``--out`` also writes it).

    python benchmarks/prefix_cache.py --profile adaptive-profile --data ../shared/data/spec_bench_dev.jsonl \\
        --skip-first 16 --per-category 4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from adaptive.bench.data import load_bench_prompts
from adaptive.engine.prefix import PrefixStore, budget_bytes
from adaptive.runtime.engines import open_runtime


def resident_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024)
    return 0


def backbones(rt) -> list:
    members = getattr(rt, "runtimes", None)
    return [m.engine.backbone for m in members.values()] if members else [rt.engine.backbone]


def use(rt, stores: list[PrefixStore]) -> None:
    for bb, store in zip(backbones(rt), stores):
        bb.prefixes = store


def single(rt, prompts, args) -> dict:
    on_stores = [PrefixStore(budget_bytes(args.budget)) for _ in backbones(rt)]
    off_stores = [PrefixStore(0) for _ in backbones(rt)]
    totals = {"on": [0, 0.0], "off": [0, 0.0]}
    cached, same, runs = 0, 0, 0
    for r in range(args.repeats):
        for store in on_stores:
            store.clear()
        for i, p in enumerate(prompts):
            order = ("on", "off") if (i + r) % 2 == 0 else ("off", "on")
            out = {}
            for mode in order:
                use(rt, on_stores if mode == "on" else off_stores)
                t = time.perf_counter()
                res = rt.generate([{"role": "user", "content": p.turns[0]}], max_new_tokens=args.max_new_tokens)
                dt = time.perf_counter() - t
                totals[mode][0] += len(res.token_ids)
                totals[mode][1] += dt
                out[mode] = res
            cached += out["on"].stats.cached_tokens
            same += out["on"].token_ids == out["off"].token_ids
            runs += 1
            print(f"single {r + 1}/{args.repeats} {i + 1}/{len(prompts)}: cached {out['on'].stats.cached_tokens}"
                  f" of {out['on'].stats.prompt_tokens}", file=sys.stderr, flush=True)
    on, off = (totals[m][0] / totals[m][1] for m in ("on", "off"))
    return {"tokens_per_s_on": round(on, 3), "tokens_per_s_off": round(off, 3), "ratio": round(on / off, 4),
            "cached_tokens_per_request": round(cached / runs, 1), "identical_outputs": f"{same} of {runs}"}


def memory(rt, prompts, args) -> dict:
    budget = budget_bytes(args.memory_budget)
    stores = [PrefixStore(budget) for _ in backbones(rt)]
    use(rt, stores)
    before, peak, replies = resident_mib(), 0, []
    for k in range(args.requests):
        p = prompts[k % len(prompts)]
        messages = [{"role": "user", "content": p.turns[0]}]
        if k % 4 == 3 and replies:  # a second turn over an earlier request's reply
            first, reply = replies[-1]
            messages = [{"role": "user", "content": first}, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "Say that again in fewer words."}]
        res = rt.generate(messages, max_new_tokens=args.max_new_tokens)
        replies.append((messages[0]["content"], res.text))
        peak = max(peak, max(s.stats().nbytes for s in stores))
        if k % 20 == 19:
            print(f"memory {k + 1}/{args.requests}: store {peak / 2**20:.1f} MiB at most, "
                  f"resident {resident_mib()} MiB", file=sys.stderr, flush=True)
    return {"requests": args.requests, "budget_mib": args.memory_budget, "store_peak_mib": round(peak / 2**20, 2),
            "within_budget": peak <= budget, "resident_before_mib": before, "resident_after_mib": resident_mib(),
            "entries": [s.stats().to_dict() for s in stores]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", type=float, default=256.0, help="MiB of the cache in the single-turn runs")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--memory-budget", type=float, default=16.0, help="MiB of the cache in the memory run")
    ap.add_argument("--parts", default="single,memory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = load_bench_prompts(args.data, args.per_category, skip_first=args.skip_first)
    rt = open_runtime(args.profile, online=False, prefix_cache=0)
    report = {"profile": args.profile, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "engines": [bb.engine for bb in backbones(rt)]}
    parts = args.parts.split(",")
    if "single" in parts:
        report["single"] = single(rt, prompts, args)
    if "memory" in parts:
        report["memory"] = memory(rt, prompts, args)
    rt.close()
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
