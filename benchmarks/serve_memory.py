"""Resident memory of `adaptive serve`: after start, and after each round of requests.

Starts ``adaptive serve --profile PROFILE`` (extra arguments after ``--`` go to it), reads its resident
set once it answers (``VmRSS``: ``RssAnon`` allocated and ``RssFile`` of mapped files; the peak
``VmHWM``; with ``--files N`` the N mapped files holding the most), then sends ``--rounds`` rounds of
12 chat requests (two held-out prompts of each Spec-Bench group, the next two each round) from 4 client
threads, ``--max-tokens`` each, reading it again 3 s after each round (the server gives freed memory back
after 1 s idle).

    python benchmarks/serve_memory.py --profile /tmp/two --data ../shared/data/spec_bench_dev.jsonl --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from adaptive.bench.data import load_bench_prompts


def resident(pid: int) -> dict:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = round(int(value.split()[0]) / 1024)  # MiB
    return out


def files(pid: int, top: int) -> dict:
    """The ``top`` mapped files holding the most resident memory (MiB), from ``/proc/PID/smaps``."""
    rss: dict[str, int] = {}
    name = None
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's header: address range, perms, offset, device, inode, path
            name = head[5] if len(head) > 5 and head[5].startswith("/") else None
        elif head[0] == "Rss:" and name:
            rss[name] = rss.get(name, 0) + int(head[1])
    ranked = sorted(rss.items(), key=lambda kv: -kv[1])[:top]
    return {path.rsplit("/", 1)[-1]: round(kb / 1024) for path, kb in ranked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8641)
    ap.add_argument("--files", type=int, default=0, help="also name the N mapped files with the most resident MiB")
    ap.add_argument("serve_args", nargs="*", help="after --: more `adaptive serve` options")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "adaptive.cli.main", "serve", "--profile", args.profile,
                             "--port", str(args.port), *args.serve_args], stdout=subprocess.DEVNULL)
    try:
        for _ in range(900):
            try:
                model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=2))["data"][0]["id"]
                break
            except OSError:
                time.sleep(1)
        else:
            raise SystemExit("the server did not answer in 15 minutes")
        time.sleep(3)
        extra = (lambda: {"files": files(proc.pid, args.files)}) if args.files else dict
        print(json.dumps({"after": "start", **resident(proc.pid), **extra()}), flush=True)
        prompts = load_bench_prompts(args.data, skip_first=16, per_category=2 * args.rounds)
        groups: dict[str, list] = {}
        for p in prompts:
            groups.setdefault(p.group, []).append(p.turns[0])

        def ask(text: str) -> None:
            body = json.dumps({"model": model, "max_tokens": args.max_tokens,
                               "messages": [{"role": "user", "content": text}]}).encode()
            req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=900).read()

        for k in range(args.rounds):
            texts = [t for g in groups.values() for t in g[2 * k: 2 * k + 2]]
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(ask, texts))
            time.sleep(3)
            print(json.dumps({"after": f"round {k + 1}", "requests": len(texts), **resident(proc.pid),
                              **extra()}), flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
