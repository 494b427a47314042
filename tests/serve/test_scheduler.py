"""The decoding worker on a scripted runtime: admission, queue limits, events, cancellation, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from adaptive.errors import ConfigError
from adaptive.serve.scheduler import Admission, Event, Job, Scheduler
from adaptive.serve.wire import RequestError, ServeRequest, parse_request
from tests.serve.conftest import ScriptedRuntime


def chat(text="hello", **kw):
    return ServeRequest("chat", ({"role": "user", "content": text},), **kw)


def run_job(scheduler, req, loop, cancel_after: int | None = None):
    job = Job(req, scheduler.admit(req), loop)
    scheduler.submit(job)

    async def collect():
        out = []
        while True:
            ev = await asyncio.wait_for(job.events.get(), 10)
            out.append(ev)
            if cancel_after is not None and len(out) == cancel_after:
                job.cancel()
                return out
            if ev.kind != "delta":
                return out

    return job, loop.run_until_complete(collect())


def run_together(scheduler, rt, loop, n: int):
    """``n`` jobs queued while ``rt.gate`` holds every decode, then let go together: each one's events."""
    jobs = [Job(chat(), Admission(tuple(range(5)), 5), loop) for _ in range(n)]
    for job in jobs:
        scheduler.submit(job)
    for _ in range(1000):
        rt.gate.release()

    async def collect(job):
        out = []
        while not out or out[-1].kind == "delta":
            out.append(await asyncio.wait_for(job.events.get(), 10))
        return out

    async def collect_all():
        return await asyncio.gather(*(collect(j) for j in jobs))

    return loop.run_until_complete(collect_all())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_admission_sizes_and_refusals():
    s = Scheduler(ScriptedRuntime(), default_max_tokens=50)
    try:
        assert s.admit(chat("hello")) == Admission(tuple(range(5)), 50)  # room 86: the server default
        assert s.admit(chat("x" * 60)) == Admission(tuple(range(60)), 31)  # room 31 < default
        assert s.admit(chat("hello", max_tokens=86)).max_tokens == 86
        with pytest.raises(RequestError) as e:
            s.admit(chat("hello", max_tokens=87))
        assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded" and "86" in str(e.value)
        with pytest.raises(RequestError) as e:
            s.admit(chat("x" * 91))
        assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
    finally:
        s.close()


@pytest.mark.parametrize("fields,param", [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
                                          ({"max_completion_tokens": 0}, "max_completion_tokens")])
def test_max_tokens_below_one_is_refused_at_admission_naming_the_field(fields, param):
    s = Scheduler(ScriptedRuntime())
    try:
        req = parse_request("chat", {"messages": [{"role": "user", "content": "hello"}], **fields}, served_model="m")
        with pytest.raises(RequestError) as e:
            s.admit(req)
        assert (e.value.status, e.value.param) == (400, param) and "at least 1" in str(e.value)
    finally:
        s.close()


@pytest.mark.parametrize("error", [ConfigError("no chat template"), ValueError("template says no")])
def test_prompts_that_cannot_be_encoded_are_400(error):
    s = Scheduler(ScriptedRuntime(encode_error=error))
    try:
        with pytest.raises(RequestError) as e:
            s.admit(chat())
        assert e.value.status == 400 and e.value.param == "messages" and str(error) in str(e.value)
    finally:
        s.close()


def test_deltas_then_the_result_and_metrics(loop):
    rt = ScriptedRuntime()
    s = Scheduler(rt)
    try:
        _, events = run_job(s, chat(max_tokens=7, temperature=0.0, seed=3, speculation="off"), loop)
        assert [e.kind for e in events] == ["delta", "delta", "delta", "done"]
        assert "".join(e.text for e in events) == "abc"
        assert rt.calls[0] == {"max_new_tokens": 7, "temperature": 0.0, "top_p": 1.0, "stop": (), "seed": 3,
                               "policy": "ar", "chunk": 128}
        assert rt.encoded == [None]  # encoded once, at admission, through the chat template
        m = s.metrics
        assert m.value("generated_tokens_total") == 3 and m.value("prompt_tokens_total") == 5
        assert m.value("accepted_tokens_total", domain="maths", drafter="ssd") == 3
        assert m.value("drafted_tokens_total", domain="maths", drafter="ssd") == 4
    finally:
        s.close()


