"""Where a server's time goes: the held-out mix through the real scheduler in-process, closed-loop
clients, the two-engine runtime's time split into each engine's prefills and steps.

    python benchmarks/serve_breakdown.py /tmp/twofull --data ../shared/data/spec_bench_dev.jsonl \\
        --clients 8 --max-batch 8          # --max-batch 1: the same requests one at a time

A step's time includes the prompt chunks that ride in it (a torch batch carries them). With
``--steep`` the batch's draft lengths are priced on a verify table rising 0.09 steps a row (what eight
sequences of the embedded model cost on the 2-core host, against the flat one-sequence table), to see
whether the batch drafts too much (it did not: 2026-11-27).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import adaptive.runtime.runtime as runtime_module
from adaptive.bench.data import load_bench_prompts
from adaptive.runtime.engines import TwoEngineRuntime
from adaptive.runtime.runtime import AdaptiveRuntime, RoutedPrefilling
from adaptive.serve.scheduler import Job, Scheduler
from adaptive.serve.wire import ServeRequest

STEEP = tuple(1 + 0.09 * r for r in range(16))


def instrument(spent: collections.Counter, calls: collections.Counter, steep: bool) -> None:
    """Time every step and prompt chunk by engine (class-level wrappers, for this process only)."""
    step, advance, lengths = AdaptiveRuntime.step, RoutedPrefilling.advance, runtime_module.batch_draft_lengths

    def timed_step(self, decodings, riders=()):
        t = time.perf_counter()
        try:
            return step(self, decodings, riders)
        finally:
            key = f"step {self.lm.engine}"
            spent[key] += time.perf_counter() - t
            calls[key] += 1
            calls[f"{key} rows {len(decodings)}"] += 1

    def timed_advance(self, tokens=None):
        t = time.perf_counter()
        try:
            return advance(self, tokens)
        finally:
            key = f"prefill {self.runtime.lm.engine}"
            spent[key] += time.perf_counter() - t
            calls[key] += 1

    AdaptiveRuntime.step, RoutedPrefilling.advance = timed_step, timed_advance
    if steep:
        runtime_module.batch_draft_lengths = lambda g, c, verify, fixed_rows=0: lengths(g, c, STEEP, fixed_rows)


async def serve(scheduler: Scheduler, prompts: list[str], clients: int, max_tokens: int) -> tuple[int, dict]:
    """Closed loop: each client sends its next prompt when its last answer is done; tokens made and
    requests per engine."""
    queue, made, engines = list(prompts), [0], collections.Counter()
    loop = asyncio.get_running_loop()

    async def client():
        while queue:
            req = ServeRequest("completion", queue.pop(0), max_tokens=max_tokens, temperature=0.0)
            job = Job(req, scheduler.admit(req), loop)
            scheduler.submit(job)
            while (event := await job.events.get()).kind == "delta":
                pass
            if event.kind == "error":
                raise RuntimeError(f"a request failed: {event.error}")
            made[0] += len(event.result.token_ids)
            engines[event.result.engine] += 1

    await asyncio.gather(*[client() for _ in range(clients)])
    return made[0], dict(engines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a two-engine profile directory")
    ap.add_argument("--data", required=True, help="Spec-Bench JSONL")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steep", action="store_true", help="price batch drafts on a steep verify table")
    args = ap.parse_args()
    prompts = [p.turns[0] for p in load_bench_prompts(args.data, args.per_category, skip_first=args.skip_first)]
    runtime = TwoEngineRuntime.from_profile(args.profile, online=False, prefix_cache=0)
    spent, calls = collections.Counter(), collections.Counter()
    instrument(spent, calls, args.steep)
    scheduler = Scheduler(runtime, max_batch=args.max_batch, default_max_tokens=args.max_tokens)
    t = time.perf_counter()
    try:
        made, engines = asyncio.run(serve(scheduler, prompts, args.clients, args.max_tokens))
    finally:
        scheduler.close()
    wall = time.perf_counter() - t
    print(f"{len(prompts)} requests, {args.clients} clients, batches of up to {args.max_batch}: {made} tokens in "
          f"{wall:.1f} s = {made / wall:.1f} tok/s; requests per engine {engines}")
    for key in sorted(spent):
        print(f"  {key}: {spent[key]:.2f} s over {calls[key]} calls ({spent[key] / wall:.0%} of the time)")
    rows = sorted((k, v) for k, v in calls.items() if " rows " in k)
    print("  steps by requests in them:", ", ".join(f"{k.split()[1]} x{k.split()[-1]}: {v}" for k, v in rows))


if __name__ == "__main__":
    main()
