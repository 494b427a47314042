"""The server on a free local port (tiny model), driven by the real `openai` client and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from adaptive.serve.app import create_app  # noqa: E402
from tests.conftest import TINY_DOMAINS  # noqa: E402
from tests.serve.conftest import Server, plain  # noqa: E402

KEY = "test-key"
PROMPTS = [TINY_DOMAINS["math"][-1], TINY_DOMAINS["chat"][-1], TINY_DOMAINS["code"][-1], "zz qq xx"]


@pytest.fixture(scope="module")
def server(runtime):
    s = Server(create_app(runtime, api_key=KEY, max_queue=4, max_body=4096))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def model_name(runtime):
    return runtime.profile.model.name


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if r.getheader("content-type", "").startswith("application/json")
                          else data.decode())
    finally:
        conn.close()


# -- the OpenAI client ---------------------------------------------------------------------------

def test_chat_completion_is_plain_greedy_decoding_with_usage(client, runtime):
    r = client.chat.completions.create(model=model_name(runtime), messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == model_name(runtime)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == plain(runtime, PROMPTS[0], 12)
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens >= 1
    ext = u.model_extra["adaptive"]
    assert ext["policy"] == "knn-ssd" and ext["drafter"] in ("pld", "ssd", "ar")
    assert ext["drafted"] >= ext["accepted"] >= 0 and 0.0 <= ext["acceptance_rate"] <= 1.0
    assert ext["mean_accepted_tokens"] >= 1.0


def test_streamed_chat_equals_the_whole_response(client, runtime):
    name, msgs = model_name(runtime), [{"role": "user", "content": PROMPTS[2]}]
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain(runtime, PROMPTS[2], 16)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert "adaptive" in chunks[-1].usage.model_extra


def test_text_completion_streamed_and_not(client, runtime):
    name = model_name(runtime)
    r = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == plain(runtime, PROMPTS[1], 10, chat=False)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True))
    assert text == r.choices[0].text


@pytest.mark.parametrize("speculation,drafter", [("off", "ar"), ("ssd-static", "ssd"), ("cascade", "cascade")])
def test_speculation_is_chosen_per_request_and_output_is_unchanged(client, runtime, speculation, drafter):
    r = client.chat.completions.create(model=model_name(runtime), messages=[{"role": "user", "content": PROMPTS[3]}],
                                       max_tokens=12, temperature=0, extra_body={"speculation": speculation})
    assert r.usage.model_extra["adaptive"]["drafter"] == drafter
    assert r.choices[0].message.content == plain(runtime, PROMPTS[3], 12)


def test_sampling_with_a_seed_repeats_without_speculation(client, runtime):
    # with speculation the bandit's draft lengths move between requests, and with them the random stream
    kw = dict(model=model_name(runtime), messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12,
              temperature=0.9, top_p=0.9, extra_body={"speculation": "off"})
    a, b, *others = [client.chat.completions.create(seed=s, **kw).choices[0].message.content
                     for s in (5, 5, 6, 7, 8)]
    assert a == b and any(o != a for o in others)  # the seed, and only it, fixes the sample


def test_concurrent_clients_are_batched_and_get_their_own_lossless_outputs(runtime):
    """Eight clients at once, streaming and not, speculating or not: decoded in shared steps (the
    mean batch is above one), every greedy output equal to plain decoding of its prompt alone."""
    s = Server(create_app(runtime, max_queue=16, max_batch=8))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i):
            prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 1
            kw = dict(model=model_name(runtime), messages=[{"role": "user", "content": prompt}],
                      max_tokens=10 + 3 * i, temperature=0,
                      extra_body={"speculation": ("auto", "off", "cascade")[i % 3]})
            if not stream:
                return client.chat.completions.create(**kw).choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(8)))
        assert got == [plain(runtime, PROMPTS[i % len(PROMPTS)], 10 + 3 * i) for i in range(8)]
        _, text = raw(s, "GET", "/metrics")
        steps = {k: float(v) for k, v in (line.split() for line in text.splitlines()
                                          if line.startswith("adaptive_batch_size_"))}
        assert steps["adaptive_batch_size_sum"] > steps["adaptive_batch_size_count"] > 0  # mean batch > 1
    finally:
        s.stop()


def test_the_server_batches_on_graphs_where_they_run_and_eagerly_elsewhere(runtime, tiny_profile, tiny_model_dir,
                                                                         cpu_step_graphs):
    """On the CPU the server's batch is the eager forward; with CUDA graphs (stood in for on the CPU) it
    lays its caches out in slabs and four clients at once step through batched graphs, every greedy
    output equal to plain decoding of its prompt alone."""
    from adaptive.models import load_model
    from adaptive.profile import load_profile
    from adaptive.runtime import AdaptiveRuntime
    from tests.helpers.profiles import with_domains

    cpu = create_app(runtime, max_batch=4)
    assert not cpu.state.scheduler.batched_graphs
    cpu.state.scheduler.close()
    lm = load_model(str(tiny_model_dir), dtype="float32")
    lm.__dict__["backbone"] = bb = cpu_step_graphs(lm.model)
    rt = AdaptiveRuntime(with_domains(load_profile(tiny_profile), lambda n: "pld" if n == "math" else "ssd"), lm,
                         seed=0, online=False)
    s = Server(create_app(rt, max_queue=8, max_batch=4))
    try:
        assert s.app.state.scheduler.batched_graphs and bb.graphs.slab_slots == 4
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i):
            kw = dict(model=model_name(rt), messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                      max_tokens=8 + 2 * i, temperature=0, extra_body={"speculation": ("auto", "off")[i % 2]})
            return client.chat.completions.create(**kw).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert got == [plain(runtime, PROMPTS[i % len(PROMPTS)], 8 + 2 * i) for i in range(4)]
        assert bb.graphs.batched_replays > 0
    finally:
        s.stop()
        rt.close()


def test_concurrent_clients_drafting_with_an_eagle_head_get_lossless_outputs(tiny_profile, tiny_model_dir, tmp_path):
    """A profile with an eagle head: every request's cache keeps the head's feature rows, batched steps
    (and the prefill chunks they carry) write each one's own, and greedy outputs equal plain decoding."""
    import shutil

    from adaptive.distill.heads import HeadConfig
    from adaptive.distill.refine import RefineSettings, attach_refiner
    from adaptive.distill.trainer import distill_head
    from adaptive.models import load_model
    from adaptive.runtime import AdaptiveRuntime

    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    lm = load_model(str(tiny_model_dir), dtype="float32")
    distill_head(lm, prof, TINY_DOMAINS, HeadConfig(layers=(1, 2, 4), steps=20, new_tokens=12, vocab=32, batch=2,
                                                    window=32), progress=False, race=False)
    rt = AdaptiveRuntime.from_profile(prof, dtype="float32", online=False, bandit=False)
    # the head refined on the traffic as it is served (a round every 2 requests of a domain, in the request's
    # thread here): the rounds show in /v1/adaptive/online and /metrics, and outputs stay plain decoding's
    refiner = attach_refiner(rt, RefineSettings(background=False, every=2, steps=2, min_held=1))
    s = Server(create_app(rt, max_queue=16, max_batch=8, prefill_chunk=8))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i):
            r = client.chat.completions.create(model=model_name(rt), max_tokens=8 + 2 * i, temperature=0,
                                               messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                               extra_body={"speculation": ("eagle", "off")[i % 2]})
            return r.choices[0].message.content, r.usage.model_extra["adaptive"]["drafter"]

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, range(6)))
        assert [g for g, _ in got] == [plain(rt, PROMPTS[i % len(PROMPTS)], 8 + 2 * i) for i in range(6)]
        assert [d for _, d in got] == ["eagle", "ar"] * 3
        rounds = len(refiner.history)
        assert rounds >= 1
        status, online = raw(s, "GET", "/v1/adaptive/online")
        assert status == 200 and online["heads"]["rounds"] == rounds
        assert f"adaptive_online_head_rounds_total {float(rounds)}" in raw(s, "GET", "/metrics")[1]
        with ThreadPoolExecutor(6) as pool:  # the same requests again, after the rounds
            again = list(pool.map(ask, range(6)))
        assert again == got
    finally:
        s.stop()
        rt.close()


