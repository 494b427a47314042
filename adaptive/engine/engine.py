"""Text in, text out: prompt encoding (chat template), EOS and stop strings, streaming, results."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import Acceptor, GenerationStats, Plan, decode, default_acceptor
from adaptive.engine.protocol import Drafter, DraftLengthPolicy
from adaptive.errors import ConfigError

Messages = Sequence[dict]


@dataclass
class GenerationResult:
    """``token_ids`` are the generated ids (the EOS id included when generation ended on it)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    stats: GenerationStats
    drafter: str  # the drafter kind that decoded it (adaptive.drafters.factory.DRAFTERS), "ar" for none
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "drafter": self.drafter, "stats": self.stats.to_dict(), **self.info}


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or ``None``."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, (list, tuple)):
            ids.update(int(v) for v in val)
    return ids


class Engine:
    """Decodes prompts with a loaded model (:class:`adaptive.models.LoadedModel`).

    ``generate(prompt, config, drafter=...)`` returns a :class:`GenerationResult` (no drafter: plain
    decoding; drafters come from :func:`adaptive.drafters.factory.build_drafter`); ``stream(...)``
    yields text deltas and finally the result.
    """

    def __init__(self, lm):
        self.lm = lm
        self.backbone = lm.backbone
        self.tokenizer = lm.tokenizer
        self.eos = eos_ids(lm.model, lm.tokenizer)

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

    def stream(
        self,
        prompt: str | Messages | list[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        plan=None,
        chat: bool | None = None,
        acceptor: Acceptor = default_acceptor,
    ) -> Iterator[str | GenerationResult]:
        """Yield text deltas as tokens are accepted, then the final :class:`GenerationResult`.

        ``prompt`` may also be a list of token ids (used as is). ``drafter`` drafts with ``policy``
        choosing each step's draft length (default: ``config.draft_len`` every step). ``plan`` (a
        :class:`Plan` or a function of the prompt embedding returning one) overrides both.
        """
        cfg = config or GenerationConfig()
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.encode(prompt, chat)
        if plan is None:
            plan = Plan(drafter, policy, {"drafter": drafter.describe()} if drafter is not None else {})
        chosen: list[Plan] = [plan] if isinstance(plan, Plan) else []
        if callable(plan):
            route = plan

            def plan(pooled, _route=route):  # remember what the router chose, for the result
                chosen.append(_route(pooled))
                return chosen[-1]
        stats = GenerationStats()
        out: list[int] = []
        emitted = ""
        finish = None
        hold = max((len(s) for s in cfg.stop), default=1) - 1
        t0 = time.perf_counter()
        steps = decode(self.backbone, prompt_ids, cfg, plan, stats, acceptor)
        for chunk in steps:
            # Token by token, so that a multi-token step ends exactly where plain decoding would.
            for t in chunk:
                out.append(t)
                if t in self.eos and not cfg.ignore_eos:
                    finish = "eos"
                elif cfg.stop and (cut := _first_stop(self._text(out), cfg.stop)) is not None:
                    finish = "stop"
                elif len(out) >= cfg.max_new_tokens:
                    finish = "length"
                if finish:
                    break
            text = self._text(out)
            if finish == "stop":
                text = text[:cut]
            if finish:
                steps.close()
                if text.startswith(emitted) and len(text) > len(emitted):
                    yield text[len(emitted):]
                break
            safe = text[: len(text) - hold] if hold else text
            safe = safe.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for the next token
            if safe.startswith(emitted) and len(safe) > len(emitted):
                yield safe[len(emitted):]
                emitted = safe
        stats.tokens = len(out)
        stats.total_time = time.perf_counter() - t0
        info = dict(chosen[-1].info) if chosen else {}
        used = chosen[-1].drafter if chosen else None
        yield GenerationResult(text, out, finish or "length", stats, used.name if used is not None else "ar", info)

    def generate(self, prompt, config: GenerationConfig | None = None, **kwargs) -> GenerationResult:
        result = None
        for item in self.stream(prompt, config, **kwargs):
            result = item
        assert isinstance(result, GenerationResult)
        return result

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=True)
