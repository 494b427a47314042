"""Text in, text out: prompt encoding (chat template), EOS and stop strings, streaming, results.

One request is :meth:`Engine.start` (encode is the caller's; the prefill, optionally pooling the
prompt's embedding) then :meth:`Engine.decode` (the decode steps with a drafter, turned into text
deltas and a :class:`GenerationResult`); :meth:`Engine.stream` does both. Several requests decode
together with :meth:`Engine.begin` (a :class:`Decoding` per started session) and :meth:`Engine.step`
(one verification forward for all of them). Text is detokenized
incrementally (:class:`TextDecoder`) and stop strings are looked for only where a new token can
have completed one, so a long generation costs linear time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.loop import (
    Acceptor,
    ChunkedPrefill,
    GenerationStats,
    Lane,
    Prefill,
    as_poolings,
    default_acceptor,
    new_cache,
    new_generator,
    step,
)
from adaptive.engine.prefix import Match
from adaptive.engine.protocol import DecodeState, DraftChoice, Drafter, DraftLengthPolicy, FixedDraftLength
from adaptive.errors import ConfigError

Messages = Sequence[dict]
REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


@dataclass
class GenerationResult:
    """``token_ids`` are the generated ids (the EOS id included when generation ended on it).
    ``drafter``: the drafter kind that decoded it (:data:`adaptive.drafters.factory.DRAFTERS`; ``ar``
    for none); ``drafter_info``: that drafter's :meth:`~adaptive.engine.protocol.Drafter.describe`."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    stats: GenerationStats
    drafter: str = "ar"
    drafter_info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON: ``drafter`` is the drafter's description (``{"name": "ar"}`` when none drafted)."""
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "drafter": self.drafter_info or {"name": self.drafter}, "stats": self.stats.to_dict()}


def eos_ids(model, tokenizer) -> set[int]:
    """The EOS ids a Hugging Face ``model`` (its generation config and config; ``None``: none) and its
    ``tokenizer`` name."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, (list, tuple)):
            ids.update(int(v) for v in val)
    return ids


class TextDecoder:
    """Incremental detokenization: token ids in, text out, decoding only a short window per update.

    ``committed`` text only grows. Each update decodes the tokens since the start of the previous
    update's window (a lookback, so that tokenizers which render a token differently at the start
    of a text, such as SentencePiece's leading space, are seen in context) and commits the part
    beyond that lookback's own text, unless it ends in U+FFFD: an incomplete UTF-8 sequence (a
    byte-level BPE token holding part of a character) waits, as ``pending``, for the tokens that
    complete it. ``committed + pending`` equals decoding all ids at once for byte-level and
    character tokenizers.

    Example (a character tokenizer): ``add([h, i])`` -> committed ``"hi"``; ``add([!])`` decodes
    ``[h, i, !]`` against ``[h, i]`` -> committed ``"hi!"``.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are committed
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._pieces: list[str] = []
        self.committed_len = 0
        self.pending = ""

    def add(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        new = self._decode(self.ids[self._prefix:])
        if len(new) > len(self._prefix_text) and not new.endswith(REPLACEMENT):
            delta = new[len(self._prefix_text):]
            self._pieces.append(delta)
            self.committed_len += len(delta)
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix:self._read])
            self.pending = ""
        else:
            self.pending = new[len(self._prefix_text):] if new.startswith(self._prefix_text) else ""

    @property
    def length(self) -> int:
        """Length of ``committed + pending``."""
        return self.committed_len + len(self.pending)

    def text_from(self, start: int) -> str:
        """``(committed + pending)[start:]``, joining only the pieces it needs."""
        tail, n = [], self.committed_len
        for piece in reversed(self._pieces):
            if n <= start:
                break
            n -= len(piece)
            tail.append(piece)
        return "".join(reversed(tail))[max(start - n, 0):] + self.pending[max(start - self.committed_len, 0):]

    def text(self) -> str:
        return self.text_from(0)


