"""Online distillation (issue 61, item 6): a server refines each domain's eagle head on the text it serves.

The profile's head (``adaptive distill --drafter eagle``) was trained on the calibration's prompts. A
server then sees its own traffic, often of a domain the head never saw (one the online learner found
among out-of-domain requests, :mod:`adaptive.runtime.online`). :class:`HeadRefiner` learns from it as
the online learner's bigram tables do, from what the target itself produced:

1. **Observe.** Every greedy request a runtime finishes (:class:`~adaptive.runtime.runtime.FinishedRequest`,
   either engine's: the text is the same model's) is kept under the record it was decoded with (a
   calibrated domain, a learned one, or ``global``): its prompt and output ids, the last ``keep`` of
   them per domain. Every ``held_every``-th one is *held out*: never trained on, it is what a round
   decides by.
2. **A round**, once ``every`` new requests of a domain are kept (on the refiner's own thread):
   the target's feature rows of each kept sequence are captured in one teacher-forced forward on the
   torch engine (once per sequence, then kept with it); a copy of the domain's current head (its
   refined one; a domain learned online without one: the global record's refined one, as the runtime
   drafts it; else the profile's) is trained ``steps`` steps as ``adaptive distill`` trains
   (:class:`~adaptive.distill.heads.HeadTrainer`: forward KL to the target's distribution over the
   head's rows and the prompt's tokens, unrolled steps) at a smaller learning rate; then the held-out
   sequences' first-draft acceptance (greedy verification's, over each one's drafter rows,
   :meth:`~adaptive.distill.heads.HeadTrainer.evaluate`) of the current head and of the copy are
   compared sequence by sequence (:func:`adoption`: positions within one sequence are not independent
   draws, sequences are). The copy is **adopted** only if, over at least ``min_held`` held-out
   sequences, it keeps at least ``margin`` more first drafts and its paired gain per sequence is
   significant (a one-sided t test at 95%): the runtime drafts that domain with it from then on
   (:meth:`~adaptive.runtime.runtime.AdaptiveRuntime.set_eagle_head`; requests already decoding keep
   theirs). Otherwise the domain keeps its head and waits for ``every`` more requests.
3. **Persist.** An adopted head is written atomically beside the online overlay,
   ``PROFILE.online.d/REPLICA.head-DOMAIN.safetensors`` (its metadata: the profile's digest, the domain,
   the acceptance before and after, the rounds), and loaded again when a server of that replica starts
   over the same profile; a head of another calibration (another digest) is left out, a damaged file
   is reported in :meth:`HeadRefiner.state` and left out. ``adaptive profile reset-online`` removes
   them with the overlays. Each replica refines its own heads (they are not merged).

The model's time: every block of a round (a sequence's capture, a training step, an evaluation) is
taken through ``guard`` (a :class:`~adaptive.runtime.turns.ShareGuard` over the model lock): at once
while serving is idle, within its share of the time while serving is busy.

Only what is *drafted* changes: verification decides every token, so outputs stay those of plain
decoding (the runtime's lossless tests hold for any head).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from adaptive.distill.heads import HeadConfig, HeadData, HeadTrainer
from adaptive.drafters.eagle import EagleHead, HeadShape
from adaptive.errors import ConfigError
from adaptive.profile import GLOBAL
from adaptive.profile.overlay import default_replica_id, overlay_path, profile_digest, replica_dir
from adaptive.workdir import atomic_write

log = logging.getLogger("adaptive.refine")

HISTORY = 64  # the latest rounds kept for state() and the benchmark
REFINED_FORMAT = "adaptive-refined-head"
REFINED_VERSION = "1"
HEAD_INFIX = ".head-"  # REPLICA.head-DOMAIN.safetensors
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class RefineSettings:
    """How a :class:`HeadRefiner` learns (see the module doc). ``every``: a domain's new greedy requests
    between rounds; ``steps``, ``lr``: a round's training; ``keep``: sequences kept per domain (the
    oldest go first); ``kept_positions``: the positions of a sequence kept with their feature rows (its
    last ones; the rows come from a forward over the whole sequence: a training window's length bounds
    what the head learns from anyway); ``held_every``: every so many a domain's held-out one;
    ``min_held``: held-out sequences a round needs to decide; ``margin``: the rise in first-draft
    acceptance a copy must show to be adopted; ``background=False``: rounds run in the observing thread
    (tests); ``persist=False``: load adopted heads, never write them; ``feature_mib``: the feature rows
    kept over all domains (beyond it, other domains' rows go, least recently refined first, and are
    captured again at their next round)."""

    every: int = 16
    steps: int = 40
    lr: float = 3e-4
    keep: int = 64
    kept_positions: int = 256
    held_every: int = 4
    min_held: int = 4
    margin: float = 0.01
    background: bool = True
    persist: bool = True
    feature_mib: float = 256.0
    seed: int = 0

    def __post_init__(self):
        for name in ("every", "steps", "keep", "kept_positions", "min_held"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"head refinement's {name} must be a positive integer, got {v!r}")
        if not isinstance(self.held_every, int) or self.held_every < 2:
            raise ConfigError(f"head refinement's held_every must be an integer >= 2, got {self.held_every!r}")
        if not self.lr > 0:
            raise ConfigError(f"head refinement's lr must be > 0, got {self.lr}")
        if not self.feature_mib > 0:
            raise ConfigError(f"head refinement's feature_mib must be > 0, got {self.feature_mib}")
        if not 0.0 <= self.margin < 1.0:
            raise ConfigError(f"head refinement's margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True)
class RefineRound:
    """One round's outcome: the domain, its round number, the sequences it trained on and held out,
    the held-out positions, the first-draft acceptance of the current head (``before``) and of the
    trained copy (``after``), the paired test's ``t`` (:func:`adoption`), whether the copy was adopted,
    and the round's seconds."""

    domain: str
    round: int
    train_sequences: int
    held_sequences: int
    held_rows: int
    before: float
    after: float
    t: float | None  # None: every sequence gained the same (no spread; JSON has no infinity)
    adopted: bool
    seconds: float
    at: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Sequence:
    ids: list[int]  # the whole request: prompt and output
    start: int  # where the output begins
    held: bool
    features: torch.Tensor | None = None  # [T', n, H] bf16 on the host: the rows of the kept positions
    cut: int = 0  # the positions before the kept ones (their rows come from a forward over the whole)


