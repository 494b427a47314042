"""A two-engine runtime behind the server: concurrent requests on both engines in one scheduler,
each answered as plain greedy decoding on the engine that decoded it, and the engine in usage."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llama_cpp")

from adaptive.engine.config import GenerationConfig  # noqa: E402
from adaptive.engine.engine import Engine  # noqa: E402
from adaptive.profile import load_profile  # noqa: E402
from adaptive.runtime import AdaptiveRuntime, TwoEngineRuntime  # noqa: E402
from adaptive.runtime.turns import TurnLock  # noqa: E402
from adaptive.serve.app import create_app  # noqa: E402
from tests.conftest import TINY_DOMAINS  # noqa: E402
from tests.runtime.test_engines import _set_costs  # noqa: E402
from tests.serve.conftest import Server  # noqa: E402

SHORT, LONG = TINY_DOMAINS["math"][5], "hello there friend " * 14


@pytest.fixture(scope="module")
def served(two_engine_profile):
    out, lms = two_engine_profile
    lock = TurnLock()
    rt = TwoEngineRuntime({e: AdaptiveRuntime(load_profile(out, e), lm, seed=0, model_lock=lock)
                           for e, lm in lms.items()}, "llama.cpp")
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    s = Server(create_app(rt, max_queue=8, max_batch=4, prefill_chunk=64))
    yield s, rt, lms
    s.stop()
    rt.close()


def _post(server, prompt: str, n: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_concurrent_requests_on_both_engines_are_plain_decoding_there(served):
    server, rt, lms = served
    alone = _post(server, SHORT, 10)  # an idle server: the short prompt decodes on llama.cpp
    assert alone[0] == 200 and alone[1]["usage"]["adaptive"]["engine"] == "llama.cpp"
    burst = [LONG, SHORT, LONG, TINY_DOMAINS["code"][5]]  # together: joining torch's batch adds least
    with ThreadPoolExecutor(len(burst)) as pool:
        answers = [alone, *pool.map(lambda p: _post(server, p, 10), burst)]
    engines = set()
    for prompt, (status, body) in zip([SHORT, *burst], answers):
        assert status == 200, body
        ext = body["usage"]["adaptive"]
        engines.add(ext["engine"])
        assert ext["engine_choice"]["engine"] == ext["engine"] and ext["engine_choice"]["reason"].startswith("expected")
        ids = rt.encode([{"role": "user", "content": prompt}])
        ref = Engine(lms[ext["engine"]]).generate(ids, GenerationConfig(max_new_tokens=10))
        assert body["choices"][0]["message"]["content"] == ref.text
    assert engines == {"llama.cpp", "torch"}  # both engines served by the one scheduler


def test_online_state_reports_each_engine(served):
    server, _, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/adaptive/online")
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 200 and body["enabled"] and set(body["engines"]) == {"llama.cpp", "torch"}
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 200


def test_a_lone_request_through_the_server_teaches_its_engines_pace_and_its_length(two_engine_profile):
    from adaptive.runtime.lengths import LengthLearner
    from adaptive.runtime.pace import PaceLearner, PaceSettings

    out, lms = two_engine_profile
    lock = TurnLock()
    pace = PaceLearner(PaceSettings(explore=False, min_tokens=1))
    rt = TwoEngineRuntime({e: AdaptiveRuntime(load_profile(out, e), lm, seed=0, model_lock=lock)
                           for e, lm in lms.items()}, "llama.cpp", pace, LengthLearner())
    _set_costs(rt, llama_prefill_ms_per_token=3.0, torch_prefill_ms_per_token=1.0)
    s = Server(create_app(rt, max_queue=8, max_batch=4, prefill_chunk=64))
    try:
        status, body = _post(s, SHORT, 10)
        assert status == 200 and body["usage"]["adaptive"]["engine"] == "llama.cpp"
        assert body["usage"]["completion_tokens"] >= 2  # decoded past the prefill's token
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("GET", "/v1/adaptive/online")
        state = json.loads(conn.getresponse().read())
        assert state["pace"]["llama.cpp"]["requests"] == 1 and "torch" not in state["pace"]
        assert state["pace"]["llama.cpp"]["factor"] == pytest.approx(pace.factor("llama.cpp", draw=False), abs=1e-4)
        assert state["lengths"]["requests"] == 1  # where its answer ended, too
        assert body["usage"]["adaptive"]["engine_choice"]["expected_tokens"] == 10.0  # nothing learned before it
    finally:
        s.stop()
        rt.close()