class TextStream:
    """Turns a request's generated ids into text deltas, watching EOS, stop strings and the length.

    Token by token, exactly as plain decoding would see them: generation ends on an EOS id (kept in
    the ids; unless ``ignore_eos``), on the token that completes a stop string (the text is cut
    before it), or at ``max_new_tokens``. A stop string is searched for only in the tail that can
    hold one completed by the new token: from ``longest stop - 1`` characters before where the
    text stood before it. Deltas hold back ``longest stop - 1`` characters (a stop string is never
    emitted) and a trailing U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, decode: Callable[[list[int]], str], eos: set[int], cfg: GenerationConfig):
        self.cfg = cfg
        self.eos = eos
        self.ids: list[int] = []
        self.text = TextDecoder(decode)
        self.finish: str | None = None
        self.cut: int | None = None  # where the text ends when a stop string ended it
        self._longest = max((len(s) for s in cfg.stop), default=1)
        self._emitted = 0

    def push(self, chunk: list[int]) -> str:
        """Take one step's tokens; return the text that can be shown now ('' for none).

        Once :attr:`finish` is set the rest of the text is returned and later tokens are ignored.
        """
        if self.finish:
            return ""
        cfg, text = self.cfg, self.text
        batch: list[int] = []  # text tokens not yet given to the decoder (no stop strings to watch)
        for t in chunk:
            self.ids.append(t)
            if t in self.eos and not cfg.ignore_eos:
                self.finish = "eos"
            elif cfg.stop and t not in self.eos:
                before = text.committed_len  # the text up to here held no stop string
                text.add([t])
                start = max(before - (self._longest - 1), 0)
                window = text.text_from(start)
                found = [i for i in (window.find(s) for s in cfg.stop) if i >= 0]
                if found:
                    self.finish, self.cut = "stop", start + min(found)
            elif t not in self.eos:
                batch.append(t)
            if not self.finish and len(self.ids) >= cfg.max_new_tokens:
                self.finish = "length"
            if self.finish:
                break
        if batch:
            text.add(batch)
        if self.finish:
            end = self.cut if self.cut is not None else text.length
        else:
            end = text.length - (self._longest - 1)
        if end <= self._emitted:
            return ""
        delta = text.text_from(self._emitted)[: end - self._emitted]
        if not self.finish:
            delta = delta.rstrip(REPLACEMENT)  # an incomplete UTF-8 sequence waits for the next token
        self._emitted += len(delta)
        return delta

    def final_text(self) -> str:
        full = self.text.text()
        return full[: self.cut] if self.cut is not None else full


@dataclass(eq=False)
class Session:
    """A prefilled request, ready for :meth:`Engine.decode` (once): its ids, config, the loop's
    :class:`DecodeState` (the first token pending), the :class:`Prefill` (``pooled`` embedding when
    asked for) and the statistics so far; ``started``: when the request began (``perf_counter``)."""

    prompt_ids: list[int]
    config: GenerationConfig
    state: DecodeState
    prefill: Prefill
    stats: GenerationStats
    started: float
    decoded: bool = False
    keep: bool = False  # once decoded, its keys go to the backbone's prefix cache

    @property
    def pooled(self) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """``[hidden]`` the prompt's embedding (a tuple of them when started with a tuple of poolings;
        ``None`` unless started with ``pool``)."""
        return self.prefill.pooled


@dataclass(eq=False)
class Prefilling:
    """A request being prefilled a chunk at a time (:meth:`Engine.prefilling`)."""

    task: ChunkedPrefill
    started: float
    keep: bool = False  # the session's keys go to the prefix cache once decoded
    cached: int = 0  # prompt tokens started from the prefix cache

    @property
    def remaining(self) -> int:
        """Prompt tokens not prefilled yet."""
        return self.task.remaining

    @property
    def config(self) -> GenerationConfig:
        """The request's :class:`GenerationConfig`."""
        return self.task.cfg

    @property
    def can_ride(self) -> bool:
        """Whether a decoding step can carry the next chunk (:meth:`Engine.step`'s ``riders``)."""
        return self.task.can_ride

    def advance(self, tokens: int | None = None) -> Session | None:
        """Prefill the next chunk (or ``tokens``); the :class:`Session` once the prompt is all in the cache."""
        pre = self.task.advance(tokens)
        if pre is None:
            return None
        t, cfg = self.task, self.task.cfg
        stats = GenerationStats(prompt_tokens=len(t.prompt_ids), prefill_time=pre.time, cached_tokens=self.cached)
        state = DecodeState(t.backbone, t.cache, list(t.prompt_ids) + [pre.first], cfg, t.generator)
        return Session(list(t.prompt_ids), cfg, state, pre, stats, self.started, keep=self.keep)


