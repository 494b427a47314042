"""llama.cpp's own C++ ``llama-server`` as a benchmark peer: the strongest CPU baseline we know of.

``benchmarks/build_llama_server.sh`` builds the binary (CPU, ``-march=native``) from the llama.cpp
vendored in the installed llama-cpp-python's sdist, so both llama.cpp peers run the same llama.cpp.
:class:`LlamaServer` starts it as a subprocess on the loopback interface with one slot, waits for
``/health``, and for each prompt POSTs ``/completion`` with the prompt's token ids (our tokenizer and
chat template, as for every method), greedy, no prompt cache (each run pays its prefill, as ours do),
and reads the generated token ids back; the time is the wall clock of the whole request.

``spec_type`` turns on one of the server's draft-model-free ("self") speculation types
(:data:`SPEC_TYPES`, ``--spec-type``) with this llama.cpp version's default settings. Two of them
keep what they learnt across requests in the server process (a shared n-gram pool or cache): for
those the server is restarted, untimed, before every prompt after the first, so that no run is drafted
from an earlier run's output (our runtime is benchmarked with online learning off for the same reason).

Like llama-cpp-python, the server decodes with the GGUF file's own quantized weights, so its tokens
are compared with ``ar`` as agreement, never as a lossless check.
"""

from __future__ import annotations

import atexit
import http.client
import importlib.metadata
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from adaptive.engine import llamacpp_host
from adaptive.errors import ConfigError
from adaptive.workdir import cache_dir

BUILD = "benchmarks/build_llama_server.sh"
ENV_BINARY = "ADAPTIVE_LLAMA_SERVER"
HOST = "127.0.0.1"  # loopback only, never another interface

# llama.cpp's draft-model-free speculation types (tools/server --spec-type; common/speculative.cpp),
# with what each drafts under this version's defaults (0.3.36's vendored llama.cpp)
SPEC_TYPES: dict[str, str] = {
    "ngram-simple": "the 48 tokens that followed the last earlier occurrence of the current 12-gram",
    "ngram-map-k": "a map of the context's 12-grams to the 48 tokens after them, drafted once a key was seen",
    "ngram-map-k4v": "up to four 48-token continuations per 12-gram key, the clearly most frequent one drafted",
    "ngram-mod": "a hashed pool of 24-grams to their next token, drafts of 48 to 64 tokens",
    "ngram-cache": "1- to 4-gram statistics of the context, 8-token drafts",
}
# types whose state outlives a request in the server process: restarted before each prompt
STATEFUL_SPEC_TYPES = frozenset({"ngram-mod", "ngram-cache"})


@dataclass(frozen=True)
class ServerSettings:
    """How one ``llama-server`` process runs: the model, threads (``-t``/``-tb``), context (``-c``,
    shared by the slots), the speculation type (``None``: plain decoding) and its slots (``-np``:
    requests decoded together, continuous batching)."""

    gguf: Path
    threads: int
    n_ctx: int
    spec_type: str | None = None
    start_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    slots: int = 1
    # llama.cpp's repacked and AMX weight layouts: off where the Python binding's probe found them faulting
    # (adaptive.engine.llamacpp_host.extra_buffers_ok; the build script compiles the same llama.cpp version natively)
    repack: bool = True
    # reuse a slot's cached prompt for the next request sharing its start (llama-server's default; off by
    # default here, for single-turn fairness against our runs, which start from nothing either)
    cache_prompt: bool = False

    def __post_init__(self):
        if self.spec_type is not None and self.spec_type not in SPEC_TYPES:
            raise ConfigError(f"unknown llama-server speculation type {self.spec_type}; "
                              f"choose from {', '.join(SPEC_TYPES)}")
        if self.threads < 1 or self.n_ctx < 1 or self.slots < 1:
            raise ConfigError(f"llama-server needs threads, n_ctx and slots >= 1, got {self.threads}, {self.n_ctx}, "
                              f"{self.slots}")


def cache_root() -> Path:
    """Where the build script installs llama.cpp builds (``$ADAPTIVE_CACHE/llama.cpp``)."""
    return cache_dir() / "llama.cpp"


