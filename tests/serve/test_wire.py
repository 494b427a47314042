"""The OpenAI wire format on literal bodies: what is accepted, what is refused and how."""

import pytest

from adaptive.serve.wire import (
    SPECULATION,
    RequestError,
    ServeRequest,
    chunk_body,
    completion_body,
    extension,
    parse_request,
)

MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_request("chat", {"model": "m", "messages": MSG, **fields}, served_model="m")


def refused(kind, body, status=400):
    with pytest.raises(RequestError) as info:
        parse_request(kind, body, served_model="m")
    assert info.value.status == status
    return info.value


def test_a_minimal_chat_request_takes_openai_defaults():
    r = chat()
    assert (r.kind, r.prompt, r.max_tokens, r.temperature, r.top_p, r.stop, r.seed, r.stream) == \
        ("chat", ({"role": "user", "content": "Hi"},), None, 1.0, 1.0, (), None, False)
    assert r.policy == "knn-ssd" and r.response_id.startswith("chatcmpl-")


def test_fields_are_honoured():
    r = chat(max_tokens=7, temperature=0, top_p=0.5, stop="\n", seed=3, stream=True,
             stream_options={"include_usage": True}, speculation="off", n=1, user="u")
    assert (r.max_tokens, r.temperature, r.top_p, r.stop, r.seed, r.stream, r.include_usage, r.policy) == \
        (7, 0.0, 0.5, ("\n",), 3, True, True, "ar")
    assert chat(max_completion_tokens=5, max_tokens=9).max_tokens == 5  # the newer name wins
    # the limits (at least 1, at most the context's room) are checked at admission, which names the field
    assert (chat(max_tokens=0).max_tokens, chat(max_tokens=0).max_tokens_param) == (0, "max_tokens")
    assert chat(max_completion_tokens=-1, max_tokens=9).max_tokens_param == "max_completion_tokens"


@pytest.mark.parametrize("value,policy", [("auto", "knn-ssd"), ("off", "ar"), ("cascade", "cascade"),
                                          ("ssd-static", "ssd-static")])
def test_speculation_picks_the_policy(value, policy):
    assert chat(speculation=value).policy == policy


def test_content_parts_and_developer_role():
    r = chat(messages=[{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert r.prompt == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"})


def test_a_completion_prompt_may_be_a_list_of_one():
    r = parse_request("completion", {"prompt": ["def f():"], "max_tokens": 3}, served_model="m")
    assert (r.kind, r.prompt, r.chat, r.model) == ("completion", "def f():", False, "m")
    assert r.response_id.startswith("cmpl-")
    assert (r.prompt_param, r.runtime_prompt()) == ("prompt", ("def f():", False))  # raw text
    assert (chat().prompt_param, chat().runtime_prompt()) == ("messages", (MSG, None))  # the template


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
    ({"seed": "1"}, "seed"), ({"seed": 2**64}, "seed"), ({"stream": "yes"}, "stream"), ({"n": 2}, "n"),
    ({"speculation": "warp"}, "speculation"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logprobs": True}, "logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ({"messages": []}, "messages"), ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": ["Hi"]}, "messages[0]"), ({"temprature": 0}, "temprature"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    err = refused("chat", {"model": "m", "messages": MSG, **fields})
    assert err.param == param
    body = err.body()["error"]
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]


def test_missing_prompt_unknown_model_and_non_objects():
    assert refused("chat", {"model": "m"}).param == "messages"
    assert refused("completion", {"model": "m"}).param == "prompt"
    assert refused("completion", {"prompt": ""}).param == "prompt"
    assert refused("completion", {"prompt": ["a", "b"]}).param == "prompt"
    assert refused("completion", {"prompt": "x", "echo": True}).param == "echo"
    err = refused("chat", {"model": "gpt-4", "messages": MSG}, status=404)
    assert err.code == "model_not_found" and "'m'" in str(err)
    refused("chat", ["not", "an", "object"])
    refused("chat", None)


def test_serve_request_rejects_impossible_values():
    with pytest.raises(ValueError):
        ServeRequest("embedding", "x")
    with pytest.raises(ValueError):
        ServeRequest("chat", (), speculation="sometimes")
    assert set(SPECULATION) >= {"auto", "off", "knn-ssd", "ar", "cascade"}


def test_response_bodies():
    r = ServeRequest("chat", tuple(MSG), id="abc", created=7)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert completion_body(r, "m", "Hello", "stop", usage) == {
        "id": "chatcmpl-abc", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                     "finish_reason": "stop"}], "usage": usage}
    assert chunk_body(r, "m", "He", first=True) == {
        "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"}, "logprobs": None,
                     "finish_reason": None}]}
    assert chunk_body(r, "m", "", "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                            "finish_reason": "length"}
    c = ServeRequest("completion", "x", id="abc", created=7, stream=True, include_usage=True)
    assert chunk_body(c, "m", "lo")["choices"] == [{"index": 0, "text": "lo", "logprobs": None, "finish_reason": None}]
    assert chunk_body(c, "m", "lo")["usage"] is None  # include_usage: every chunk has the key, null until the last
    last = chunk_body(c, "m", None, usage=usage)
    assert last["choices"] == [] and last["usage"] == usage and last["object"] == "text_completion"


def test_the_usage_extension_gives_the_skip_set_as_text():
    from types import SimpleNamespace

    from adaptive.engine.loop import GenerationStats
    from adaptive.engine.skip import SkipSet

    stats = GenerationStats(tokens=4, steps=2, drafted=4, accepted=3, total_time=0.123456)
    r = SimpleNamespace(stats=stats, domain="maths", applied="maths", policy="knn-ssd", decision="ssd",
                        skip=SkipSet((1, 2), (3,)), engine="torch", engine_choice=None)
    assert extension(r) == {"domain": "maths", "applied": "maths", "policy": "knn-ssd", "drafter": "ssd",
                            "skip": "attn=1-2;mlp=3", "drafted": 4, "accepted": 3, "cached_tokens": 0,
                            "seconds": 0.1235, "acceptance_rate": 0.75, "mean_accepted_tokens": 2.5, "engine": "torch"}
    assert extension(SimpleNamespace(**{**vars(r), "decision": "pld", "skip": None}))["skip"] is None
    why = {"engine": "torch", "reason": "expected 1.00 s on torch, 2.00 s on llama.cpp"}
    assert extension(SimpleNamespace(**{**vars(r), "engine_choice": why}))["engine_choice"] == why


def test_usage_counts_cached_prompt_tokens_as_openai_defines_them():
    from adaptive.serve.wire import usage_body

    assert usage_body(10, 4, None, cached_tokens=6) == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,  # cached tokens stay in prompt_tokens
        "prompt_tokens_details": {"cached_tokens": 6}}
    assert usage_body(3, 1, {"engine": "torch"})["prompt_tokens_details"] == {"cached_tokens": 0}
