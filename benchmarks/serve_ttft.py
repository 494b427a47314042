"""Time to first token of a short request that arrives while long ones decode (issue 32's TTFT target).

For each ``--prefill-chunk`` value in turn (repeated, interleaved), starts ``adaptive serve`` with it,
then measures the short request's TTFT alone (``--repeats`` times on an idle server) and under load:
``--long`` clients send long held-out prompts (the rag and summarization groups) back to back,
``--long-tokens`` new tokens each, streaming; once all of them decode, the short request (a held-out
qa prompt) is sent, its TTFT taken, and again after a pause, ``--repeats`` times. The long clients
keep starting new requests, so a short one may land behind a long prompt's prefill: that wait is
what chunked prefill bounds. Reports per chunk the median TTFT alone and under load and their ratio
(target: at most 2x), as JSON.

    python benchmarks/serve_ttft.py --profile /tmp/cpp-prof --data ../shared/data/spec_bench_dev.jsonl \\
        --chunks 128 0 --repeats 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_batch import start_server, stop_server  # noqa: E402
from serve_load import prompts_from  # noqa: E402


def stream(url: str, prompt: str, max_tokens: int, first_token: threading.Event | None = None) -> float | None:
    """Send one streaming greedy chat request; its time to the first content delta (s)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    ttft = None
    try:
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                           "temperature": 0, "stream": True}).encode()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"the server answered {r.status}: {r.read()[:200]!r}")
        for line in r:
            if line.startswith(b"data: [DONE]"):
                break
            if ttft is None and line.startswith(b"data: ") and b'"content"' in line:
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                    if first_token is not None:
                        first_token.set()
    finally:
        conn.close()
    return ttft


def measure(args, chunk: int, short: list[str], long: list[str]) -> dict:
    proc, url = start_server(SimpleNamespace(profile=args.profile, model=args.model, prefill_chunk=chunk,
                                             goodput=True), args.max_batch)
    try:
        stream(url, short[0], 4)  # warm up
        alone = [stream(url, short[i % len(short)], args.short_tokens) for i in range(args.repeats)]
        stop, started = threading.Event(), [threading.Event() for _ in range(args.long)]

        def client(j: int) -> None:
            i = j
            while not stop.is_set():
                stream(url, long[i % len(long)], args.long_tokens, started[j])
                i += args.long

        threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in range(args.long)]
        for t in threads:
            t.start()
        for e in started:
            e.wait(600)
        loaded = []
        for i in range(args.repeats):
            loaded.append(stream(url, short[i % len(short)], args.short_tokens))
            time.sleep(args.pause)
        stop.set()
        for t in threads:
            t.join(600)
    finally:
        stop_server(proc)
    med_alone, med_loaded = statistics.median(alone), statistics.median(loaded)
    return {"prefill_chunk": chunk, "ttft_alone_s": [round(x, 3) for x in alone],
            "ttft_loaded_s": [round(x, 3) for x in loaded], "median_alone_s": round(med_alone, 3),
            "median_loaded_s": round(med_loaded, 3), "loaded_vs_alone": round(med_loaded / med_alone, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--skip-first", type=int, default=16, help="prompts of each group left out (calibrated on)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 0])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--long", type=int, default=7, help="long clients decoding meanwhile")
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="times each chunk setting is measured, interleaved")
    ap.add_argument("--pause", type=float, default=1.5, help="seconds between short requests under load")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    short = prompts_from(args.data, args.skip_first, ["qa"])
    long = prompts_from(args.data, args.skip_first, ["rag", "summarization"])
    rows = []
    for rnd in range(args.rounds):
        for chunk in args.chunks:
            row = measure(args, chunk, short, long)
            print(f"round {rnd + 1} prefill_chunk {chunk}: alone {row['median_alone_s']} s, loaded "
                  f"{row['median_loaded_s']} s ({row['loaded_vs_alone']}x)", file=sys.stderr, flush=True)
            rows.append(row)
    report = {"profile": args.profile, "max_batch": args.max_batch, "long_clients": args.long,
              "long_tokens": args.long_tokens, "rows": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