@dataclass(eq=False)
class Decoding:
    """A session being decoded (:meth:`Engine.begin`): the loop's :class:`~adaptive.engine.loop.Lane`
    and the :class:`TextStream` turning its tokens into text. ``first``: the text delta of the
    prefill's token. :meth:`Engine.step` advances it (with others), :meth:`result` ends it."""

    session: Session
    lane: Lane
    out: TextStream
    first: str = field(init=False)

    def __post_init__(self):
        self.first = self.out.push([self.session.prefill.first])

    @property
    def done(self) -> bool:
        """EOS, a stop string or ``max_new_tokens`` ended it."""
        return self.out.finish is not None or self.lane.done

    def result(self) -> GenerationResult:
        """The :class:`GenerationResult` so far (the whole generation once :attr:`done`)."""
        stats, drafter = self.session.stats, self.lane.drafter
        stats.tokens = len(self.out.ids)
        stats.total_time = time.perf_counter() - self.session.started
        return GenerationResult(self.out.final_text(), self.out.ids, self.out.finish or "length", stats,
                                drafter.name if drafter is not None else "ar",
                                drafter.describe() if drafter is not None else {})


class Engine:
    """Decodes prompts with a loaded model (:class:`adaptive.models.LoadedModel`).

    ``generate(prompt, config, drafter=...)`` returns a :class:`GenerationResult` (no drafter: plain
    decoding; drafters come from :func:`adaptive.drafters.factory.build_drafter`); ``stream(...)``
    yields text deltas and finally the result. ``start`` and ``decode`` are the two halves, for a
    caller that decides what to draft with after the prefill (the runtime routes on ``pooled``);
    ``begin`` and ``step`` decode several started sessions together (a server's batch).
    """

    def __init__(self, lm):
        self.lm = lm
        self.backbone = lm.backbone
        self.tokenizer = lm.tokenizer
        self.eos = lm.eos_ids()
        self._decode_text = lm.text_decoder()  # ids -> text, special tokens left out (streaming's)

    def encode(self, prompt: str | Messages, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string or chat messages (``[{"role": ..., "content": ...}]``).

        ``chat=None`` applies the tokenizer's chat template when it has one; ``chat=False`` encodes
        a string as raw text.
        """
        tok = self.tokenizer
        has_template = bool(getattr(tok, "chat_template", None))
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty")
            if chat is False or (chat is None and not has_template):
                return list(tok(prompt)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ConfigError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        if not has_template:
            raise ConfigError("this model's tokenizer has no chat template: pass a string prompt")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def text(self, ids: Sequence[int]) -> str:
        """The text of generated ids, as results show it (EOS ids and special tokens left out)."""
        return self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=True)

    def start(self, prompt_ids: list[int], config: GenerationConfig | None = None,
              pool: bool | Pooling | tuple[Pooling, ...] = False, prefix: bool = False) -> Session:
        """Prefill ``prompt_ids`` (with the prompt's embedding when ``pool``: ``True`` for the final mean,
        a :class:`~adaptive.engine.config.Pooling`, or a tuple of them, all from the one prefill): a
        :class:`Session` to decode. ``prefix``: use the backbone's prefix cache (see :meth:`prefilling`)."""
        session = self.prefilling(prompt_ids, config, pool, prefix=prefix).advance()
        assert session is not None
        return session

    def prefilling(self, prompt_ids: list[int], config: GenerationConfig | None = None,
                   pool: bool | Pooling | tuple[Pooling, ...] = False, chunk: int = 0,
                   prefix: bool = False) -> Prefilling:
        """:meth:`start` a chunk at a time: a :class:`Prefilling` whose :meth:`~Prefilling.advance`
        prefills ``chunk`` more prompt tokens (``0``: all of them) and returns the :class:`Session`
        after the last chunk (``None`` before). The cache is allocated now.

        ``prefix``: start from the longest prompt prefix the backbone's prefix cache holds
        (:mod:`adaptive.engine.prefix`; its ``stats.cached_tokens``), and keep this request's keys there
        once it is decoded. Not where a ``mean`` pooling is asked for (it needs every prompt
        position's hidden state), nor while the cache has no budget. Measurements leave it off: a
        prompt decoded twice would be prefilled once."""
        cfg = config or GenerationConfig()
        t0 = time.perf_counter()
        gen = new_generator(cfg, self.backbone.device)
        store = self.backbone.prefixes
        keep = prefix and store.enabled and not any(p.mode == "mean" for p in as_poolings(pool))
        match = store.lookup(prompt_ids) if keep else Match(None, 0)
        try:
            cache = new_cache(self.backbone, len(prompt_ids), cfg, shared=match.tokens)
            t_restore = time.perf_counter()
            cached = self.backbone.restore_prefix(match.entry, cache, match.tokens) if match.entry is not None else 0
        finally:
            if keep:
                store.unpin(match.entry)
        store.restored(cached)
        cache.length = cached
        # the copy of a cached prefix counts as prefill time: it is what the request waits for instead
        task = ChunkedPrefill(self.backbone, list(prompt_ids), cache, cfg, gen, pool, chunk, position=cached,
                              elapsed=time.perf_counter() - t_restore if cached else 0.0)
        return Prefilling(task, t0, keep=keep, cached=cached)

    def _kept(self, decoding: Decoding) -> None:
        """A finished decoding's keys to the prefix cache (once; only a session started with ``prefix``)."""
        session = decoding.session
        if session.keep and decoding.done:
            session.keep = False
            self.backbone.keep_prefix(session.state.cache, session.state.tokens)

    def begin(self, session: Session, drafter: Drafter | None = None, policy: DraftLengthPolicy | None = None,
              acceptor: Acceptor = default_acceptor) -> Decoding:
        """A started session made ready to step (once per session): a :class:`Decoding`, whose
        ``first`` delta is the prefill token's text. ``drafter`` drafts with ``policy`` choosing each
        step's draft length (default: ``config.draft_len`` every step); no drafter decodes plainly."""
        if session.decoded:
            raise ConfigError("a session is decoded once; start another")
        session.decoded = True
        cfg = session.config
        lane = Lane(session.state, drafter, policy or FixedDraftLength(cfg.draft_len), cfg, session.stats, acceptor)
        decoding = Decoding(session, lane, TextStream(self._decode_text, self.eos, cfg))
        self._kept(decoding)
        return decoding

    def step(self, decodings: Sequence[Decoding], choices: Sequence[DraftChoice | None] | None = None,
             riders: Sequence[Prefilling] = ()) -> list[str]:
        """One verification step of each unfinished decoding, all verified in one forward
        (:func:`adaptive.engine.loop.step`; ``choices``: the batch's draft choices, see there), which
        also carries the next chunk of each of ``riders`` (prefills whose ``can_ride``); returns each
        decoding's text delta ('' for none yet)."""
        if any(d.done for d in decodings):
            raise ConfigError("a finished decoding cannot step")
        chunks = step(self.backbone, [d.lane for d in decodings], choices, [p.task for p in riders])
        deltas = [d.out.push(c) for d, c in zip(decodings, chunks)]
        for d in decodings:
            self._kept(d)
        return deltas

    def decode(self, session: Session, drafter: Drafter | None = None, policy: DraftLengthPolicy | None = None,
               acceptor: Acceptor = default_acceptor) -> Iterator[str | GenerationResult]:
        """Decode a started session: yield text deltas as tokens are accepted, then the :class:`GenerationResult`.

        :meth:`begin`, then :meth:`step` on this one decoding until it is done.
        """
        d = self.begin(session, drafter, policy, acceptor)
        if d.first:
            yield d.first
        while not d.done:
            delta = self.step([d])[0]
            if delta:
                yield delta
        yield d.result()

    def stream(
        self,
        prompt: str | Messages | list[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        chat: bool | None = None,
        acceptor: Acceptor = default_acceptor,
    ) -> Iterator[str | GenerationResult]:
        """Yield text deltas as tokens are accepted, then the final :class:`GenerationResult`.

        ``prompt`` may also be a list of token ids (used as is): encode -> :meth:`start` -> :meth:`decode`.
        """
        cfg = config or GenerationConfig()
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.encode(prompt, chat)
        yield from self.decode(self.start(prompt_ids, cfg), drafter, policy, acceptor)

    def generate(self, prompt, config: GenerationConfig | None = None, **kwargs) -> GenerationResult:
        """:meth:`stream`'s final result."""
        result = None
        for item in self.stream(prompt, config, **kwargs):
            result = item
        assert isinstance(result, GenerationResult)
        return result
