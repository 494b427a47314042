"""``calibrate()``: prompts per domain in, a profile directory out.

Phases, each checkpointed in ``OUT.work/`` so that ``resume=True`` after a kill redoes nothing
that finished:

1. cost model: time the forwards of this machine (``costs.json``);
2. per domain, in parallel: encode the prompts, generate the full model's greedy continuation of
   each (its prefill yields the prompt embedding, exactly as at run time) and measure sublayer
   influence (``prep-*.pt``);
3. FAISS k-means anchors per domain, one index over all;
4. per domain and once over all domains (the global set), in parallel: the Bayesian search (one
   line of ``trials-*.jsonl`` per trial, fsynced), then timed self-speculative decoding of the
   best candidates against plain decoding (``confirm-*.json``, one record per candidate), then
   prompt lookup timed the same way (``pld-*.json``), then the cascade: the domain's bigram table,
   its statistical drafter's teacher-forced acceptance, the starting split, and a timed run
   (``cascade-*.json``);
5. the profile, written atomically; the work directory is then removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from adaptive.costs import CostModel, measure_costs
from adaptive.calibrate.search import SPACES, Estimate, MatchnessScorer, estimate, make_space, run_search, top_candidates
from adaptive.drafters.cascade import CascadePlan as CascadeConfig
from adaptive.drafters.ngram import DEFAULT_PLD_DRAFT_LEN, BigramTable
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError, ConfigError, PromptTooLongError
from adaptive.costs import STAT_DRAFT_COST
from adaptive.profile import (Decision, DomainRecord, Measurement, Prior, Priors, Profile, RuntimeSettings, SkipSearch,
                              StatisticalAcceptance, VocabChoice, check_writable, save_profile)

BACKENDS = ("loky", "threading", "dask", "ray")
MIN_PROMPTS = 3
GLOBAL = "__global__"


class CalibrationError(AdaptiveError):
    """A calibration cannot start or resume (locked output, mismatched checkpoint, bad domains)."""


@dataclass(frozen=True)
class CalibrationSettings:
    """Everything that decides a calibration's result. Validated on construction."""

    prompts_per_domain: int = 16
    anchors_per_domain: int = 10
    trials: int = 30
    init_trials: int = 6
    space: str = "ranked"
    continuation_tokens: int = 32
    confirm_candidates: int = 3
    confirm_prompts: int = 3
    confirm_tokens: int = 64
    max_draft_len: int = 8
    pld_draft_len: int = DEFAULT_PLD_DRAFT_LEN
    min_gain: float = 0.02
    bigram_min_count: int = 2
    cascade_max_split: int = 2
    cascade_max_draft_len: int = 12  # statistical tokens cost no forward: the cascade may draft longer
    cascade_lenience: float = 1.0
    vocab_sizes: tuple = (1024, 2048, 4096, 8192, 16384)  # reduced draft heads tried (empty: full head only)
    route_k: int = 5
    cost_context: int = 128
    chat: bool | None = None
    seed: int = 0

    def __post_init__(self):
        positive = ("prompts_per_domain", "anchors_per_domain", "trials", "continuation_tokens",
                    "confirm_candidates", "confirm_prompts", "confirm_tokens", "max_draft_len", "pld_draft_len", "route_k",
                    "cost_context", "bigram_min_count", "cascade_max_draft_len")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.confirm_tokens < 2:
            raise ConfigError(f"confirm-tokens must be at least 2 (decode-phase timing), got {self.confirm_tokens}")
        if self.prompts_per_domain < MIN_PROMPTS:
            raise ConfigError(f"prompts-per-domain must be at least {MIN_PROMPTS}, got {self.prompts_per_domain}")
        if not 0 <= self.init_trials <= self.trials:
            raise ConfigError(f"init-trials must be between 0 and trials ({self.trials}), got {self.init_trials}")
        if self.space not in SPACES:
            raise ConfigError(f"space must be one of {', '.join(SPACES)}, got {self.space!r}")
        if self.max_draft_len > 64:
            raise ConfigError("max-draft-len must be at most 64")
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"min-gain must be in [0, 1), got {self.min_gain}")
        if self.cascade_max_draft_len > 64:
            raise ConfigError("cascade-max-draft-len must be at most 64")
        if not isinstance(self.cascade_max_split, int) or not 0 <= self.cascade_max_split <= self.cascade_max_draft_len:
            raise ConfigError(f"cascade-max-split must be in 0 .. cascade-max-draft-len, got {self.cascade_max_split!r}")
        if not self.cascade_lenience >= 1.0:
            raise ConfigError(f"cascade-lenience must be >= 1, got {self.cascade_lenience}")
        sizes = tuple(self.vocab_sizes)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 16 for v in sizes) or len(set(sizes)) != len(sizes):
            raise ConfigError(f"vocab-sizes must be distinct integers >= 16, got {list(sizes)}")
        object.__setattr__(self, "vocab_sizes", tuple(sorted(sizes)))

    @classmethod
    def quick(cls, **overrides) -> "CalibrationSettings":
        """The README preset: a few minutes on 2 CPU cores for the built-in domains."""
        base = dict(prompts_per_domain=6, anchors_per_domain=6, trials=10, init_trials=4, continuation_tokens=24,
                    confirm_candidates=2, confirm_prompts=2, confirm_tokens=40)
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["vocab_sizes"] = list(self.vocab_sizes)  # as JSON reads it back: a resumed run compares equal
        return d


