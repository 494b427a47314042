"""The prefix cache's cost where it cannot help, and its memory: single turns with it on and off, and
the budget over many requests (issue 62).

1. ``single``: the held-out single-turn prompts (``--skip-first``, ``--per-category`` of each group),
   decoded by the profile's runtime (routed, greedy, ``--max-new-tokens``) with its prefix cache on
   (``--budget`` MiB, kept across the prompts as a server keeps it, emptied between repeats so that no
   prompt meets its own earlier run) and off, interleaved per prompt (the order alternating), repeated.
   Reports the aggregate tokens/s of each (all tokens over all seconds, prefill included), their
   ratio (issue target: >= 0.98), the prompt tokens the cache held (the chat template's start and
   whatever the prompts share) and whether the outputs are equal.
2. ``turns``: MT-bench's two turns (``--turns-data``, held-out rows), each conversation decoded with
   the cache on (turn 2 re-sends turn 1 and the runtime's own reply, as a chat client does) and the
   same two requests with it off, interleaved, repeated: the time to the first token (the prefill's)
   of each turn, on and off, and the throughput over both turns (issue target: turn 2's 3x lower).
3. ``shared``: the RAG and summarization prompts (held-out), each followed by ``--questions`` of the
   bench's fixed questions (``adaptive.bench.data.SHARED_QUESTIONS``), separate requests over the same
   text, cache on: the first question's time to the first token against the later ones' (issue
   target: 4x lower), and the same requests with the cache off.
4. ``memory``: ``--requests`` requests (held-out prompts in turn, every fourth a second turn over an
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


def new_stores(rt, args) -> tuple[list[PrefixStore], list[PrefixStore]]:
    """Each backbone's store with the cache on (``--budget``) and off: what :func:`use` swaps in."""
    return ([PrefixStore(budget_bytes(args.budget)) for _ in backbones(rt)],
            [PrefixStore(0) for _ in backbones(rt)])


def timed(rt, messages, args):
    t = time.perf_counter()
    res = rt.generate(messages, max_new_tokens=args.max_new_tokens)
    return res, time.perf_counter() - t


def single(rt, prompts, args) -> dict:
    on_stores, off_stores = new_stores(rt, args)
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
                res, dt = timed(rt, [{"role": "user", "content": p.turns[0]}], args)
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


def turns(rt, args) -> dict:
    rows = [p for p in load_bench_prompts(args.turns_data, args.per_category, all_turns=True,
                                          skip_first=args.skip_first) if len(p.turns) > 1]
    on_stores, off_stores = new_stores(rt, args)
    ttft = {(m, t): [] for m in ("on", "off") for t in (1, 2)}
    work = {"on": [0, 0.0], "off": [0, 0.0]}
    cached, same, n = 0, 0, 0
    for r in range(args.repeats):
        for store in on_stores:
            store.clear()
        for i, p in enumerate(rows):
            first = [{"role": "user", "content": p.turns[0]}]
            use(rt, on_stores)  # the conversation as a client has it: turn 1, our reply, turn 2
            a1, s1 = timed(rt, first, args)
            second = first + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": p.turns[1]}]
            a2, s2 = timed(rt, second, args)
            use(rt, off_stores)  # the same two requests, every prompt prefilled whole
            b1, t1 = timed(rt, first, args)
            b2, t2 = timed(rt, second, args)
            for mode, res, secs in (("on", (a1, a2), s1 + s2), ("off", (b1, b2), t1 + t2)):
                ttft[(mode, 1)].append(res[0].stats.prefill_time)
                ttft[(mode, 2)].append(res[1].stats.prefill_time)
                work[mode][0] += len(res[0].token_ids) + len(res[1].token_ids)
                work[mode][1] += secs
            cached += a2.stats.cached_tokens
            same += (a2.token_ids == b2.token_ids)
            n += 1
            print(f"turns {r + 1}/{args.repeats} {i + 1}/{len(rows)}: turn 2 {a2.stats.prefill_time:.3f} s on, "
                  f"{b2.stats.prefill_time:.3f} s off ({a2.stats.cached_tokens} of {a2.stats.prompt_tokens} cached)",
                  file=sys.stderr, flush=True)
    mean = {k: sum(v) / len(v) for k, v in ttft.items()}
    on, off = (work[m][0] / work[m][1] for m in ("on", "off"))
    return {"conversations": len(rows), "repeats": args.repeats,
            "ttft_s": {f"turn{t}_{m}": round(mean[(m, t)], 4) for m in ("on", "off") for t in (1, 2)},
            "turn2_ttft_off_over_on": round(mean[("off", 2)] / mean[("on", 2)], 2),
            "tokens_per_s_on": round(on, 3), "tokens_per_s_off": round(off, 3), "throughput_ratio": round(on / off, 4),
            "turn2_cached_tokens_mean": round(cached / n, 1), "turn2_identical": f"{same} of {n}"}


def shared(rt, args) -> dict:
    from adaptive.bench.data import SHARED_QUESTIONS

    docs = load_bench_prompts(args.shared_data, args.per_category, skip_first=args.skip_first,
                              shared_context=args.questions)
    on_stores, off_stores = new_stores(rt, args)
    first, later, off_first, off_later = [], [], [], []
    for i, doc in enumerate(docs):
        for store in on_stores:
            store.clear()  # each document's first question starts from nothing
        for k, text in enumerate(doc.turns):
            messages = [{"role": "user", "content": text}]
            use(rt, on_stores)
            a, _ = timed(rt, messages, args)
            use(rt, off_stores)
            b, _ = timed(rt, messages, args)
            (first if k == 0 else later).append(a.stats.prefill_time)
            (off_first if k == 0 else off_later).append(b.stats.prefill_time)
        rest = later[-(len(doc.turns) - 1):]
        print(f"shared {i + 1}/{len(docs)}: first {first[-1]:.3f} s, later {sum(rest) / len(rest):.3f} s",
              file=sys.stderr, flush=True)
    m = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"documents": len(docs), "questions": args.questions, "first_ttft_s": round(m(first), 4),
            "later_ttft_s": round(m(later), 4), "first_over_later": round(m(first) / m(later), 2),
            "off_first_ttft_s": round(m(off_first), 4), "off_later_ttft_s": round(m(off_later), 4),
            "questions_asked": list(SHARED_QUESTIONS[:args.questions])}


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
    ap.add_argument("--parts", default="single,turns,shared,memory")
    ap.add_argument("--turns-data", default=None, help="Spec-Bench rows with two turns (default: --data)")
    ap.add_argument("--shared-data", default=None, help="rows with RAG and summarization prompts (default: --data)")
    ap.add_argument("--questions", type=int, default=4, help="questions per shared text")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.turns_data = args.turns_data or args.data
    args.shared_data = args.shared_data or args.data
    prompts = load_bench_prompts(args.data, args.per_category, skip_first=args.skip_first)
    rt = open_runtime(args.profile, online=False, prefix_cache=0)
    report = {"profile": args.profile, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "engines": [bb.engine for bb in backbones(rt)]}
    parts = args.parts.split(",")
    if "single" in parts:
        report["single"] = single(rt, prompts, args)
    if "turns" in parts:
        report["turns"] = turns(rt, args)
    if "shared" in parts:
        report["shared"] = shared(rt, args)
    if "memory" in parts:
        report["memory"] = memory(rt, prompts, args)
    rt.close()
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
