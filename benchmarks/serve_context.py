"""Concurrent long prompts against a running `adaptive serve`: does every request finish when their
caches together need more than llama.cpp's shared context holds?

Sends ``--clients`` chat requests at once, each the ``--repeat`` times concatenated text of one of the
longest prompts of a Spec-Bench-format file (so that, together, they need more positions than the
context), ``--max-tokens`` each, and prints each answer's status, prompt and completion tokens and
engine (a 4xx for one of these valid requests is a server error).

    adaptive serve --profile /tmp/two --engine llama.cpp --port 8632 &
    python benchmarks/serve_context.py --url http://127.0.0.1:8632 --data ../shared/data/spec_bench_dev.jsonl
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--data", required=True, help="a Spec-Bench-format JSONL file (turns) or one of prompts")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="copies of the prompt's text in each request")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    texts = sorted((r.get("prompt") or r["turns"][0] for r in rows), key=len, reverse=True)[: args.clients]
    model = json.load(urllib.request.urlopen(f"{args.url}/v1/models", timeout=30))["data"][0]["id"]

    def ask(text: str):
        body = json.dumps({"model": model, "max_tokens": args.max_tokens,
                           "messages": [{"role": "user", "content": "\n\n".join([text] * args.repeat)}]}).encode()
        req = urllib.request.Request(f"{args.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        try:
            out = json.load(urllib.request.urlopen(req, timeout=1800))
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, "error": json.loads(exc.read() or b"{}").get("error", {}).get("message")}
        u = out["usage"]
        return {"status": 200, "prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "engine": u.get("adaptive", {}).get("engine")}

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(ask, texts))
    for a in answers:
        print(json.dumps(a))
    ok = sum(a["status"] == 200 for a in answers)
    print(f"{ok} of {len(answers)} answered 200")


if __name__ == "__main__":
    main()