def test_a_request_is_sized_and_queued_for_its_own_policy(loop):
    """The room and the fit asked for a request are its policy's (a two-engine runtime answers them for
    the members that can decode it: a forced eagle on the member holding the head)."""
    rt = ScriptedRuntime()
    s = Scheduler(rt)
    try:
        _, events = run_job(s, chat(max_tokens=5, speculation="eagle"), loop)
        assert events[-1].kind == "done"
        assert set(rt.policies) == {("room", "eagle"), ("fits", "eagle")} and rt.calls[0]["policy"] == "eagle"
    finally:
        s.close()


def test_a_completion_is_encoded_as_raw_text(loop):
    rt = ScriptedRuntime()
    s = Scheduler(rt)
    try:
        run_job(s, ServeRequest("completion", "def f():", max_tokens=3), loop)
        assert rt.encoded == [False]
    finally:
        s.close()


@pytest.mark.parametrize("fail,status", [(ConfigError("bad top_p"), 400), (RuntimeError("boom"), 500)])
def test_decoding_errors_become_error_events(loop, fail, status):
    s = Scheduler(ScriptedRuntime(fail=fail))
    try:
        _, events = run_job(s, chat(), loop)
        assert events[-1].kind == "error" and events[-1].error.status == status
        assert ("boom" not in str(events[-1].error)) if status == 500 else "bad top_p" in str(events[-1].error)
    finally:
        s.close()


def test_cancelling_stops_the_decode_and_frees_the_worker(loop):
    rt = ScriptedRuntime(pieces=tuple("abcdefgh"))
    rt.gate = threading.Semaphore(2)  # two pieces, then the decode waits until the test has cancelled
    s = Scheduler(rt)
    try:
        job, events = run_job(s, chat(), loop, cancel_after=2)
        assert [e.kind for e in events] == ["delta", "delta"]
        for _ in range(100):
            rt.gate.release()
        _, events = run_job(s, chat(), loop)  # the next request still runs to its end
        assert events[-1].kind == "done" and "".join(e.text for e in events) == "abcdefgh"
        assert not rt.runs[0].done  # the cancelled request left the batch: never decoded to its end
        assert s.metrics.value("cancelled_requests_total") == 1
    finally:
        s.close()


def test_queue_limit_and_shutdown(loop):
    rt = ScriptedRuntime()
    rt.gate = threading.Semaphore(0)  # hold the first request mid-decode
    s = Scheduler(rt, max_queue=1, max_batch=1)
    jobs = [Job(chat(), Admission(tuple(range(5)), 3), loop) for _ in range(3)]
    s.submit(jobs[0])
    deadline = loop.time() + 10
    while not s.busy:  # the worker has taken it: the queue is empty again
        assert loop.time() < deadline
        loop.run_until_complete(asyncio.sleep(0.01))
    s.submit(jobs[1])  # waits
    with pytest.raises(RequestError) as e:
        s.submit(jobs[2])
    assert e.value.status == 429 and e.value.code == "queue_full"
    jobs[1].cancel()  # its client left while queued: skipped, never decoded
    for _ in range(10):
        rt.gate.release()
    assert s.close(timeout=10)
    assert len(rt.calls) == 1 and s.metrics.value("cancelled_requests_total") == 1
    with pytest.raises(RequestError) as e:
        s.submit(Job(chat(), Admission(tuple(range(5)), 3), loop))
    assert e.value.status == 503


def test_events_are_validated():
    with pytest.raises(ValueError):
        Event("progress")


