"""benchmarks/serve_load.py's conversations (``--turns``) against a live tiny server: each turn re-sends
the conversation with the replies streamed so far, and the later turns start from the prefix cache."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from adaptive.serve.app import create_app  # noqa: E402
from tests.conftest import TINY_DOMAINS  # noqa: E402
from tests.helpers.scripts import load_benchmark  # noqa: E402
from tests.serve.conftest import Server  # noqa: E402


def test_prompts_become_conversations_of_their_own_turns_or_the_follow_up(tmp_path):
    load = load_benchmark("serve_load")
    f = tmp_path / "sb.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"category": "qa", "turns": ["q0"]}, {"category": "qa", "turns": ["q1"]},
        {"category": "writing", "turns": ["w0", "w0 again"]}, {"category": "writing", "turns": ["w1", "more"]}]))
    assert load.prompts_from(str(f), 1) == ["q1", "w1"]
    assert load.prompts_from(str(f), 1, turns=2) == [["q1", load.FOLLOW_UP], ["w1", "more"]]


def test_conversations_against_a_live_server_report_ttft_by_turn_and_cached_tokens(runtime, tmp_path, monkeypatch,
                                                                                   capsys):
    load = load_benchmark("serve_load")
    data = tmp_path / "sb.jsonl"
    data.write_text("".join(json.dumps({"category": n, "turns": [p, "and then?"]}) + "\n"
                            for n, ps in TINY_DOMAINS.items() for p in ps[-2:]))
    s = Server(create_app(runtime, max_queue=16, max_batch=4))
    try:
        record = tmp_path / "texts.jsonl"
        monkeypatch.setattr(sys, "argv", ["serve_load.py", "--url", s.url, "--data", str(data), "--skip-first", "1",
                                          "--clients", "2", "--requests", "6", "--turns", "2", "--max-tokens", "6",
                                          "--record", str(record)])
        load.main()
    finally:
        s.stop()
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 6 and report["server_errors"] == 0
    assert set(report["ttft_by_turn_s"]) == {"1", "2"} and report["cached_tokens"] > 0
    texts = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(t["prompt"] for t in texts) == ["0/1", "0/2", "1/1", "1/2", "2/1", "2/2"]
