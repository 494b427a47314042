"""``run_bench()``: every method on every prompt, interleaved prompt by prompt, then the report.

:data:`BENCH_METHODS` is the one table of benchmarked methods, built from the other lists: the
Hugging Face and llama.cpp baselines (llama-cpp-python and llama.cpp's own ``llama-server``), the
engine's own ``ar`` (the reference) and ``pld``, every routing policy of
:data:`~adaptive.runtime.policies.POLICIES`, and their ``-fixed`` (bandit off) and ``-full-vocab``
(full LM head) variants where they apply.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from adaptive.bench.data import BenchPrompt
from adaptive.bench.llama_server import SPEC_TYPES, STATEFUL_SPEC_TYPES, LlamaServer
from adaptive.bench.llamacpp import LlamaCpp, gguf_path
from adaptive.bench.report import summarize
from adaptive.drafters.eagle import DEFAULT_TREE
from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.drafters.ngram import DEFAULT_PLD_DRAFT_LEN as PLD_DRAFT_LEN
from adaptive.engine.audit import audit_divergence, common_prefix
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.llamacpp import ENGINE as LLAMA_CPP
from adaptive.engine.prefix import PrefixStore, budget_bytes
from adaptive.engine.quant import FLOAT_MODES
from adaptive.errors import ConfigError
from adaptive.models import load_model
from adaptive.profile import is_two_engine, load_profile, read_engines
from adaptive.progress import progress_bar
from adaptive.runtime import POLICIES, AdaptiveRuntime, RuntimeResult, TwoEngineRuntime
from adaptive.runtime.policies import DISTILLED
from adaptive.workdir import cpu_name

FIXED_VARIANTS = ("knn-ssd", "cascade", "early-exit", "eagle")  # also benchmarked with the bandit off (`-fixed`)
FULL_VOCAB_VARIANTS = ("knn-ssd", "knn-skip")  # policies benchmarked also with the full LM head (`-full-vocab`)
WITHOUT_BANDIT = ("ssd-static",)  # policies benchmarked with calibration's fixed draft length only (Self-SD)


@dataclass(frozen=True)
class BenchMethod:
    """One benchmarked method. ``runs_on``: ``"engine"`` (our loop with ``drafter``: ``ar`` or ``pld``,
    no profile), ``"hf"`` (transformers ``generate``), ``"llamacpp"`` (llama-cpp-python on the model's
    GGUF file; ``drafter`` ``pld`` for its prompt lookup), ``"llama-server"`` (llama.cpp's C++ server on
    that file; ``drafter`` its ``--spec-type``, ``ar`` for none), ``"runtime"`` (an :class:`AdaptiveRuntime`
    with ``policy``, ``bandit`` on or off and the reduced vocabulary or not; needs a profile),
    ``"engines"`` (the :class:`~adaptive.runtime.TwoEngineRuntime` of a two-engine profile) or
    ``"torch"`` (a two-engine profile's torch member alone: plain decoding, or its runtime with ``policy``)."""

    name: str
    description: str
    runs_on: str
    drafter: str = "ar"
    policy: str | None = None
    bandit: bool = True
    reduced_vocab: bool = True
    tree: bool = True  # the eagle head drafts trees (False: chains, the ablation)

    @property
    def runtime_key(self) -> tuple[bool, bool, bool]:
        """What tells this method's runtime apart from another's: bandit, reduced vocabulary, trees."""
        return (self.bandit, self.reduced_vocab, self.tree)

    @property
    def needs_profile(self) -> bool:
        return self.runs_on in ("runtime", "engines", "torch")

    @property
    def needs_two_engines(self) -> bool:
        return self.runs_on in ("engines", "torch")

    @property
    def distilled(self) -> str | None:
        """The kind of drafter `adaptive distill` must have stored in the profile, or ``None``."""
        return self.policy if self.policy in DISTILLED else None


HF_STATIC_LEN = 2048  # hf-static's cache positions (more for a longer prompt): one shape, one compilation


def _bench_methods() -> dict[str, BenchMethod]:
    table = [
        BenchMethod("ar", "our loop, plain greedy decoding (the reference)", "engine"),
        BenchMethod("hf", "transformers generate, greedy", "hf"),
        BenchMethod("hf-static", "transformers generate, greedy, with a static cache (one of "
                    f"{HF_STATIC_LEN}+ positions reused across prompts) and, on CUDA, its compiled decoding step "
                    "(transformers compiles it by itself for a static cache)", "hf"),
        BenchMethod("hf-pld", "transformers prompt lookup decoding (prompt_lookup_num_tokens=10)", "hf"),
        BenchMethod("hf-early-exit", "transformers assisted generation with assistant_early_exit = half the layers",
                    "hf"),
        BenchMethod("llama.cpp", "llama-cpp-python on the same GGUF file (its own quantized weights), greedy, "
                    "same prompt tokens and threads", "llamacpp"),
        BenchMethod("llama.cpp-pld", "llama-cpp-python's prompt lookup decoding (LlamaPromptLookupDecoding, "
                    "10 tokens)", "llamacpp", drafter="pld"),
        BenchMethod("llama-server", "llama.cpp's own C++ llama-server (benchmarks/build_llama_server.sh) on the same "
                    "GGUF file (its own quantized weights), greedy, same prompt tokens and threads, no prompt cache",
                    "llama-server"),
        *(BenchMethod(f"llama-server-{kind}", f"llama-server --spec-type {kind}: {what}"
                      + (" (server restarted before each prompt: its n-gram state outlives a request)"
                         if kind in STATEFUL_SPEC_TYPES else ""), "llama-server", drafter=kind)
          for kind, what in SPEC_TYPES.items()),
        BenchMethod("pld", f"our loop with prompt-lookup drafts (n-gram 3..1), fixed draft length {PLD_DRAFT_LEN}",
                    "engine", drafter="pld"),
        BenchMethod("engines", "the two-engine runtime (a two-engine profile): each request on the engine expected "
                    "to finish it first, routed there as knn-ssd", "engines", policy="knn-ssd"),
        BenchMethod("torch-ar", "plain greedy decoding on the torch engine (a two-engine profile's torch member; "
                    "the other engine's reference)", "torch", drafter="ar"),
        BenchMethod("torch-knn-ssd", "the runtime's knn-ssd on the torch engine alone (a two-engine profile's torch "
                    "member)", "torch", policy="knn-ssd"),
    ]
    for name, policy in POLICIES.items():
        if name == "ar":  # the engine's own `ar` is the reference
            continue
        bandit = name not in WITHOUT_BANDIT
        how = "Thompson-sampled draft length" if bandit else "calibration's fixed draft length"
        table.append(BenchMethod(name, f"the runtime's {name}: {policy.description} ({how})", "runtime",
                                 policy=name, bandit=bandit))
        if name in FIXED_VARIANTS:
            table.append(BenchMethod(f"{name}-fixed", f"{name} with calibration's fixed draft length (for a distilled "
                                     "drafter: the one its acceptance and cost give) instead of the bandit", "runtime",
                                     policy=name, bandit=False))
        if name == "eagle":
            table.append(BenchMethod("eagle-chain", "eagle drafting chains instead of trees (the tree ablation)",
                                     "runtime", policy=name, tree=False))
        if name in FULL_VOCAB_VARIANTS:
            table.append(BenchMethod(f"{name}-full-vocab", f"{name} with the full LM head for every layer-skip draft "
                                     "(the reduced-vocabulary ablation)", "runtime", policy=name, reduced_vocab=False))
    return {m.name: m for m in table}


BENCH_METHODS: dict[str, BenchMethod] = _bench_methods()
METHODS = tuple(BENCH_METHODS)
NEEDS_PROFILE = tuple(m.name for m in BENCH_METHODS.values() if m.needs_profile)
# bench methods that decode with a drafter `adaptive distill` stored in the profile -> its kind
DISTILLED_KIND = {m.name: m.distilled for m in BENCH_METHODS.values() if m.distilled}
DESCRIPTIONS = {m.name: m.description for m in BENCH_METHODS.values()}


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 64
    warmup: int = 1
    threads: int | None = None
    # MiB of prefix cache for our runtime methods (each method its own, kept across prompts as a server
    # keeps it), and llama-server's cache_prompt on; 0: every request prefilled whole (single turns' fairness)
    prefix_cache: float = 0.0
    # sampling, the same for every method: 0 decodes greedily (outputs compared with ar's and audited); above,
    # each prompt samples with seed ``seed + its index`` (the model's own distribution with top_p 1), and
    # losslessness is the distribution tests' to show, not identity's (docs/benchmarks.md)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.prefix_cache < 0:
            raise ConfigError(f"prefix-cache must be >= 0 MiB, got {self.prefix_cache}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")


# where a method decodes: those that decode greedily only (the HF baselines' and llama-cpp-python's loops)
GREEDY_ONLY = ("hf", "llamacpp")


def check_sampling(methods: Sequence[str], settings: BenchSettings) -> None:
    """A :class:`ConfigError` naming the methods that cannot sample, where ``settings`` do."""
    greedy_only = [m for m in methods if BENCH_METHODS[m].runs_on in GREEDY_ONLY]
    if not settings.greedy and greedy_only:
        raise ConfigError(f"method(s) {', '.join(greedy_only)} decode greedily only: leave them out of "
                          f"--methods or bench at --temperature 0")


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

    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(device)}
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