def test_concurrent_jobs_share_steps_up_to_max_batch(loop):
    rt = ScriptedRuntime(pieces=tuple("abcde"))
    rt.gate = threading.Semaphore(0)  # the jobs queue up before any decodes
    s = Scheduler(rt, max_batch=2)
    try:
        results = run_together(s, rt, loop, 3)
        assert all(["".join(e.text for e in ev), ev[-1].kind] == ["abcde", "done"] for ev in results)
        assert max(rt.batches) == 2 and sum(rt.batches) == 3 * 4  # never more than two; each job stepped 4 times
        assert s.metrics.value("generated_tokens_total") == 15
    finally:
        s.close()


def test_a_job_waits_for_the_positions_a_shared_context_has_left(loop):
    """On an engine whose live requests share one context (llama.cpp), a request starts only when the
    positions it needs are free: three requests of 10 positions in a context of 25 run two at a time,
    the third once one has finished, and all three complete (none overflows the context mid-request)."""
    rt = ScriptedRuntime(pieces=tuple("abcde"))
    rt.gate = threading.Semaphore(0)
    rt.shared = 25  # each job below holds 5 prompt and 5 new positions
    s = Scheduler(rt, max_batch=8)
    try:
        results = run_together(s, rt, loop, 3)
        assert all(["".join(e.text for e in ev), ev[-1].kind] == ["abcde", "done"] for ev in results)
        assert max(rt.batches) == 2 and rt.batches[-1] == 1  # two at a time, the third alone at the end
    finally:
        s.close()
    rt = ScriptedRuntime(pieces=tuple("ab"))  # positions held outside the batch: the job waits for them
    rt.shared, rt.held = 25, 20
    s = Scheduler(rt, max_batch=8)
    try:
        job = Job(chat(), Admission(tuple(range(5)), 5), loop)
        s.submit(job)
        threading.Timer(0.3, lambda: setattr(rt, "held", 0)).start()
        t0 = time.perf_counter()

        async def collect():
            out = []
            while not out or out[-1].kind == "delta":
                out.append(await asyncio.wait_for(job.events.get(), 10))
            return out

        assert loop.run_until_complete(collect())[-1].kind == "done"
        assert time.perf_counter() - t0 >= 0.3 and rt.prefills[0].need == 10
    finally:
        s.close()
    rt = ScriptedRuntime(pieces=tuple("abcde"))  # the check can fail: without the limit all three run at once
    rt.gate = threading.Semaphore(0)
    s = Scheduler(rt, max_batch=8)
    try:
        run_together(s, rt, loop, 3)
        assert max(rt.batches) == 3
    finally:
        s.close()


def test_a_job_whose_positions_were_taken_after_it_fitted_waits_instead_of_failing(loop):
    """Between fits() and its cache an online measurement may take the positions (ContextFullError): the
    job goes back to the head of the queue and starts once there is room, with no error event."""
    from adaptive.errors import ContextFullError

    rt = ScriptedRuntime(pieces=tuple("ab"))
    real, refusals = rt.prefilling, []

    def prefilling(prompt_ids, **kw):
        if len(refusals) < 2:
            refusals.append(1)
            raise ContextFullError("10 positions are needed and live requests leave 5")
        return real(prompt_ids, **kw)

    rt.prefilling = prefilling
    s = Scheduler(rt)
    try:
        job, events = run_job(s, chat(), loop)
        assert [e.kind for e in events][-1] == "done" and len(refusals) == 2
        assert s.metrics.value("queue_depth") == 0
    finally:
        s.close()


