"""The worker that owns the model: a bounded queue of admitted requests, decoded one at a time.

Request handlers (asyncio) :meth:`Scheduler.admit` a :class:`~adaptive.serve.protocol.ServeRequest`
(tokenise it, check it fits the context: a :class:`RequestError` before any response starts), then
:meth:`Scheduler.submit` it as a :class:`Job` and read the job's :class:`Event` stream. One worker
thread takes jobs in arrival order and runs :meth:`AdaptiveRuntime.stream` for each, posting text
deltas and the final result back to the handler's event loop. A job whose client went away is
cancelled: skipped if still queued, stopped at its next decoding step if running (its slot is free
at once). :meth:`Scheduler.close` stops admitting and lets queued and running jobs finish.

Requests are decoded one at a time, like :class:`AdaptiveRuntime` itself: batching concurrent
requests into one verification forward is not implemented yet (docs/api.md says so).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from adaptive.errors import AdaptiveError
from adaptive.serve.metrics import Metrics
from adaptive.serve.protocol import RequestError, ServeRequest

log = logging.getLogger("adaptive.serve")
EVENT_KINDS = ("delta", "done", "error")


@dataclass(frozen=True)
class Event:
    """What the worker posts to a job's handler: ``delta`` (``text``: accepted text), ``done``
    (``result``: the :class:`~adaptive.runtime.RuntimeResult`) or ``error`` (``error``: a
    :class:`RequestError` to show the client)."""

    kind: str
    text: str = ""
    result: object = None
    error: RequestError | None = None

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, not {self.kind!r}")


@dataclass(frozen=True)
class Admission:
    """An admitted request's sizes: ``prompt_tokens`` and the ``max_tokens`` it will decode."""

    prompt_tokens: int
    max_tokens: int


@dataclass
class Job:
    """One admitted request in flight: its events arrive on ``events`` in the handler's ``loop``."""

    request: ServeRequest
    admission: Admission
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, event: Event) -> None:
        """Thread-safe: hand ``event`` to the handler (dropped if its loop has closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """Admission, a bounded FIFO queue (``max_queue`` waiting; more is a 429) and the decoding worker."""

    def __init__(self, runtime, metrics: Metrics | None = None, max_queue: int = 64, default_max_tokens: int = 256):
        if max_queue < 1 or default_max_tokens < 1:
            raise ValueError("max_queue and default_max_tokens must be at least 1")
        self.runtime = runtime
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="adaptive-serve-worker", daemon=True)
        self._worker.start()

    # -- handler side ----------------------------------------------------------------------------

    def admit(self, req: ServeRequest) -> Admission:
        """Tokenise ``req`` and size it; :class:`RequestError` if it cannot fit the model's context."""
        param = req.prompt_param
        try:
            ids = self.runtime.encode(*req.runtime_prompt())
        except AdaptiveError as exc:
            raise RequestError(str(exc), param=param) from None
        except Exception as exc:  # e.g. a chat template that refuses this sequence of roles
            raise RequestError(f"the {param} could not be encoded for this model ({type(exc).__name__}: {exc})",
                               param=param) from None
        room = self.runtime.room(ids)
        if room < 1:
            raise RequestError(f"the prompt is {len(ids)} tokens, which leaves no room in the model's context "
                               f"of {self.runtime.engine.backbone.max_positions}", param=param,
                               code="context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise RequestError(f"'max_tokens' is {req.max_tokens}, but the prompt ({len(ids)} tokens) leaves room "
                               f"for at most {room} in the model's context of "
                               f"{self.runtime.engine.backbone.max_positions}", param="max_tokens",
                               code="context_length_exceeded")
        return Admission(len(ids), req.max_tokens or min(self.default_max_tokens, room))

    def submit(self, job: Job) -> None:
        """Queue ``job``: 503 while shutting down, 429 when ``max_queue`` jobs already wait."""
        with self._cond:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, type="server_error",
                                   code="shutting_down")
            if len(self._queue) >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting); retry later",
                                   status=429, type="rate_limit_error", code="queue_full")
            self._queue.append(job)
            self.metrics.set("queue_depth", len(self._queue))
            self._cond.notify()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def busy(self) -> bool:
        """A request holds the model now."""
        return self._running is not None

    def close(self, timeout: float = 30.0) -> bool:
        """Stop admitting; wait up to ``timeout`` s for queued and running jobs. ``True`` if all finished
        (otherwise the rest are cancelled)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._worker.join(timeout)
        if self._worker.is_alive():
            with self._cond:
                for job in [*self._queue, *([self._running] if self._running else [])]:
                    job.cancel()
            self._worker.join(5.0)
            return False
        return True

    # -- worker side -----------------------------------------------------------------------------

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            job = self._queue.popleft()
            self.metrics.set("queue_depth", len(self._queue))
            self._running = job
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.cancelled.is_set():
                    self.metrics.inc("cancelled_requests_total")
                else:
                    self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        req, m = job.request, self.metrics
        m.set("running_requests", 1)
        first = True
        prompt, chat = req.runtime_prompt()
        gen = self.runtime.stream(prompt, max_new_tokens=job.admission.max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, stop=req.stop, seed=req.seed, policy=req.policy, chat=chat)
        try:
            for item in gen:
                if job.cancelled.is_set():
                    m.inc("cancelled_requests_total")
                    break
                if isinstance(item, str):
                    if first:
                        m.observe("time_to_first_token_seconds", time.perf_counter() - job.submitted)
                        first = False
                    job.post(Event("delta", text=item))
                else:
                    self._account(item)
                    job.post(Event("done", result=item))
        except AdaptiveError as exc:  # what the request asked for cannot be decoded
            job.post(Event("error", error=RequestError(str(exc))))
        except Exception as exc:  # a bug: the client gets a 500-style error, the log the traceback
            log.exception("decoding request %s failed", req.id)
            job.post(Event("error", error=RequestError(f"internal error ({type(exc).__name__})", status=500,
                                                       type="server_error")))
        finally:
            gen.close()  # releases the runtime's model lock at once when the job was cancelled
            m.set("running_requests", 0)

    def _account(self, result) -> None:
        s, m = result.stats, self.metrics
        labels = {"domain": result.domain or "none", "drafter": result.decision}
        m.inc("prompt_tokens_total", s.prompt_tokens)
        m.inc("generated_tokens_total", s.tokens)
        m.inc("drafted_tokens_total", s.drafted, **labels)
        m.inc("accepted_tokens_total", s.accepted, **labels)
        m.inc("verify_steps_total", s.steps, **labels)
        if s.tokens > 1:
            m.observe("time_per_output_token_seconds", max(s.total_time - s.prefill_time, 0.0), s.tokens - 1)
