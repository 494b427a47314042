"""Batched against one-at-a-time serving, and against llama.cpp's own server: throughput, latency, outputs.

For each repeat, and in it for each server setting in turn (interleaved, so that drift hits all
settings alike), starts the server on a free port, then for each ``--clients`` N runs
``benchmarks/serve_load.py`` (N streaming greedy clients sending ``--requests`` requests in all, the
same held-out Spec-Bench prompts in the same order each time, texts recorded), and stops it. One
model process at a time. The settings: ``adaptive serve --profile DIR --max-batch B`` for each of
``--batches`` (and for each ``--speculation`` value the requests carry: ``auto`` or ``off``; online
learning off unless ``--online``, then what the learner did during each load is reported); with
``--llama-server``, llama.cpp's C++ ``llama-server`` on the same GGUF (``--gguf``) and threads,
``-np`` the largest batch (continuous batching), plain and with each ``--llama-server-spec`` type
(``benchmarks/build_llama_server.sh`` builds it). With ``--members``, a two-engine profile's
engines are also served each alone (``adaptive serve --engine E``, the largest batch), and each
row counts the requests each engine decoded (``engines``, from ``usage.adaptive.engine``).

Reports, as JSON (and a Markdown table with ``--md``): per (setting, N) the median over repeats of
aggregate tokens/s, TTFT and latency, the throughput against ``adaptive --max-batch 1`` at the same
N (the one-at-a-time server) and with one client, against plain ``llama-server`` at the same N, and
how many streamed texts differ from the one-at-a-time single-client text of the same prompt
(greedy: every one of ours should be equal; in bf16 a batched verification may part from it only
at a near-tie, which ``adaptive bench``'s audit explains; llama-server applies the chat template
itself and decodes with its own numerics, so its texts are agreement, not a lossless check).

    python benchmarks/serve_batch.py --profile /tmp/s135-prof --data ../shared/data/spec_bench_dev.jsonl \
        --batches 1 8 --clients 1 2 4 8 --requests 32 --repeats 2 --out /tmp/serve-batch.json --md /tmp/sb.md
    python benchmarks/serve_batch.py --profile /tmp/cpp-prof --data ../shared/data/spec_bench_dev.jsonl \
        --batches 1 8 --clients 8 --llama-server --llama-server-spec ngram-mod --gguf SmolLM2.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from adaptive.profile import read_engines

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, batch: int, engine: str | None = None) -> tuple[subprocess.Popen, str]:
    """``adaptive serve`` on a free port with ``args``' settings (no prefix cache unless ``args.prefix_cache``:
    the single-request measurements repeat prompts); the process and its URL once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "adaptive.cli.main", "serve", "--profile", args.profile, "--port", str(port),
           "--max-batch", str(batch), "--max-queue", "256", "--prefill-chunk", str(args.prefill_chunk),
           "--prefix-cache", str(getattr(args, "prefix_cache", 0))] + \
        ([] if args.goodput else ["--no-goodput"]) + (["--engine", engine] if engine else [])
    if getattr(args, "online", False):  # learning from this run only: a fresh overlay per server
        cmd += ["--online", "--online-path", os.path.join(tempfile.mkdtemp(prefix="serve-batch-"), "overlay")]
    else:
        cmd += ["--no-online"]  # batching alone, as measured
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 10 minutes")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def load(args, url: str, clients: int, record: str, speculation: str | None = None) -> dict:
    cmd = [sys.executable, str(HERE / "serve_load.py"), "--url", url, "--data", args.data, "--clients", str(clients),
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--skip-first", str(args.skip_first), "--record", record, "--turns", str(args.turns)] + \
        (["--categories", *args.categories] if args.categories else []) + \
        (["--speculation", speculation] if speculation else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def texts(record: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in open(record, encoding="utf-8"):
        row = json.loads(line)
        out.setdefault(row["prompt"], []).append(row["text"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--categories", nargs="+", default=None, help="only these groups (default: all)")
    ap.add_argument("--skip-first", type=int, default=16, help="prompts of each group left out (calibrated on)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--speculation", nargs="+", default=["auto"], choices=["auto", "off"],
                    help="what adaptive serve's requests ask for (off: plain decoding, batched all the same)")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="adaptive serve's --prefill-chunk")
    ap.add_argument("--turns", type=int, default=1, help="requests per conversation (serve_load.py --turns)")
    ap.add_argument("--prefix-cache", type=float, default=None,
                    help="adaptive serve's --prefix-cache MiB, and llama-server's cache_prompt on when > 0 "
                         "(default: 256 with --turns above 1, else 0: single turns as measured before)")
    ap.add_argument("--no-goodput", dest="goodput", action="store_false", help="adaptive serve --no-goodput")
    ap.add_argument("--online", action="store_true",
                    help="adaptive serve with online learning on (a fresh overlay each start; default: off)")
    ap.add_argument("--members", action="store_true",
                    help="a two-engine profile: also serve each of its engines alone, at the largest batch "
                         "(adaptive-ENGINE-bB)")
    ap.add_argument("--llama-server", action="store_true", help="also llama.cpp's llama-server, -np the largest batch")
    ap.add_argument("--llama-server-spec", nargs="*", default=[], help="and with these --spec-type values")
    ap.add_argument("--gguf", default=None, help="the GGUF file llama-server serves (the profile's model)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t/-tb (ours: the engine's default)")
    ap.add_argument("--slot-context", type=int, default=2048, help="llama-server's context per slot (-c: this x -np)")
    args = ap.parse_args()
    if args.prefix_cache is None:
        args.prefix_cache = 256.0 if args.turns > 1 else 0.0
    if (args.llama_server or args.llama_server_spec) and not args.gguf:
        raise SystemExit("--llama-server needs --gguf (the file the profile's model was loaded from)")
    peers = ([None] if args.llama_server else []) + list(args.llama_server_spec)
    slots = max(args.batches)

    runs: dict[tuple[str, int], list[dict]] = {}
    outputs: dict[tuple[str, int], list[dict[int, list[str]]]] = {}

    def measure(label: str, url: str, tmp: str, rep: int, speculation: str | None = None) -> None:
        for clients in args.clients:
            record = os.path.join(tmp, f"r{rep}-{label}-c{clients}.jsonl")
            r = load(args, url, clients, record, speculation)
            if label.startswith("adaptive") and args.online:  # what the learner did during this load
                with urllib.request.urlopen(url + "/v1/adaptive/online", timeout=10) as reply:
                    state = json.loads(reply.read())
                r["online"] = {k: state.get(k) for k in ("requests", "buffered", "measuring", "learned",
                                                         "measure_seconds", "measure_waits", "errors")}
            runs.setdefault((label, clients), []).append(r)
            outputs.setdefault((label, clients), []).append(texts(record))
            print(f"repeat {rep + 1} {label} clients {clients}: {r['tokens_per_s']} tok/s, "
                  f"{r['server_errors']} errors", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for batch in args.batches:
                proc, url = start_server(args, batch)
                try:
                    for spec in args.speculation:
                        label = f"adaptive-b{batch}" + ("" if spec == "auto" else f"-spec-{spec}")
                        measure(label, url, tmp, rep, None if spec == "auto" else spec)
                finally:
                    stop_server(proc)
            for engine in (read_engines(args.profile).engines if args.members else ()):
                proc, url = start_server(args, slots, engine)
                try:
                    measure(f"adaptive-{engine}-b{slots}", url, tmp, rep)
                finally:
                    stop_server(proc)
            for spec_type in peers:
                from adaptive.bench.llama_server import LlamaServer

                label = f"llama-server-np{slots}" + (f"-{spec_type}" if spec_type else "")
                with LlamaServer(Path(args.gguf), args.threads, args.slot_context * slots, spec_type,
                                 slots=slots, cache_prompt=args.prefix_cache > 0) as server:
                    measure(label, server.url, tmp, rep)

    # the reference texts: one at a time with the fewest clients (without --batches 1: the smallest batch)
    ref_key = (f"adaptive-b{min(args.batches)}", min(args.clients))
    reference = {i: ts[0] for i, ts in outputs[ref_key][0].items()}
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    ratio = lambda a, b: round(a / b, 2) if a is not None and b else None  # noqa: E731
    tps_of = lambda key: med([r["tokens_per_s"] for r in runs.get(key, [])])  # noqa: E731
    rows = []
    for (label, clients), rs in sorted(runs.items()):
        tps = med([r["tokens_per_s"] for r in rs])
        differ = sum(t != reference.get(i) for o in outputs[(label, clients)] for i, ts in o.items() for t in ts)
        total = sum(len(ts) for o in outputs[(label, clients)] for ts in o.values())
        rows.append({
            "server": label, "clients": clients, "tokens_per_s": tps,
            "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
            "vs_one_at_a_time_same_clients": ratio(tps, tps_of(("adaptive-b1", clients))),
            "vs_one_at_a_time_one_client": ratio(tps, tps_of(ref_key)),
            "vs_llama_server_same_clients": ratio(tps, tps_of((f"llama-server-np{slots}", clients))),
            "ttft_median_s": med([r["ttft_s"]["median"] for r in rs if r["ttft_s"]["median"] is not None]),
            "latency_median_s": med([r["latency_s"]["median"] for r in rs if r["latency_s"]["median"] is not None]),
            "latency_p90_s": med([r["latency_s"]["p90"] for r in rs if r["latency_s"]["p90"] is not None]),
            "server_errors": sum(r["server_errors"] for r in rs),
            "engines": [r.get("engines") for r in rs] if any(r.get("engines") for r in rs) else None,
            "ttft_by_turn_s": [r.get("ttft_by_turn_s") for r in rs],
            "cached_tokens": [r.get("cached_tokens") for r in rs],
            "online": [r["online"] for r in rs if "online" in r] or None,
            "texts": total, "texts_differing_from_one_at_a_time": differ,
        })
    report = {"profile": args.profile, "categories": args.categories or "all", "requests": args.requests,
              "max_tokens": args.max_tokens, "prefill_chunk": args.prefill_chunk, "goodput": args.goodput,
              "turns": args.turns, "prefix_cache_mib": args.prefix_cache,
              "repeats": args.repeats, "rows": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.md:
        lines = ["| server | clients | tokens/s (median) | vs one at a time, same clients | vs 1 client, 1 at a "
                 "time | vs llama-server, same clients | TTFT median | latency median / p90 | texts differing |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']} | "
                         f"{r['vs_one_at_a_time_same_clients']}x | {r['vs_one_at_a_time_one_client']}x | "
                         f"{r['vs_llama_server_same_clients']}x | "
                         f"{r['ttft_median_s']} s | {r['latency_median_s']} / {r['latency_p90_s']} s | "
                         f"{r['texts_differing_from_one_at_a_time']} of {r['texts']} |")
        Path(args.md).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