def test_long_prompts_are_prefilled_in_chunks_between_steps(loop):
    """A 90-token prompt with chunks of 32 is three chunks while a request decodes: the first two
    carried by that request's steps (one forward each), the last one a forward of its own (it picks
    the first token); on an idle server it is one (nothing waits for a step)."""
    rt = ScriptedRuntime(pieces=tuple("abcdefgh"))
    s = Scheduler(rt, prefill_chunk=32)
    try:
        run_job(s, chat("x" * 90, max_tokens=1), loop)
        assert rt.prefilled == [90]
        rt.prefilled.clear()
        rt.timeline.clear()
        rt.gate = threading.Semaphore(2)  # the short request starts, steps once, then waits for the test
        runs = len(rt.runs)
        first = Job(chat("short", max_tokens=8), s.admit(chat("short", max_tokens=8)), loop)
        s.submit(first)
        while len(rt.runs) == runs or rt.runs[-1].i < 2:
            loop.run_until_complete(asyncio.sleep(0.01))
        second = Job(chat("y" * 90, max_tokens=1), s.admit(chat("y" * 90, max_tokens=1)), loop)
        s.submit(second)
        for _ in range(100):
            rt.gate.release()
        loop.run_until_complete(asyncio.wait_for(collect(second), 10))
        # the short request's steps ran while the long prompt was prefilled a chunk at a time
        assert rt.prefilled == [5, 32, 32, 26]
        assert rt.carried == [32, 32]
        carried = [i for i, e in enumerate(rt.timeline) if e == "step 1+32"]
        assert len(carried) == 2 and rt.timeline.index("prefill 26") > carried[-1]
    finally:
        s.close()


async def collect(job):
    events = []
    while not events or events[-1].kind == "delta":
        events.append(await job.events.get())
    return events


def test_a_short_prompt_is_prefilled_before_the_rest_of_a_long_one(loop):
    """Shortest remaining first: a 10-token prompt that arrives while a 90-token one is being prefilled in
    chunks of 32 is prefilled right after the chunk in progress, before the long prompt's last one."""
    rt = ScriptedRuntime(pieces=("a",) * 200)  # 3 runs of 200 steps: within the step gate's 1000
    rt.step_delay = 0.005  # the first request decodes for a second: the long prompt arrives meanwhile
    rt.prefill_gate = threading.Semaphore(2)  # a decoding request's prefill and the long prompt's first chunk
    s = Scheduler(rt, prefill_chunk=32, max_batch=4)
    try:
        s.submit(Job(chat("zzz"), s.admit(chat("zzz")), loop))  # decodes meanwhile, so the long prompt is chunked
        while not rt.batches:
            loop.run_until_complete(asyncio.sleep(0.01))
        long_job = Job(chat("x" * 90), s.admit(chat("x" * 90)), loop)
        s.submit(long_job)
        while rt.waits < 3:  # the worker is inside the long prompt's second chunk
            loop.run_until_complete(asyncio.sleep(0.01))
        short_job = Job(chat("y" * 10), s.admit(chat("y" * 10)), loop)
        s.submit(short_job)
        for _ in range(100):
            rt.prefill_gate.release()
        for job in (long_job, short_job):
            loop.run_until_complete(asyncio.wait_for(collect(job), 10))
        assert rt.prefilled == [3, 32, 32, 10, 26]  # FIFO would have been 32, 32, 26, 10
    finally:
        s.close()


def test_the_worker_gives_freed_memory_back_once_idle_for_a_while(loop, monkeypatch):
    import adaptive.serve.scheduler as scheduler_module

    released = []
    monkeypatch.setattr(scheduler_module, "release_heap", lambda: released.append(1) or True)
    monkeypatch.setattr(scheduler_module, "TRIM_AFTER_S", 0.5)

    def settles_at(n: int) -> bool:
        for _ in range(300):
            if len(released) >= n:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.7)  # and no second trim in a longer idleness
        return len(released) == n

    s = Scheduler(ScriptedRuntime())
    try:
        assert settles_at(1)  # idle from the start
        for n in (2, 3):
            run_job(s, chat(max_tokens=3), loop)
            assert len(released) == n - 1  # not in the gap a request leaves behind it
            assert settles_at(n)
    finally:
        s.close()


def test_a_step_that_failed_for_some_jobs_fails_only_those(loop):
    """A two-engine runtime's step is one engine's: when it fails (:class:`StepFailed`), the jobs it
    names get the error and the others decode on."""
    from adaptive.errors import StepFailed

    class OneFails(ScriptedRuntime):
        def step(self, runs, riders=()):
            if len(runs) == 2 and not self.failed:
                self.failed = True
                raise StepFailed(RuntimeError("boom"), (0,))
            return super().step(runs, riders)

    rt = OneFails(pieces=tuple("abcd"))
    rt.failed = False
    rt.gate = threading.Semaphore(0)
    s = Scheduler(rt, max_batch=2)
    try:
        first, second = run_together(s, rt, loop, 2)
        assert first[-1].kind == "error" and first[-1].error.status == 500
        assert second[-1].kind == "done" and "".join(e.text for e in second) == "abcd"
    finally:
        s.close()


