"""The serving example in docs/api.md runs, and the docs show the tested file verbatim."""

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.runtime import AdaptiveRuntime

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "serve_http.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("serve_http", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_show_the_tested_example():
    doc = (ROOT / "docs" / "api.md").read_text()
    block = doc.split("<!-- examples/serve_http.py -->\n```python\n", 1)[1].split("```", 1)[0]
    assert block == EXAMPLE.read_text()


def _post(url, body: bytes):
    req = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_server_answers_concurrent_requests_losslessly(tiny_profile, tiny_model_dir):
    from tests.runtime.test_runtime import drafting

    rt = AdaptiveRuntime.from_profile(tiny_profile, model=str(tiny_model_dir), dtype="float32")
    # make the domains draft (layer skipping, prompt lookup) so that the server exercises both
    p = rt.profile
    names = sorted(p.domains)
    p.domains = {n: drafting(d, "pld" if names.index(n) % 2 else "ssd") for n, d in p.domains.items()}
    p.global_set = drafting(p.global_set, "ssd")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _load_example().make_handler(rt))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        prompts = ["what is 5 plus 8?", "hello there friend", "def g(x): return"]
        results = {}

        def call(p):
            results[p] = _post(url + "/generate", json.dumps({"prompt": p, "max_new_tokens": 12}).encode())

        threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        engine = Engine(rt.lm)
        for p in prompts:
            status, body = results[p]
            assert status == 200
            assert body["token_ids"] == engine.generate(p, GenerationConfig(max_new_tokens=12)).token_ids
            assert body["decision"] in ("ssd", "pld") and "stats" in body
        assert _post(url + "/generate", b"{not json")[0] == 400
        status, body = _post(url + "/generate", json.dumps({"prompt": "x", "max_new_tokens": 0}).encode())
        assert status == 400 and "max_new_tokens" in body["error"]
        assert _post(url + "/generate", json.dumps({"text": "x"}).encode())[0] == 400
        assert _post(url + "/other", b"{}")[0] == 404
    finally:
        server.shutdown()
        server.server_close()