def test_a_conversation_re_sent_each_turn_starts_from_its_cached_history_and_is_lossless(runtime):
    """Three turns, each re-sending the conversation so far (as chat clients do), and four clients
    sharing a system prompt at once: every reply equals plain decoding of its conversation, the
    later turns report the history's tokens as cached (OpenAI's field and ours), and /metrics counts
    the hits."""
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    def reference(messages, n):
        return Engine(runtime.lm).generate(messages, GenerationConfig(max_new_tokens=n)).text

    s = Server(create_app(runtime, max_queue=16, max_batch=4))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages, cached = [], []
        for turn in ("what is 4 plus 7?", "and 5 plus 9?", "zz qq"):
            messages.append({"role": "user", "content": turn})
            r = client.chat.completions.create(model=model_name(runtime), messages=messages, max_tokens=6,
                                               temperature=0)
            reply = r.choices[0].message.content
            assert reply == reference(messages, 6)
            details = r.usage.prompt_tokens_details
            assert details.cached_tokens == r.usage.model_extra["adaptive"]["cached_tokens"]
            cached.append((details.cached_tokens, r.usage.prompt_tokens))
            messages.append({"role": "assistant", "content": reply})
        assert cached[0][0] < cached[0][1] and all(c > 0 for c, _ in cached[1:])
        assert cached[2][0] > cached[1][0]  # the longer history

        system = {"role": "system", "content": "You answer in one word, and only about sums of two numbers."}

        def ask(i):
            msgs = [system, {"role": "user", "content": PROMPTS[i]}]
            r = client.chat.completions.create(model=model_name(runtime), messages=msgs, max_tokens=5, temperature=0)
            return r.choices[0].message.content == reference(msgs, 5)

        assert ask(0)  # the system prompt is cached now
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(ask, range(4)))
        _, text = raw(s, "GET", "/metrics")
        series = 'adaptive_prefix_cache_hits_total{engine="torch"}'
        hits = [line for line in text.splitlines() if line.startswith(series)]
        assert hits and float(hits[0].split()[-1]) >= 5
        assert 'adaptive_prefix_cache_budget_bytes{engine="torch"}' in text
    finally:
        s.stop()


