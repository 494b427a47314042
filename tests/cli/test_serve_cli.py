"""`adaptive serve` as users run it: a process on a free port, drained by SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from adaptive.cli.main import main

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def test_missing_extra_is_one_clear_line(monkeypatch, capsys, tiny_profile):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the serve extra were not installed
    monkeypatch.delitem(sys.modules, "adaptive.serve.app", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--profile", str(tiny_profile)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and err.count("\n") == 0
    assert "pip install 'adaptive[serve]'" in err and "uvicorn" in err


def test_bad_options_are_usage_errors(capsys, tiny_profile):
    for args in (["--max-queue", "0"], ["--port", "70000"], ["--policy", "ar"], ["--replica-id", "../x"],
                 ["--merge-interval", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--profile", str(tiny_profile), *args])
        assert exc.value.code == 2, args
    err = capsys.readouterr().err
    assert "speculation" in err  # --policy's hint: speculation is per request
    assert "replica id '../x'" in err


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_connections(tiny_profile, tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptive.cli.main", "serve", "--profile", str(tiny_profile), "--model",
         str(tiny_model_dir), "--dtype", "float32", "--port", "0", "--drain-timeout", "60"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port, lines = None, []
        deadline = time.time() + 120
        while port is None:
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            line = proc.stderr.readline()
            lines.append(line)
            m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"messages": [{"role": "user", "content": "hello there friend"}], "max_tokens": 300,
                "temperature": 0, "stream": True, "speculation": "off"}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)  # mid-stream
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")  # the in-flight request finished
        events = [json.loads(x[6:]) for x in (first.decode() + rest).split("\n\n") if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.wait(60) == 0
        with pytest.raises(OSError):  # nothing listens any more
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).request("GET", "/health")
        from adaptive.profile.overlay import load_replicas, overlay_path, remove_overlay

        saved = load_replicas(overlay_path(tiny_profile))  # online learning saved at shutdown, as its replica
        assert [ov.requests for ov in saved.values()] == [1] and next(iter(saved)).endswith(f"-{proc.pid}")
        remove_overlay(overlay_path(tiny_profile))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_profile_with_an_eagle_head_is_served_refining_it_unless_asked_not_to(monkeypatch, capsys, tiny_profile,
                                                                               tiny_model_dir, tmp_path):
    import shutil

    import adaptive.serve.app as app
    from adaptive.distill.heads import HeadConfig
    from adaptive.distill.trainer import distill_head
    from adaptive.models import load_model

    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    distill_head(load_model(str(tiny_model_dir), dtype="float32"), prof, {"math": ["what is 1 plus 2?"] * 2},
                 HeadConfig(layers=(1, 2, 4), steps=1, new_tokens=4, vocab=16, batch=1, window=8, warmup=1),
                 progress=False, race=False)
    served = []
    monkeypatch.setattr(app, "serve", lambda a, **kw: served.append(a))  # the app made, not run
    common = ["serve", "--profile", str(prof), "--model", str(tiny_model_dir), "--dtype", "float32"]
    for extra, refining in (([], True), (["--no-refine-heads"], False), (["--no-online"], False)):
        main(common + extra)
        err = capsys.readouterr().err
        assert ("refining the eagle head on the traffic served" in err) is refining, (extra, err)
        rt = served[-1].state.scheduler.runtime
        assert ("heads" in rt.listener_state()) is refining
        rt.close()