class _Methods:
    """Runs one method on one prompt and returns the measured fields."""

    def __init__(self, lm, profile, settings: BenchSettings, methods: list[str]):
        self.lm, self.settings = lm, settings
        self.engine = Engine(lm)
        self.profile = profile
        self._static_cache = None  # hf-static's, reused (reset) across prompts
        self.llamacpp: dict[str, LlamaCpp] = {}
        torch_only = [name for name in methods if BENCH_METHODS[name].runs_on == "hf"]
        if torch_only and lm.model is None:
            raise ConfigError(f"method(s) {', '.join(torch_only)} run Hugging Face's generate on the torch model: "
                              f"load it with --engine torch (it is on the {lm.engine} engine)")
        # every engine and peer on the same threads: our llama.cpp engine's own, else torch's
        threads = lm.backbone.threads if lm.model is None else torch.get_num_threads()
        for name in methods:  # loaded up front: a missing extra or GGUF file fails before any run
            if BENCH_METHODS[name].runs_on == "llamacpp":
                self.llamacpp[name] = LlamaCpp(gguf_path(lm), threads,
                                               min(4096, lm.backbone.max_positions),
                                               prompt_lookup=BENCH_METHODS[name].drafter == "pld")
        self.servers: dict[str, LlamaServer] = {}  # one llama-server process per method
        try:
            for m in (BENCH_METHODS[name] for name in methods):
                if m.runs_on == "llama-server":
                    self.servers[m.name] = LlamaServer(gguf_path(lm), threads,
                                                       min(4096, lm.backbone.max_positions),
                                                       spec_type=None if m.drafter == "ar" else m.drafter,
                                                       cache_prompt=settings.prefix_cache > 0)
        except BaseException:
            self.close()
            raise
        self.runtimes: dict[tuple[bool, bool, bool], AdaptiveRuntime] = {}  # BenchMethod.runtime_key -> runtime
        self.two = self.other = None  # the two-engine runtime and its torch member's plain engine
        self._other_refs: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> plain decoding on the torch engine
        if any(BENCH_METHODS[name].needs_two_engines for name in methods):
            self._two_engines(lm, profile)
        for m in (BENCH_METHODS[name] for name in methods):
            key = m.runtime_key
            if m.runs_on == "runtime" and key not in self.runtimes:
                # online learning off: a repeated prompt would otherwise be drafted from its own
                # earlier output, and the figures measure the calibrated profile
                self.runtimes[key] = AdaptiveRuntime(profile, lm, bandit=m.bandit, seed=0,
                                                     reduced_vocab=m.reduced_vocab, online=False,
                                                     tree=DEFAULT_TREE if m.tree else None,
                                                     prefix_cache=settings.prefix_cache)
        self._stores: dict[str, list[PrefixStore]] = {}  # method -> its own prefix stores, one per backbone

    def _two_engines(self, lm, profile) -> None:
        """Load the torch member of the two-engine profile ``profile`` belongs to (``lm``: its
        llama.cpp member's model) and the two-engine runtime over both."""
        home = profile.path.parent if profile is not None and profile.path is not None else None
        if home is None or not is_two_engine(home) or lm.engine != LLAMA_CPP:
            raise ConfigError("methods engines, torch-ar and torch-knn-ssd need a two-engine profile "
                              "(`adaptive calibrate --engine auto` on a CPU with llama-cpp-python) loaded on llama.cpp")
        tp = load_profile(home, "torch")
        tlm = load_model(tp.model.spec or lm.name, device="cpu", dtype=tp.model.dtype or "auto",
                         weights=tp.model.weights, engine="torch")
        cache = self.settings.prefix_cache
        mine = AdaptiveRuntime(profile, lm, seed=0, online=False, prefix_cache=cache)
        self.torch_runtime = AdaptiveRuntime(tp, tlm, seed=0, online=False, model_lock=mine.model_lock,
                                             prefix_cache=cache)
        self.two = TwoEngineRuntime({lm.engine: mine, "torch": self.torch_runtime}, read_engines(home).default)
        self.other = Engine(tlm)

    def other_reference(self, ids: list[int]) -> list[int]:
        """Plain greedy decoding of ``ids`` on the torch engine (computed once per prompt, untimed)."""
        key = tuple(ids)
        if key not in self._other_refs:
            cfg = GenerationConfig(max_new_tokens=self.settings.max_new_tokens)
            self._other_refs[key] = self.other.generate(list(ids), cfg).token_ids
        return self._other_refs[key]

    def static_cache(self, positions: int):
        """hf-static's cache, reset, of :data:`HF_STATIC_LEN` positions or the next power of two above
        ``positions`` (a new one, and a new compilation, only for a longer prompt)."""
        from transformers import StaticCache

        if self._static_cache is None or self._static_cache[0] < positions:
            size = max(HF_STATIC_LEN, 1 << (positions - 1).bit_length())
            self._static_cache = (size, StaticCache(config=self.lm.model.config, max_cache_len=size))
        cache = self._static_cache[1]
        cache.reset()
        return cache

    def captures(self) -> int | None:
        """CUDA graphs the engine's backbone has captured so far (``None`` without graphs)."""
        graphs = getattr(self.lm.backbone, "graphs", None)
        return None if graphs is None else graphs.captures

    def close(self) -> None:
        """Stop the llama-server processes."""
        for server in self.servers.values():
            server.close()

    def same_weights(self, method: str) -> bool:
        """Whether ``method`` decodes with our engine's weights (llama.cpp never does; Hugging Face's
        ``generate`` does unless the engine quantized them)."""
        runs_on = BENCH_METHODS[method].runs_on
        return runs_on not in ("llamacpp", "llama-server") and not (runs_on == "hf" and
                                                                     self.lm.weights not in FLOAT_MODES)

    def ids(self, messages) -> list[int]:
        chat = self.profile.runtime.chat if self.profile is not None else None
        return self.engine.encode(messages, chat=chat)

    def new_conversation(self) -> None:
        """Empty every method's prefix cache, and restart (untimed) the llama-server processes that keep
        theirs: after the warm-up, no measured prompt starts from its runs (a slot keeps its last prompt)."""
        for stores in self._stores.values():
            for store in stores:
                store.clear()
        for server in self.servers.values():
            if server.settings.cache_prompt:
                server.start()

    def run(self, method: str, messages, fresh: bool = True, seed: int | None = None) -> dict:
        """One run of ``method`` on ``messages``. With a prefix cache, each of our runtime methods reads and
        writes only its own, kept across prompts as a server keeps it (no method starts from another's
        turns; what prompts share, the chat template's start, is reused as llama-server's slot reuses
        it); ``fresh``: a new conversation (a stateful llama-server speculation type restarts); ``seed``: the
        sampler's, where the settings sample (default: theirs)."""
        m = BENCH_METHODS[method]
        self._seed = self.settings.seed if seed is None else seed
        if not self.settings.prefix_cache or m.runs_on not in ("runtime", "engines", "torch"):
            return self._run(method, messages, fresh)
        backbones = [self.lm.backbone] + ([self.other.backbone] if self.other is not None else [])
        if method not in self._stores:
            self._stores[method] = [PrefixStore(budget_bytes(self.settings.prefix_cache)) for _ in backbones]
        stores = self._stores[method]
        saved = [bb.prefixes for bb in backbones]
        for bb, store in zip(backbones, stores):
            bb.prefixes = store
        try:
            return self._run(method, messages, fresh)
        finally:
            for bb, store in zip(backbones, saved):
                bb.prefixes = store

    def _sampling(self) -> dict:
        """The runtimes' sampling options of this run (:meth:`run`'s seed)."""
        st = self.settings
        return {} if st.greedy else {"temperature": st.temperature, "top_p": st.top_p, "seed": self._seed}

    def _run(self, method: str, messages, fresh: bool) -> dict:
        m = BENCH_METHODS[method]
        n = self.settings.max_new_tokens
        sampling = self._sampling()
        if m.runs_on == "hf":
            return self._hf(method, self.ids(messages), n)
        if m.runs_on == "llamacpp":
            out, dt = self.llamacpp[method].generate(self.ids(messages), n, self.engine.eos)
            return {"token_ids": out, "tokens_per_s": len(out) / dt if dt > 0 else 0.0, "seconds": dt, "steps": None,
                    "drafted": None, "accepted": None, "info": {}}
        if m.runs_on == "llama-server":
            server = self.servers[method]
            ids = self.ids(messages)
            out, dt = server.generate(ids, n, self.engine.eos, fresh=fresh, sampling=sampling)
            timings = server.last_timings
            drafted = None if m.drafter == "ar" else timings.get("draft_n", 0)
            accepted = None if m.drafter == "ar" else timings.get("draft_n_accepted", 0)
            prompt_ms, prompt_n = timings.get("prompt_ms"), timings.get("prompt_n")
            return {"token_ids": out, "tokens_per_s": len(out) / dt if dt > 0 else 0.0, "seconds": dt, "steps": None,
                    "drafted": drafted, "accepted": accepted, "info": {},
                    "ttft_s": round(prompt_ms / 1e3, 5) if prompt_ms is not None else None,
                    "cached_tokens": max(len(ids) - int(prompt_n), 0) if prompt_n is not None else None}
        if m.runs_on == "engine":
            cfg = GenerationConfig(max_new_tokens=n, draft_len=PLD_DRAFT_LEN if m.drafter == "pld" else 4, **sampling)
            drafter = build_drafter(DrafterSpec(m.drafter), self.lm.backbone)
            return _from_result(self.engine.generate(self.ids(messages), cfg, drafter=drafter))
        if m.runs_on == "engines":
            return _from_result(self.two.generate(messages, max_new_tokens=n, policy=m.policy, **sampling))
        if m.runs_on == "torch":
            if m.policy is None:
                out = _from_result(self.other.generate(self.ids(messages), GenerationConfig(max_new_tokens=n,
                                                                                             **sampling)))
                self._other_refs[tuple(self.ids(messages))] = out["token_ids"]
                return out
            return _from_result(self.torch_runtime.generate(messages, max_new_tokens=n, policy=m.policy, **sampling))
        runtime = self.runtimes[m.runtime_key]
        return _from_result(runtime.generate(messages, max_new_tokens=n, policy=m.policy, **sampling))

    @torch.inference_mode()
    def _hf(self, method: str, ids: list[int], n: int) -> dict:
        model = self.lm.model
        kw = dict(do_sample=False, max_new_tokens=n, pad_token_id=self.lm.tokenizer.pad_token_id
                  or self.lm.tokenizer.eos_token_id)
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        elif method == "hf-static":
            kw["past_key_values"] = self.static_cache(len(ids) + n)
        elif method == "hf-early-exit":
            kw["assistant_early_exit"] = max(1, self.lm.n_layers // 2)
        inp = torch.tensor([ids], device=self.lm.device)
        with self.lm.backbone.module_weights():  # packed weights: the modules' own, for this run
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
        return {"token_ids": out, "tokens_per_s": len(out) / dt if dt > 0 else 0.0, "seconds": dt, "steps": None,
                "drafted": None, "accepted": None, "info": {}}


def _from_result(r) -> dict:
    s = r.stats
    info = {}
    if isinstance(r, RuntimeResult):
        info = {"applied": r.applied, "decision": r.decision}
        if r.skip is not None:
            info["skip_text"] = r.skip.to_text()
        if "draft_vocab" in r.drafter_info:
            info["draft_vocab"] = r.drafter_info["draft_vocab"]
        if r.route is not None:
            info["domain"] = r.domain
        if r.engine_choice is not None:
            info["engine"] = r.engine
            info["engine_reason"] = r.engine_choice["reason"]
            info["expected_s"] = {e["engine"]: e["expected_s"] for e in r.engine_choice["estimates"]}
    if s.draft_lengths:
        info["draft_lengths"] = {str(k): v for k, v in sorted(s.draft_lengths.items())}
        info["accept_hist"] = {str(k): v for k, v in sorted(s.accept_hist.items())}
    return {"token_ids": r.token_ids, "tokens_per_s": s.tokens_per_s, "seconds": s.total_time, "steps": s.steps,
            "drafted": s.drafted,
            "accepted": s.accepted, "draft_time_s": round(s.draft_time, 5),
            "prefill_time_s": round(s.prefill_time, 5), "info": info,
            "ttft_s": round(s.prefill_time, 5), "cached_tokens": s.cached_tokens}


def balanced_order(methods: Sequence[str], k: int) -> list[str]:
    """The order the methods run in on the ``k``-th prompt: row ``k`` of a Williams design, so that
    over every ``n`` prompts (``2n`` for an odd count ``n`` of methods) each method runs once in each
    place and right after each other method equally often. A fixed order can favour a method on a
    CPU whose last-level cache holds a model (480 MiB of L3 on our Intel Xeon host): one right after
    a method that read the same weights starts warm (llama-server right after our plain decoding on
    llama.cpp: the same file's pages), one right after the torch engine starts cold. Example, for
    four methods the rows are ``[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]``:
    ``balanced_order(["a", "b", "c", "d"], 1) == ["b", "c", "a", "d"]``."""
    n = len(methods)
    if n < 2:
        return list(methods)
    first, lo, hi = [0], 1, n - 1
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        if j % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    r = k % (2 * n if n % 2 else n)
    row = [(x + r) % n for x in first]
    return [methods[i] for i in (row if r < n else reversed(row))]


def run_bench(lm, prompts: list[BenchPrompt], methods: list[str], settings: BenchSettings, profile=None,
              progress: bool = True, on_run: Callable[[dict], None] | None = None) -> dict:
    """Benchmark ``methods`` on ``prompts``; returns the report (see docs/benchmarks.md)."""
    missing = [m for m in methods if BENCH_METHODS[m].needs_profile]
    if missing and profile is None:
        raise ConfigError(f"method(s) {', '.join(missing)} need a calibration profile: pass --profile DIR")
    check_sampling(methods, settings)
    if profile is not None:
        profile.check_model(lm.fingerprint())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    runner = _Methods(lm, profile, settings, methods)
    try:
        # warm-up, not measured: every method on the first prompt and on the longest, so that one-time work
        # (CUDA graph captures and compilations for the short and the long slots) precedes the timing, as a
        # server's happens at its first requests; what is still captured later is counted per run
        if settings.warmup:  # the graphs a server captures at startup (AdaptiveRuntime.warm): none on a CPU
            warm = getattr(lm.backbone, "warm_graphs", None)
            if warm is not None:
                warm()
            for rt in runner.runtimes.values():
                rt.warm()
        firsts = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
        longest = max(range(len(firsts)), key=lambda i: len(runner.ids(firsts[i])))
        for _ in range(settings.warmup):
            for messages in (firsts[0], firsts[longest]) if longest else (firsts[0],):
                for m in methods:
                    runner.run(m, messages)
                runner.new_conversation()
        items = [(p, t) for p in prompts for t in range(len(p.turns))]
        bar = None
        if progress:
            bar = progress_bar(len(items) * len(methods), "bench", unit="run")
        runs: list[dict] = []
        replies: dict[tuple[str, int], str] = {}
        t_start = time.perf_counter()
        for k, (p, t) in enumerate(items):
            messages = []
            for j in range(0 if p.shared else t):  # a conversation: the earlier turns and ar's replies first
                messages += [{"role": "user", "content": p.turns[j]},
                             {"role": "assistant", "content": replies[(p.id, j)]}]
            messages.append({"role": "user", "content": p.turns[t]})
            item_id = p.id if len(p.turns) == 1 else f"{p.id}/turn{t + 1}"
            ref = None
            ids = runner.ids(messages)
            outs = {}
            for m in balanced_order(methods, k):  # interleaved: every method on this prompt before the next prompt
                captured = runner.captures()
                outs[m] = runner.run(m, messages, fresh=t == 0, seed=settings.seed + k)
                if captured is not None and runner.captures() > captured:  # one-time work inside this run's time
                    outs[m]["graph_captures"] = runner.captures() - captured
                if bar is not None:
                    bar.update(1)
            for m in methods:  # in the listed order: ar's tokens are the others' reference
                out = outs[m]
                rec = {"id": item_id, "group": p.group, "category": p.category, "method": m,
                       "prompt_tokens": len(ids), "new_tokens": len(out["token_ids"]),
                       "tokens_per_s": round(out["tokens_per_s"], 4), "seconds": round(out["seconds"], 5),
                       "steps": out["steps"],
                       "drafted": out["drafted"], "accepted": out["accepted"], "draft_time_s": out.get("draft_time_s"),
                       "prefill_time_s": out.get("prefill_time_s"), "ttft_s": out.get("ttft_s"),
                       "cached_tokens": out.get("cached_tokens"), **out["info"]}
                if len(p.turns) > 1:
                    rec["turn"] = t + 1
                if "graph_captures" in out:
                    rec["graph_captures"] = out["graph_captures"]
                if m == "ar":
                    ref = out["token_ids"]
                    replies[(p.id, t)] = runner.engine.text(ref)
                    rec["identical"] = True if settings.greedy else None
                elif not settings.greedy:  # sampled: another draw of the same distribution, not a copy of ar's
                    rec["identical"] = None
                elif BENCH_METHODS[m].needs_two_engines and out["info"].get("engine", "torch") == "torch":
                    # decoded on the torch engine: lossless against plain decoding there
                    other_ref = runner.other_reference(ids)
                    a = audit_divergence(runner.other.backbone, ids, other_ref, out["token_ids"])
                    rec["identical"] = a.identical
                    rec["violation"] = bool(a.violation)
                    if not a.identical:
                        rec["divergence"] = a.to_dict()
                elif not runner.same_weights(m):  # other numbers: agreement with ar, never a lossless check
                    rec["identical"] = None
                    rec["agreement"] = common_prefix(ref, out["token_ids"])
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
            bar.close()
    finally:
        runner.close()  # the llama-server processes
    summary = summarize(runs, methods)
    return {
        "machine": machine_info(lm.device),
        "model": {"name": lm.name, "engine": lm.engine, "weights": lm.weights, "n_layers": lm.n_layers,
                  "dtype": lm.dtype_name},
        "settings": {"max_new_tokens": settings.max_new_tokens, "warmup": settings.warmup,
                     "prefix_cache_mib": settings.prefix_cache,
                     "threads": torch.get_num_threads() if lm.model is not None else lm.backbone.threads,
                     "prompts": len(items),
                     "profile": str(profile.path) if profile is not None else None, "greedy": settings.greedy,
                     "temperature": settings.temperature, "top_p": settings.top_p, "seed": settings.seed,
                     "seconds": round(time.perf_counter() - t_start, 1)},
        "methods": {m: DESCRIPTIONS[m] for m in methods},
        "results": summary,
        "runs": runs,
    }
