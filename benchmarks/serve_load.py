"""Load a running `adaptive serve` with concurrent streaming clients: throughput, latency, errors.

Each of ``--clients`` threads sends chat requests back to back for ``--seconds`` (or
``--requests`` in all), streaming, greedy, ``--max-tokens`` each, prompts taken in turn from a
Spec-Bench-format file; with ``--invalid F`` a fraction F of requests are malformed on purpose
(bad JSON, wrong types, unknown fields, ``max_tokens`` 0 or beyond the context, an unknown model,
an oversized body), each of which must get a 4xx. Reports requests by status, server errors (5xx,
broken streams, a 4xx for a valid request or a 2xx for an invalid one), aggregate generated
tokens/s, time to first token, per-request latency and inter-token latency (each request's mean gap
between its tokens after the first; median and 90th percentile), as JSON.
Prompts are the held-out ones of each group (``--skip-first``), taken round robin over the groups;
request ``i`` asks about prompt ``i`` (in turn), so runs with the same ``--requests`` ask the same
questions; ``--record FILE`` writes each valid request's prompt index and streamed text (JSON lines)
for comparing outputs across server settings (``benchmarks/serve_batch.py`` does). ``--turns T``:
each job is a conversation of T requests, each turn re-sending the earlier turns and the replies
streamed to them (as chat clients do): the prompt's own later turns where the file has them (MT-bench),
else :data:`FOLLOW_UP`; the time to first token is reported by turn too (``ttft_by_turn_s``), and a
recorded text's index is ``PROMPT/TURN``.

    adaptive serve --profile /tmp/sb-prof &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --data ../shared/data/spec_bench_dev.jsonl \\
        --clients 4 --seconds 60 --invalid 0.3
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import threading
import time
from urllib.parse import urlparse

FOLLOW_UP = "Thank you. Now say that again in two sentences."  # a later turn where the file has none


def prompts_from(path: str, skip: int, categories: list[str] | None = None, turns: int = 1) -> list:
    """The held-out prompts (all but the first ``skip`` of each group; only ``categories`` if given),
    round robin over the groups; with ``turns`` > 1 each is a list of that many user turns."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    by_cat: dict[str, list] = {}
    for r in rows:
        if categories and r.get("category", "") not in categories:
            continue
        said = [str(t) for t in r["turns"] if str(t).strip()] if "turns" in r else [r["prompt"]]
        text = said[0] if turns == 1 else (said + [FOLLOW_UP] * turns)[:turns]
        by_cat.setdefault(r.get("category", ""), []).append(text)
    groups = [texts[skip:] for texts in by_cat.values() if len(texts) > skip]
    # round robin over the groups, so that any number of requests asks about every group alike
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def invalid_bodies(model: str) -> list[tuple[str, bytes]]:
    msg = [{"role": "user", "content": "hi"}]
    bad = [
        b"{not json",
        json.dumps({"model": model, "messages": msg, "max_tokens": "many"}).encode(),
        json.dumps({"model": model, "messages": msg, "max_tokens": 0}).encode(),
        json.dumps({"model": model, "messages": msg, "max_tokens": 10**7}).encode(),
        json.dumps({"model": model, "messages": []}).encode(),
        json.dumps({"model": model, "messages": msg, "temperature": "hot"}).encode(),
        json.dumps({"model": model, "messages": msg, "frobnicate": 1}).encode(),
        json.dumps({"model": "no-such-model", "messages": msg}).encode(),
        json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(),
    ]
    return [("invalid", b) for b in bad]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status: dict[str, int] = {}
        self.errors: list[str] = []
        self.tokens = 0
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.itl: list[float] = []  # each request's mean inter-token latency after its first text
        self.texts: list[tuple[int, str]] = []  # (prompt index, streamed text) of each valid request
        self.engines: dict[str, int] = {}  # requests per engine that decoded them (usage.adaptive.engine)
        self.ttft_by_turn: dict[int, list[float]] = {}
        self.cached_tokens = 0  # usage.prompt_tokens_details.cached_tokens, where the server says

    def add(self, key: str, error: str | None = None):
        with self.lock:
            self.status[key] = self.status.get(key, 0) + 1
            if error:
                self.errors.append(error)


