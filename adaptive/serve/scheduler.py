"""The worker that owns the model: a bounded queue of admitted requests, decoded together in a batch.

Request handlers (asyncio) :meth:`Scheduler.admit` a :class:`~adaptive.serve.protocol.ServeRequest`
(tokenise it, check it fits the context: a :class:`RequestError` before any response starts), then
:meth:`Scheduler.submit` it as a :class:`Job` and read the job's :class:`Event` stream.

One worker thread runs the batch, continuously: before each step it takes waiting jobs in arrival
order while fewer than ``max_batch`` run, and starts each (:meth:`AdaptiveRuntime.start`: prefill,
route, plan); then one :meth:`AdaptiveRuntime.step` drafts for every running request and verifies
all of them in one forward; each job's text delta, and its result when it is done, go back to its
handler's event loop. A finished job leaves the batch at once and a waiting one takes its place at
the next step. A job whose client went away is cancelled: skipped if still queued, dropped from the
batch before the next step if running. :meth:`Scheduler.close` stops admitting and lets queued and
running jobs finish. ``max_batch=1`` decodes one request at a time.
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
from adaptive.serve.protocol import RequestError, ServeRequest, internal_error

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
    first_posted: bool = False  # the worker's: a text delta has been posted

    def post(self, event: Event) -> None:
        """Thread-safe: hand ``event`` to the handler (dropped if its loop has closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """Admission, a bounded FIFO queue (``max_queue`` waiting; more is a 429) and the decoding worker,
    which decodes up to ``max_batch`` requests together."""

    def __init__(self, runtime, metrics: Metrics | None = None, max_queue: int = 64, default_max_tokens: int = 256,
                 max_batch: int = 8):
        if max_queue < 1 or default_max_tokens < 1 or max_batch < 1:
            raise ValueError("max_queue, default_max_tokens and max_batch must be at least 1")
        self.runtime = runtime
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.default_max_tokens = default_max_tokens
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: list[Job] = []
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
        """A request is being decoded now."""
        return bool(self._running)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop admitting; wait up to ``timeout`` s for queued and running jobs. ``True`` if all finished
        (otherwise the rest are cancelled)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._worker.join(timeout)
        if self._worker.is_alive():
            with self._cond:
                for job in [*self._queue, *self._running]:
                    job.cancel()
            self._worker.join(5.0)
            return False
        return True

    # -- worker side -----------------------------------------------------------------------------

    def _admit(self, running: int) -> list[Job] | None:
        """Jobs to start before the next step (waits while nothing runs or waits); ``None``: closed and idle."""
        with self._cond:
            while not self._queue and not running:
                if self._closing:
                    return None
                self._cond.wait()
            new = []
            while self._queue and running + len(new) < self.max_batch:
                new.append(self._queue.popleft())
            self.metrics.set("queue_depth", len(self._queue))
            return new

    def _work(self) -> None:
        batch: list[tuple[Job, object]] = []  # (job, its RoutedDecoding), in admission order
        while (new := self._admit(len(batch))) is not None:
            with self._cond:
                self._running = [job for job, _ in batch] + new
            for job in new:
                started = self._start(job)
                if started is not None:
                    batch.append((job, started))
            batch = [(job, run) for job, run in batch if not self._dropped(job)]
            self._set_running(batch)
            if batch:
                batch = self._step(batch)
                self._set_running(batch)  # an idle server reads 0 as soon as its last request finished
        self._set_running([])

    def _set_running(self, batch: list[tuple[Job, object]]) -> None:
        with self._cond:
            self._running = [job for job, _ in batch]
        self.metrics.set("running_requests", len(batch))

    def _dropped(self, job: Job) -> bool:
        """The job's client went away (counted once)."""
        if job.cancelled.is_set():
            self.metrics.inc("cancelled_requests_total")
            return True
        return False

    def _start(self, job: Job):
        """Prefill, route and plan ``job`` (its first delta posted): its RoutedDecoding while it has more
        to decode, ``None`` when it is already finished, cancelled or failed."""
        if self._dropped(job):
            return None
        req = job.request
        prompt, chat = req.runtime_prompt()
        try:
            run = self.runtime.start(prompt, max_new_tokens=job.admission.max_tokens, temperature=req.temperature,
                                     top_p=req.top_p, stop=req.stop, seed=req.seed, policy=req.policy, chat=chat)
        except Exception as exc:  # noqa: BLE001 - becomes the job's error event
            self._fail([job], exc)
            return None
        self._deliver(job, run, run.first)
        return None if run.done else run

    def _step(self, batch: list[tuple[Job, object]]) -> list[tuple[Job, object]]:
        """One step of every running job; the jobs still running after it."""
        self.metrics.observe("batch_size", len(batch))
        try:
            deltas = self.runtime.step([run for _, run in batch])
        except Exception as exc:  # noqa: BLE001 - every job in the failed step gets the error
            self._fail([job for job, _ in batch], exc)
            return []
        for (job, run), delta in zip(batch, deltas):
            self._deliver(job, run, delta)
        return [(job, run) for job, run in batch if not run.done]

    def _deliver(self, job: Job, run, delta: str) -> None:
        """Post ``delta`` (the first non-empty one also times the first token), then the result when done."""
        if delta:
            if not job.first_posted:
                job.first_posted = True
                self.metrics.observe("time_to_first_token_seconds", time.perf_counter() - job.submitted)
            job.post(Event("delta", text=delta))
        if run.done:
            result = run.result()
            self._account(result)
            job.post(Event("done", result=result))

    def _fail(self, jobs: list[Job], exc: Exception) -> None:
        if isinstance(exc, AdaptiveError):  # what the request asked for cannot be decoded
            error = RequestError(str(exc))
        else:  # a bug: the client gets a 500-style error, the log the traceback
            log.error("decoding requests %s failed", ", ".join(j.request.id for j in jobs), exc_info=exc)
            error = internal_error(exc)
        for job in jobs:
            job.post(Event("error", error=error))

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