def test_models_health_and_metrics(client, server, runtime):
    assert [m.id for m in client.models.list().data] == [model_name(runtime)]
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})
    status, text = raw(server, "GET", "/metrics")
    assert status == 200
    assert 'adaptive_requests_total{endpoint="chat_completions",status="200"}' in text
    assert "adaptive_generated_tokens_total " in text and "adaptive_accepted_tokens_total{" in text
    assert "adaptive_time_per_output_token_seconds_count" in text


def test_online_learning_state_endpoint(client, server, runtime):
    status, before = raw(server, "GET", "/v1/adaptive/online")
    assert status == 200 and before["enabled"] is True and before["persist"] is True
    client.chat.completions.create(model=model_name(runtime), messages=[{"role": "user", "content": PROMPTS[1]}],
                                   max_tokens=8, temperature=0)
    _, after = raw(server, "GET", "/v1/adaptive/online")
    assert after["requests"] == before["requests"] + 1 and after["tables"]
    assert raw(server, "GET", "/v1/adaptive/online", headers={"Authorization": "Bearer nope"})[0] == 401


# -- refusals: OpenAI-style 4xx, never a 500 ---------------------------------------------------------

@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"\xff\xfe", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"messages": []}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}).encode(), 400,
     "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(), 400,
     "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi " * 1000}]}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": None, "top_k": 3}).encode(),
     400, "top_k"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (b"x" * 5000, 413, None),
])
def test_bad_requests_are_4xx_with_an_openai_error_body(server, body, status, param):
    got, err = raw(server, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param


def test_openai_client_sees_the_errors(client, runtime):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=model_name(runtime), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_paths_methods_and_auth(server):
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    assert raw(server, "GET", "/v1/chat/completions")[0] == 405
    status, err = raw(server, "POST", "/v1/completions", b"{}", {"Authorization": "Bearer nope"})
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")  # no key needed
    assert conn.getresponse().status == 200
    conn.close()


def test_a_client_that_leaves_mid_stream_frees_the_model(server, runtime, client):
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    body = json.dumps({"model": model_name(runtime), "messages": msgs, "max_tokens": runtime.room(runtime.encode(msgs)),
                       "temperature": 0, "stream": True, "speculation": "off"}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while b"data: " not in seen:  # the stream has started
        part = sock.recv(4096)
        assert part, seen
        seen += part
    sock.close()
    scheduler, metrics = server.app.state.scheduler, server.app.state.metrics
    deadline = time.time() + 20
    while scheduler.busy:
        assert time.time() < deadline, "the abandoned request kept the model"
        time.sleep(0.05)
    assert metrics.value("cancelled_requests_total") >= 1  # stopped, not run to its end
    r = client.chat.completions.create(model=model_name(runtime), messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.content == plain(runtime, PROMPTS[1], 4)


def test_a_full_queue_is_429(runtime):
    """One request decoding (max_batch 1) and one waiting (max_queue 1): a third concurrent one is refused."""
    s = Server(create_app(runtime, max_queue=1, max_batch=1))
    try:
        body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 400,
                           "temperature": 0}).encode()
        with ThreadPoolExecutor(6) as pool:
            statuses = sorted(f.result()[0] for f in [pool.submit(raw, s, "POST", "/v1/chat/completions", body)
                                                      for _ in range(6)])
        assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) <= {200, 429}
    finally:
        s.stop()
