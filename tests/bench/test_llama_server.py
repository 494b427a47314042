"""The llama-server peer without a real binary: a clear error when none is built, and the client
against a fake server (a stdlib HTTP server on the loopback interface, started as the "binary"):
the command line, the request body, the parsing of the reply, restarts and shutdown. With a real
binary built by benchmarks/build_llama_server.sh, one more test decodes the embedded GGUF."""

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from adaptive.bench import llama_server
from adaptive.bench.llama_server import (
    SPEC_TYPES,
    LlamaServer,
    ServerSettings,
    completion_request,
    find_server,
    generated_tokens,
    server_command,
)
from adaptive.bench.runner import BENCH_METHODS, DESCRIPTIONS, METHODS
from adaptive.errors import ConfigError

# the fake llama-server: logs its argv and every /completion body to $FAKE_LOG (JSON lines), answers
# /health with 503 (loading) once and then 200, and /completion with fixed tokens
FAKE = textwrap.dedent("""\
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    LOG = os.environ["FAKE_LOG"]
    argv = sys.argv[1:]
    if os.environ.get("FAKE_FAIL"):
        print("error: failed to load model", flush=True)
        sys.exit(1)
    with open(LOG, "a") as f:
        f.write(json.dumps({"argv": argv, "pid": os.getpid()}) + "\\n")
    port = int(argv[argv.index("--port") + 1])
    health = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            health.append(1)
            if len(health) == 1:
                self.reply(503, {"error": {"message": "Loading model"}})
            else:
                self.reply(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(LOG, "a") as f:
                f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
            timings = {"predicted_n": 5}
            if "--spec-type" in argv:
                timings.update(draft_n=8, draft_n_accepted=3)
            tokens = [11, 12, 2, 13, 14][: body["n_predict"]]
            self.reply(200, {"content": "ab", "tokens": tokens, "stop_type": "limit", "timings": timings})

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake llama-server named by ADAPTIVE_LLAMA_SERVER; returns a function reading its log."""
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE, encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("ADAPTIVE_LLAMA_SERVER", str(script))
    monkeypatch.setenv("FAKE_LOG", str(log))

    def read() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return read


def test_a_missing_binary_is_a_one_line_error_naming_the_build_script(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPTIVE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"benchmarks/build_llama_server\.sh") as err:
        LlamaServer(tmp_path / "m.gguf", threads=2, n_ctx=256)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("ADAPTIVE_LLAMA_SERVER", str(tmp_path / "nothing-here"))
    with pytest.raises(ConfigError, match="ADAPTIVE_LLAMA_SERVER=.*not an executable.*build_llama_server"):
        find_server()


def test_the_build_scripts_location_for_the_installed_version_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPTIVE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_server.importlib.metadata, "version", lambda name: "9.9.9")
    binary = tmp_path / "llama.cpp" / "9.9.9" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_server() == binary


def test_repacking_is_turned_off_only_when_the_settings_say_so(tmp_path):
    gguf = tmp_path / "m.gguf"
    on = server_command(Path("llama-server"), ServerSettings(gguf, 2, 512), 8080)
    off = server_command(Path("llama-server"), ServerSettings(gguf, 2, 512, repack=False), 8080)
    assert "--no-repack" not in on and off == on + ["--no-repack"]


def test_with_cache_prompt_the_slot_keeps_its_prompt_and_a_conversation_keeps_a_stateful_pool(fake, tmp_path):
    gguf = tmp_path / "m.gguf"
    assert "--no-cache-prompt" in server_command(Path("llama-server"), ServerSettings(gguf, 2, 512), 8080)
    cached = server_command(Path("llama-server"), ServerSettings(gguf, 2, 512, cache_prompt=True), 8080)
    assert "--no-cache-prompt" not in cached and cached[cached.index("--cache-ram") + 1] == "0"
    assert completion_request([1], 4, cache_prompt=True)["cache_prompt"] is True
    assert completion_request([1], 4)["ignore_eos"] is False
    assert completion_request([1], 4, ignore_eos=True)["ignore_eos"] is True
    server = LlamaServer(gguf, threads=1, n_ctx=64, spec_type="ngram-mod", cache_prompt=True)
    try:
        server.generate([1], 4, eos={2})
        server.generate([1, 5], 4, eos={2}, fresh=False)  # the conversation's next turn: same process
        assert len([r for r in fake() if "argv" in r]) == 1
        server.generate([7], 4, eos={2})  # a new conversation: a fresh pool
        assert len([r for r in fake() if "argv" in r]) == 2
        assert [r["body"]["cache_prompt"] for r in fake() if "body" in r] == [True, True, True]
    finally:
        server.close()


