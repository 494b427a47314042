"""A served tiny model: a runtime whose domains draft, and uvicorn in a thread on a free port."""

from __future__ import annotations

import threading
import time

import pytest

from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.profile import load_profile
from adaptive.runtime import AdaptiveRuntime
from tests.runtime.test_runtime import with_domains


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
    return AdaptiveRuntime(p, load_model(str(tiny_model_dir), dtype="float32"), seed=0)


def plain(runtime, prompt, n: int, chat: bool = True) -> str:
    """Plain greedy decoding of ``prompt`` (the lossless reference), as text."""
    return Engine(runtime.lm).generate([{"role": "user", "content": prompt}] if chat else prompt,
                                       GenerationConfig(max_new_tokens=n), chat=None if chat else False).text