def _hold_one_request(s: Scheduler, loop) -> None:
    """Submit one request and wait until the worker decodes it (its runtime's gate holds it there)."""
    s.submit(Job(chat(), Admission(tuple(range(5)), 3), loop))
    deadline = time.time() + 10
    while not s.busy:
        assert time.time() < deadline
        time.sleep(0.01)


def test_a_cancelled_job_leaves_a_full_queue_at_once_while_the_worker_is_busy(loop):
    """A disconnected client's queued request frees its place at once, however long the worker is busy
    (the regression: abandoned streams kept the queue full, so new clients got 429s until the worker
    had prefilled and decoded every one of them): with one request held mid-decode and the queue full,
    cancelling the waiting jobs (as their responses do when their clients reset) empties the queue
    there and then, each counted cancelled once; the next submit is accepted, and no cancelled job is
    ever prefilled."""
    rt = ScriptedRuntime()
    rt.gate = threading.Semaphore(0)  # the worker is busy: its first request waits mid-decode
    s = Scheduler(rt, max_queue=4, max_batch=1)
    try:
        _hold_one_request(s, loop)
        waiting = [Job(chat(), Admission(tuple(range(5)), 3), loop) for _ in range(4)]
        for job in waiting:
            s.submit(job)
        with pytest.raises(RequestError) as e:
            s.submit(Job(chat(), Admission(tuple(range(5)), 3), loop))
        assert e.value.status == 429
        for job in waiting:
            job.cancel()
        waiting[0].cancel()  # twice: still counted once
        assert s.metrics.value("queue_depth") == 0 and s.metrics.value("cancelled_requests_total") == 4
        fresh = Job(chat(), Admission(tuple(range(5)), 3), loop)
        s.submit(fresh)  # no 429, though the worker has not moved
        assert s.metrics.value("queue_depth") == 1 and len(rt.calls) == 1
        for _ in range(10):
            rt.gate.release()
        events = loop.run_until_complete(asyncio.wait_for(collect(fresh), 10))
        assert events[-1].kind == "done" and "".join(e.text for e in events) == "abc"
        assert len(rt.calls) == 2  # the busy request's prefill and the fresh one's: none of the cancelled
        assert s.metrics.value("cancelled_requests_total") == 4 and s.metrics.value("queue_depth") == 0
    finally:
        s.close()


def test_a_job_withdrawn_while_the_worker_asks_whether_it_fits_is_passed_over(loop):
    """The worker asks whether the queue's head fits without the lock; a head whose client leaves
    meanwhile is withdrawn, and the worker then takes the new head (not the job behind the one it
    asked about, which would be lost): the job behind it is served, the withdrawn one never prefilled."""
    rt = ScriptedRuntime()
    rt.gate = threading.Semaphore(0)
    asked = []

    def fits(prompt_tokens, max_new_tokens, policy=None):
        asked.append(prompt_tokens)
        if prompt_tokens == 7:  # the client of the job being asked about leaves now
            leaving.cancel()
        return True

    rt.fits = fits
    s = Scheduler(rt, max_batch=1)
    try:
        _hold_one_request(s, loop)
        leaving = Job(chat(), Admission(tuple(range(7)), 3), loop)
        staying = Job(chat(), Admission(tuple(range(9)), 3), loop)
        s.submit(leaving)
        s.submit(staying)
        for _ in range(10):
            rt.gate.release()
        events = loop.run_until_complete(asyncio.wait_for(collect(staying), 10))
        assert events[-1].kind == "done" and asked == [5, 7, 9]
        assert rt.prefilled == [5, 9]  # the busy request's prompt and the staying one's
        assert s.metrics.value("cancelled_requests_total") == 1 and s.metrics.value("queue_depth") == 0
    finally:
        s.close()