def one(host, port, headers, body: bytes, valid: bool, stats: Stats, index=-1, turn: int = 1) -> str | None:
    """Send one request and stream its answer: the text, or ``None`` when it failed (counted in ``stats``)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        r = conn.getresponse()
        if not valid:
            r.read()
            ok = 400 <= r.status < 500
            stats.add(f"invalid {r.status}", None if ok else f"invalid request answered {r.status}")
            return
        if r.status != 200:
            stats.add(f"valid {r.status}", f"valid request answered {r.status}: {r.read()[:200]!r}")
            return
        first, last, tokens, done, pieces, engine = None, None, 0, False, [], None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                stats.add("valid stream error", f"error in stream: {chunk['error']}")
                return
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                pieces.append(content)
                last = time.perf_counter() - t0
                if first is None:
                    first = last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                engine = (chunk["usage"].get("adaptive") or {}).get("engine")
                with stats.lock:
                    stats.cached_tokens += (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            elif chunk.get("timings", {}).get("predicted_n"):  # llama-server's own count, when it sends no usage
                tokens = chunk["timings"]["predicted_n"]
        if not done:
            stats.add("valid broken stream", "stream ended without [DONE]")
            return
        with stats.lock:
            stats.tokens += tokens
            stats.latency.append(time.perf_counter() - t0)
            stats.texts.append((index, "".join(pieces)))
            if engine is not None:  # the engine that decoded it (adaptive serve's usage.adaptive)
                stats.engines[engine] = stats.engines.get(engine, 0) + 1
            if first is not None and tokens > 1:
                stats.itl.append((last - first) / (tokens - 1))
            if first is not None:
                stats.ttft.append(first)
                stats.ttft_by_turn.setdefault(turn, []).append(first)
        stats.add("valid 200")
        return "".join(pieces)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        stats.add("exception", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--data", required=True)
    ap.add_argument("--skip-first", type=int, default=16, help="prompts of each group left out (calibrated on)")
    ap.add_argument("--categories", nargs="+", default=None, help="only these groups (default: all)")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=0, help="stop after this many requests in all (0: by time)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--invalid", type=float, default=0.0, help="fraction of deliberately malformed requests")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", default=None, help="write each valid request's prompt index and text here (JSON lines)")
    ap.add_argument("--turns", type=int, default=1, help="requests per conversation, each after the last's reply")
    ap.add_argument("--speculation", default=None,
                    help="the body's 'speculation' field (adaptive serve's extension: auto, off or a policy)")
    args = ap.parse_args()

    u = urlparse(args.url)
    host, port = u.hostname, u.port or 80
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/v1/models", headers=headers)
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    prompts = prompts_from(args.data, args.skip_first, args.categories, args.turns)
    bad = invalid_bodies(model)
    rng = random.Random(args.seed)
    lock = threading.Lock()
    counter = [0]
    stats = Stats()
    deadline = time.perf_counter() + args.seconds

    def next_job():
        with lock:
            if args.requests and counter[0] >= args.requests:
                return None
            if not args.requests and time.perf_counter() >= deadline:
                return None
            i = counter[0]
            counter[0] += args.turns  # a conversation is its turns' requests
            if rng.random() < args.invalid:
                return rng.choice(bad)[1], False, i
        return None, True, i // args.turns % len(prompts)

    def body_of(messages) -> bytes:
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if args.speculation:
            body["speculation"] = args.speculation
        return json.dumps(body).encode()

    def client():
        while (job := next_job()) is not None:
            body, valid, index = job
            if not valid:
                one(host, port, headers, body, valid, stats, index)
                continue
            if args.turns == 1:
                one(host, port, headers, body_of([{"role": "user", "content": prompts[index]}]), True, stats, index)
                continue
            messages = []
            for k, turn in enumerate(prompts[index], start=1):
                messages.append({"role": "user", "content": turn})
                reply = one(host, port, headers, body_of(messages), True, stats, f"{index}/{k}", k)
                if reply is None:
                    break
                messages.append({"role": "assistant", "content": reply})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if args.record:
        with open(args.record, "w", encoding="utf-8") as f:
            for index, text in sorted(stats.texts, key=lambda it: str(it[0])):
                f.write(json.dumps({"prompt": index, "text": text}) + "\n")

    def pct(xs, q, digits=3):
        if len(xs) < 2:
            return round(xs[0], digits) if xs else None
        return round(statistics.quantiles(xs, n=10)[q - 1], digits)

    print(json.dumps({
        "clients": args.clients, "wall_s": round(wall, 1), "requests": sum(stats.status.values()),
        "by_status": dict(sorted(stats.status.items())), "server_errors": len(stats.errors),
        "error_samples": stats.errors[:5], "generated_tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / wall, 2),
        "ttft_s": {"median": round(statistics.median(stats.ttft), 3) if stats.ttft else None,
                   "p90": pct(stats.ttft, 9)},
        "latency_s": {"median": round(statistics.median(stats.latency), 3) if stats.latency else None,
                      "p90": pct(stats.latency, 9)},
        "itl_s": {"median": round(statistics.median(stats.itl), 4) if stats.itl else None,
                  "p90": pct(stats.itl, 9, 4)},
        "engines": dict(sorted(stats.engines.items())),
        "ttft_by_turn_s": {str(k): round(statistics.median(v), 3) for k, v in sorted(stats.ttft_by_turn.items())},
        "cached_tokens": stats.cached_tokens,
    }, indent=1))


if __name__ == "__main__":
    main()