@dataclass
class _Domain:
    kept: deque = field(default_factory=deque)
    seen: int = 0  # greedy requests observed
    pending: int = 0  # since the last round
    rounds: int = 0
    last: RefineRound | None = None


# Student's t: the one-sided 95% critical value for 1..30 degrees of freedom (beyond: 30's, a little above
# the normal's 1.645); a test holds it to scipy.stats.t.ppf(0.95, df)
T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def t_critical(df: int) -> float:
    """The one-sided 95% critical value of Student's t with ``df`` >= 1 degrees of freedom."""
    return T_95[min(df, len(T_95)) - 1]


@dataclass(frozen=True)
class Adoption:
    """:func:`adoption`'s verdict: the pooled first-draft acceptance ``before`` and ``after`` over ``rows``
    held-out positions, the paired ``t`` statistic over sequences, and whether to adopt."""

    before: float
    after: float
    rows: int
    t: float
    adopted: bool


def adoption(before: list[tuple[int, int]], after: list[tuple[int, int]], margin: float) -> Adoption:
    """Whether a trained copy replaces the current head. ``before``/``after``: per held-out sequence,
    ``(first drafts kept, first drafts made)`` by the current head and by the copy (the same rows). Adopt
    when the pooled acceptance rises by at least ``margin`` and the per-sequence gains ``d_s`` (the copy's
    acceptance on sequence ``s`` minus the current's) are significantly positive: a paired one-sided t
    test at 95%, ``t = mean(d) / (sd(d) / sqrt(n)) >= t_critical(n - 1)`` (all gains equal and positive:
    ``t`` infinite). Positions within one sequence are not independent draws; sequences are.

    Worked example: rows (10, 10, 10, 10), kept before (3, 4, 5, 4), after (5, 5, 6, 6): pooled 0.400 ->
    0.550, gains (0.2, 0.1, 0.1, 0.2), mean 0.15, sd 0.0577, t = 5.20 >= 2.353 (3 degrees of freedom):
    adopted. After (5, 3, 6, 4) instead: gains (0.2, -0.1, 0.1, 0), t = 0.77: kept, though the pooled
    rise is 0.05.
    """
    rows = sum(m for _, m in before)
    gains = [(ka - kb) / m for (kb, m), (ka, _) in zip(before, after) if m > 0]
    if rows == 0 or not gains:
        return Adoption(0.0, 0.0, 0, 0.0, False)
    b = sum(k for k, _ in before) / rows
    a = sum(k for k, _ in after) / rows
    mean = sum(gains) / len(gains)
    var = sum((g - mean) ** 2 for g in gains) / max(len(gains) - 1, 1)
    if var > 0:
        t = mean / math.sqrt(var / len(gains))
    else:
        t = math.inf if mean > 0 else (-math.inf if mean < 0 else 0.0)
    significant = len(gains) > 1 and t >= t_critical(len(gains) - 1)
    return Adoption(round(b, 4), round(a, 4), rows, round(t, 3) if math.isfinite(t) else t,
                    a >= b + margin and significant)


