"""Any request body gets a 4xx with an OpenAI error body or a correct answer, never a 5xx (issue 32).

The app runs over the scripted runtime (no model), driven by Starlette's test client: hypothesis
throws random bytes, random JSON and random values in the fields the parser reads, and the
hostile shapes a probe once turned into 5xx answers are replayed literally.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from adaptive.serve.app import create_app  # noqa: E402
from adaptive.serve.wire import _FIELDS  # noqa: E402
from tests.serve.conftest import ScriptedRuntime, Server  # noqa: E402

PATHS = ("/v1/chat/completions", "/v1/completions")
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    app = create_app(ScriptedRuntime(), served_model="m", max_body=1 << 16)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def check(client, path: str, body: bytes):
    """POST ``body``: a 2xx with a well-formed answer, or a 4xx with an OpenAI error body."""
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in r.text.split("\n\n") if ln]
        assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
        for ln in lines[:-1]:
            json.loads(ln[len("data: "):])
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return r


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def field_bodies(kind: str):
    """Objects with the fields the parser reads (any values), around a valid prompt or not."""
    prompt = {"messages": MSG} if kind == "chat" else {"prompt": "hi"}
    fields = st.dictionaries(st.sampled_from(sorted(_FIELDS[kind])), json_values, max_size=5)
    return st.tuples(st.booleans(), fields).map(lambda t: {**(prompt if t[0] else {}), **t[1]})


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(body=st.binary(max_size=64), path=st.sampled_from(PATHS))
def test_random_bytes(client, body, path):
    check(client, path, body)


@FAST
@given(value=json_values, path=st.sampled_from(PATHS))
def test_random_json(client, value, path):
    check(client, path, json.dumps(value).encode())


@FAST
@given(body=field_bodies("chat"))
def test_random_chat_fields(client, body):
    check(client, PATHS[0], json.dumps(body).encode())


@FAST
@given(body=field_bodies("completion"))
def test_random_completion_fields(client, body):
    check(client, PATHS[1], json.dumps(body).encode())


HOSTILE = [
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nesting past the C parser's recursion limit
    b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}",  # nesting past ours
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",  # int too long to parse
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + b"9" * 400 + b"}",  # int too big for a float
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1e999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}',  # a field name that cannot be encoded
    b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "speculation": ["auto"]}',  # unhashable where a name goes
    b'{"messages": [{"role": "user", "content": "hi"}], "speculation": {"a": 1}}',
    b'{"messages": [{"role": {"x": 1}, "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "model": ["m"]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": [["a"]]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": []}, "stream": true}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"prompt": [["hi"]]}',
    b"\xff\xfe{}",
    b"",
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("path", PATHS)
def test_hostile_bodies_are_4xx(client, path, body):
    r = check(client, path, body)
    assert 400 <= r.status_code < 500


def test_an_error_after_the_stream_started_still_ends_it():
    app = create_app(ScriptedRuntime(fail=RuntimeError("boom")), served_model="m")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post(PATHS[0], json={"messages": MSG, "stream": True})
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["type"] == "server_error" and "boom" not in err["message"]


def test_gauges_return_to_idle():
    app = create_app(ScriptedRuntime(), served_model="m")
    with TestClient(app) as c:
        for stream in (False, True):
            assert c.post(PATHS[0], json={"messages": MSG, "stream": stream}).status_code == 200
        text = c.get("/metrics").text
    assert "adaptive_running_requests 0.0\n" in text and "adaptive_queue_depth 0.0\n" in text


class SlowRuntime(ScriptedRuntime):
    """A step every 20 ms, for as long as asked: a client's events arrive faster than the handler's poll."""

    def step(self, runs, riders=()):
        time.sleep(0.02)
        return super().step(runs, riders)


@pytest.mark.parametrize("stream", [False, True])
def test_a_departed_client_is_dropped_within_a_second(stream):
    rt = SlowRuntime(pieces=("x",) * 5000)
    server = Server(create_app(rt, served_model="m"))
    try:
        body = json.dumps({"messages": MSG, "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        scheduler = server.app.state.scheduler
        deadline = time.time() + 10
        while not (scheduler.busy and rt.batches):  # decoding
            assert time.time() < deadline
            time.sleep(0.01)
        sock.close()
        left = time.perf_counter()
        while scheduler.busy:
            assert time.perf_counter() - left < 5, "the departed client's request kept decoding"
            time.sleep(0.01)
        assert time.perf_counter() - left < 1.0
        assert server.app.state.metrics.value("cancelled_requests_total") == 1
        assert server.app.state.metrics.value("running_requests") == 0
    finally:
        server.stop()
