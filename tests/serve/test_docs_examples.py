"""The serving examples in docs/api.md run against a live server: the curl line and the OpenAI
client script (which the docs must show verbatim)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("openai")

from adaptive.serve.app import create_app  # noqa: E402
from tests.serve.conftest import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "examples" / "openai_client.py"


def block(marker: str, lang: str) -> str:
    return DOC.split(f"<!-- {marker} -->\n```{lang}\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def server(runtime):
    s = Server(create_app(runtime))
    yield s
    s.stop()


def test_docs_show_the_client_example():
    assert block("examples/openai_client.py", "python") == EXAMPLE.read_text(encoding="utf-8")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_example(server):
    cmd = block("curl", "bash").replace("localhost:8000", f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["adaptive"]["policy"] == "knn-ssd"


def test_the_client_example(server):
    env = {**os.environ, "ADAPTIVE_URL": server.url + "/v1"}
    env.pop("ADAPTIVE_API_KEY", None)
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "'policy': 'knn-ssd'" in out.stdout and "'drafter'" in out.stdout
