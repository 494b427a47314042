"""Continuous batching in-process (no HTTP): throughput by batch size and policy, and a lossless audit.

Loads a profile's runtime once. For each ``--policies`` P and ``--batch`` B (interleaved over
``--repeats``), decodes ``--requests`` held-out Spec-Bench prompts (round robin over the groups, as
``benchmarks/serve_load.py`` takes them; greedy, ``--max-tokens`` each, as chat messages): while
fewer than B run, the next request is started whole (``AdaptiveRuntime.start``: prefill, route,
plan), then one ``AdaptiveRuntime.step`` advances all running ones. With ``--chunk N`` the
server's own scheduler (:class:`adaptive.serve.scheduler.Scheduler`, ``--prefill-chunk N``, no
HTTP) runs them instead, all queued at once: prompts prefilled N tokens per step, their chunks
carried by the steps. Reports wall time, generated tokens/s (prefills included), the time spent in
prefills and in steps (whole prefills only), and the mean batch; and audits every output against
plain decoding of the same prompt alone (``ar``, batch 1): identical, a near-tie
(``adaptive.engine.audit``: the two tokens' logits within the dtype's tolerance where they part)
or a violation.

    python benchmarks/batch_decode.py --profile /tmp/s135-prof --data ../shared/data/spec_bench_dev.jsonl \\
        --policies knn-ssd ar --batch 1 8 --requests 32 --repeats 2 --out /tmp/batch-decode.json
    python benchmarks/batch_decode.py --profile /tmp/cpp-prof --data ../shared/data/spec_bench_dev.jsonl \\
        --policies knn-ssd --batch 1 8 --chunk 128 --requests 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import prompts_from  # noqa: E402  (the same prompts, in the same order, as the load test)

from adaptive.engine.audit import audit_divergence  # noqa: E402
from adaptive.runtime import AdaptiveRuntime  # noqa: E402
from adaptive.serve.scheduler import Job, Scheduler  # noqa: E402
from adaptive.serve.wire import ServeRequest  # noqa: E402


def run(rt: AdaptiveRuntime, prompts: list[str], policy: str, batch: int, max_tokens: int) -> dict:
    """Decode ``prompts`` with at most ``batch`` running at once, admitting in order as others finish."""
    waiting = list(range(len(prompts)))
    running: dict[int, object] = {}
    ids: dict[int, list[int]] = {}
    prefills: list[float] = []  # each request's prefill forward (what `adaptive generate` reports as prefill)
    prefill_s = step_s = 0.0
    steps = sizes = 0
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < batch:
            i = waiting.pop(0)
            t = time.perf_counter()
            running[i] = rt.start([{"role": "user", "content": prompts[i]}], max_new_tokens=max_tokens, policy=policy)
            prefill_s += time.perf_counter() - t
        live = [i for i, r in running.items() if not r.done]
        if live:
            t = time.perf_counter()
            rt.step([running[i] for i in live])
            step_s += time.perf_counter() - t
            steps += 1
            sizes += len(live)
        for i in [i for i, r in running.items() if r.done]:
            result = running.pop(i).result()
            ids[i] = result.token_ids
            prefills.append(result.stats.prefill_time)
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in ids.values())
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "prefill_s": prefill_s,
            "step_s": step_s, "steps": steps, "mean_batch": sizes / steps if steps else 0.0, "ids": ids,
            "prefill_median_s": statistics.median(prefills)}


def scheduled(rt: AdaptiveRuntime, prompts: list[str], policy: str, batch: int, max_tokens: int, chunk: int,
              carry: bool | None = None) -> dict:
    """Decode ``prompts`` through the server's scheduler (``max_batch=batch``, ``prefill_chunk=chunk``,
    ``carry``: steps carry prompt chunks, ``None``: where the engine does), all submitted at once; the
    ids of each request's output."""
    speculation = {"knn-ssd": "auto", "ar": "off"}.get(policy, policy)
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(rt, max_queue=len(prompts), max_batch=batch, prefill_chunk=chunk, carry=carry)

    async def result(job: Job):
        while (ev := await job.events.get()).kind == "delta":
            pass
        if ev.kind != "done":
            raise SystemExit(f"request failed: {ev.error}")
        return ev.result

    try:
        t0 = time.perf_counter()
        jobs = []
        for text in prompts:
            req = ServeRequest("chat", ({"role": "user", "content": text},), max_tokens=max_tokens, temperature=0.0,
                               speculation=speculation)
            jobs.append(Job(req, scheduler.admit(req), loop))
            scheduler.submit(jobs[-1])

        async def results_of_all():
            return await asyncio.gather(*(result(j) for j in jobs))

        results = loop.run_until_complete(results_of_all())
        wall = time.perf_counter() - t0
    finally:
        scheduler.close()
        loop.close()
    ids = {i: r.token_ids for i, r in enumerate(results)}
    tokens = sum(len(v) for v in ids.values())
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "prefill_s": 0.0, "step_s": 0.0,
            "steps": 0, "mean_batch": 0.0, "ids": ids,
            "prefill_median_s": statistics.median(r.stats.prefill_time for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--categories", nargs="+", default=None, help="only these groups (default: all)")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--policies", nargs="+", default=["knn-ssd", "ar"],
                    help="routing policies; with --chunk, a policy ending in ':carry' or ':nocarry' runs the "
                         "scheduler with steps carrying prompt chunks or not (default: as the engine does)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--chunk", type=int, default=None,
                    help="run the server's scheduler with this --prefill-chunk (0: whole prompts) instead of the loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rt = AdaptiveRuntime.from_profile(args.profile, model=args.model, dtype=args.dtype, online=False, prefix_cache=0)
    prompts = prompts_from(args.data, args.skip_first, args.categories)[: args.requests]
    rt.generate(prompts[0], max_new_tokens=4, policy="ar")  # warm-up
    ref = run(rt, prompts, "ar", 1, args.max_tokens)["ids"]  # the lossless reference: plain, alone
    results: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):
        for policy in args.policies:
            for batch in args.batch:
                name, _, mode = policy.partition(":")
                r = run(rt, prompts, name, batch, args.max_tokens) if args.chunk is None else \
                    scheduled(rt, prompts, name, batch, args.max_tokens, args.chunk,
                                                         carry={"nocarry": False, "carry": True}.get(mode))
                results.setdefault((policy, batch), []).append(r)
                print(f"repeat {rep + 1} {policy} batch {batch}: {r['tokens_per_s']:.1f} tok/s "
                      f"(prefill {r['prefill_s']:.1f} s, steps {r['step_s']:.1f} s, mean batch {r['mean_batch']:.2f})",
                      file=sys.stderr, flush=True)
    base = statistics.median(r["tokens_per_s"] for r in results[(args.policies[0], 1)]) \
        if (args.policies[0], 1) in results else None
    rows = []
    for (policy, batch), rs in results.items():
        identical = near_ties = violations = 0
        margins = []
        for r in rs:
            for i, other in r["ids"].items():
                prompt_ids = rt.encode([{"role": "user", "content": prompts[i]}])
                a = audit_divergence(rt.engine.backbone, prompt_ids, ref[i], other)
                if a.identical:
                    identical += 1
                elif a.violation:
                    violations += 1
                else:
                    near_ties += 1
                    margins.append(round(a.margin, 4))
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rows.append({"policy": policy, "batch": batch, "tokens_per_s": round(tps, 2),
                     "tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in rs],
                     f"vs_{args.policies[0]}_batch_1": round(tps / base, 2) if base else None,
                     "prefill_s": round(statistics.median(r["prefill_s"] for r in rs), 2),
                     "prefill_median_per_request_s": round(statistics.median(r["prefill_median_s"] for r in rs), 3),
                     "step_s": round(statistics.median(r["step_s"] for r in rs), 2),
                     "mean_batch": round(statistics.median(r["mean_batch"] for r in rs), 2),
                     "outputs": identical + near_ties + violations, "identical_to_ar_alone": identical,
                     "near_ties": near_ties, "near_tie_margins": margins, "violations": violations})
    report = {"profile": args.profile, "categories": args.categories or "all", "model": rt.profile.model.name,
              "dtype": str(rt.engine.backbone.dtype),
              "requests": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
