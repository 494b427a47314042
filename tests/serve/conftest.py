"""A served tiny model: a runtime whose domains draft, and uvicorn in a thread on a free port."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.loop import GenerationStats
from adaptive.engine.skip import SkipSet
from adaptive.profile import load_profile
from adaptive.runtime import AdaptiveRuntime
from tests.helpers.profiles import with_domains

CONTEXT = 100  # the scripted runtime's context, in tokens (one per character)


class Server:
    """uvicorn serving ``app`` in a thread, on a free port, until :meth:`stop`."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def runtime(tiny_profile, tiny_model_dir):
    """Domains that draft (prompt lookup for math, layer skipping elsewhere), so that serving exercises speculation."""
    from adaptive.models import load_model

    p = with_domains(load_profile(tiny_profile), lambda n: "pld" if n == "math" else "ssd")
    rt = AdaptiveRuntime(p, load_model(str(tiny_model_dir), dtype="float32"), seed=0)
    yield rt
    rt.close()  # stops a background measurement of a domain learned from the serving tests' traffic


def plain(runtime, prompt, n: int, chat: bool = True) -> str:
    """Plain greedy decoding of ``prompt`` (the lossless reference), as text."""
    return Engine(runtime.lm).generate([{"role": "user", "content": prompt}] if chat else prompt,
                                       GenerationConfig(max_new_tokens=n), chat=None if chat else False).text


class ScriptedRun:
    """A started request: ``pieces[0]`` is its first delta, each step gives the next piece."""

    def __init__(self, rt, pieces):
        self.rt, self.pieces, self.i = rt, pieces, 1
        rt.gate.acquire()
        self.first = pieces[0]

    @property
    def done(self):
        return self.i >= len(self.pieces)

    def result(self):
        stats = GenerationStats(tokens=len(self.pieces), steps=2, drafted=4, accepted=3, prompt_tokens=5,
                                total_time=1.0, prefill_time=0.2)
        return SimpleNamespace(stats=stats, domain="maths", decision="ssd", token_ids=[1, 2, 3], finish_reason="length",
                               text="".join(self.pieces), applied="maths", policy="knn-ssd", skip=SkipSet((1,)),
                               engine="torch", engine_choice=None)


class ScriptedPrefill:
    """A prompt of ``n`` tokens prefilled ``chunk`` per advance (all at once for 0); then a ScriptedRun."""

    def __init__(self, rt, n, chunk, need=0):
        self.rt, self.remaining, self.chunk, self.need, self.run = rt, n, chunk, need, None

    @property
    def live(self):
        """Holds its positions: being prefilled, or decoding."""
        return self.run is None or not self.run.done

    @property
    def can_ride(self):
        return 0 < self.chunk < self.remaining

    def ride(self):
        """The next chunk, carried by a step (RoutedPrefilling's riders)."""
        assert self.can_ride
        self.rt.waits += 1  # the worker is in a prefill chunk (waiting for the gate, maybe)
        self.rt.prefill_gate.acquire()
        self.remaining -= self.chunk
        self.rt.prefilled.append(self.chunk)
        self.rt.carried.append(self.chunk)

    def advance(self, tokens=None):
        self.rt.waits += 1  # the worker is in a prefill chunk (waiting for the gate, maybe)
        self.rt.prefill_gate.acquire()
        size = self.chunk if tokens is None else tokens
        step = min(self.remaining, size or self.remaining)
        self.remaining -= step
        self.rt.prefilled.append(step)
        self.rt.timeline.append(f"prefill {step}")
        if self.remaining:
            return None
        self.rt.runs.append(ScriptedRun(self.rt, self.rt.pieces))
        self.run = self.rt.runs[-1]
        return self.run


class ScriptedRuntime:
    """Encodes a prompt as one id per character; a request's deltas are ``pieces`` (the first at its
    start, one per step), then its result; ``fail`` is raised by the step that would end it. ``gate``:
    each piece waits for it (so that a test can hold a request mid-decode). ``batches``: the sizes of
    the steps run."""

    def __init__(self, pieces=("a", "b", "c"), fail: Exception | None = None, encode_error: Exception | None = None):
        self.pieces, self.fail, self.encode_error = pieces, fail, encode_error
        self.engine = SimpleNamespace(backbone=SimpleNamespace(max_positions=CONTEXT))
        self.carry_chunks = True
        self.gate = threading.Semaphore(1000)
        self.prefill_gate = threading.Semaphore(1000)  # each prefill chunk waits for it too
        self.waits = 0
        self.step_delay = 0.0  # seconds each step takes
        self.calls, self.runs, self.batches, self.encoded, self.prefilled = [], [], [], [], []
        self.carried = []  # the sizes of the prefill chunks carried by steps
        self.timeline = []  # "prefill N" and "step B" (+N: chunks it carried) in the order the worker ran them
        self.shared = None  # positions live requests share (fits), None: no shared limit
        self.held = 0  # of them, held by something other than the server's requests (an online measurement)
        self.prefills = []
        self.policies = []  # ("room" or "fits", the policy it was asked for)

    def encode(self, prompt, chat=None):
        self.encoded.append(chat)
        if self.encode_error is not None:
            raise self.encode_error
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return list(range(len(text)))

    def room(self, ids, policy=None):
        self.policies.append(("room", policy))
        return CONTEXT - len(ids) - 9

    def fits(self, prompt_tokens, max_new_tokens, policy=None):
        """Always, unless ``shared`` is set: then live requests share that many positions (llama.cpp's
        context), each holding its prompt's and new tokens' from its prefilling to its end."""
        self.policies.append(("fits", policy))
        if self.shared is None:
            return True
        used = self.held + sum(p.need for p in self.prefills if p.live)
        return used + prompt_tokens + max_new_tokens <= self.shared

    def prefilling(self, prompt_ids, **kw):
        self.calls.append(kw)
        need = len(prompt_ids) + kw["max_new_tokens"]
        self.prefills.append(ScriptedPrefill(self, len(prompt_ids), kw["chunk"], need))
        return self.prefills[-1]

    def step(self, runs, riders=()):
        assert runs and not any(r.done for r in runs)
        time.sleep(self.step_delay)
        self.batches.append(len(runs))
        for r in riders:
            r.ride()
        self.timeline.append(f"step {len(runs)}" + "".join(f"+{r.chunk}" for r in riders))
        out = []
        for r in runs:
            self.gate.acquire()
            if self.fail is not None and r.i == len(r.pieces) - 1:
                raise self.fail
            out.append(r.pieces[r.i])
            r.i += 1
        return out
