"""The ASGI application: OpenAI's endpoints over the :class:`~adaptive.serve.scheduler.Scheduler`.

Starlette, not FastAPI: the request bodies are validated by :mod:`adaptive.serve.wire` so that
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

from adaptive.distill.refine import HeadRefiner
from adaptive.resources import release_threads
from adaptive.serve import DEFAULT_PREFILL_CHUNK
from adaptive.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from adaptive.serve.metrics import Metrics
from adaptive.serve.scheduler import Job, Scheduler
from adaptive.serve.wire import (
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
    """A job's server-sent events. However the response ends (the stream finished, the client left
    before or while it streamed, a send failed, the task was cancelled), the job is cancelled and
    the events' generator closed: a request nobody listens to leaves the scheduler's queue at once,
    or the batch at its next step. Cancelling the job here, not only in the generator's ``finally``,
    covers a stream whose body never started (a send of the response's start that fails, as ASGI
    2.4 servers' sends to a closed connection do, or a disconnect that cancels the stream while
    the start is being sent): closing a generator that never started runs none of its code."""

    def __init__(self, job: Job, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op once the job has finished
            await self.body_iterator.aclose()


class _Endpoints:
    """The route handlers over one app's state, held here explicitly: the ``runtime``, its
    ``scheduler`` and ``metrics``, the served ``model_name``, the ``api_key`` (``None``: open) and
    the request-body limit ``max_body``. One method per route; what they share (the key check,
    reading a body, following a job's events) are the methods between them."""

    def __init__(self, runtime, scheduler: Scheduler, metrics: Metrics, model_name: str, api_key: str | None,
                 max_body: int, drain_timeout: float):
        self.runtime, self.scheduler, self.metrics = runtime, scheduler, metrics
        self.model_name, self.api_key, self.max_body = model_name, api_key, max_body
        self.drain_timeout = drain_timeout
        self.started = int(time.time())  # the model's ``created`` in /v1/models

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/adaptive/online", self.online, methods=["GET"]),
        ]

    # -- what the handlers share -------------------------------------------------------------------

    def refused_key(self, request: Request) -> Response | None:
        """The 401 for a request without the API key (``None`` when it may pass)."""
        if self.api_key is None or hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                       f"Bearer {self.api_key}".encode()):
            return None
        return error_response(RequestError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                                           status=401, type="authentication_error", code="invalid_api_key"))

    def counted(self, endpoint: str, response: Response) -> Response:
        """``response``, counted in ``requests_total`` by endpoint and status."""
        self.metrics.inc("requests_total", endpoint=endpoint, status=str(response.status_code))
        return response

    async def read_json(self, request: Request):
        """The decoded JSON body; 413 once it is known to be over ``max_body`` bytes (from its
        declared length, or while it arrives), before it is read whole."""
        too_large = RequestError(f"the request body is over the limit of {self.max_body} bytes", status=413,
                                 code="body_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body:
                raise too_large
        return decode_body(bytes(body))

    # -- the completion endpoints ------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, "chat", "chat_completions")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "completion", "completions")

    async def complete(self, request: Request, kind: str, endpoint: str) -> Response:
        """Check the key, parse, admit and queue the request; then stream its events or answer at once."""
        if (refusal := self.refused_key(request)) is not None:
            return self.counted(endpoint, refusal)
        try:
            req = parse_request(kind, await self.read_json(request), self.model_name)
            admission = await asyncio.to_thread(self.scheduler.admit, req)
            job = Job(req, admission, asyncio.get_running_loop())
            self.scheduler.submit(job)
        except RequestError as exc:
            return self.counted(endpoint, error_response(exc))
        except ClientDisconnect:
            return self.counted(endpoint, Response(status_code=499))
        if req.stream:  # the response cancels the job however it ends, started or not
            return self.counted(endpoint, _EventStream(job, self.sse(request, job), media_type="text/event-stream",
                                                       headers={"Cache-Control": "no-cache"}))
        return self.counted(endpoint, await self.answer(request, job))

    async def answer(self, request: Request, job: Job) -> Response:
        """A non-streaming request's response: its whole result, an error, or 499 if the client left
        (noticed within ``POLL_S``). However it ends (its task cancelled too) the job is cancelled:
        a queued one leaves the queue at once."""
        try:
            result = None
            async for event in job_events(request, job):  # the deltas add up to the result's text
                if event.kind == "error":
                    return error_response(event.error)
                if event.kind == "done":
                    result = event.result
            if result is None:  # the client left
                return Response(status_code=499)
            req = job.request
            usage = usage_body(job.admission.prompt_tokens, len(result.token_ids), extension(result),
                               result.stats.cached_tokens)
            return JSONResponse(completion_body(req, self.model_name, result.text, FINISH_REASONS[result.finish_reason],
                                                usage))
        finally:
            job.cancel()

    async def sse(self, request: Request, job: Job):
        """The job's events as server-sent events; every stream that started ends with ``[DONE]``
        (after an error event too)."""
        req, model = job.request, self.model_name

        def data(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            first = True
            async for event in job_events(request, job):
                if event.kind == "delta":
                    yield data(chunk_body(req, model, event.text, first=first))
                    first = False
                elif event.kind == "error":
                    yield data(event.error.body())
                else:
                    r = event.result
                    if first:  # nothing was said: still open the assistant's message
                        yield data(chunk_body(req, model, "", first=True))
                    yield data(chunk_body(req, model, "", FINISH_REASONS[r.finish_reason]))
                    if req.include_usage:
                        usage = usage_body(job.admission.prompt_tokens, len(r.token_ids), extension(r),
                                           r.stats.cached_tokens)
                        yield data(chunk_body(req, model, None, usage=usage))
        except Exception as exc:  # noqa: BLE001 - a bug after the stream started: say so, then end it
            log.error("streaming request %s failed", req.id, exc_info=exc)
            yield data(internal_error(exc).body())
        yield "data: [DONE]\n\n"  # the response (_EventStream) cancels the job however it ends

    # -- the other endpoints -----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if (refusal := self.refused_key(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "adaptive"}]})

    async def health(self, request: Request) -> Response:
        if self.scheduler.closing:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def online(self, request: Request) -> Response:
        if (refusal := self.refused_key(request)) is not None:
            return refusal
        learner = getattr(self.runtime, "online", None)
        body = {"enabled": False} if learner is None else {"enabled": True, **learner.state()}
        heads = self._listeners().get(HeadRefiner.name)
        if heads is not None:  # the eagle heads refined on the traffic (adaptive.distill.refine)
            body["heads"] = heads
        return JSONResponse(body)

    def _listeners(self) -> dict:
        states = getattr(self.runtime, "listener_state", None)
        return states() if states is not None else {}

    async def prometheus(self, request: Request) -> Response:
        if (refusal := self.refused_key(request)) is not None:
            return refusal
        learner = getattr(self.runtime, "online", None)
        if learner is not None:  # the background races' cost, as the learner counts it
            cost = learner.measure_cost()
            self.metrics.set("online_measure_seconds_total", cost["measure_seconds"])
            self.metrics.set("online_measure_waits_total", cost["measure_waits"])
        heads = self._listeners().get(HeadRefiner.name)
        if heads is not None:
            self.metrics.set("online_head_rounds_total", heads["rounds"])
            self.metrics.set("online_head_adoptions_total", heads["adopted"])
            self.metrics.set("online_head_round_seconds_total", heads["round_seconds"])
        caches = getattr(self.runtime, "prefix_caches", None)
        for engine, stats in (caches() if caches is not None else {}).items():  # as each engine's store counts them
            for name, value in (("prefix_cache_bytes", stats.nbytes), ("prefix_cache_budget_bytes", stats.budget),
                                ("prefix_cache_entries", stats.entries), ("prefix_cache_hits_total", stats.hits),
                                ("prefix_cached_tokens_total", stats.cached_tokens),
                                ("prefix_cache_evictions_total", stats.evictions)):
                self.metrics.set(name, value, engine=engine)
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # -- the app's life ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """On shutdown: drain the scheduler (within ``drain_timeout``), then close the runtime."""
        yield
        drained = await asyncio.to_thread(self.scheduler.close, self.drain_timeout)
        if not drained:
            log.warning("requests still decoding after %.0f s were cancelled", self.drain_timeout)
        if hasattr(self.runtime, "close"):
            await asyncio.to_thread(self.runtime.close)  # saves what online learning learned


async def job_events(request: Request, job: Job):
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


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 (and any other HTTPException) as OpenAI error bodies."""
    message = {404: f"no such endpoint: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return error_response(RequestError(message, status=exc.status_code,
                                       code="not_found" if exc.status_code == 404 else None))


async def server_error(request: Request, exc: Exception) -> Response:
    """An unhandled exception: logged, answered with a 500 that does not show it."""
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(internal_error(exc))


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
    endpoints = _Endpoints(runtime, scheduler, metrics, model_name, api_key, max_body, drain_timeout)
    app = Starlette(routes=endpoints.routes(), exception_handlers={HTTPException: http_error, Exception: server_error},
                    lifespan=endpoints.lifespan)
    app.state.scheduler, app.state.metrics, app.state.model_name = scheduler, metrics, model_name
    return app


def serve(app: Starlette, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          on_ready=None) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM: then stop accepting connections, let in-flight
    requests finish for up to ``drain_timeout`` seconds, and return. Call it on the thread that loaded
    the runtime: the OpenMP threads that thread's loading started are given back first
    (:func:`~adaptive.resources.release_threads`), so that the scheduler's worker, which decodes, keeps
    the only pool and its steps run at the engine's pace."""
    import uvicorn

    release_threads()

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
