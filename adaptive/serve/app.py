"""The ASGI application: OpenAI's endpoints over the :class:`~adaptive.serve.scheduler.Scheduler`.

Starlette, not FastAPI: the request bodies are validated by :mod:`adaptive.serve.protocol` so that
every refusal is an OpenAI-style error body (FastAPI's automatic 422s are not), and Starlette is
the whole of what is used (routing, streaming responses), with no pydantic models to keep in step
with the wire format. uvicorn runs it (:func:`serve`).

============================  ====================================================================
``POST /v1/chat/completions``  chat messages through the model's chat template
``POST /v1/completions``       a raw text prompt
``GET /v1/models``             the one served model
``GET /health``                ``{"status": "ok"}`` (503 ``draining`` while shutting down)
``GET /metrics``               Prometheus text (:mod:`adaptive.serve.metrics`)
============================  ====================================================================

With an API key every path but ``/health`` needs ``Authorization: Bearer KEY``. Bodies over
``max_body`` bytes are refused (413) before they are read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from adaptive.serve import DEFAULT_PREFILL_CHUNK
from adaptive.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from adaptive.serve.metrics import Metrics
from adaptive.serve.protocol import (
    FINISH_REASONS,
    RequestError,
    chunk_body,
    completion_body,
    decode_body,
    extension,
    internal_error,
    parse_request,
    usage_body,
)
from adaptive.serve.scheduler import Job, Scheduler

log = logging.getLogger("adaptive.serve")
MAX_BODY = 1 << 20  # bytes: the default request-body limit (1 MiB)
POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class _JSON(JSONResponse):
    """JSON with non-ASCII characters escaped: every string encodes, whatever a refused request held."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return _JSON(exc.body(), status_code=exc.status, headers=headers)


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as sending fails (the client left)."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def create_app(runtime, *, served_model: str | None = None, api_key: str | None = None, max_queue: int = 64,
               max_batch: int = 8, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_body: int = MAX_BODY,
               default_max_tokens: int = 256,
               drain_timeout: float = 30.0) -> Starlette:
    """The server's ASGI app over ``runtime`` (an :class:`~adaptive.runtime.AdaptiveRuntime`).

    ``served_model``: the name in ``/v1/models`` and the only ``model`` requests may name (default:
    the profile's model name). ``max_batch``: requests decoded together (one verification forward
    per step for all of them; 1: one at a time); ``prefill_chunk``: prompt tokens prefilled between
    two decoding steps (0: whole prompts; :mod:`adaptive.serve.scheduler`). The decoding worker
    starts now and is drained on the app's shutdown (within ``drain_timeout`` seconds).
    """
    model_name = served_model or runtime.profile.model.name
    metrics = Metrics()
    scheduler = Scheduler(runtime, metrics, max_queue=max_queue, default_max_tokens=default_max_tokens,
                          max_batch=max_batch, prefill_chunk=prefill_chunk)

    def refused_key(request: Request) -> Response | None:
        """The 401 for a request without the API key (``None`` when it may pass)."""
        if api_key is None or hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                  f"Bearer {api_key}".encode()):
            return None
        return error_response(RequestError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                                           status=401, type="authentication_error", code="invalid_api_key"))

    too_large = RequestError(f"the request body is over the limit of {max_body} bytes", status=413,
                             code="body_too_large")

    def finish(endpoint: str, response: Response) -> Response:
        metrics.inc("requests_total", endpoint=endpoint, status=str(response.status_code))
        return response

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body):
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body:
                raise too_large
        return decode_body(bytes(body))

    async def completions(request: Request, kind: str, endpoint: str) -> Response:
        if (refusal := refused_key(request)) is not None:
            return finish(endpoint, refusal)
        try:
            req = parse_request(kind, await read_json(request), model_name)
            admission = await asyncio.to_thread(scheduler.admit, req)
            job = Job(req, admission, asyncio.get_running_loop())
            scheduler.submit(job)
        except RequestError as exc:
            return finish(endpoint, error_response(exc))
        except ClientDisconnect:
            return finish(endpoint, Response(status_code=499))
        if req.stream:
            return finish(endpoint, _EventStream(sse(request, job), media_type="text/event-stream",
                                                 headers={"Cache-Control": "no-cache"}))
        try:
            result = None
            async for event in events(request, job):  # the deltas add up to the result's text
                if event.kind == "error":
                    return finish(endpoint, error_response(event.error))
                if event.kind == "done":
                    result = event.result
            if result is None:  # the client left
                return finish(endpoint, Response(status_code=499))
            usage = usage_body(admission.prompt_tokens, len(result.token_ids), extension(result))
            body = completion_body(req, model_name, result.text, FINISH_REASONS[result.finish_reason], usage)
            return finish(endpoint, JSONResponse(body))
        finally:
            job.cancel()

    async def events(request: Request, job: Job):
        """The job's events until ``done`` or ``error``; stops (cancelling the job) once the client is
        gone, which is checked every ``POLL_S`` seconds whether events arrive or not."""
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                event = None
            if event is None or time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
                    return
            if event is None:
                continue
            yield event
            if event.kind != "delta":
                return

    async def sse(request: Request, job: Job):
        """The job's events as server-sent events; every stream that started ends with ``[DONE]``
        (after an error event too)."""
        req = job.request

        def data(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            first = True
            async for event in events(request, job):
                if event.kind == "delta":
                    yield data(chunk_body(req, model_name, event.text, first=first))
                    first = False
                elif event.kind == "error":
                    yield data(event.error.body())
                else:
                    r = event.result
                    if first:  # nothing was said: still open the assistant's message
                        yield data(chunk_body(req, model_name, "", first=True))
                    yield data(chunk_body(req, model_name, "", FINISH_REASONS[r.finish_reason]))
                    if req.include_usage:
                        usage = usage_body(job.admission.prompt_tokens, len(r.token_ids), extension(r))
                        yield data(chunk_body(req, model_name, None, usage=usage))
        except Exception as exc:  # noqa: BLE001 - a bug after the stream started: say so, then end it
            log.error("streaming request %s failed", req.id, exc_info=exc)
            yield data(internal_error(exc).body())
        finally:
            job.cancel()
        yield "data: [DONE]\n\n"

    async def chat_endpoint(request: Request) -> Response:
        return await completions(request, "chat", "chat_completions")

    async def completion_endpoint(request: Request) -> Response:
        return await completions(request, "completion", "completions")

    async def models(request: Request) -> Response:
        if (refusal := refused_key(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "adaptive"}]})

    async def health(request: Request) -> Response:
        if scheduler.closing:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def online_endpoint(request: Request) -> Response:
        if (refusal := refused_key(request)) is not None:
            return refusal
        learner = getattr(runtime, "online", None)
        return JSONResponse({"enabled": False} if learner is None else {"enabled": True, **learner.state()})

    async def metrics_endpoint(request: Request) -> Response:
        if (refusal := refused_key(request)) is not None:
            return refusal
        learner = getattr(runtime, "online", None)
        if learner is not None:  # the background races' cost, as the learner counts it
            cost = learner.measure_cost()
            metrics.set("online_measure_seconds_total", cost["measure_seconds"])
            metrics.set("online_measure_waits_total", cost["measure_waits"])
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(RequestError(message, status=exc.status_code,
                                           code="not_found" if exc.status_code == 404 else None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(internal_error(exc))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        drained = await asyncio.to_thread(scheduler.close, drain_timeout)
        if not drained:
            log.warning("requests still decoding after %.0f s were cancelled", drain_timeout)
        if hasattr(runtime, "close"):
            await asyncio.to_thread(runtime.close)  # saves what online learning learned

    started = int(time.time())
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_endpoint, methods=["POST"]),
        Route("/v1/completions", completion_endpoint, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/adaptive/online", online_endpoint, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error}, lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.model_name = scheduler, metrics, model_name
    return app


def serve(app: Starlette, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          on_ready=None) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM: then stop accepting connections, let in-flight
    requests finish for up to ``drain_timeout`` seconds, and return."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout,
                            lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; a drained SIGTERM is a clean
    # stop, so it then lands on a handler that does nothing and serve() returns (exit status 0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if threading.current_thread() is threading.main_thread() \
        else None
    if on_ready is not None:
        orig = server.startup

        async def startup(sockets=None):
            await orig(sockets=sockets)
            if server.started:
                on_ready(server)

        server.startup = startup
    try:
        server.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
