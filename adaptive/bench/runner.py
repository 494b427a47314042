"""``run_bench()``: every method on every prompt, interleaved prompt by prompt, then the report."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import torch

from adaptive.bench.data import BenchPrompt
from adaptive.bench.report import summarize
from adaptive.errors import ConfigError

METHODS = ("ar", "hf", "hf-pld", "hf-early-exit", "pld", "ssd-static", "knn-ssd", "knn-ssd-fixed", "knn-ssd-full-vocab",
           "knn-skip", "knn-skip-full-vocab", "cascade", "cascade-fixed", "early-exit", "early-exit-fixed",
           "draft-model")
from adaptive.drafters.ngram import DEFAULT_PLD_DRAFT_LEN as PLD_DRAFT_LEN  # noqa: E402
NEEDS_PROFILE = METHODS[5:]
# bench methods that decode with a drafter `adaptive distill` stored in the profile -> its kind
DISTILLED_KIND = {"early-exit": "early-exit", "early-exit-fixed": "early-exit", "draft-model": "draft-model"}
DESCRIPTIONS = {
    "ar": "our loop, plain greedy decoding (the reference)",
    "hf": "transformers generate, greedy",
    "hf-pld": "transformers prompt lookup decoding (prompt_lookup_num_tokens=10)",
    "hf-early-exit": "transformers assisted generation with assistant_early_exit = half the layers",
    "pld": f"our loop with prompt-lookup drafts (n-gram 3..1), fixed draft length {PLD_DRAFT_LEN}",
    "ssd-static": "self-speculative with the profile's global skip set and its draft length (Self-SD)",
    "knn-ssd": "the runtime: KNN routing to the domain's calibrated choice (layer-skip drafting, prompt lookup "
               "or plain decoding), Thompson-sampled draft length",
    "knn-ssd-fixed": "the runtime with calibration's fixed draft length instead of the bandit",
    "knn-ssd-full-vocab": "knn-ssd with the full LM head for every layer-skip draft (the reduced-vocabulary ablation)",
    "knn-skip": "the runtime routing every request to its domain's skip set (KNN-SSD as published: layer skipping "
                "only), over the domain's reduced draft vocabulary where calibration measured it faster",
    "knn-skip-full-vocab": "knn-skip with the full LM head",
    "cascade": "the runtime's cascade: KNN routing to the domain's cascade (prompt lookup and its bigram table, "
               "under and after the domain's layer-skip drafter), split and draft length by a two-level Thompson sampler",
    "cascade-fixed": "the runtime's cascade with calibration's split and draft length instead of the sampler",
    "early-exit": "the early-exit drafter `adaptive distill` stored in the profile (first N layers and a trained exit "
                  "block), draft length by the routed domain's Thompson sampler (EESD)",
    "early-exit-fixed": "early-exit with the draft length its distilled acceptance and cost give, no sampler",
    "draft-model": "the separate draft model `adaptive distill` fine-tuned and stored in the profile, Thompson-sampled "
                   "draft length",
}


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 64
    warmup: int = 1
    threads: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")


def parse_methods(text: str) -> list[str]:
    """``"ar,knn-ssd"`` -> ``["ar", "knn-ssd"]`` (``ar`` first, added when missing: it is the reference)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ConfigError("a method is listed twice")
    return ["ar"] + [m for m in methods if m != "ar"]


def machine_info(device) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": str(device)}
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