def find_server() -> Path:
    """The ``llama-server`` binary: ``$ADAPTIVE_LLAMA_SERVER``, else the build script's for the installed
    llama-cpp-python version (else the newest one built); a one-line error naming the script when none."""
    named = os.environ.get(ENV_BINARY)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"{ENV_BINARY}={named} is not an executable file; unset it or build one with {BUILD}")
        return path
    try:
        candidates = [cache_root() / importlib.metadata.version("llama-cpp-python") / "bin" / "llama-server"]
    except importlib.metadata.PackageNotFoundError:
        candidates = sorted(cache_root().glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = candidates[0] if candidates else cache_root() / "VERSION" / "bin" / "llama-server"
    raise ConfigError(f"the llama-server methods need llama.cpp's llama-server (none at {where}): "
                      f"run {BUILD} (CPU build, 10-15 minutes) or set {ENV_BINARY} to a binary")


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(binary: Path, settings: ServerSettings, port: int) -> list[str]:
    """The command line: the settings' slots, no web UI, no prompt cache in RAM, loopback only (and
    with ``cache_prompt`` off, no reuse of a slot's cached prompt either)."""
    cmd = [str(binary), "-m", str(settings.gguf), "-t", str(settings.threads), "-tb", str(settings.threads),
           "-np", str(settings.slots), "-c", str(settings.n_ctx), "--host", HOST, "--port", str(port),
           "--no-webui", "--cache-ram", "0"]
    if not settings.cache_prompt:
        cmd.append("--no-cache-prompt")
    if settings.spec_type is not None:
        cmd += ["--spec-type", settings.spec_type]
    if not settings.repack:
        cmd.append("--no-repack")
    return cmd


def completion_request(ids: list[int], max_new_tokens: int, cache_prompt: bool = False,
                       ignore_eos: bool = False, sampling: dict | None = None) -> dict:
    """The ``/completion`` body: the prompt as token ids, greedy with every penalty and sampler off,
    the slot's cached prompt reused only with ``cache_prompt``, the generated token ids asked back
    (all ``max_new_tokens`` of them with ``ignore_eos``). ``sampling`` (``temperature``, ``top_p``, ``seed``):
    sampled instead, from the model's own distribution but for ``top_p`` (``top_k`` and ``min_p`` off, as
    ours)."""
    s = sampling or {}
    return {"prompt": [int(t) for t in ids], "n_predict": int(max_new_tokens), "stream": False,
            "cache_prompt": bool(cache_prompt), "return_tokens": True,
            "temperature": float(s.get("temperature", 0.0)), "top_k": 0 if s else 1,
            "top_p": float(s.get("top_p", 1.0)), "min_p": 0.0, "typical_p": 1.0, "seed": int(s.get("seed", 0)),
            "repeat_penalty": 1.0, "repeat_last_n": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0, "ignore_eos": bool(ignore_eos), "n_probs": 0}


def generated_tokens(reply: dict, max_new_tokens: int, eos: set[int]) -> list[int]:
    """The token ids of a ``/completion`` reply, up to and including the first of ``eos``."""
    if "tokens" not in reply:
        raise ConfigError(f"llama-server's reply has no token ids (fields: {', '.join(sorted(reply))}); "
                          "it needs a version that supports return_tokens")
    out: list[int] = []
    for tok in reply["tokens"][:max_new_tokens]:
        out.append(int(tok))
        if tok in eos:
            break
    return out


class LlamaServer:
    """One ``llama-server`` process kept alive across prompts (restarted before each prompt for the
    :data:`STATEFUL_SPEC_TYPES`); use as a context manager or call :meth:`close` (also done at exit).
    With ``slots`` > 1 it serves concurrent clients on its OpenAI-compatible endpoints at :attr:`url`
    (``benchmarks/serve_batch.py`` drives it so).
    ``last_timings`` is the server's ``timings`` of the last request (``draft_n``/``draft_n_accepted``
    when it drafted)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, spec_type: str | None = None,
                 binary: Path | None = None, slots: int = 1, cache_prompt: bool = False):
        self.binary = binary if binary is not None else find_server()
        self.settings = ServerSettings(Path(gguf), threads, n_ctx, spec_type, slots=slots,
                                       repack=not llamacpp_host.available() or llamacpp_host.extra_buffers_ok(gguf),
                                       cache_prompt=cache_prompt)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path: Path | None = None
        self.last_timings: dict = {}
        self._requests = 0
        self.start()

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers ok; a clear error when it does not."""
        self.close()
        atexit.register(self.close)  # a server never outlives the interpreter
        fd, log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(log)
        self.port = free_port()
        with os.fdopen(fd, "wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(server_command(self.binary, self.settings, self.port),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self._log_tail()
                self.close()
                raise ConfigError(f"llama-server exited with code {code} on start: {tail}")
            try:
                status, _ = self._call("GET", "/health", None, timeout=5.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):  # not listening yet
                pass
            time.sleep(0.1)
        self.close()
        raise ConfigError(f"llama-server did not become healthy in {self.settings.start_timeout_s:.0f} s")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int],
                 fresh: bool = True, ignore_eos: bool = False, sampling: dict | None = None) -> tuple[list[int], float]:
        """Greedy tokens after ``ids`` (up to and including an EOS; ``ignore_eos``: all ``max_new_tokens``)
        and the request's wall time in seconds; ``sampling``: sampled ones (:func:`completion_request`).
        ``fresh=False``: the request goes on a conversation, so a stateful speculation type keeps its pool."""
        if self.settings.spec_type in STATEFUL_SPEC_TYPES and self._requests > 0 and fresh:
            self.start()  # untimed: a fresh n-gram pool, so this run cannot draft from an earlier one
        if self.proc is None:
            self.start()
        body = json.dumps(completion_request(ids, max_new_tokens, self.settings.cache_prompt, ignore_eos,
                                             sampling)).encode()
        t = time.perf_counter()
        status, data = self._call("POST", "/completion", body, timeout=self.settings.request_timeout_s)
        reply = json.loads(data)
        dt = time.perf_counter() - t
        self._requests += 1
        if status != 200:
            raise ConfigError(f"llama-server answered {status}: {reply.get('error', reply)}")
        self.last_timings = dict(reply.get("timings") or {})
        return generated_tokens(reply, max_new_tokens, set() if ignore_eos else eos), dt

    def _call(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _log_tail(self, n: int = 400) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        return " ".join(text[-n:].split()) or "(no output)"

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its log; safe to call twice."""
        atexit.unregister(self.close)
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
