"""A client that leaves before its answer: its queued request leaves the queue at once.

The regression: 100 clients that each POST a streamed chat completion and then reset their
connections at once left the queue full, and the next request got a 429 for as long as the worker
took to prefill and decode every abandoned request to its end with nobody listening. A stream
whose client was gone before its body started never cancelled its job (closing a generator that
never started runs none of its ``finally``), and a cancelled job kept its place in the queue until
the worker took it.

The app runs over the scripted runtime with its worker held busy (a request waiting mid-decode,
``max_batch`` 1), so a place in the queue frees only if cancelling frees it. The ASGI app is driven
directly (a client gone before the stream's body started, a send that fails, a task cancelled
mid-stream, a non-streamed request whose client left), then by real clients that reset at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import struct
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from adaptive.serve.app import create_app  # noqa: E402
from adaptive.serve.scheduler import Admission, Job  # noqa: E402
from adaptive.serve.wire import RequestError, ServeRequest  # noqa: E402
from tests.serve.conftest import ScriptedRuntime, Server  # noqa: E402

PATH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def busy_app(max_queue: int = 1):
    """A scripted app whose worker decodes one request at a time and holds its first mid-decode
    (the runtime's gate is shut until the test opens it)."""
    rt = ScriptedRuntime()
    rt.gate = threading.Semaphore(0)
    return rt, create_app(rt, served_model="m", max_queue=max_queue, max_batch=1)


def a_job(loop) -> Job:
    return Job(ServeRequest("chat", tuple(MSG)), Admission((0, 1), 3), loop)


async def hold_worker(scheduler) -> None:
    """Give the worker a request that it holds mid-decode: the queue behind it does not move."""
    scheduler.submit(a_job(asyncio.get_running_loop()))
    deadline = time.monotonic() + 10
    while not scheduler.busy:
        assert time.monotonic() < deadline, "the worker did not take the first request"
        await asyncio.sleep(0.01)


def http_scope(spec_version: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": PATH, "raw_path": PATH.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}


async def call(app, case: str, sent: list) -> None:
    """One request through the ASGI app, its client leaving as ``case`` says; the messages sent go
    to ``sent``."""
    body = json.dumps({"messages": MSG, "stream": case != "not-streamed"}).encode()
    gone = asyncio.Event()  # the client has left (http.disconnect is what receive() says from then on)
    if case in ("gone-before-body", "send-fails", "not-streamed"):
        gone.set()  # it sent its request and reset at once
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if case == "send-fails":  # ASGI 2.4: a server's send to a closed connection raises OSError
            raise OSError("connection reset by peer")
        sent.append(message)

    spec = "2.4" if case == "send-fails" else "2.3"  # 2.3: Starlette listens for the disconnect itself
    task = asyncio.ensure_future(app(http_scope(spec, body), receive, send))
    if case == "cancelled-mid-stream":  # the stream started (its generator waits for events): cancel the task
        deadline = time.monotonic() + 10
        while not any(m["type"] == "http.response.start" for m in sent):
            assert time.monotonic() < deadline, "the stream did not start"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # send-fails ends in ClientDisconnect
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("case", ["gone-before-body", "send-fails", "cancelled-mid-stream", "not-streamed"])
def test_a_departed_client_s_queued_request_leaves_the_queue_at_once(case):
    """Whichever way the response ends without its client (gone before a stream's body started, a
    send that fails, the response's task cancelled mid-stream, a non-streamed request's client
    gone), its job is cancelled and leaves the queue there and then, counted once, though the
    worker has not moved: the next request finds the place free (no 429), and the abandoned one is
    never prefilled."""
    rt, app = busy_app(max_queue=1)
    scheduler, metrics = app.state.scheduler, app.state.metrics

    async def scenario():
        await hold_worker(scheduler)
        sent = []
        await call(app, case, sent)
        if case == "not-streamed":
            assert sent[0]["status"] == 499
        assert metrics.value("queue_depth") == 0, "the departed client's request still holds its place"
        assert metrics.value("cancelled_requests_total") == 1
        fresh = a_job(asyncio.get_running_loop())
        try:
            scheduler.submit(fresh)  # the queue's one place is free again
        except RequestError as exc:
            pytest.fail(f"the next request was refused: {exc.status} {exc}")
        for _ in range(10):
            rt.gate.release()
        events = []
        while not events or events[-1].kind == "delta":
            events.append(await asyncio.wait_for(fresh.events.get(), 10))
        assert events[-1].kind == "done"
        assert await asyncio.to_thread(scheduler.close, 10)

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close(1)
    assert len(rt.calls) == 2  # the held request and the fresh one were prefilled; the departed one never
    assert metrics.value("cancelled_requests_total") == 1


def test_clients_that_post_a_stream_and_reset_at_once_leave_no_queue_behind():
    """The user's report over real sockets: with the worker busy, 8 clients (the queue's size) POST a
    streamed chat completion and reset their connections at once. Their requests leave the queue
    (within a second of the last one's handler), and the next client's stream is answered, not
    refused with a 429."""
    n = 8
    rt, app = busy_app(max_queue=n)
    server = Server(app)
    scheduler, metrics = app.state.scheduler, app.state.metrics
    loop = asyncio.new_event_loop()  # the held request's events are posted to it, never read
    try:
        scheduler.submit(a_job(loop))
        deadline = time.time() + 10
        while not scheduler.busy:
            assert time.time() < deadline
            time.sleep(0.01)
        body = json.dumps({"model": "m", "messages": MSG, "stream": True}).encode()
        request = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        clients = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(n)]
        for sock in clients:
            sock.sendall(request)
        deadline = time.time() + 10
        while metrics.value("queue_depth") < n and time.time() < deadline:  # all queued (some may be gone already)
            time.sleep(0.01)
        for sock in clients:  # reset, as a client killed mid-request does
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

        def handled():
            return sum(metrics.value("requests_total", endpoint="chat_completions", status=s) for s in ("200", "499"))

        deadline = time.time() + 10
        while handled() < n:
            assert time.time() < deadline, "the handlers did not answer"
            time.sleep(0.01)
        deadline = time.time() + 1.0
        while metrics.value("queue_depth"):
            assert time.time() < deadline, f"{metrics.value('queue_depth'):.0f} abandoned requests still queued"
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("POST", PATH, body=body, headers={"Content-Type": "application/json"})
            assert conn.getresponse().status == 200  # streamed: the headers come before the worker gets to it
        finally:
            conn.close()
        assert len(rt.calls) == 1  # only the held request was ever prefilled
    finally:
        for _ in range(100):
            rt.gate.release()
        server.stop()
        loop.close()
