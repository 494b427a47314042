"""A minimal HTTP server around AdaptiveRuntime (standard library only).

    python examples/serve_http.py --profile adaptive-profile --port 8000
    curl -s localhost:8000/generate -d '{"prompt": "What is 17 * 23?", "max_new_tokens": 64}'
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from adaptive import AdaptiveError, AdaptiveRuntime

OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")


def make_handler(runtime: AdaptiveRuntime):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/generate":
                return self.reply(404, {"error": "POST /generate"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                result = runtime.generate(body["prompt"], **{k: body[k] for k in OPTIONS if k in body})
            except (ValueError, KeyError, TypeError, AdaptiveError) as exc:  # bad JSON, fields or options
                return self.reply(400, {"error": str(exc) or type(exc).__name__})
            self.reply(200, {"text": result.text, "token_ids": result.token_ids, "domain": result.domain,
                             "decision": result.decision, "skip": result.skip,
                             "finish_reason": result.finish_reason, "stats": result.stats.to_dict()})

        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    runtime = AdaptiveRuntime.from_profile(args.profile)  # the runtime serialises requests on the model
    ThreadingHTTPServer((args.host, args.port), make_handler(runtime)).serve_forever()


if __name__ == "__main__":
    main()
