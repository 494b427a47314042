"""Online adaptation: the runtime learns from the traffic it serves (issue 20).

Three things are learned, all from what the target model itself accepted, so drafts follow it:

1. **Statistical tables.** Each record's bigram table (a calibrated domain, ``global``, or a learned
   domain) is a :class:`~adaptive.drafters.live.LiveBigramTable`: calibration's table plus the pairs
   of every finished request's output routed to that record (bounded: halved past ``max_pairs``).
2. **Bandits.** The draft-length bandits already update on every verification; their posteriors
   are now saved and restored, so a restarted server starts where the last one stopped.
3. **New domains.** A request the calibrated index flags out-of-domain is kept (its embedding,
   prompt and output ids) in a bounded buffer. Once ``min_cluster`` are pending,
   :func:`~adaptive.index.cluster.find_cluster` looks for a coherent group (FAISS k-means, then the
   calibration's leave-one-out test: at least ``coherence`` of the members lie within the
   out-of-domain threshold of anchors fitted without them). A group becomes a proposed domain; a
   background thread measures it as calibration measures a domain
   (:func:`~adaptive.measure.race.measure_learned_domain`: the statistical drafters' teacher-forced
   acceptance on the members' outputs, then prompt lookup, the cascade and, where the runtime drafts
   with an eagle head, the head raced against ``ar`` in
   paired blocks with bootstrap intervals, and the pure decision:
   :func:`~adaptive.measure.race.race_domain`, as calibration). Until that finishes its requests use
   the global record; after, they route to it (its anchors are searched when the calibrated index
   says out-of-domain). The race takes the model lock one block at a time through a
   :class:`~adaptive.runtime.turns.ShareGuard`: at once while serving is idle, and under load only
   while its own model time stays within ``share`` of the wall time (10% by default), so a
   measurement costs a busy server about that share of its throughput.

What was learned is saved beside the profile (:mod:`adaptive.profile.overlay`) every ``save_every``
requests, when a request is buffered, when a domain is learned and on :meth:`OnlineLearner.close`;
the calibrated profile is never written.

**Replicas** (issue 45). Each server is a *replica* (``replica``: ``--replica-id``, by default host
and pid) and writes only its own contribution, ``PROFILE.online.d/REPLICA.online``. At start and
then every ``merge_interval`` seconds while serving it reads the other replicas' files that changed
and merges them (:func:`~adaptive.profile.overlay.merge_overlays`): their pair counts are added to
its tables' answers (:meth:`LiveBigramTable.set_others`), their bandits' evidence to its bandits'
(``rebase``), their buffered requests join the pool that discovery clusters (so a domain seen a
little by every replica is found), and the domains they learned are adopted (a domain whose anchors
lie within the out-of-domain threshold of an earlier one is left out: one domain per traffic). One
replica measures a proposed domain at a time: it holds ``PROFILE.online.d/measuring.lock``
(``lock_timeout`` makes a dead holder's lock stale); the others adopt its record at their next merge,
and drop their buffered requests it took as members. Which files changed, the others' merged
state, which of their domains are adopted, the lock and the publishing thread are
:mod:`adaptive.runtime.replicas`'; folding the others' state into this replica's tables, bandits
and domains is the learner's, here (:meth:`OnlineLearner.merge`).

**Two engines' members.** A two-engine runtime (:mod:`adaptive.runtime.engines`) sends each request to
one member, each an :class:`~adaptive.runtime.AdaptiveRuntime` with its own learner and overlay
(``PROFILE/ENGINE.online``), so a domain's traffic is split between two buffers, and neither may hold
``min_cluster`` of it. :func:`link_members` (called by the two-engine runtime) pools them: each
member's discovery clusters its own pending requests (its replicas' included) and the other member's
(its :class:`~adaptive.runtime.replicas.MemberShare`, a snapshot read without the other's lock, ids
prefixed with the other's engine: ``torch/REPLICA:N``), as replicas pool theirs. That needs the
vectors to be comparable: the members were calibrated apart, each with its own index, and
are pooled only where both route on the same embedding (pooling, dimension, centring:
:func:`~adaptive.runtime.replicas.embedding_mismatch`), where the vectors differ only by the engines'
numerics (the same model's hidden state in Q4 kernels and in bf16); members that route on different
layers stay apart (the log and :meth:`OnlineLearner.state` say why: re-embedding each request on
the other engine would cost a prefill, not built). One member discovers at a time (neither proposes
while the other measures). The member that learns a domain measured it on its own engine; it hands
the domain (name, anchors, members' token ids) to the other (:meth:`OnlineLearner.offer`), which
measures it on *its* engine in turn (under its own measuring lock; until then those requests use its
global record), so each member decides with its own engine's race. A request counts once in
discovery: a domain's members are taken out of both members' pools (by id), and a member already
holding a domain near an offered one skips it. Another replica's members learn the domain from
their replicas' files as before.

Everything here only changes what is *drafted*: verification still decides every
token, so outputs stay those of plain decoding.

Why it runs past 600 lines: its one concern is the learner's state under its one lock (the tables,
the buffer, the learned domains, the domain being proposed and measured), and each change to it is
a method here; what only reads or writes beside it lives apart (the replicas' files, lock and
merged state in :mod:`adaptive.runtime.replicas`, a learned domain's race in
:mod:`adaptive.measure.race`, the overlay format in :mod:`adaptive.profile.overlay`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from adaptive.drafters.live import DEFAULT_MAX_PAIRS, DEFAULT_PRIOR_WEIGHT, LiveBigramTable, accepted_text
from adaptive.errors import AdaptiveError, ContextFullError
from adaptive.index.anchors import AnchorIndex, Route
from adaptive.index.cluster import find_cluster
from adaptive.measure.race import HeadCandidate, measure_learned_domain
from adaptive.profile import GLOBAL, DomainRecord, Profile
from adaptive.profile.overlay import (
    BufferedRequest,
    LearnedDomain,
    OnlineOverlay,
    OverlayError,
    PairCounts,
    check_replica_id,
    default_replica_id,
    overlay_path,
    profile_digest,
    replica_path,
    save_overlay,
)
from adaptive.runtime.replicas import (
    MeasuringLock,
    MemberShare,
    Others,
    Publisher,
    ReplicaFiles,
    adoptable,
    embedding_mismatch,
    load_own,
    lock_path,
    member_id,
    near,
)
from adaptive.runtime.turns import ShareGuard

log = logging.getLogger("adaptive.online")

LEARNED_PREFIX = "learned-"


@dataclass(frozen=True)
class OnlineSettings:
    """How the runtime learns from traffic (see the module doc). ``enabled=False``: nothing is
    learned, loaded or saved. ``path``: the overlay file (``None``: ``PROFILE.online`` beside the
    profile; a profile never saved to disk learns in memory only). ``persist=False``: load the
    overlay if there is one, learn in memory, never write.
    ``save_every``: requests between saves. ``prior_weight``, ``max_pairs``: the live tables'.
    ``buffer_size``: out-of-domain requests kept. ``min_cluster``: pending requests that may form a
    domain; ``coherence``: the share of them that must pass the leave-one-out test. ``discover=False``:
    tables and bandits only. ``background=False``: measure a proposed domain in the observing thread
    (tests). ``measure_prompts``: members a new domain is raced on (a verdict needs the
    profile's ``min_prompts`` of them). ``share``: the most of the
    model's time a measurement takes while serving is busy; ``idle_s``: how long serving must have
    left the model alone for a measurement to run freely (:class:`~adaptive.runtime.turns.ShareGuard`).
    ``replica``: this server's replica id (``None``: host and pid); ``merge_interval``: seconds between
    merges of the other replicas' files while serving (0: before every request's learning);
    ``lock_timeout``: seconds after which another replica's measuring lock is taken as a dead one's."""

    enabled: bool = True
    path: str | Path | None = None
    persist: bool = True
    save_every: int = 16
    prior_weight: float = DEFAULT_PRIOR_WEIGHT
    max_pairs: int = DEFAULT_MAX_PAIRS
    buffer_size: int = 64
    min_cluster: int = 8
    coherence: float = 0.75
    discover: bool = True
    background: bool = True
    measure_prompts: int = 6
    share: float = 0.1
    idle_s: float = 0.2
    replica: str | None = None
    merge_interval: float = 2.0
    lock_timeout: float = 900.0

    def __post_init__(self):
        if self.replica is not None:
            check_replica_id(self.replica)
        if self.merge_interval < 0 or self.lock_timeout <= 0:
            raise ValueError("merge_interval must be >= 0 and lock_timeout > 0")
        if self.save_every < 1 or self.buffer_size < 1 or self.max_pairs < 1 or self.measure_prompts < 1:
            raise ValueError("save_every, buffer_size, max_pairs and measure_prompts must be >= 1")
        if not 2 <= self.min_cluster <= self.buffer_size:
            raise ValueError(f"min_cluster must be in 2 .. buffer_size ({self.buffer_size}), got {self.min_cluster}")
        if not 0.0 < self.coherence <= 1.0 or self.prior_weight < 0:
            raise ValueError("coherence must be in (0, 1] and prior_weight >= 0")
        if not 0.0 < self.share <= 1.0 or self.idle_s < 0:
            raise ValueError("share must be in (0, 1] and idle_s >= 0")

    @classmethod
    def coerce(cls, online: bool | OnlineSettings | None) -> OnlineSettings:
        if isinstance(online, OnlineSettings):
            return online
        return cls(enabled=bool(online) if online is not None else True)


class _Stopped(Exception):
    """The learner was closed while a measurement ran."""


@dataclass(frozen=True, eq=False)
class Observation:
    """One finished request as the learner sees it: the raw pooled ``vector`` ``[d]``, ``prompt`` and
    ``output`` token ids, the record it was decoded with (``applied``) and whether the calibrated
    index flagged it out-of-domain (``flagged``; a request routed to a learned domain was flagged too)."""

    vector: np.ndarray
    prompt: Sequence[int]
    output: Sequence[int]
    applied: str
    flagged: bool
    learned: bool = False


@dataclass
class _Pending:
    name: str
    anchors: np.ndarray
    members: list[BufferedRequest]
    offered: bool = False  # the other member's learned domain, measured on this engine (OnlineLearner.offer)
    share: ShareGuard | None = field(default=None, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)


class OnlineLearner:
    """The runtime's online state (see the module doc). ``lm``: the loaded model (a new domain is
    raced on it); ``guard``: the runtime's model lock; ``bandits``: a callable giving the runtime's
    live bandits (``{"policy:domain": bandit}``) to save; ``eagle``: gives the eagle head a new domain
    races besides prompt lookup and the cascade (``None``, or giving ``None``: none). Thread-safe."""

    def __init__(self, profile: Profile, lm, settings: OnlineSettings, guard, bandits: Callable[[], dict],
                 eagle: Callable[[], HeadCandidate | None] | None = None):
        self.profile = profile
        self._eagle = eagle  # the eagle head a learned domain races too, where the runtime drafts with one
        self.lm = lm
        self.settings = settings
        self._guard = guard
        self._bandits = bandits
        # the tables' counts, the buffer, the learned domains (re-entrant: a merge makes tables)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()  # one save at a time (the serving and the measuring threads both save)
        self._stop = threading.Event()
        self.replica = settings.replica or default_replica_id()
        self.path = Path(settings.path) if settings.path is not None else (
            overlay_path(profile.path) if profile.path is not None else None)
        self.own_path = replica_path(self.path, self.replica) if self.path is not None else None
        self.persist = settings.persist and self.path is not None and profile.path is not None
        self._digest = profile_digest(profile.path) if profile.path is not None else ""
        self.tables: dict[str, LiveBigramTable] = {}
        self.learned: dict[str, LearnedDomain] = {}  # this replica's and those adopted from others
        self._own_learned: set[str] = set()  # the ones this replica measured (what it saves)
        self._learned_index: AnchorIndex | None = None
        self.buffer: deque[BufferedRequest] = deque(maxlen=settings.buffer_size)  # this replica's
        self._pending: _Pending | None = None
        self._since_attempt = 0  # requests buffered since the last clustering attempt
        self.saved_bandits: dict[str, dict] = {}
        self.requests = 0  # this replica's
        self.generation = 0
        self._since_save = 0
        files = ReplicaFiles(self.path, self.own_path, self.replica, self._digest or None,
                             self._bad_file) if self.path is not None else None
        self._others = Others(files, settings.merge_interval, self._lock)  # the other replicas', as last read
        self._measuring_lock = MeasuringLock(lock_path(self.path) if self.persist else None, self.replica,
                                             settings.lock_timeout)
        self._publisher: Publisher | None = None
        self._unadopted: dict[str, PairCounts] = {}  # own counts of tables of domains not adopted yet
        self._closing = threading.Event()
        # the two-engine runtime's other members (link_members): engine -> learner, pooled for discovery; those
        # whose embeddings differ, with why; what this one shows them; the domains they learned, to measure here
        self.member: str | None = None
        self._siblings: dict[str, OnlineLearner] = {}
        self._apart: dict[str, str] = {}
        self._share = MemberShare()
        self._offers: list[_Pending] = []
        self.update_seconds = 0.0  # time spent in observe() (tables, buffer, discovery; not measuring)
        self.measure_seconds = 0.0  # model time taken by finished measurements' race blocks
        self.measure_waits = 0  # race blocks that waited for their share while serving was busy
        self.saves = 0
        self.errors: list[str] = []
        if self.own_path is not None and self.own_path.exists():
            self._load()
        if self.path is not None:
            self.merge(force=True)

    # -- loading, saving and merging -------------------------------------------------------------

    def _load(self) -> None:
        """This replica's own overlay (a replica restarted with its id continues from it)."""
        ov = load_own(self.own_path, self._digest)  # a damaged one: OverlayError, and the runtime does not start
        if ov is None:
            return
        self.generation, self.requests = ov.generation, ov.requests
        for d in ov.learned:
            self.learned[d.name] = d
            self._own_learned.add(d.name)
        self._rebuild_index()
        for name, c in ov.counts.items():
            if name in self.profile.domains or name == GLOBAL or name in self.learned:
                self.table(name).load(c.prev, c.succ, c.count)
            else:  # a domain another replica learned: loaded when it is adopted (the merge below)
                self._unadopted[name] = c
        self.buffer.extend(ov.buffer)
        self.saved_bandits = dict(ov.bandits)

    def _bad_file(self, path: Path, exc: OverlayError) -> None:
        log.warning("another replica's overlay left out: %s", exc)
        self.errors.append(f"merge: {exc}")

    def merge(self, force: bool = False) -> bool:
        """Read the other replicas' overlays that changed since the last read and fold them in (see the
        module doc); ``force``: now, else at most every ``merge_interval`` seconds. ``True`` if anything
        changed. A damaged file of another replica is left out and reported in :meth:`state`."""
        return self._others.merge(force, self._fold, self._after_merge)

    def _fold(self, merged: OnlineOverlay) -> None:
        """Take the other replicas' merged state in (caller holds the lock): their learned domains
        (:func:`~adaptive.runtime.replicas.adoptable`: one domain per traffic) are routed to from now
        on, this replica's buffered requests that one took as members leave the buffer and those that
        route to one feed its table; every table whose others' counts changed is given them."""
        added = adoptable(merged.learned, self.learned, self.profile.domains, self.profile.index.ood_threshold)
        for d in added:
            self.learned[d.name] = d
        if added:
            self._rebuild_index()
            taken = self._members()
            kept = [b for b in self.buffer if b.id not in taken]
            self.buffer.clear()
            self.buffer.extend(kept)
        for d in added:
            own = self._unadopted.pop(d.name, None)
            if own is not None:  # what this replica had taught it before a restart
                self.table(d.name).load(own.prev, own.succ, own.count)
            self._absorb(d.name, self.table(d.name))
        held = [n for n in merged.counts if n in self.profile.domains or n == GLOBAL or n in self.learned]
        for name, c in self._others.changed_counts(held):
            self.table(name).set_others(c.prev, c.succ, c.count)
        self._reshare()

    def _after_merge(self, merged: OnlineOverlay, shared: bool) -> None:
        """Outside the lock: the publishing thread once other replicas exist, and the bandits rebased
        on the others' evidence."""
        if shared and self.persist:
            self._start_publisher()
        for key, b in self._bandits().items():
            if hasattr(b, "rebase"):
                b.rebase(merged.bandits.get(key, {}).get("states", []))

    def snapshot(self) -> OnlineOverlay:
        """What :meth:`save` writes: this replica's own contribution now (the live bandits' posteriors
        and own evidence included)."""
        bandits = dict(self.saved_bandits)
        for key, b in self._bandits().items():
            if hasattr(b, "posteriors"):
                bandits[key] = b.posteriors()
        with self._lock:
            counts = {**self._unadopted, **{n: PairCounts(*t.counts()) for n, t in self.tables.items() if t.pairs}}
            return OnlineOverlay(self._digest, self.generation + 1, time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 self.requests, counts, bandits, tuple(self.buffer),
                                 tuple(d for n, d in self.learned.items() if n in self._own_learned), self.replica)

    def save(self) -> Path | None:
        """Write this replica's overlay now (atomically); ``None`` when this learner does not persist."""
        if not self.persist:
            return None
        with self._save_lock:
            ov = self.snapshot()
            save_overlay(ov, self.own_path)
            with self._lock:
                self.generation = ov.generation
                self._since_save = 0
                self.saves += 1
        return self.own_path

    def _start_publisher(self) -> None:
        """Among other replicas: a :class:`~adaptive.runtime.replicas.Publisher` that, every
        ``merge_interval`` (at least 0.5 s), merges and saves what is unsaved, so an idle replica's last
        requests and the others' domains do not wait for its next request."""
        if self._publisher is None:
            self._publisher = Publisher(self._publish, self.settings.merge_interval, self._closing,
                                        self.errors.append)

    def _publish(self) -> None:
        self.merge()
        if self._offers:
            self._start_offer()
        if self._since_save > 0:
            self._save_quietly()

    def _members(self) -> set[str]:
        """The ids of the buffered requests (of any replica) that formed the domains held (caller holds the lock)."""
        return {m for d in self.learned.values() for m in d.member_ids}

    def _own_pool(self) -> list[BufferedRequest]:
        """This replica's buffered requests and the other replicas' (less any a learned domain took or
        that now route to one) (caller holds the lock)."""
        taken = self._members()
        mine = {b.id for b in self.buffer}
        theirs = [b for b in self._others.merged.buffer if b.id not in taken and b.id not in mine]
        if theirs and self._learned_index is not None:
            theirs = [b for b in theirs if self._learned_index.route(b.vector).out_of_domain]
        return list(self.buffer) + theirs

    def _pooled(self) -> list[BufferedRequest]:
        """What discovery clusters (caller holds the lock): :meth:`_own_pool`, less the requests a domain
        of another member took (held or being measured), and the other members' pending requests (their
        :class:`~adaptive.runtime.replicas.MemberShare`, ids as this member names them) less those this
        member's domains took or that route to one."""
        pool = self._own_pool()
        taken = self._members()
        for name, sib in self._siblings.items():
            share = sib._share  # a snapshot: read without the other learner's lock
            pool = [b for b in pool if member_id(b.id, self.member, name) not in share.taken]
            theirs = [replace(b, id=member_id(b.id, name, self.member)) for b in share.entries]
            theirs = [b for b in theirs if b.id not in taken]
            if theirs and self._learned_index is not None:
                theirs = [b for b in theirs if self._learned_index.route(b.vector).out_of_domain]
            pool += theirs
        return pool

    def _reshare(self) -> None:
        """Renew what the other members see of this one (:class:`~adaptive.runtime.replicas.MemberShare`):
        its pending requests, the ids its domains (held, or being measured) took and their names (caller
        holds the lock)."""
        if not self._siblings:
            return
        p = self._pending
        taken, names = self._members(), set(self.learned) | {d.name for d in self._others.merged.learned}
        if p is not None:
            taken |= {m.id for m in p.members}
            names.add(p.name)
        self._share = MemberShare(tuple(b for b in self._own_pool() if b.id not in taken), frozenset(taken),
                                  frozenset(names))

    def _sibling_measuring(self) -> bool:
        """Whether another member measures a domain now (this process's, or, by its lock, another replica's)."""
        return any(s._pending is not None or s._measuring_lock.held_elsewhere() for s in self._siblings.values())

    # -- routing and tables ------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """The learned domains' anchors in an index like the calibrated one (same threshold, pooling, mean)."""
        idx = self.profile.index
        if not self.learned:
            self._learned_index = None
            return
        names = sorted(self.learned)
        anchors = np.concatenate([self.learned[n].anchors for n in names])
        labels = [n for n in names for _ in range(self.learned[n].anchors.shape[0])]
        self._learned_index = AnchorIndex(anchors, labels, idx.mean, idx.ood_threshold, idx.k, idx.pooling)

    def route(self, vector: np.ndarray) -> tuple[Route, bool]:
        """``(route, flagged)``: the calibrated index's route, or, when it says out-of-domain and a
        learned domain's anchors are within the threshold, the route to that learned domain.
        ``flagged``: the calibrated index said out-of-domain."""
        route = self.profile.index.route(vector)
        if not route.out_of_domain:
            return route, False
        learned = self._learned_index
        if learned is not None:
            r = learned.route(vector)
            if not r.out_of_domain:
                return r, True
        return route, True

    def record(self, name: str | None) -> DomainRecord:
        """A domain's record: a learned domain's, else the profile's (``None``: the global record)."""
        d = self.learned.get(name) if name is not None else None
        return d.record if d is not None else self.profile.domain(name)

    def table(self, name: str) -> LiveBigramTable:
        """The live bigram table of record ``name`` (created from the record's calibrated table)."""
        t = self.tables.get(name)
        if t is None:
            with self._lock:
                t = self.tables.get(name)
                if t is None:
                    base = None if name in self.learned else self.profile.domain(
                        None if name == GLOBAL else name).bigram
                    t = self.tables[name] = self._new_table(base)
        return t

    def _new_table(self, base) -> LiveBigramTable:
        """A live table over ``base`` (a calibrated table, or ``None``), counting bigrams as calibration did."""
        return LiveBigramTable(base, self.settings.prior_weight, self.profile.settings.bigram_min_count,
                               self.settings.max_pairs)

    def restore_bandit(self, key: str, bandit) -> None:
        """Continue ``bandit`` from its saved posteriors, if this replica's overlay has them, and fold in
        the other replicas' evidence for it (a mismatch is ignored)."""
        saved = self.saved_bandits.get(key)
        try:
            if saved is not None and hasattr(bandit, "restore"):
                bandit.restore(saved)
            theirs = self._others.merged.bandits.get(key, {}).get("states", [])
            if theirs and hasattr(bandit, "rebase"):
                bandit.rebase(theirs)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("saved bandit %s not restored (%s)", key, exc)

    # -- learning ------------------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        """Learn from one finished request; may save, and may start measuring a new domain."""
        t0 = time.perf_counter()
        if self._publisher is None:  # else that thread merges, off the serving thread
            self.merge()  # the other replicas' files, at most every merge_interval seconds
        tokens = accepted_text(obs.prompt, obs.output)
        table = self.table(obs.applied)
        start, buffered, attempt = None, False, False
        with self._lock:  # a save's snapshot reads the counts from another thread
            table.observe(tokens)
            self.requests += 1
            self._since_save += 1
            joined = self._joins_learned(obs) if obs.flagged and not obs.learned else None
            if joined is not None:  # routed before a domain near it was learned: it joins that one
                joined.observe(tokens)
            elif obs.flagged and not obs.learned and self.settings.discover:
                self.buffer.append(BufferedRequest(np.asarray(obs.vector, dtype=np.float32).copy(),
                                                   tuple(int(t) for t in obs.prompt),
                                                   tuple(int(t) for t in obs.output),
                                                   f"{self.replica}:{self.requests}"))  # this request's number: unique
                self._since_attempt += 1
                buffered = True
                self._reshare()
                attempt = self._attempt_due()
            # saved when save_every requests are unsaved and when a request was buffered (discovery pools the
            # replicas' buffers); among other replicas the publishing thread also saves what is unsaved
            # every merge_interval, off the serving thread
            due = self.persist and (self._since_save >= self.settings.save_every or buffered)
        if self._offers:  # a domain the other member learned, measured on this engine before any new one
            start = self._take_offer()
        if attempt and start is None:  # outside the lock: proposing merges the other replicas' files first
            start = self._propose()
        self.update_seconds += time.perf_counter() - t0
        if start is not None:
            self._start_measuring(start)
        elif due:  # a buffered request is published at once: other replicas pool it for discovery
            self._save_quietly()

    def _attempt_due(self) -> bool:
        """Whether to look for a new domain now (caller holds the lock): once ``min_cluster`` requests are
        pending (this replica's and the others'), then after every ``min_cluster // 2`` more (a full buffer
        of unrelated requests takes about 0.1 s to search, so not at every request), and not while
        another replica or member measures."""
        if self._pending is not None or self._since_attempt < max(1, self.settings.min_cluster // 2):
            return False
        if len(self._pooled()) < self.settings.min_cluster or self._measuring_lock.held_elsewhere():
            return False
        if self._sibling_measuring():
            return False
        self._since_attempt = 0
        return True

    def _propose(self) -> _Pending | None:
        """A new domain from the pooled buffer, if a coherent group is there: under the measuring lock,
        after a merge (so a domain another replica just learned is not proposed again). The caller does
        not hold the learner's lock."""
        if not self._measuring_lock.take():
            return None
        self.merge(force=True)  # holding the lock: the domains learned and requests buffered up to now
        with self._lock:
            pending = self._cluster() if self._pending is None else None
        if pending is None:
            self._measuring_lock.release()
        return pending

    def _cluster(self) -> _Pending | None:
        """The proposal itself (caller holds the learner's lock and the measuring lock)."""
        entries = self._pooled()  # this replica's buffered requests and the other replicas'
        found = None
        if len(entries) >= self.settings.min_cluster:
            x = self.profile.index.transform(np.stack([b.vector for b in entries]))
            found = find_cluster(x, self.profile.index.ood_threshold, self.settings.min_cluster,
                                 self.profile.settings.anchors_per_domain, self.settings.coherence,
                                 seed=len(self.learned))
        if found is None:
            return None
        idx, anchors = found
        chosen = {entries[i].id for i in idx.tolist()}
        members = [e for e in entries if e.id in chosen]
        kept = [b for b in self.buffer if b.id not in chosen]
        self.buffer.clear()
        self.buffer.extend(kept)
        self._pending = _Pending(self._fresh_name(), anchors, members)
        self._reshare()
        return self._pending

    def _fresh_name(self, prefer: str | None = None) -> str:
        """A learned domain's name: ``prefer`` where this member's replicas hold no domain of that name,
        else the first ``learned-N`` none of them, the calibration nor another member holds (caller holds
        the lock)."""
        learned = set(self.learned) | {d.name for d in self._others.merged.learned}
        taken = learned | set(self.profile.domains)
        if prefer is not None and prefer not in taken:
            return prefer
        learned |= {n for s in self._siblings.values() for n in s._share.names}
        taken |= learned
        n = len(learned) + 1
        while f"{LEARNED_PREFIX}{n}" in taken:
            n += 1
        return f"{LEARNED_PREFIX}{n}"

    def offer(self, source: str, domain: LearnedDomain, members: Sequence[BufferedRequest]) -> None:
        """The other member ``source`` learned ``domain`` from ``members`` (ids as ``source`` names them),
        measured on its engine: this member measures it on its own (the same name where free, the same
        anchors and members; its own of them leave its buffer), now if it can, else at its next request
        or publish, unless it holds a domain near it by then. See the module doc."""
        mine = [replace(m, id=member_id(m.id, source, self.member)) for m in members]
        with self._lock:
            self._offers.append(_Pending(domain.name, domain.anchors, mine, offered=True))
        self._start_offer()

    def _start_offer(self) -> None:
        pending = self._take_offer()
        if pending is not None:
            self._start_measuring(pending)

    def _take_offer(self) -> _Pending | None:
        """The first offered domain to measure now (:meth:`offer`), under the measuring lock and after a
        merge; ``None`` when there is none or not now (this replica or the other member measures, or
        another replica holds the lock: tried again later). One this member holds a domain near (its own,
        or a replica's) is dropped. The caller does not hold the learner's lock."""
        if not self._offers or self._pending is not None or self._sibling_measuring() \
                or not self._measuring_lock.take():  # one member measures at a time, as for a proposal
            return None
        self.merge(force=True)  # a replica of this member may have measured it meanwhile
        pending = None
        with self._lock:
            while self._offers and self._pending is None and pending is None:
                p = self._offers.pop(0)
                if any(near(p.anchors, d.anchors, self.profile.index.ood_threshold) for d in self.learned.values()):
                    continue  # this traffic has its domain here already: one domain per traffic
                ids = {m.id for m in p.members}
                kept = [b for b in self.buffer if b.id not in ids]
                self.buffer.clear()
                self.buffer.extend(kept)
                p.name = self._fresh_name(p.name)
                self._pending = pending = p
            self._reshare()
        if pending is None:
            self._measuring_lock.release()
        return pending

    def _start_measuring(self, pending: _Pending) -> None:
        if self.settings.background:
            pending.thread = threading.Thread(target=self._measure, args=(pending,), name="adaptive-online-measure",
                                              daemon=True)
            pending.thread.start()
        else:
            self._measure(pending)

    def _race_guard(self, share: ShareGuard) -> ShareGuard:
        if self._stop.is_set():
            raise _Stopped
        return share

    def _measure(self, pending: _Pending) -> None:
        """Measure a proposed domain; on success it routes from now on and the overlay is saved.
        On failure or :meth:`close` its members go back to the buffer."""
        table = self._new_table(None)
        for m in pending.members:
            table.observe(accepted_text(m.prompt, m.output))
        try:
            seqs = [(list(m.prompt), list(m.output)) for m in pending.members]
            prompts = min(self.settings.measure_prompts, len(seqs))
            share = pending.share = ShareGuard(self._guard, self.settings.share, self.settings.idle_s)
            try:
                rec = measure_learned_domain(self.lm, self.profile, pending.name, seqs, prompts, table,
                                             guard=lambda: self._race_guard(share),
                                             anchors=int(pending.anchors.shape[0]),
                                             eagle=self._eagle() if self._eagle is not None else None)
            finally:
                with self._lock:
                    self.measure_seconds += share.used_s
                    self.measure_waits += share.waits
        except _Stopped:
            self._give_back(pending, again=True)
            return
        except ContextFullError as exc:  # the served requests hold llama.cpp's context: measured again later
            log.info("measuring %s waits for room in the context: %s", pending.name, exc)
            self._give_back(pending, again=True)
            return
        except (AdaptiveError, ValueError, RuntimeError) as exc:  # a failed measurement must not stop serving
            log.warning("measuring %s failed: %s", pending.name, exc)
            with self._lock:
                self.errors.append(f"{pending.name}: {type(exc).__name__}: {exc}")
            self._give_back(pending)
            return
        domain = LearnedDomain(pending.name, pending.anchors, rec, len(pending.members),
                               time.strftime("%Y-%m-%dT%H:%M:%S%z"), tuple(m.id for m in pending.members))
        with self._lock:
            self.learned[domain.name] = domain
            self._own_learned.add(domain.name)
            self.tables[domain.name] = table
            self._rebuild_index()
            self._pending = None
            self._absorb(domain.name, table)
            self._reshare()
        log.info("learned domain %s from %d requests: %s at %.2fx", domain.name, domain.members,
                 rec.decision.drafter, rec.decision.speedup)
        self._save_quietly()  # saved before the lock goes: the others adopt it at their next merge
        self._measuring_lock.release()
        if not pending.offered and not self._stop.is_set():  # found here: the other members race it too
            for sib in list(self._siblings.values()):
                try:
                    sib.offer(self.member, domain, pending.members)
                except (AdaptiveError, OSError, ValueError, RuntimeError) as exc:  # serving goes on
                    log.warning("handing %s to the %s member failed: %s", domain.name, sib.member, exc)
                    self.errors.append(f"offer {domain.name}: {type(exc).__name__}: {exc}")

    def _give_back(self, pending: _Pending, again: bool = False) -> None:
        """A measurement that did not finish: this replica's members go back to its buffer (the other
        replicas' and members' never left theirs), and the lock goes; ``again``: an offered domain
        (:meth:`offer`) is offered again (measured at a later request)."""
        mine = [m for m in pending.members if m.id.startswith(f"{self.replica}:")]
        with self._lock:
            self.buffer.extendleft(reversed(mine))
            self._pending = None
            if again and pending.offered:
                self._offers.append(pending)
            self._reshare()
        self._measuring_lock.release()

    def _joins_learned(self, obs: Observation) -> LiveBigramTable | None:
        """The table of a domain learned after ``obs`` was routed out-of-domain, if it now routes there:
        such a request was served while that domain was measured, and finished after :meth:`_absorb`
        ran (caller holds the lock)."""
        if self._learned_index is None:
            return None
        r = self._learned_index.route(np.asarray(obs.vector, dtype=np.float32))
        return None if r.out_of_domain else self.tables.get(r.domain)

    def _absorb(self, name: str, table: LiveBigramTable) -> None:
        """Buffered requests that now route to the learned domain ``name`` (flagged while it was being
        measured) join it: their outputs feed its table, and they leave the buffer, so they cannot
        form a second domain of the same traffic (caller holds the lock)."""
        keep = []
        for b in self.buffer:
            r = self._learned_index.route(b.vector)
            if not r.out_of_domain and r.domain == name:
                table.observe(accepted_text(b.prompt, b.output))
            else:
                keep.append(b)
        self.buffer.clear()
        self.buffer.extend(keep)

    def _save_quietly(self) -> None:
        """:meth:`save`, logging (not raising) a failure: serving goes on, the state stays in memory."""
        try:
            self.save()
        except OSError as exc:
            log.warning("could not save the online overlay %s: %s", self.path, exc)
            self.errors.append(f"save: {exc}")

    # -- control -------------------------------------------------------------------------------

    @property
    def measuring(self) -> str | None:
        """The name of the domain being measured, if any."""
        p = self._pending
        return p.name if p is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running measurement to finish; ``False`` on timeout."""
        p = self._pending
        t = p.thread if p is not None else None
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def close(self) -> None:
        """Stop a running measurement (its members return to the buffer, the measuring lock goes) and save."""
        self._stop.set()
        p = self._pending
        if p is not None and p.thread is not None:
            p.thread.join()
        self._stop.clear()  # a runtime used after close() may measure again
        self._closing.set()
        if self._publisher is not None:
            self._publisher.join()
            self._publisher = None
        self._closing.clear()
        self._save_quietly()

    def state(self) -> dict:
        """A summary for ``/v1/adaptive/online`` and logs: the merged state (``requests``: every
        replica's; ``buffered``: the pooled buffer), and each replica's part (``replicas``)."""
        self.merge()
        with self._lock:
            others = self._others
            replicas = {self.replica: {"requests": self.requests, "saved": "", "generation": self.generation,
                                       "buffered": len(self.buffer), "learned": sorted(self._own_learned),
                                       "self": True}, **others.summary()}
            return {"replica": self.replica,
                    "requests": self.requests + sum(o.requests for o in others.overlays.values()),
                    "own_requests": self.requests, "generation": self.generation, "saves": self.saves,
                    "path": str(self.own_path) if self.own_path else None, "persist": self.persist,
                    "buffered": len(self._pooled()), "measuring": self.measuring,
                    "members": {**{n: "pooled" for n in self._siblings}, **self._apart},
                    "offered": [p.name for p in self._offers],
                    "replicas": replicas, "merges": others.merges,
                    "merge_ms": round(1e3 * others.seconds, 3),
                    "tables": {n: {"entries": len(t), "pairs": t.pairs, "observed": round(t.observed, 1)}
                               for n, t in sorted(self.tables.items())},
                    "learned": {n: {"members": d.members, "decision": d.record.decision.drafter,
                                    "speedup": d.record.decision.speedup} for n, d in sorted(self.learned.items())},
                    "update_ms_per_request": round(1e3 * self.update_seconds / self.requests, 3)
                    if self.requests else 0.0, **self.measure_cost(), "errors": list(self.errors[-5:])}

    def measure_cost(self) -> dict:
        """Model time the background races took (``measure_seconds``, the running one's so far) and
        the blocks that waited for their share of a busy server (``measure_waits``)."""
        p = self._pending
        share = p.share if p is not None else None
        running = (share.used_s, share.waits) if share is not None else (0.0, 0)
        return {"measure_seconds": round(self.measure_seconds + running[0], 3),
                "measure_waits": self.measure_waits + running[1]}


def link_members(learners: Mapping[str, OnlineLearner]) -> None:
    """Link the online learners of a two-engine runtime's members (engine -> learner): each pools the
    others' out-of-domain requests for discovery and hands them the domains it learns (see the module
    doc). Members whose routing vectors cannot be compared
    (:func:`~adaptive.runtime.replicas.embedding_mismatch`) stay apart, said in the log and in each
    one's :meth:`~OnlineLearner.state` (``members``)."""
    for name, learner in learners.items():
        learner.member = name
    for name, a in learners.items():
        for other, b in learners.items():
            if other == name:
                continue
            why = embedding_mismatch(a.profile.index, b.profile.index)
            if why is None:
                a._siblings[other] = b
                a._apart.pop(other, None)
            else:
                a._apart[other] = why
                a._siblings.pop(other, None)
                if name < other:
                    log.warning("the %s and %s members discover domains apart: %s", name, other, why)
    for learner in learners.values():
        with learner._lock:
            learner._reshare()