# -- model sharing in workers --------------------------------------------------------------------

_MODELS: dict = {}
_MODELS_LOCK = threading.Lock()


def _model_key(spec, device, dtype) -> tuple:
    return (str(spec), str(device), str(dtype))


def _get_model(spec, device, dtype):
    """Load a model once per process (workers of a pool reuse it across tasks)."""
    from adaptive.models import load_model

    key = _model_key(spec, device, dtype)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(spec, device=device, dtype=dtype)
        return _MODELS[key]


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


# -- checkpoint files ------------------------------------------------------------------------------

def slug(name: str) -> str:
    """A file-name-safe, collision-free form of a domain name: ``"a b"`` -> ``"a_b-<8 hex>"``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    _atomic_write(path, (json.dumps(obj, indent=1) + "\n").encode())


def _read_trials(path: Path) -> list[dict]:
    """Complete trial records of a checkpoint; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(rec, dict) or rec.get("trial") != len(out):
            break
        out.append(rec)
    _atomic_write(path, "".join(json.dumps(r) + "\n" for r in out).encode())
    return out


def _append_line(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class WorkDir:
    """``OUT.work/``: checkpoints of one calibration, guarded by a lock file."""

    def __init__(self, out: Path, what: str = "calibration"):
        self.path = Path(str(out) + ".work")
        self.what = what

    def file(self, kind: str, name: str | None = None, ext: str = "json") -> Path:
        return self.path / (f"{kind}-{slug(name)}.{ext}" if name is not None else f"{kind}.{ext}")

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CalibrationError` if another live calibration holds it.

        The lock is an ``flock`` on ``OUT.work/lock``, held for as long as this process keeps the
        file open: the operating system releases it when the process ends, however it ends (a
        SIGKILL included), so there is no stale lock to take over and no race in taking one over.
        The file records who holds it, for the message.
        """
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / "lock"
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CalibrationError(
                f"another {self.what} ({holder}) is writing {self.path}; wait for it"
                + (" or choose another --out" if self.what == "calibration" else "")) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)  # releases the flock; the file may stay (the next holder truncates it)

    def remove(self) -> None:
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)


# -- worker tasks ----------------------------------------------------------------------------------

@dataclass
class _Common:
    spec: str
    device: str
    dtype: str
    settings: dict
    work: str
    threads: int | None = None
    progress: bool = True


def prepare_domain(common: _Common, name: str, prompts: list[str]) -> dict:
    """Encode, embed, continue greedily and measure influence for one domain (checkpointed)."""
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.index.embedding import pooled_to_numpy

    path = WorkDir(Path(common.work[: -len(".work")])).file("prep", name, "pt")
    if path.exists():
        try:
            return torch.load(path, weights_only=False)
        except Exception:  # a torn checkpoint is redone
            path.unlink(missing_ok=True)
    _set_threads(common.threads)
    s = CalibrationSettings(**common.settings)
    lm = _get_model(common.spec, common.device, common.dtype)
    engine = Engine(lm)
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=s.continuation_tokens)
    ids, embs, seqs = [], [], []
    influence = torch.zeros(2, bb.n_layers)
    for prompt in _bar(prompts, f"prepare {name}", common.progress):
        p = engine.encode(prompt, chat=s.chat)
        session = engine.start(p, cfg, pool=True)  # the prefill's pooled embedding, as the runtime routes
        cont = list(engine.decode(session))[-1].token_ids  # greedy, through the first EOS
        tail = (p + cont)[-(len(cont) + 64):]
        influence += bb.sublayer_influence(torch.tensor(tail, device=bb.device), from_position=len(tail) - len(cont))
        ids.append(p)
        embs.append(pooled_to_numpy(session.pooled))
        seqs.append((p, cont))
    out = {"name": name, "ids": ids, "embeddings": np.stack(embs), "sequences": seqs,
           "influence": influence / len(prompts)}
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(out, tmp)
    os.replace(tmp, path)
    return out


def _bar(it, desc, on):
    if not on:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, leave=False, file=None)


def _decode_rate(stats) -> tuple[int, float]:
    """Tokens decoded after the prefill and the time they took (the prefill is the same for every
    method, and on long prompts its noise would swamp the difference being measured)."""
    return max(stats.tokens - 1, 0), max(stats.total_time - stats.prefill_time, 1e-9)


def _candidate_drafter(lm, cand: dict, bigram, vocab, prompt: list[int]):
    """The drafter for one prompt of a candidate: ``ssd`` (``skip``; with ``draft_vocab``, drafting
    over the ``vocab`` ids joined with the prompt's, as the runtime does), ``pld``, or ``cascade``
    (``skip``, ``split``, ``vertical``, ``lenience``, ``min_prob``, drafting with ``bigram``)."""
    from adaptive.drafters.factory import DrafterSpec, build_drafter
    from adaptive.drafters.vocab import DraftHead

    bb = lm.backbone
    method = cand.get("method", "ssd")
    if method == "cascade":
        skip = SkipSet.from_text(cand["skip"], lm.n_layers) if cand.get("split") else None
        plan = CascadeConfig(split=int(cand["split"]), draft_len=int(cand["draft_len"]), vertical=bool(cand["vertical"]),
                             lenience=float(cand["lenience"]), min_prob=float(cand["min_prob"]))
        return build_drafter(DrafterSpec("cascade", skip=skip, cascade=plan, bigram=bigram), bb)
    if method == "ssd":
        head = None
        if cand.get("draft_vocab"):
            head = DraftHead.build(bb.lm_head.weight, torch.as_tensor(vocab, dtype=torch.long, device=bb.device),
                                   extra=prompt)
        return build_drafter(DrafterSpec("ssd", skip=SkipSet.from_text(cand["skip"], lm.n_layers), head=head), bb)
    return build_drafter(DrafterSpec(method), bb)


def measure_candidates(lm, prompt_ids: list[list[int]], candidates: list[dict], tokens: int,
                       done: list[dict] | None = None, on_done: Callable[[dict], None] | None = None,
                       repeats: int = 1, bigram=None, vocab=None) -> list[dict]:
    """Timed plain vs self-speculative decoding of each candidate on the same prompts.

    Plain decoding runs right before each candidate on every prompt (``repeats`` times), so drift
    hits both alike. Speedup = (candidate tokens/s) / (plain tokens/s), decode phase only, each
    over all prompts. Candidates already in ``done`` are not measured again. A candidate's
    ``method`` is ``ssd`` (default; with ``draft_vocab`` set, drafting over the ``vocab`` ids),
    ``pld`` or ``cascade`` (drafting with ``bigram``).
    """
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    engine = Engine(lm)
    out = list(done or [])
    engine.generate(prompt_ids[0], GenerationConfig(max_new_tokens=4))  # warm-up
    for cand in candidates[len(out):]:
        method = cand.get("method", "ssd")
        cfg = GenerationConfig(max_new_tokens=tokens, draft_len=int(cand["draft_len"]))
        t_ar = n_ar = t_sd = n_sd = drafted = accepted = steps = same = rejections = 0
        for _ in range(repeats):
            for p in prompt_ids:
                a = engine.generate(p, cfg)
                b = engine.generate(p, cfg, drafter=_candidate_drafter(lm, cand, bigram, vocab, p))
                n, t = _decode_rate(a.stats)
                n_ar, t_ar = n_ar + n, t_ar + t
                n, t = _decode_rate(b.stats)
                n_sd, t_sd = n_sd + n, t_sd + t
                drafted += b.stats.drafted
                accepted += b.stats.accepted
                rejections += b.stats.rejections
                steps += b.stats.steps
                same += a.token_ids == b.token_ids
        rec = {"method": method, **{k: cand[k] for k in ("skip", "draft_len", "matchness", "draft_cost", "target", "split",
                                                          "vertical", "lenience", "min_prob", "draft_vocab")
                                    if k in cand},
               "measured_acceptance": round(accepted / drafted, 4) if drafted else 0.0,
               # per-token acceptance up to the first rejection (what the runtime's bandit models)
               "token_acceptance": round(accepted / (accepted + rejections), 4) if accepted + rejections else 0.0,
               "measured_mean_accepted": round((accepted + steps) / steps, 4) if steps else 0.0,
               "ar_tokens_per_s": round(n_ar / t_ar, 3), "ssd_tokens_per_s": round(n_sd / t_sd, 3),
               "measured_speedup": round((n_sd / t_sd) / (n_ar / t_ar), 4) if n_ar else 0.0,
               "identical_outputs": int(same),
               "prompts": len(prompt_ids), "repeats": repeats}
        out.append(rec)
        if on_done is not None:
            on_done(rec)
    return out


def search_domain(common: _Common, name: str, sequences: list, influence, costs: dict,
                  confirm_ids: list[list[int]], meta: dict) -> dict:
    """Bayesian search then timed confirmation for one domain (or the global set)."""
    _set_threads(common.threads)
    s = CalibrationSettings(**common.settings)
    work = WorkDir(Path(common.work[: -len(".work")]))
    lm = _get_model(common.spec, common.device, common.dtype)
    bb = lm.backbone
    cost_model = CostModel.from_dict(costs)
    space = make_space(s.space, bb.n_layers, influence)
    tpath = work.file("trials", name, "jsonl")
    history = _read_trials(tpath)
    scorer = None

    def score(skip: SkipSet) -> Estimate:
        nonlocal scorer
        if scorer is None:
            scorer = MatchnessScorer(bb, sequences)
        return estimate(skip, scorer, cost_model, s.max_draft_len)

    bar = None
    if common.progress and len(history) < s.trials:
        from tqdm.auto import tqdm

        bar = tqdm(total=s.trials, initial=len(history), desc=f"search {name}", leave=False)

    best_so_far = [max((h["target"] for h in history), default=0.0)]

    def on_trial(rec):
        _append_line(tpath, rec)
        best_so_far[0] = max(best_so_far[0], rec["target"])
        if bar is not None:
            bar.update(1)
            bar.set_postfix(best=f"{best_so_far[0]:.3f}")

    history = run_search(space, score, s.trials, seed=s.seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:6], 16),
                         n_init=s.init_trials, history=history, on_trial=on_trial)
    if bar is not None:
        bar.close()
    cands = top_candidates(history, s.confirm_candidates)
    cpath = work.file("confirm", name)
    done = []
    for d, c in zip(json.loads(cpath.read_text()) if cpath.exists() else [], cands):
        if (d.get("method", "ssd"), d.get("skip"), d.get("draft_len")) != ("ssd", c["skip"], c["draft_len"]):
            break  # measured for another candidate list: measure from here on
        done.append(d)

    measured: list[dict] = []

    def on_done_acc(rec):
        measured.append(rec)
        _write_json(cpath, done + measured)

    results = measure_candidates(lm, confirm_ids, cands, s.confirm_tokens, done=done, on_done=on_done_acc) if cands else []
    # no candidate at all (every trial proposed the empty set): layer skipping cannot be chosen
    best = max(results, key=lambda r: r["measured_speedup"]) if results else {
        "method": "ssd", "skip": "none", "draft_len": 1, "matchness": 1.0, "draft_cost": 1.0, "target": 0.0,
        "measured_acceptance": 0.0, "token_acceptance": 0.0, "measured_mean_accepted": 1.0, "measured_speedup": 0.0}
    # prompt lookup, timed the same way (it needs no search: its draft costs no forward)
    ppath = work.file("pld", name)
    if ppath.exists():
        pld = json.loads(ppath.read_text())
    else:
        pld = measure_candidates(lm, confirm_ids, [{"method": "pld", "skip": "none", "draft_len": s.pld_draft_len}],
                                 s.confirm_tokens)[0]
        _write_json(ppath, pld)
    cascade, bigram = _calibrate_cascade(lm, s, work, name, sequences, best, cost_model, confirm_ids)
    vocab, vocab_ids = _calibrate_vocab(lm, s, work, name, sequences, best, cascade["verify"], confirm_ids)
    reduced = vocab.get("timed")
    use_reduced = bool(reduced) and reduced["measured_speedup"] > best["measured_speedup"]
    timed = {"ssd": reduced if use_reduced else best, "pld": pld, "cascade": cascade["cascade_stats"]["timed"]}
    speed = {m: r["measured_speedup"] for m, r in timed.items()}
    winner = max(speed, key=speed.get)
    recheck = None
    if speed[winner] >= 1.0 + s.min_gain:
        # The best of several noisy measurements is biased upwards: time the winner once more and
        # decide on the mean of both.
        rpath = work.file("recheck", name)
        if rpath.exists():
            recheck = json.loads(rpath.read_text())
        else:
            recheck = measure_candidates(lm, confirm_ids, [timed[winner]], s.confirm_tokens, bigram=bigram,
                                         vocab=vocab_ids)[0]
            _write_json(rpath, recheck)
        speed[winner] = (speed[winner] + recheck["measured_speedup"]) / 2
    paying = {m: v for m, v in speed.items() if v >= 1.0 + s.min_gain}
    method = max(paying, key=paying.get) if paying else "ar"
    cascade["cascade_speedup"] = round(speed["cascade"], 4)
    return {"name": name, "skip": best["skip"], "draft_len": best["draft_len"], "pays": speed["ssd"] >= 1.0 + s.min_gain,
            "method": method, "estimated_matchness": best["matchness"], "estimated_draft_cost": best["draft_cost"],
            "estimated_speedup": best["target"], "measured_acceptance": best["measured_acceptance"],
            "measured_speedup": round(speed["ssd"], 4), "measured_mean_accepted": best["measured_mean_accepted"],
            "pld_speedup": round(speed["pld"], 4), "pld_acceptance": pld["measured_acceptance"],
            "token_acceptance": {m: r.get("token_acceptance") for m, r in timed.items()},
            "pld_draft_len": s.pld_draft_len, "trials": len(history),
            "candidates": results + [pld] + ([{**recheck, "recheck": True}] if recheck else []),
            "reduced_vocab": use_reduced, "draft_vocab": vocab_ids, "vocab_stats": vocab,
            **cascade, **meta}


def _calibrate_vocab(lm, s: CalibrationSettings, work: "WorkDir", name: str, sequences: list, best: dict,
                     verify: list[float], confirm_ids: list[list[int]]) -> tuple[dict, np.ndarray | None]:
    """The domain's reduced draft vocabulary (issue 9): token ranking over its prompts and continuations,
    leave-one-out coverage of the continuations and measured draft cost for each size in
    ``vocab_sizes``, the size with the best estimated speedup for the best skip set at its own
    draft length (``verify``: the domain's verification costs), and, when that beats the full
    head's estimate, a timed run of the skip set drafting over it.
    Returns the record (``{}`` when the skip set drafts nothing) and the chosen ids."""
    from adaptive.costs import extrapolate, measure_head_costs
    from adaptive.costs import expected_tokens_per_step
    from adaptive.drafters.vocab import coverage_curve, rank_tokens

    bb = lm.backbone
    sizes = [v for v in s.vocab_sizes if v < bb.vocab_size]
    if best["skip"] in ("none", "") or not sizes:
        return {}, None
    ranking = rank_tokens([list(p) + list(c) for p, c in sequences], bb.vocab_size)
    path = work.file("vocab", name)
    if path.exists():
        rec = json.loads(path.read_text())
    else:
        coverage = coverage_curve([list(p) + list(c) for p, c in sequences], [list(c) for _, c in sequences], sizes,
                                  bb.vocab_size)
        masks = SkipSet.from_text(best["skip"], lm.n_layers).masks(lm.n_layers)
        costs = measure_head_costs(bb, masks, [*sizes, bb.vocab_size], context=s.cost_context)
        a = float(best.get("token_acceptance") or 0.0)
        k = int(best["draft_len"])  # the skip set's own draft length: sizes compared at equal k (an
        v_k = extrapolate(verify, k)  # optimised k would collapse to 0, "do not draft", wherever the model is pessimistic)

        def est(acc: float, c: float) -> float:
            return round(expected_tokens_per_step(acc, k) / (k * c + v_k), 4)

        full = est(a, costs[bb.vocab_size])
        ests = {v: est(a * coverage[v], costs[v]) for v in sizes}
        size = max(ests, key=ests.get)
        rec = {"size": size, "vocab_size": bb.vocab_size, "coverage": coverage, "draft_len": k,
               "draft_cost": {str(v): c for v, c in costs.items()},
               "estimate": {str(v): e for v, e in ests.items()}, "full_estimate": full}
        if ests[size] > full:
            cand = {"method": "ssd", "skip": best["skip"], "draft_len": k, "draft_vocab": size}
            rec["timed"] = measure_candidates(lm, confirm_ids, [cand], s.confirm_tokens, vocab=ranking[:size])[0]
        _write_json(path, rec)
    return rec, ranking[: rec["size"]]


def _calibrate_cascade(lm, s: CalibrationSettings, work: "WorkDir", name: str, sequences: list, best: dict,
                       cost_model: CostModel, confirm_ids: list[list[int]]) -> tuple[dict, object]:
    """The domain's bigram table, its statistical drafter's measured acceptance, the cascade's starting
    configuration (from those and the best skip set's measured acceptance), and its timed speedup.
    Returns the profile fields and the table."""
    from adaptive.calibrate.cascade import choose_cascade, statistical_acceptance
    from adaptive.drafters.ngram import build_bigram_table

    from adaptive.costs import measure_verify_costs

    bigram = build_bigram_table([list(p) + list(c) for p, c in sequences], s.bigram_min_count)
    path = work.file("cascade", name)
    if path.exists():
        rec = json.loads(path.read_text())
    else:
        n = s.cascade_max_draft_len
        # verification costs at this domain's context length (long prompts make long drafts relatively cheap)
        context = int(np.median([len(p) for p, _ in sequences])) + s.confirm_tokens // 2
        verify = measure_verify_costs(lm.backbone, context, max_verify=n + 1)
        stats = statistical_acceptance(sequences, n, s.bigram_min_count)
        skip_ok = best["skip"] not in ("none", "") and (best.get("token_acceptance") or 0) > 0
        cfg = choose_cascade(stats["position_acceptance"], float(best.get("token_acceptance") or 0.0),
                             float(best["draft_cost"]), verify, n, s.cascade_max_split if skip_ok else 0,
                             s.cascade_lenience)
        timed = measure_candidates(lm, confirm_ids, [{"method": "cascade", "skip": best["skip"], **cfg.to_dict()}],
                                   s.confirm_tokens, bigram=bigram)[0]
        rec = {"cascade": cfg.to_dict(), "cascade_speedup": timed["measured_speedup"],
               "cascade_stats": {"statistical": stats, "timed": timed}, "verify": verify, "verify_context": context}
        _write_json(path, rec)
    return {**rec, "bigram": (bigram.keys, bigram.succ, bigram.prob)}, bigram


# -- parallel execution ------------------------------------------------------------------------------

def _run_parallel(fn, arg_list: list[tuple], jobs: int, backend: str, scheduler: str | None) -> list:
    """Run ``fn(*args)`` for each args tuple with joblib's ``backend``; in-process when ``jobs == 1``."""
    if jobs == 1 and backend in ("loky", "threading"):
        return [fn(*args) for args in arg_list]
    from joblib import Parallel, delayed, parallel_config

    if backend in ("loky", "threading"):
        with parallel_config(backend=backend, n_jobs=jobs):
            return Parallel()(delayed(fn)(*args) for args in arg_list)
    if backend == "dask":
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:
            raise ConfigError("--backend dask needs dask[distributed]: pip install 'adaptive[dask]'") from None
        cluster = None
        if scheduler:
            try:
                client = Client(scheduler, timeout="20s")
            except (OSError, TimeoutError) as exc:
                raise ConfigError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from None
        else:
            cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None)
            client = Client(cluster)
        try:
            with parallel_config(backend="dask", n_jobs=jobs):
                return Parallel()(delayed(fn)(*args) for args in arg_list)
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
    if backend == "ray":
        try:
            import ray
            from ray.util.joblib import register_ray
        except ImportError:
            raise ConfigError("--backend ray needs ray: pip install 'adaptive[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=scheduler) if scheduler else ray.init()
        register_ray()
        with parallel_config(backend="ray", n_jobs=jobs):
            return Parallel()(delayed(fn)(*args) for args in arg_list)
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


# -- the whole calibration -------------------------------------------------------------------------

def _domains_digest(domains: dict[str, list[str]]) -> str:
    h = hashlib.sha256()
    for name in sorted(domains):
        h.update(name.encode() + b"\0")
        for p in domains[name]:
            h.update(p.encode() + b"\1")
    return h.hexdigest()[:16]


def check_domains(domains: dict[str, list[str]], settings: CalibrationSettings) -> dict[str, list[str]]:
    """The prompts actually used: the first ``prompts_per_domain`` of each domain (in file order)."""
    if not domains:
        raise ConfigError("no domains to calibrate")
    for reserved in (GLOBAL, "global"):
        if reserved in domains:
            raise ConfigError(f"{reserved!r} is reserved for the global skip set; rename that domain")
    out = {}
    for name, prompts in domains.items():
        prompts = [p for p in prompts if isinstance(p, str) and p.strip()]
        if len(prompts) < MIN_PROMPTS:
            raise ConfigError(f"domain {name!r} has {len(prompts)} prompt(s); calibration needs at least {MIN_PROMPTS}")
        out[name] = prompts[: settings.prompts_per_domain]
    return out


def check_room(encoded: dict[str, list[list[int]]], room: int, limit: int, what: str) -> None:
    """Refuse (:class:`PromptTooLongError`, naming the domain and prompt) any encoded prompt that
    leaves fewer than ``room`` positions in a context of ``limit`` for ``what`` to generate.
    Prompts are not truncated: a cut prompt would tune for text nobody sends."""
    for name, prompts in encoded.items():
        for i, ids in enumerate(prompts, 1):
            if len(ids) + room > limit:
                raise PromptTooLongError(
                    f"domain {name!r}, prompt {i}: {len(ids)} tokens, and {what} needs {room} more, but the "
                    f"model's context is {limit}; shorten or remove that prompt")


def check_prompt_lengths(lm, domains: dict[str, list[str]], settings: CalibrationSettings) -> None:
    """:func:`check_room` for calibration: each prompt encoded as calibration encodes it, with room
    for the continuation and the timed decoding."""
    from adaptive.engine.engine import Engine

    engine = Engine(lm)
    room = max(settings.continuation_tokens, settings.confirm_tokens) + settings.max_draft_len + 1
    encoded = {name: [engine.encode(p, chat=settings.chat) for p in prompts] for name, prompts in domains.items()}
    check_room(encoded, room, lm.backbone.max_positions, "calibration")


def calibrate(model_spec: str, domains: dict[str, list[str]], out: str | Path,
              settings: CalibrationSettings | None = None, *, jobs: int = 1, backend: str = "loky",
              scheduler: str | None = None, resume: bool = False, device: str = "auto", dtype: str = "auto",
              progress: bool = True, log: Callable[[str], None] = lambda msg: None,
              cost_model: CostModel | None = None) -> Profile:
    """Calibrate ``model_spec`` on ``domains`` (``{name: [prompt, ...]}``) and write the profile to ``out``.

    ``cost_model`` replaces the timed measurement (e.g. another profile's, for a reproducible search:
    with it and the same seed, the search is deterministic; the final choice among the
    ``confirm_candidates`` best is by timed decoding, hence noisy unless that is 1).
    """
    from adaptive import __version__
    from adaptive.index.anchors import AnchorIndex
    from adaptive.models import resolve_device, resolve_dtype

    settings = settings or CalibrationSettings()
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a positive integer, got {jobs!r}")
    if scheduler and backend not in ("dask", "ray"):
        raise ConfigError("--scheduler is for --backend dask or ray")
    domains = check_domains(domains, settings)
    if jobs > len(domains) + 1:
        raise ConfigError(f"{jobs} jobs for {len(domains) + 1} tasks ({len(domains)} domains and the global set): use at most {len(domains) + 1}")
    out = Path(out)
    check_writable(out)
    started = time.perf_counter()
    lm = _get_model(model_spec, device, dtype)
    check_prompt_lengths(lm, domains, settings)  # before anything is written: a bad prompt leaves nothing behind
    log(f"calibrating {model_spec} on {len(domains)} domains: {', '.join(sorted(domains))}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fingerprint = replace(lm.fingerprint(), spec=model_spec, dtype=str(dt).replace("torch.", ""))
    work = WorkDir(out)
    state = {"settings": settings.to_dict(), "model": fingerprint.to_dict(), "domains": _domains_digest(domains),
             "costs": cost_model.to_dict() if cost_model is not None else "measured"}
    state_path = work.path / "state.json"
    had_work = work.path.exists()
    work.acquire()  # first: a live calibration of this output is reported as such, not as a leftover
    if had_work and state_path.exists() and not resume:
        work.release()
        raise CalibrationError(f"an interrupted calibration left {work.path}: pass --resume to continue it, or delete it to start over")
    try:
        if state_path.exists():
            old = json.loads(state_path.read_text())
            if old != state:
                diff = [k for k in state if old.get(k) != state[k]]
                raise CalibrationError(f"--resume: the checkpoint in {work.path} was made with different {', '.join(diff)}; "
                                       "rerun with the same model, domains and settings, or delete it")
            log(f"resuming from {work.path}")
        else:
            _write_json(state_path, state)
        cost_path = work.file("costs")
        if cost_model is not None:
            costs = cost_model
        elif cost_path.exists():
            costs = CostModel.from_dict(json.loads(cost_path.read_text()))
        else:
            log("measuring the cost model ...")
            costs = measure_costs(lm.backbone, context=settings.cost_context)
            _write_json(cost_path, costs.to_dict())
        threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
        common = _Common(model_spec, device, dtype, settings.to_dict(), str(work.path), threads, progress)
        names = sorted(domains)
        log(f"preparing {len(names)} domains ...")
        preps = _run_parallel(prepare_domain, [(common, n, domains[n]) for n in names], jobs, backend, scheduler)
        prep = {p["name"]: p for p in preps}
        index = AnchorIndex.build({n: prep[n]["embeddings"] for n in names}, per_domain=settings.anchors_per_domain,
                                  seed=settings.seed, k=settings.route_k)
        n_anchors = {n: index.labels.count(n) for n in names}
        tasks = []
        for n in names:
            p = prep[n]
            tasks.append((common, n, p["sequences"], p["influence"], costs.to_dict(),
                          p["ids"][: settings.confirm_prompts], {"prompts": len(p["ids"]), "anchors": n_anchors[n]}))
        # the global set: sequences taken round-robin over domains, as many as one domain has
        pool = [p["sequences"][i] for i in range(settings.prompts_per_domain) for n in names
                for p in [prep[n]] if i < len(p["sequences"])][: settings.prompts_per_domain]
        confirm = [prep[n]["ids"][0] for n in names][: settings.confirm_prompts]
        influence = sum(prep[n]["influence"] for n in names) / len(names)
        tasks.append((common, GLOBAL, pool, influence, costs.to_dict(), confirm,
                      {"prompts": sum(len(prep[n]["ids"]) for n in names), "anchors": len(index.labels)}))
        log(f"searching skip sets ({settings.trials} trials each) ...")
        results = _run_parallel(search_domain, tasks, jobs, backend, scheduler)
        by_name = {r["name"]: r for r in results}
        dprof = {n: _domain_profile(by_name[n], settings) for n in names}
        glob = _domain_profile({**by_name[GLOBAL], "name": "global"}, settings)
        profile = Profile(model=fingerprint, settings={**settings.to_dict(), "jobs": jobs, "backend": backend,
                                                       "seconds": round(time.perf_counter() - started, 1)},
                          runtime=RuntimeSettings(chat=settings.chat, max_draft_len=settings.max_draft_len,
                                                  cascade_max_draft_len=settings.cascade_max_draft_len,
                                                  pld_draft_len=settings.pld_draft_len),
                          cost_model=costs, domains=dprof, global_set=glob, index=index,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), version=__version__)
        save_profile(profile, out)
    except BaseException:
        work.release()
        raise
    work.remove()
    return profile


def _measurement(rec: dict, role: str) -> Measurement:
    """A timed record of :func:`measure_candidates` as a typed :class:`Measurement`."""
    cascade = None
    if rec.get("method") == "cascade":
        cascade = CascadeConfig(split=int(rec["split"]), draft_len=int(rec["draft_len"]), vertical=bool(rec["vertical"]),
                                lenience=float(rec["lenience"]), min_prob=float(rec["min_prob"]),
                                max_split=max(int(rec["split"]), 0))
    return Measurement(
        drafter=rec.get("method", "ssd"), role="recheck" if rec.get("recheck") else role, draft_len=int(rec["draft_len"]),
        speedup=float(rec["measured_speedup"]), acceptance=float(rec["measured_acceptance"]),
        token_acceptance=float(rec.get("token_acceptance", 0.0)), mean_accepted=float(rec["measured_mean_accepted"]),
        ar_tokens_per_s=float(rec["ar_tokens_per_s"]), tokens_per_s=float(rec["ssd_tokens_per_s"]),
        identical_outputs=int(rec["identical_outputs"]), prompts=int(rec["prompts"]), repeats=int(rec["repeats"]),
        skip=str(rec.get("skip", "none")), estimated_acceptance=rec.get("matchness"),
        estimated_draft_cost=rec.get("draft_cost"), estimated_speedup=rec.get("target"), cascade=cascade,
        draft_vocab=rec.get("draft_vocab"))


def _domain_profile(r: dict, s: CalibrationSettings) -> DomainRecord:
    """The typed record of one domain from :func:`search_domain`'s result."""
    tok = r.get("token_acceptance") or {}
    stats = (r.get("cascade_stats") or {}).get("statistical")
    vocab = r.get("vocab_stats") or {}
    skip = SkipSet.from_text(r["skip"]) if r["skip"] else SkipSet((), ())
    a_ssd = tok.get("ssd") if tok.get("ssd") is not None else (r["measured_acceptance"] or r["estimated_matchness"])
    a_pld = tok.get("pld") if tok.get("pld") is not None else (r.get("pld_acceptance") or 0.5)
    by_pos = tuple(stats["position_acceptance"]) if stats else ()
    a_stat = stats["token_acceptance"] if stats else a_pld
    reduced_cost = None
    if vocab.get("draft_cost"):
        costs = vocab["draft_cost"]
        reduced_cost = r["estimated_draft_cost"] * costs[str(vocab["size"])] / costs[str(vocab["vocab_size"])]
    method = r.get("method") or "ar"
    fixed = {"ssd": int(r["draft_len"]), "pld": s.pld_draft_len,
             "cascade": int(r["cascade"]["draft_len"]) if r.get("cascade") else s.pld_draft_len, "ar": 1}
    speed = {"ssd": r["measured_speedup"], "pld": r.get("pld_speedup"), "cascade": r.get("cascade_speedup"), "ar": 1.0}
    roles = []
    for rec in r["candidates"]:
        roles.append(_measurement(rec, "lookup" if rec.get("method") == "pld" else "candidate"))
    if r.get("cascade_stats"):
        roles.append(_measurement(r["cascade_stats"]["timed"], "cascade"))
    if vocab.get("timed"):
        roles.append(_measurement(vocab["timed"], "vocab"))
    return DomainRecord(
        name=r["name"], prompts=int(r["prompts"]), anchors=int(r["anchors"]),
        decision=Decision(method, fixed[method], float(speed[method] if speed[method] is not None else 1.0)),
        layer_skip=SkipSearch(skip, int(r["draft_len"]), float(r["estimated_matchness"]),
                              float(r["estimated_draft_cost"]), float(r["estimated_speedup"]), int(r["trials"])),
        priors=Priors(layer_skip=Prior(min(max(float(a_ssd), 0.0), 1.0), float(r["estimated_draft_cost"])),
                      lookup=Prior(float(a_pld), STAT_DRAFT_COST),
                      statistical=Prior(float(a_stat), STAT_DRAFT_COST, by_pos),
                      reduced_head_cost=reduced_cost),
        verify=tuple(r.get("verify") or (1.0,)), verify_context=int(r.get("verify_context", 0)),
        cascade=CascadeConfig.from_dict(r["cascade"]) if r.get("cascade") else CascadeConfig(
            split=0, draft_len=s.pld_draft_len, max_split=0),
        statistical=StatisticalAcceptance.from_dict(stats) if stats else None,
        vocab=VocabChoice(size=int(vocab["size"]), vocab_size=int(vocab["vocab_size"]), draft_len=int(vocab["draft_len"]),
                          coverage={str(k): float(v) for k, v in vocab["coverage"].items()},
                          draft_cost=vocab["draft_cost"], estimate=vocab["estimate"],
                          full_estimate=float(vocab["full_estimate"]), use=bool(r.get("reduced_vocab")))
        if vocab else None,
        measurements=tuple(roles),
        bigram=BigramTable(*r["bigram"]) if r.get("bigram") is not None else None,
        draft_vocab=np.asarray(r["draft_vocab"]) if r.get("draft_vocab") is not None else None)