def head_file(directory: Path, replica: str, domain: str) -> Path:
    """Where ``replica``'s head for ``domain`` lives in the overlays' directory ``directory``."""
    return directory / f"{replica}{HEAD_INFIX}{_SAFE.sub('_', domain)}.safetensors"


class HeadRefiner:
    """Refines the eagle head of each domain a runtime serves (see the module doc); a
    :class:`~adaptive.runtime.runtime.RequestListener`. ``lm``: the torch engine's loaded model (its
    features); ``profile``: that engine's profile (where adopted heads are saved); ``head``: the
    profile's head; ``adopt(domain, head)``: hands an adopted head to the runtime; ``guard``: a context
    manager taken around every block of model time (``None``: none, for tests); ``replica``: the file
    names' replica (``None``: host and pid); ``directory``: where adopted heads are saved (``None``: beside
    the profile's online overlay, ``PROFILE.online.d``); ``current(domain)``: the head the runtime drafts
    the domain with now (``None``: the profile's; without it: the domain's adopted one). Thread-safe."""

    name = "heads"

    def __init__(self, lm, profile, head: EagleHead, adopt: Callable[[str, EagleHead], None],
                 settings: RefineSettings | None = None, guard=None, replica: str | None = None,
                 directory: str | Path | None = None, current: Callable[[str], EagleHead | None] | None = None):
        self.lm, self.profile, self.settings = lm, profile, settings or RefineSettings()
        self.bb = lm.backbone
        if head.shape.top != self.bb.feature_top or not self.bb.keeps_features(head.shape.layers):
            raise ConfigError(f"the {self.bb.engine} engine does not keep the features this head was trained on")
        self.base = head
        self.shape: HeadShape = head.shape
        self._adopt = adopt
        self._current = current
        self._guard = guard
        self.replica = replica or default_replica_id()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.domains: dict[str, _Domain] = {}
        self.heads: dict[str, EagleHead] = {}  # domain -> its adopted head
        self.history: deque[RefineRound] = deque(maxlen=HISTORY)  # the latest rounds
        self.rounds = 0  # rounds run, and adopted, in all
        self.adopted = 0
        self.errors: deque[str] = deque(maxlen=HISTORY)
        self.skipped = 0  # requests not kept (sampled, too short or too long, another engine's learned domain)
        self.round_seconds = 0.0
        self._due: deque[str] = deque()
        self._active = False  # a round is running
        if directory is None and profile.path is not None:
            directory = replica_dir(overlay_path(profile.path))
        self.directory = Path(directory) if directory is not None else None
        self._digest = profile_digest(profile.path) if profile.path is not None else ""
        self._thread: threading.Thread | None = None
        if self.directory is not None:
            self._load()
        if self.settings.background:
            self._thread = threading.Thread(target=self._work, name="adaptive-refine", daemon=True)
            self._thread.start()

    # -- what a runtime calls ---------------------------------------------------------------------

    def observe(self, finished) -> None:
        """Keep a finished request's text (greedy ones only: the target's own greedy text is what a
        head is judged against; of another engine, only those of a calibrated domain or the global
        record); a round is due once its domain has ``every`` new ones."""
        # another engine's learned domain is that engine's own (each member of a two-engine runtime learns
        # its own), not the one of the same name here: its text is not kept
        foreign = finished.engine != self.bb.engine and finished.domain not in self.profile.domains \
            and finished.domain != GLOBAL
        size = len(finished.prompt) + len(finished.output)
        if not finished.greedy or len(finished.output) < 2 or size >= self.bb.max_positions or foreign:
            with self._lock:
                self.skipped += 1
            return
        s = self.settings
        with self._lock:
            if self._closed:
                return
            d = self.domains.setdefault(finished.domain, _Domain())
            held = d.seen % s.held_every == s.held_every - 1
            d.seen += 1
            d.kept.append(_Sequence(list(finished.prompt) + list(finished.output), len(finished.prompt), held))
            while len(d.kept) > s.keep:
                d.kept.popleft()
            d.pending += 1
            due = d.pending >= s.every and finished.domain not in self._due
            if due:
                self._due.append(finished.domain)
                self._wake.notify_all()
        if due and not s.background:
            self.run_due()

    def state(self) -> dict:
        """What a server reports: per domain the requests kept and seen, the rounds, whether it drafts with
        a refined head and the last round; the rounds in all, adopted ones, their seconds, errors."""
        with self._lock:
            domains = {name: {"kept": len(d.kept), "seen": d.seen, "pending": d.pending, "rounds": d.rounds,
                              "refined": name in self.heads,
                              "last": d.last.to_dict() if d.last is not None else None}
                       for name, d in sorted(self.domains.items())}
            for name in self.heads:
                domains.setdefault(name, {"kept": 0, "seen": 0, "pending": 0, "rounds": 0, "refined": True,
                                          "last": None})
            return {"rounds": self.rounds, "adopted": self.adopted,
                    "round_seconds": round(self.round_seconds, 2), "skipped": self.skipped,
                    "domains": domains, "errors": list(self.errors)[-10:]}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no round is due or running (``timeout`` seconds at most); ``True`` if none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._due or self._active:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left if left is not None else 1.0)
            return True

    def close(self) -> None:
        """Stop the refiner's thread (a round under way stops at its next block; nothing half-made is kept)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # -- rounds -------------------------------------------------------------------------------------

    def run_due(self) -> list[RefineRound]:
        """Run every round that is due now, in this thread; the rounds run (one that fails is reported in
        :meth:`state`'s errors and changes nothing)."""
        done = []
        while True:
            with self._lock:
                if self._closed or not self._due:
                    self._wake.notify_all()
                    return done
                name = self._due.popleft()
                self._active = True
            try:
                r = self.refine(name)
            except _Stopped:  # closed meanwhile: nothing half-made is kept
                return done
            except Exception as exc:  # a failed round must not stop serving: reported, the head kept
                log.exception("a head refinement round of %s failed", name)
                with self._lock:
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                r = None
            finally:
                with self._lock:
                    self._active = False
                    self._wake.notify_all()
            if r is not None:
                done.append(r)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._due and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            self.run_due()

    def _block(self):
        if self._closed:
            raise _Stopped
        return self._guard if self._guard is not None else contextlib.nullcontext()

    def refine(self, domain: str) -> RefineRound | None:
        """One round for ``domain`` now (see the module doc); ``None`` when its held-out text is too short
        to decide yet (the round is not counted)."""
        t0 = time.perf_counter()
        s = self.settings
        with self._lock:
            d = self.domains[domain]
            kept = list(d.kept)
            d.pending = 0
        current = self.head_of(domain)
        for seq in kept:
            if seq.features is None:
                with self._block():
                    features = self._features(seq.ids)
                seq.cut = max(len(seq.ids) - s.kept_positions, 0)  # the last positions, their rows of the whole
                seq.features = features[seq.cut:].clone()
        self._bound_features(domain)
        train = self._data([q for q in kept if not q.held], domain)
        if len(train) == 0:
            return None
        held_seqs = [q for q in kept if q.held]
        if len(held_seqs) < s.min_held:
            return None
        cfg = HeadConfig(steps=s.steps, lr=s.lr, warmup=max(1, s.steps // 5), seed=s.seed + d.rounds,
                         layers=self.shape.layers, lookup=self.shape.lookup)
        trainer = HeadTrainer(self.bb, self.shape, current.ids.cpu(), cfg)
        trainer.head.load_state_dict(current.state_dict())
        held = [self._data([q], domain) for q in held_seqs]  # each alone: the test is over sequences
        before = self._kept_by_sequence(trainer, held)
        for _ in range(s.steps):
            with self._block():
                trainer.train_step(train)
        after = self._kept_by_sequence(trainer, held)
        verdict = adoption(before, after, s.margin)
        adopted = verdict.adopted
        with self._lock:
            d.rounds += 1
            t = verdict.t if math.isfinite(verdict.t) else None
            r = RefineRound(domain, d.rounds, len(train), len(held_seqs), verdict.rows, verdict.before,
                            verdict.after, t, adopted, round(time.perf_counter() - t0, 2),
                            time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            d.last = r
            self.history.append(r)
            self.rounds += 1
            self.adopted += adopted
            self.round_seconds += r.seconds
        log.info("head round %d of %s: first draft kept %.3f -> %.3f over %d held-out positions of %d sequences, "
                 "t %s (%s)", r.round, domain, r.before, r.after, r.held_rows, r.held_sequences, r.t,
                 "adopted" if adopted else "kept the current head")
        if adopted:
            head = EagleHead.from_state(self.shape, trainer.head.state())
            with self._lock:
                self.heads[domain] = head
            self._adopt(domain, head)
            self._save(domain, head, r)
        return r

    def feature_bytes(self) -> int:
        """Bytes of feature rows kept over all domains."""
        with self._lock:
            seqs = [q for d in self.domains.values() for q in d.kept]
        return sum(q.features.numel() * q.features.element_size() for q in seqs if q.features is not None)

    def _bound_features(self, domain: str) -> None:
        """Keep the feature rows within ``feature_mib``: other domains' go, least recently refined first
        (they are captured again at their next round)."""
        budget = self.settings.feature_mib * 2**20
        with self._lock:
            others = sorted((d.last.at if d.last is not None else "", name) for name, d in self.domains.items()
                            if name != domain)
        for _, name in others:
            if self.feature_bytes() <= budget:
                return
            with self._lock:
                for q in self.domains[name].kept:
                    q.features = None

    def head_of(self, domain: str) -> EagleHead:
        """The head ``domain`` drafts with now, as the runtime picks it (``current``), else the profile's."""
        head = self._current(domain) if self._current is not None else self.heads.get(domain)
        return head if head is not None else self.base

    @torch.inference_mode()
    def _features(self, ids: list[int]) -> torch.Tensor:
        """The target's feature rows of every position of ``ids`` (``[T, n, H]``, bf16 on the host), from
        one teacher-forced forward."""
        bb = self.bb
        cache = bb.new_cache(len(ids) + 1, features=self.shape.layers)
        bb.forward(torch.tensor(ids, device=bb.device), cache, 0)
        return cache.features[:len(ids)].to(device="cpu", dtype=torch.bfloat16).clone()

    def _kept_by_sequence(self, trainer: HeadTrainer, held: list[HeadData]) -> list[tuple[int, int]]:
        """Per held-out sequence (each its own :class:`HeadData`), ``(first drafts kept, first drafts made)``
        by ``trainer``'s head."""
        out = []
        for data in held:
            with self._block(), torch.no_grad():
                ev = trainer.evaluate(data, steps=1)
            out.append((round(ev["positions"][0] * ev["rows"]), ev["rows"]))
        return out

    def _data(self, seqs: list[_Sequence], domain: str) -> HeadData:
        return HeadData.build([(q.ids[q.cut:], q.features) for q in seqs], [max(q.start - q.cut, 0) for q in seqs],
                              [domain] * len(seqs), self.shape.lookup)

    # -- files ----------------------------------------------------------------------------------------

    def _save(self, domain: str, head: EagleHead, r: RefineRound) -> None:
        if self.directory is None or not self.settings.persist:
            return
        from safetensors.torch import save

        meta = {"format": REFINED_FORMAT, "version": REFINED_VERSION, "profile": self._digest, "domain": domain,
                "before": f"{r.before:.4f}", "after": f"{r.after:.4f}", "rounds": str(r.round),
                "created": r.at}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(head_file(self.directory, self.replica, domain),
                         save({k: v.contiguous().cpu() for k, v in head.state().items()}, metadata=meta))
        except OSError as exc:  # serving goes on with the head in memory
            log.warning("could not save the refined head of %s: %s", domain, exc)
            with self._lock:
                self.errors.append(f"save {domain}: {exc}")

    def _load(self) -> None:
        """This replica's adopted heads of this calibration (see the module doc)."""
        from safetensors import safe_open

        for path in sorted(self.directory.glob(f"{self.replica}{HEAD_INFIX}*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("format") != REFINED_FORMAT or meta.get("version") != REFINED_VERSION:
                        raise ValueError(f"not a refined head of this version ({meta.get('format')!r}, "
                                         f"{meta.get('version')!r})")
                    if meta.get("profile") != self._digest:
                        log.info("%s left out: refined for another calibration of the profile", path)
                        continue
                    head = EagleHead.from_state(self.shape, {k: f.get_tensor(k) for k in f.keys()})
            except Exception as exc:  # damaged or foreign: only speed is lost
                log.warning("refined head %s left out: %s", path, exc)
                self.errors.append(f"load {path.name}: {exc}")
                continue
            domain = meta["domain"]
            self.heads[domain] = head
            self._adopt(domain, head)


class _Stopped(Exception):
    """The refiner was closed while a round ran."""


def refined_heads(directory: str | Path, digest: str) -> list[dict]:
    """What ``adaptive profile show`` lists: every replica's refined heads in the overlays' ``directory``
    (``PROFILE.online.d``), each ``{"file", "replica", "domain", "before", "after", "rounds", "created",
    "stale"}`` (``stale``: refined for another calibration than ``digest``'s, so never loaded), or
    ``{"file", "error"}`` for a file that cannot be read."""
    from safetensors import safe_open

    out = []
    folder = Path(directory)
    for path in sorted(folder.glob(f"*{HEAD_INFIX}*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != REFINED_FORMAT:
                raise ValueError(f"not a refined head ({meta.get('format')!r})")
            out.append({"file": path.name, "replica": path.name.split(HEAD_INFIX)[0], "domain": meta.get("domain"),
                        "before": float(meta["before"]), "after": float(meta["after"]),
                        "rounds": int(meta["rounds"]), "created": meta.get("created"),
                        "stale": meta.get("profile") != digest})
        except Exception as exc:  # a damaged file is listed as such
            out.append({"file": path.name, "error": f"{type(exc).__name__}: {exc}"})
    return out


def attach_refiner(runtime, settings: RefineSettings | None = None, guard_for=None,
                   replica: str | None = None) -> HeadRefiner | None:
    """A :class:`HeadRefiner` listening to ``runtime`` (one engine, or a two-engine runtime: every member's
    requests, the head refined for the member that drafts with it), or ``None`` with the reason logged
    where no member drafts with an eagle head (no head in the profile, or no engine that keeps its
    features). ``guard_for(model_lock)``: the guard of its model time (e.g. a ``ShareGuard``); ``replica``:
    ``None``: the drafting member's online learner's, else host and pid; adopted heads are saved beside
    that learner's overlay (``PROFILE.online.d``)."""
    members = getattr(runtime, "runtimes", None) or {runtime.lm.engine: runtime}
    drafting = [rt for rt in members.values() if rt.features and "eagle" in rt.profile.distilled]
    if not drafting:
        log.info("no head refinement: no engine here drafts with an eagle head (train one with "
                 "`adaptive distill --drafter eagle`; it drafts on the engine it was trained on)")
        return None
    rt = drafting[0]
    rec, weights = rt.profile.distilled_drafter("eagle")
    head = EagleHead.from_state(HeadShape.from_dict(rec.shape), weights)
    online = getattr(rt, "online", None)  # its overlay's directory and replica id, where it learns
    where = getattr(online, "path", None)
    refiner = HeadRefiner(rt.lm, rt.profile, head, rt.set_eagle_head, settings,
                          guard_for(rt.model_lock) if guard_for is not None else None,
                          replica or getattr(online, "replica", None), replica_dir(where) if where else None,
                          rt.refined_eagle)
    runtime.add_listener(refiner)
    return refiner
