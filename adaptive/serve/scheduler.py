"""The worker that owns the model: a bounded queue of admitted requests, decoded together in a batch.

Request handlers (asyncio) :meth:`Scheduler.admit` a :class:`~adaptive.serve.wire.ServeRequest`
(tokenise it, check it and its ``max_tokens`` fit the context: a :class:`RequestError` before any
response starts), then :meth:`Scheduler.submit` it as a :class:`Job` and read the job's
:class:`Event` stream.

One worker thread runs the batch, continuously. Before each step it takes waiting jobs in arrival
order while fewer than ``max_batch`` run and the runtime can take the next one to its end
(:meth:`AdaptiveRuntime.fits`: on llama.cpp, whose live caches share one context, a request waits
for the positions it needs; the jobs behind it wait with it), and prefills them (:meth:`AdaptiveRuntime.prefilling`)
``prefill_chunk`` prompt tokens in all per step, the prompt with the fewest tokens left first: a
long prompt is admitted in chunks between decoding steps, so the running requests keep their pace,
and a short prompt arriving while a long one is prefilled waits for one chunk, not for the rest of
it (``0``: every prompt whole before the step). Where the engine gains from it (its backbone's
``carry_chunks``: torch), a chunk other than its prompt's last rides in the step's own forward
instead of a forward of its own. While nothing decodes, prompts are prefilled whole:
nothing waits for a step, and on the torch engine one forward costs less than its chunks (a server
with one client decoded the full mix at 22.6 tok/s in chunks of 128 against 28.1 whole). A request
whose prefill finished is routed and planned and joins the batch; then one :meth:`AdaptiveRuntime.step`
drafts for every running request and verifies all of them in one forward; each job's text delta,
and its result when it is done, go back to its handler's event loop. A finished job leaves the
batch at once and a waiting one takes its place at the next step. A job whose client went away is
cancelled: taken out of the queue at once if still waiting (its place is free for the next request
then, not when the worker gets round to it), dropped between chunks if prefilling and before the
next step if decoding. :meth:`Scheduler.close` stops admitting and lets queued and running jobs finish.
``max_batch=1`` decodes one request at a time.

The default chunk, 128 tokens, leaves a prefill's numbers as one call would on both engines where
measured: on llama.cpp a 630-token prompt of the embedded model prefilled in chunks of 128, 256 or
512 gave the same embedding and the same next logits bit for bit as one call (chunks of 64 did
not: llama.cpp changes kernels for small batches), for 5% more time; on the torch engine 128 is
the attention's query block, and fp32 outputs are identical (``tests/engine/test_prefill.py``);
bf16 may part at near-ties, which the divergence audit classifies.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from adaptive.errors import AdaptiveError, ContextFullError, StepFailed
from adaptive.resources import release_heap
from adaptive.serve import DEFAULT_PREFILL_CHUNK
from adaptive.serve.metrics import Metrics
from adaptive.serve.wire import RequestError, ServeRequest, internal_error

log = logging.getLogger("adaptive.serve")
EVENT_KINDS = ("delta", "done", "error")
TRIM_AFTER_S = 1.0  # idle seconds after which the worker gives the C heap's free pages back
POLL_S = 0.1  # how often a job that does not fit while nothing runs asks again (positions held elsewhere)


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
    """An admitted request: its ``prompt_ids`` (encoded once, here) and the ``max_tokens`` it will decode."""

    prompt_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(eq=False)
class Job:
    """One admitted request in flight: its events arrive on ``events`` in the handler's ``loop``.
    A job is equal only to itself (its scheduler finds it in its queue by identity)."""

    request: ServeRequest
    admission: Admission
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    first_posted: bool = False  # the worker's: a text delta has been posted
    scheduler: Scheduler | None = field(default=None, init=False, repr=False)  # set by Scheduler.submit

    def post(self, event: Event) -> None:
        """Thread-safe: hand ``event`` to the handler (dropped if its loop has closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        """Its client went away (or its handler ended): stop the job. Thread-safe, idempotent, and a
        no-op for a job already finished. A job still waiting in its scheduler's queue leaves it at
        once (:meth:`Scheduler.withdraw`: the next :meth:`Scheduler.submit` finds its place free and
        the worker never prefills it); one the worker holds is dropped between prefill chunks or
        before the next step."""
        self.cancelled.set()
        if self.scheduler is not None:
            self.scheduler.withdraw(self)


class Scheduler:
    """Admission, a bounded FIFO queue (``max_queue`` waiting; more is a 429) and the decoding worker,
    which decodes up to ``max_batch`` requests together."""

    def __init__(self, runtime, metrics: Metrics | None = None, max_queue: int = 64, default_max_tokens: int = 256,
                 max_batch: int = 8, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, carry: bool | None = None):
        if max_queue < 1 or default_max_tokens < 1 or max_batch < 1:
            raise ValueError("max_queue, default_max_tokens and max_batch must be at least 1")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        # steps carry prompt chunks (False: each chunk a forward of its own); by default where the
        # engine's backbone measured it to pay (the runtime's ``carry_chunks``)
        self.carry = bool(runtime.carry_chunks) if carry is None else carry
        self.runtime = runtime
        # on a GPU the batch's steps replay one captured graph (the runtime's caches laid out for it);
        # elsewhere the eager batched forward runs them
        self.batched_graphs = bool(getattr(runtime, "reserve_batch", lambda n: False)(max_batch))
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
        room = self.runtime.room(ids, req.policy)  # on a member that can decode its policy
        if room < 1:
            raise RequestError(f"the prompt is {len(ids)} tokens, which leaves no room in the model's context "
                               f"of {self.runtime.engine.backbone.max_positions}", param=param,
                               code="context_length_exceeded")
        return Admission(tuple(ids), self._max_tokens(req, len(ids), room))

    def _max_tokens(self, req: ServeRequest, prompt_tokens: int, room: int) -> int:
        """The new tokens ``req`` may decode: its ``max_tokens``, from 1 to the ``room`` its prompt
        leaves in the model's context (else a 400 naming the field), or when not given
        ``min(default_max_tokens, room)``. The one place a served request's token limit is checked
        (the parser only checks that it is an integer). Below 1 the refusal names the field sent
        (``max_completion_tokens`` too); beyond the room it says ``max_tokens``, the limit's name."""
        if req.max_tokens is None:
            return min(self.default_max_tokens, room)
        if req.max_tokens < 1:
            name = req.max_tokens_param
            raise RequestError(f"'{name}' must be at least 1, not {req.max_tokens}", param=name)
        if req.max_tokens > room:
            raise RequestError(f"'max_tokens' is {req.max_tokens}, but the prompt ({prompt_tokens} tokens) leaves room "
                               f"for at most {room} in the model's context of "
                               f"{self.runtime.engine.backbone.max_positions}", param="max_tokens",
                               code="context_length_exceeded")
        return req.max_tokens

    def submit(self, job: Job) -> None:
        """Queue ``job``: 503 while shutting down, 429 when ``max_queue`` jobs already wait."""
        with self._cond:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, type="server_error",
                                   code="shutting_down")
            if len(self._queue) >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting); retry later",
                                   status=429, type="rate_limit_error", code="queue_full")
            job.scheduler = self
            self._queue.append(job)
            self.metrics.set("queue_depth", len(self._queue))
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` out of the queue if it still waits there (its client left: :meth:`Job.cancel`
        calls this), counted once in ``cancelled_requests_total``: its place is free for the next
        :meth:`submit` at once, however long the worker is busy, and the worker never sees it.
        ``False`` when it is not queued (the worker has taken it, which drops a cancelled job itself,
        or it has finished)."""
        with self._cond:
            try:
                self._queue.remove(job)  # by identity (a Job equals only itself)
            except ValueError:
                return False
            self.metrics.set("queue_depth", len(self._queue))
            self.metrics.inc("cancelled_requests_total")
            return True

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

    def _admit(self, running: int) -> list[tuple[Job, object]] | None:
        """The jobs started before the next step, each with its RoutedPrefilling (waits while nothing runs
        or waits); ``None``: closed and idle. Jobs start in arrival order while fewer than ``max_batch``
        run and the runtime can take the next one now (:meth:`AdaptiveRuntime.fits`: on llama.cpp, whose
        live caches share one context, the positions it needs are free); the first that cannot waits for
        running requests to finish, and the jobs behind it with it (arrival order is kept). With none
        running it waits for positions held outside the batch (an online measurement's race) to be given
        back, asking every :data:`POLL_S`. Each job's prefilling is made (its cache taken) before the next
        is considered. A job withdrawn from the queue while its fit was asked (its client left) is
        passed over: the head is taken only if it is still the job that was asked about."""
        if not self._wait(running):
            return None
        started, taken, blocked = [], 0, False
        while running + taken < self.max_batch:
            with self._cond:  # only this thread takes jobs, but a cancelled one leaves the queue by itself
                if not self._queue:
                    break
                job = self._queue[0]
            if not job.cancelled.is_set() and not self.runtime.fits(len(job.admission.prompt_ids),
                                                                    job.admission.max_tokens, job.request.policy):
                blocked = True
                break
            with self._cond:
                if not self._queue or self._queue[0] is not job:  # withdrawn meanwhile: ask about the new head
                    continue
                self._queue.popleft()
                self.metrics.set("queue_depth", len(self._queue))
            try:
                task = self._prefilling(job)
            except ContextFullError:  # the positions fits() saw were taken meanwhile (an online measurement's)
                if self._dropped(job):  # its client left meanwhile: not queued again
                    continue
                with self._cond:
                    self._queue.appendleft(job)  # first again: it waits for room as if it had not fitted
                    self.metrics.set("queue_depth", len(self._queue))
                blocked = True
                break
            taken += 1
            if task is not None:
                started.append((job, task))
        if blocked and not running + taken:  # held by none of our requests: an online measurement's, for a moment
            with self._cond:
                self._cond.wait(POLL_S)
        return started

    def _wait(self, running: int) -> bool:
        """Wait while nothing runs or waits; ``False``: closed and idle. After
        :data:`TRIM_AFTER_S` of idleness what the requests freed goes back to the system once (not at
        every gap between one client's requests, whose next prefill would fault it in again)."""
        with self._cond:
            trimmed = False
            while not self._queue and not running:
                if self._closing:
                    return False
                if not self._cond.wait(None if trimmed else TRIM_AFTER_S) and not trimmed:
                    self._cond.release()  # a request arriving meanwhile is queued, not kept waiting
                    try:
                        release_heap()
                    finally:
                        self._cond.acquire()
                    trimmed = True
            return True

    def _work(self) -> None:
        batch: list[tuple[Job, object]] = []  # decoding: (job, its RoutedDecoding), in admission order
        filling: list[tuple[Job, object]] = []  # prefilling: (job, its RoutedPrefilling), in admission order
        while (new := self._admit(len(batch) + len(filling))) is not None:
            filling += new
            filling = [(job, task) for job, task in filling if not self._dropped(job)]
            batch = [(job, run) for job, run in batch if not self._dropped(job)]
            self._set_running(batch + filling)
            started, filling, riders = self._prefill(filling, whole=not batch)
            batch += started
            self._set_running(batch + filling)
            if batch:
                batch, failed = self._step(batch, riders)
                filling = [(job, task) for job, task in filling if id(job) not in failed]
                self._set_running(batch + filling)  # an idle server reads 0 as soon as its last request finished
        self._set_running([])

    def _set_running(self, jobs: list[tuple[Job, object]]) -> None:
        with self._cond:
            self._running = [job for job, _ in jobs]
        self.metrics.set("running_requests", len(jobs))

    def _dropped(self, job: Job) -> bool:
        """The job's client went away (counted once: a job the worker holds is no longer in the queue,
        so :meth:`withdraw` has not counted it)."""
        if job.cancelled.is_set():
            self.metrics.inc("cancelled_requests_total")
            return True
        return False

    def _prefilling(self, job: Job):
        """``job``'s RoutedPrefilling, or ``None`` when its client left or it failed; :class:`ContextFullError`
        (not the job's failure: positions held elsewhere) is the caller's to handle."""
        if self._dropped(job):
            return None
        req = job.request
        try:
            return self.runtime.prefilling(job.admission.prompt_ids, max_new_tokens=job.admission.max_tokens,
                                           temperature=req.temperature, top_p=req.top_p, stop=req.stop,
                                           seed=req.seed, policy=req.policy, chunk=self.prefill_chunk)
        except ContextFullError:
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the job's error event
            self._fail([job], exc)
            return None

    def _prefill(self, filling: list[tuple[Job, object]], whole: bool
                 ) -> tuple[list[tuple[Job, object]], list[tuple[Job, object]], list[tuple[Job, object]]]:
        """Prefill waiting prompts, the fewest remaining tokens first (arrival order among equals),
        ``prefill_chunk`` tokens in all per decoding step (every prompt whole when 0, or when
        ``whole``: nothing is decoding, so nothing waits for the step, and one forward per prompt
        costs less than its chunks): ``(started, still prefilling, riders)``. A chunk that is not its
        prompt's last rides in the next step's forward (``riders``, still prefilling: one wider
        product instead of two forwards); a prompt's last chunk is a forward of its own (it routes
        the request and picks its first token), after which the request posts its first delta and
        is started unless already done. Shortest first: a short prompt that arrives while a long
        one is being prefilled waits for one chunk, not for the rest of the long prompt."""
        started, waiting, riders, spent = [], [], [], 0
        budget = 0 if whole else self.prefill_chunk
        for job, task in sorted(filling, key=lambda jt: jt[1].remaining):
            if budget and spent < budget and self.carry and task.can_ride:
                riders.append((job, task))
                waiting.append((job, task))
                spent += min(self.prefill_chunk, task.remaining)
                continue
            run = None
            while run is None and (not budget or spent < budget):
                before = task.remaining
                try:
                    run = task.advance(task.remaining if whole else None)
                except Exception as exc:  # noqa: BLE001 - becomes the job's error event
                    self._fail([job], exc)
                    break
                spent += before - task.remaining
            else:
                if run is not None:
                    self._deliver(job, run, run.first)
                    if not run.done:
                        started.append((job, run))
                else:
                    waiting.append((job, task))
        return started, waiting, riders

    def _step(self, batch: list[tuple[Job, object]], riders: list[tuple[Job, object]] = ()
              ) -> tuple[list[tuple[Job, object]], set[int]]:
        """One step of every running job, carrying the riders' next prompt chunks: the jobs still
        running after it, and the ``id`` of each job that failed with it (a failed step fails its
        riders too; a :class:`StepFailed` only the jobs it names)."""
        self.metrics.observe("batch_size", len(batch))
        try:
            deltas = self.runtime.step([run for _, run in batch], [task for _, task in riders])
        except StepFailed as exc:  # the step was some jobs' only (one engine's): they get the error
            jobs = [batch[i][0] for i in exc.decodings] + [riders[i][0] for i in exc.riders]
            self._fail(jobs, exc.cause)
            failed = {id(job) for job in jobs}
            return [(job, run) for job, run in batch if id(job) not in failed], failed
        except Exception as exc:  # noqa: BLE001 - every job in the failed step gets the error
            jobs = [job for job, _ in batch] + [job for job, _ in riders]
            self._fail(jobs, exc)
            return [], {id(job) for job in jobs}
        for (job, run), delta in zip(batch, deltas):
            self._deliver(job, run, delta)
        return [(job, run) for job, run in batch if not run.done], set()

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
        if s.decoded_tokens:
            m.observe("time_per_output_token_seconds", s.decode_time, s.decoded_tokens)
