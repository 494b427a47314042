"""The OpenAI wire format, on plain data: request bodies in, typed requests out; results out as bodies.

Pure functions, no server: :func:`parse_request` validates a decoded JSON body of
``POST /v1/chat/completions`` or ``POST /v1/completions`` into a frozen :class:`ServeRequest`, or
raises :class:`RequestError` (an HTTP status and an OpenAI-style error body). The response
builders (:func:`completion_body`, :func:`chunk_body`, :func:`usage_body`) shape what the runtime
produced.

Fields honoured: ``model``, ``messages`` (chat) / ``prompt`` (completions), ``max_tokens`` (and
``max_completion_tokens``, chat), ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
``stream_options.include_usage``, ``n`` (1 only) and the extension ``speculation``. Accepted and
ignored (no effect on decoding): ``user``, ``metadata``, ``store``. Accepted only at their neutral
value (anything else is refused: we do not implement it): ``frequency_penalty`` and
``presence_penalty`` 0, ``logprobs`` false, ``echo`` false, ``best_of`` 1, ``logit_bias`` empty,
``tools`` / ``tool_choice`` absent. Any other field is a 400 naming it.

The parser is total: :func:`decode_body` turns any byte string into a JSON value or a 400 (not
UTF-8, not JSON, nested deeper than :data:`MAX_DEPTH`, an integer of more than
:data:`MAX_INT_DIGITS` digits, a string that is not valid Unicode such as a lone surrogate), and
:func:`parse_request` turns any JSON value into a :class:`ServeRequest` or a :class:`RequestError`
(the randomized-body test in ``tests/serve/test_fuzz.py`` holds it to that).

Worked example::

    >>> r = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
    ...                            "max_tokens": 8, "speculation": "off"}, served_model="m")
    >>> r.max_tokens, r.policy, r.stream
    (8, 'ar', False)
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from adaptive.errors import AdaptiveError
from adaptive.runtime.policies import POLICIES, ROUTED_POLICY

KINDS = ("chat", "completion")
# speculation value -> the runtime's routing policy: "auto" routes with the profile's decision,
# "off" decodes plainly, any policy name forces that policy
SPECULATION = {"auto": ROUTED_POLICY, "off": "ar", **{name: name for name in POLICIES}}
MAX_STOP = 4  # as OpenAI: at most four stop sequences
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n",
           "speculation", "user", "metadata", "store", "frequency_penalty", "presence_penalty", "logit_bias"}
_FIELDS = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"},
    "completion": _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
}
# field -> the only values accepted (we implement nothing else)
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, None, 0),
            "echo": (False,), "best_of": (1,), "logit_bias": ({}, None), "tools": (None, []),
            "tool_choice": (None, "none"), "top_logprobs": (None, 0), "suffix": (None, "")}
_ROLES = ("system", "user", "assistant", "developer")
MAX_DEPTH = 16  # nesting of arrays and objects in a request body (a chat request needs 4)
MAX_INT_DIGITS = 40  # digits of an integer in a request body (a seed needs 19)


class RequestError(AdaptiveError):
    """A request the server refuses: ``status`` (4xx), an OpenAI-style ``type`` and ``code``, the
    offending ``param``. :meth:`body` is the JSON body OpenAI clients parse."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def internal_error(exc: Exception) -> RequestError:
    """The 500 a client sees for a bug: the exception's type only (the traceback goes to the log)."""
    return RequestError(f"internal error ({type(exc).__name__})", status=500, type="server_error")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(f"the request body holds an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def _check_value(value) -> None:
    """Refuse what the body's JSON may hold but no request needs: deep nesting, unencodable strings
    (a lone surrogate from a ``\\ud800`` escape). Iterative: a deep body cannot exhaust the stack."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body holds a string that is not valid Unicode "
                                   "(an unpaired surrogate escape)") from None
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise RequestError(f"the request body is nested deeper than {MAX_DEPTH} levels")
            items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
            for k, x in items:
                if k is not None:
                    todo.append((k, depth + 1))
                todo.append((x, depth + 1))


def decode_body(raw: bytes):
    """A request body's JSON value, or a 400 :class:`RequestError` saying why it is not one.

    >>> decode_body(b'{"max_tokens": 8}')
    {'max_tokens': 8}
    >>> decode_body(b"[" * 100 + b"]" * 100)
    Traceback (most recent call last):
    ...
    adaptive.serve.wire.RequestError: the request body is nested deeper than 16 levels
    """
    try:
        value = json.loads(raw, parse_int=_bounded_int, parse_constant=_no_constant)
    except RequestError:
        raise
    except RecursionError:  # the C parser's own bound, far beyond ours
        raise RequestError(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"the request body is not valid JSON ({exc})") from None
    _check_value(value)
    return value


def _no_constant(name: str):
    raise RequestError(f"the request body holds {name}, which JSON does not allow")


@dataclass(frozen=True)
class ServeRequest:
    """One validated request. ``prompt``: the completion's text, or the chat's messages (a tuple of
    ``{"role", "content"}`` dicts); ``max_tokens``: as asked, ``None`` meaning as many as the context
    leaves (capped by the server's default), checked against its limits (at least 1, at most what
    the prompt leaves of the context) where the prompt's length is known, at admission
    (:meth:`~adaptive.serve.scheduler.Scheduler.admit`); ``max_tokens_param``: the body field it came
    from (what a refusal of it names); ``policy``: the runtime's routing policy (from
    ``speculation``); ``speculation``: the value asked for."""

    kind: str
    prompt: str | tuple[dict, ...]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    speculation: str = "auto"
    model: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.speculation not in SPECULATION:
            raise ValueError(f"unknown speculation {self.speculation!r}")

    @property
    def policy(self) -> str:
        return SPECULATION[self.speculation]

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    @property
    def prompt_param(self) -> str:
        """The body field that holds the prompt (what a refusal of the prompt names)."""
        return "messages" if self.chat else "prompt"

    def runtime_prompt(self) -> tuple[str | list[dict], bool | None]:
        """``(prompt, chat)`` as :meth:`AdaptiveRuntime.encode` and ``stream`` take them: chat
        messages through the template, a completion's prompt as raw text."""
        return (list(self.prompt), None) if self.chat else (self.prompt, False)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise RequestError(f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be between {lo:g} and {hi:g}, not {v!r}", param=name)
    return float(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer", param=name)
    if lo is not None and v < lo:
        raise RequestError(f"'{name}' must be at least {lo}, not {v}", param=name)
    if hi is not None and v > hi:
        raise RequestError(f"'{name}' must be at most {hi}, not {v}", param=name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false", param=name)
    return v


def _messages(v) -> tuple[dict, ...]:
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object with 'role' and 'content'", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(_ROLES)}", param=f"{where}.role")
        if isinstance(content, list):  # OpenAI's content parts: only text parts are meaningful here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"'{where}.content' parts must all be text parts", param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise RequestError("'messages' hold no text", param="messages")
    return tuple(out)


def _prompt(v) -> str:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if not isinstance(v, str):
        raise RequestError("'prompt' must be a string (or an array of exactly one string)", param="prompt")
    if not v.strip():
        raise RequestError("'prompt' is empty", param="prompt")
    return v


def _stop(v) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOP:
        raise RequestError(f"'stop' must be a non-empty string or an array of up to {MAX_STOP} of them",
                           param="stop")
    return tuple(v)


def parse_request(kind: str, body, served_model: str) -> ServeRequest:
    """Validate a decoded JSON body; :class:`RequestError` (400, or 404 for an unknown model) says what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise RequestError(f"unrecognized request argument{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
                           param=unknown[0])
    for name, allowed in _NEUTRAL.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"'{name}' is not supported by this server (only {allowed[0]!r})", param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    if model is not None and model != served_model:
        raise RequestError(f"the model {model!r} does not exist; this server serves {served_model!r}",
                           status=404, param="model", code="model_not_found")
    n = _int(body, "n", lo=1)
    if n not in (None, 1):
        raise RequestError("only 'n': 1 is supported", param="n")
    if kind == "chat":
        if "messages" not in body:
            raise RequestError("'messages' is required", param="messages")
        prompt = _messages(body["messages"])
        max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        prompt = _prompt(body["prompt"])
        max_tokens_param = "max_tokens"
    max_tokens = _int(body, max_tokens_param)  # an integer; its limits are the scheduler's (Scheduler.admit)
    spec = body.get("speculation", "auto")
    if not isinstance(spec, str) or spec not in SPECULATION:
        raise RequestError(f"'speculation' must be one of {', '.join(SPECULATION)}", param="speculation")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}):
        raise RequestError("'stream_options' may only hold 'include_usage'", param="stream_options")
    stream = _bool(body, "stream")
    include_usage = _bool(opts, "include_usage") if opts else False
    if include_usage and not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    return ServeRequest(
        kind, prompt, max_tokens, max_tokens_param=max_tokens_param,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        stop=_stop(body.get("stop")),
        seed=_int(body, "seed", lo=-(2**63), hi=2**63 - 1),  # what a torch.Generator takes
        stream=stream, include_usage=include_usage, speculation=spec, model=served_model,
    )


# -- responses -------------------------------------------------------------------------------------

def usage_body(prompt_tokens: int, completion_tokens: int, extension: dict | None = None,
               cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage`` fields, ``prompt_tokens_details.cached_tokens`` (the prompt tokens a prefix
    cache held, as OpenAI defines it: counted in ``prompt_tokens`` too) included, plus ``adaptive``:
    how the request was decoded (see :func:`extension`)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if extension is not None:
        usage["adaptive"] = extension
    return usage


def extension(result) -> dict:
    """The ``usage.adaptive`` object of a :class:`~adaptive.runtime.RuntimeResult`: the routed
    ``domain`` (``None``: out-of-domain), the ``applied`` record, the ``policy``, the ``drafter``
    that decoded, the ``skip`` set it drafted with (text form, ``None`` without a layer-skip level),
    ``drafted``/``accepted`` tokens, ``acceptance_rate`` and ``mean_accepted_tokens``
    (tokens per verification step, the target's own included), ``cached_tokens`` (prompt tokens
    started from the prefix cache), ``seconds`` (the runtime's time on it: prefill and decoding, without
    the queue and HTTP), the ``engine`` that decoded it and, from a two-engine profile,
    ``engine_choice`` (why: each engine's expected seconds)."""
    s = result.stats
    out = {"domain": result.domain, "applied": result.applied, "policy": result.policy,
           "drafter": result.decision, "skip": result.skip.to_text() if result.skip is not None else None,
           "drafted": s.drafted, "accepted": s.accepted, "cached_tokens": s.cached_tokens,
           "seconds": round(s.total_time, 4),
           "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_tokens": round(s.mean_accepted_tokens, 4),
           "engine": result.engine or None}
    if result.engine_choice is not None:
        out["engine_choice"] = result.engine_choice
    return out


def completion_body(req: ServeRequest, model: str, text: str, finish_reason: str, usage: dict) -> dict:
    """A whole (non-streamed) response: ``chat.completion`` or ``text_completion``."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": req.response_id, "object": "chat.completion" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": [choice], "usage": usage}


def chunk_body(req: ServeRequest, model: str, text: str | None, finish_reason: str | None = None,
               usage: dict | None = None, first: bool = False) -> dict:
    """One streamed chunk. ``text=None`` with ``usage``: the usage-only last chunk (``choices`` empty)."""
    if text is None and usage is not None:
        choices = []
    elif req.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    body = {"id": req.response_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": choices}
    if usage is not None or req.include_usage:
        body["usage"] = usage
    return body