class _Methods:
    """Runs one method on one prompt and returns the measured fields."""

    def __init__(self, lm, profile, settings: BenchSettings, methods: list[str]):
        from adaptive.engine.engine import Engine

        self.lm, self.settings = lm, settings
        self.engine = Engine(lm)
        self.profile = profile
        self.runtime = self.fixed = self.full_vocab = None
        if profile is not None:
            from adaptive.runtime import AdaptiveRuntime

            if {"knn-ssd", "cascade", "knn-skip", "early-exit", "draft-model"} & set(methods):
                self.runtime = AdaptiveRuntime(profile, lm, bandit=True, seed=0)
            if {"knn-ssd-full-vocab", "knn-skip-full-vocab"} & set(methods):
                self.full_vocab = AdaptiveRuntime(profile, lm, bandit=True, seed=0, reduced_vocab=False)
            if {"knn-ssd-fixed", "ssd-static", "cascade-fixed", "early-exit-fixed"} & set(methods):
                self.fixed = AdaptiveRuntime(profile, lm, bandit=False)

    def ids(self, messages) -> list[int]:
        chat = self.profile.settings.get("chat") if self.profile is not None else None
        return self.engine.encode(messages, chat=chat)

    def run(self, method: str, messages) -> dict:
        from adaptive.engine.config import GenerationConfig

        n = self.settings.max_new_tokens
        if method == "ar":
            r = self.engine.generate(self.ids(messages), GenerationConfig(max_new_tokens=n), method="ar")
            return _from_result(r)
        if method.startswith("hf"):
            return self._hf(method, self.ids(messages), n)
        if method == "pld":
            cfg = GenerationConfig(max_new_tokens=n, draft_len=PLD_DRAFT_LEN)
            return _from_result(self.engine.generate(self.ids(messages), cfg, method="pld"))
        if method == "knn-ssd":
            return _from_result(self.runtime.generate(messages, max_new_tokens=n, method="knn-ssd"))
        if method == "knn-ssd-fixed":
            return _from_result(self.fixed.generate(messages, max_new_tokens=n, method="knn-ssd"))
        if method == "ssd-static":
            return _from_result(self.fixed.generate(messages, max_new_tokens=n, method="ssd-static"))
        if method == "cascade":
            return _from_result(self.runtime.generate(messages, max_new_tokens=n, method="cascade"))
        if method == "knn-skip":
            return _from_result(self.runtime.generate(messages, max_new_tokens=n, method="knn-skip"))
        if method in ("knn-ssd-full-vocab", "knn-skip-full-vocab"):
            return _from_result(self.full_vocab.generate(messages, max_new_tokens=n, method=method[:-len("-full-vocab")]))
        if method == "cascade-fixed":
            return _from_result(self.fixed.generate(messages, max_new_tokens=n, method="cascade"))
        if method in DISTILLED_KIND:
            rt = self.fixed if method.endswith("-fixed") else self.runtime
            return _from_result(rt.generate(messages, max_new_tokens=n, method=DISTILLED_KIND[method]))
        raise ConfigError(f"unknown method {method!r}")

    @torch.inference_mode()
    def _hf(self, method: str, ids: list[int], n: int) -> dict:
        model = self.lm.model
        kw = dict(do_sample=False, max_new_tokens=n, pad_token_id=self.lm.tokenizer.pad_token_id
                  or self.lm.tokenizer.eos_token_id)
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        elif method == "hf-early-exit":
            kw["assistant_early_exit"] = max(1, self.lm.n_layers // 2)
        inp = torch.tensor([ids], device=self.lm.device)
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(inp, attention_mask=torch.ones_like(inp), **kw)[0, len(ids):].tolist()
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        eos = self.engine.eos
        for j, tok in enumerate(out):  # up to and including the first EOS, as our engine reports
            if tok in eos:
                out = out[: j + 1]
                break
        return {"token_ids": out, "tokens_per_s": len(out) / dt if dt > 0 else 0.0, "steps": None,
                "drafted": None, "accepted": None, "info": {}}


def _from_result(r) -> dict:
    s = r.stats
    info = {k: r.info[k] for k in ("applied", "decision", "skip_text") if k in r.info}
    if "draft_vocab" in r.info.get("drafter", {}):
        info["draft_vocab"] = r.info["drafter"]["draft_vocab"]
    if "route" in r.info:
        info["domain"] = r.info["route"].get("domain")
    if s.draft_lengths:
        info["draft_lengths"] = {str(k): v for k, v in sorted(s.draft_lengths.items())}
    return {"token_ids": r.token_ids, "tokens_per_s": s.tokens_per_s, "steps": s.steps, "drafted": s.drafted,
            "accepted": s.accepted, "draft_time_s": round(s.draft_time, 5), "info": info}


def run_bench(lm, prompts: list[BenchPrompt], methods: list[str], settings: BenchSettings, profile=None,
              progress: bool = True, on_run: Callable[[dict], None] | None = None) -> dict:
    """Benchmark ``methods`` on ``prompts``; returns the report (see docs/benchmarks.md)."""
    from adaptive.engine.audit import audit_divergence

    missing = [m for m in methods if m in NEEDS_PROFILE]
    if missing and profile is None:
        raise ConfigError(f"method(s) {', '.join(missing)} need a calibration profile: pass --profile DIR")
    if profile is not None:
        profile.check_model(lm.fingerprint())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    runner = _Methods(lm, profile, settings, methods)
    first = [{"role": "user", "content": prompts[0].turns[0]}]
    for _ in range(settings.warmup):  # warm-up: every method once, not measured
        for m in methods:
            runner.run(m, first)
    items = [(p, t) for p in prompts for t in range(len(p.turns))]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items) * len(methods), desc="bench", unit="run")
    runs: list[dict] = []
    replies: dict[tuple[str, int], str] = {}
    t_start = time.perf_counter()
    for p, t in items:
        messages = []
        for j in range(t):
            messages += [{"role": "user", "content": p.turns[j]}, {"role": "assistant", "content": replies[(p.id, j)]}]
        messages.append({"role": "user", "content": p.turns[t]})
        item_id = p.id if len(p.turns) == 1 else f"{p.id}/turn{t + 1}"
        ref = None
        ids = runner.ids(messages)
        for m in methods:  # interleaved: every method on this prompt before the next prompt
            out = runner.run(m, messages)
            rec = {"id": item_id, "group": p.group, "category": p.category, "method": m,
                   "prompt_tokens": len(ids), "new_tokens": len(out["token_ids"]),
                   "tokens_per_s": round(out["tokens_per_s"], 4), "steps": out["steps"],
                   "drafted": out["drafted"], "accepted": out["accepted"], "draft_time_s": out.get("draft_time_s"),
                   **out["info"]}
            if m == "ar":
                ref = out["token_ids"]
                replies[(p.id, t)] = runner.engine._text(ref)
                rec["identical"] = True
            else:
                a = audit_divergence(lm.backbone, ids, ref, out["token_ids"])
                rec["identical"] = a.identical
                rec["violation"] = bool(a.violation)
                if not a.identical:
                    rec["divergence"] = a.to_dict()
            runs.append(rec)
            if on_run is not None:
                on_run(rec)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    summary = summarize(runs, methods)
    return {
        "machine": machine_info(lm.device),
        "model": {"name": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "n_layers": lm.n_layers},
        "settings": {"max_new_tokens": settings.max_new_tokens, "warmup": settings.warmup,
                     "threads": torch.get_num_threads(), "prompts": len(items),
                     "profile": str(profile.path) if profile is not None else None, "greedy": True,
                     "seconds": round(time.perf_counter() - t_start, 1)},
        "methods": {m: DESCRIPTIONS[m] for m in methods},
        "results": summary,
        "runs": runs,
    }