def test_the_request_is_greedy_uncached_token_ids_and_asks_for_tokens_back():
    body = completion_request([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["repeat_penalty"] == 1.0
    assert body["presence_penalty"] == body["frequency_penalty"] == body["dry_multiplier"] == 0.0
    assert json.loads(json.dumps(body)) == body
    sampled = completion_request([1, 2, 3], 16, sampling={"temperature": 1.0, "top_p": 0.9, "seed": 5})
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (1.0, 0.9, 5)
    assert sampled["top_k"] == 0 and sampled["min_p"] == 0.0  # the model's own distribution, as ours samples it


def test_the_reply_is_cut_after_the_first_eos_and_at_max_new_tokens():
    assert generated_tokens({"tokens": [5, 6, 2, 7]}, 10, {2}) == [5, 6, 2]
    assert generated_tokens({"tokens": [5, 6, 7]}, 2, {2}) == [5, 6]
    with pytest.raises(ConfigError, match="return_tokens"):
        generated_tokens({"content": "x"}, 4, {2})


def test_the_client_drives_a_server_on_the_loopback_interface(fake, tmp_path):
    with LlamaServer(tmp_path / "m.gguf", threads=3, n_ctx=512) as server:
        out, seconds = server.generate([1, 2, 3], 8, eos={2})
        assert out == [11, 12, 2] and seconds > 0
        out, _ = server.generate([4], 1, eos={2})
        assert out == [11]
        proc = server.proc
    assert proc.poll() is not None  # stopped on leaving the block
    start, first, second = fake()
    argv = start["argv"]
    for flag, value in (("-m", str(tmp_path / "m.gguf")), ("-t", "3"), ("-tb", "3"), ("-np", "1"), ("-c", "512"),
                        ("--host", "127.0.0.1")):
        assert argv[argv.index(flag) + 1] == value
    assert "--no-webui" in argv and "--spec-type" not in argv
    assert first["path"] == "/completion" and first["body"] == completion_request([1, 2, 3], 8)
    assert second["body"]["prompt"] == [4] and second["body"]["n_predict"] == 1


def test_a_spec_type_is_passed_and_a_stateful_one_restarts_the_server_per_prompt(fake, tmp_path):
    server = LlamaServer(tmp_path / "m.gguf", threads=1, n_ctx=64, spec_type="ngram-mod")
    try:
        for _ in range(2):
            server.generate([1], 4, eos={2})
        assert server.last_timings["draft_n"] == 8 and server.last_timings["draft_n_accepted"] == 3
    finally:
        server.close()
        server.close()  # twice is fine
    starts = [r for r in fake() if "argv" in r]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]
    assert starts[0]["argv"][starts[0]["argv"].index("--spec-type") + 1] == "ngram-mod"
    simple = LlamaServer(tmp_path / "m.gguf", threads=1, n_ctx=64, spec_type="ngram-simple")
    with simple:
        for _ in range(2):
            simple.generate([1], 4, eos={2})
    assert len([r for r in fake() if "argv" in r]) == 3  # kept alive across prompts


def test_a_server_that_fails_to_start_is_a_clear_error(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(ConfigError, match="exited with code 1 on start: error: failed to load model"):
        LlamaServer(tmp_path / "m.gguf", threads=1, n_ctx=64)
    with pytest.raises(ConfigError, match="unknown llama-server speculation type"):
        LlamaServer(tmp_path / "m.gguf", threads=1, n_ctx=64, spec_type="draft-mtp")


def test_the_bench_methods_cover_every_self_speculation_type():
    names = [m for m in METHODS if m.startswith("llama-server")]
    assert names == ["llama-server", *(f"llama-server-{kind}" for kind in SPEC_TYPES)]
    assert set(SPEC_TYPES) == {"ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"}
    for name in names:
        m = BENCH_METHODS[name]
        assert m.runs_on == "llama-server" and not m.needs_profile and "llama-server" in DESCRIPTIONS[name]
        assert m.drafter == ("ar" if name == "llama-server" else name.removeprefix("llama-server-"))


@pytest.mark.skipif(os.environ.get("ADAPTIVE_LLAMA_SERVER") is None and not any(
    llama_server.cache_root().glob("*/bin/llama-server")), reason="no llama-server built")
def test_a_real_llama_server_decodes_the_embedded_gguf_greedily(embedded_fp32):
    from adaptive.bench.llamacpp import gguf_path
    from adaptive.engine.engine import Engine

    eng = Engine(embedded_fp32)
    ids = eng.encode("What is the capital of France?")
    with LlamaServer(gguf_path(embedded_fp32), threads=2, n_ctx=512) as server:
        out, seconds = server.generate(ids, 16, eng.eos)
        again, _ = server.generate(ids, 16, eng.eos)
    assert 1 <= len(out) <= 16 and seconds > 0 and again == out and eng.text(out).strip()
