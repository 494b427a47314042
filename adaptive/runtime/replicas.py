"""What the online learner's replicas share on disk (issue 45), apart from what is learned: which of the
other replicas' overlay files changed since they were last read and their merged state
(:class:`Others`), which of their learned domains a replica adopts (:func:`adoptable`), a replica's
own overlay read back at start (:func:`load_own`), the lock that lets one replica at a time measure
a proposed domain, and the thread that merges and publishes an idle replica's state. Also what the
two members of a two-engine runtime show each other for discovery (:class:`MemberShare`), whether
their embeddings can be compared (:func:`embedding_mismatch`) and how a request's id reads in the
other member (:func:`member_id`).

The learner (:mod:`adaptive.runtime.online`) folds what these give it into its tables, bandits and
domains; the file formats and the merge of overlays are :mod:`adaptive.profile.overlay`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaptive.index.anchors import AnchorIndex
from adaptive.index.choice import pooling_key
from adaptive.profile.overlay import (
    BufferedRequest,
    LearnedDomain,
    OnlineOverlay,
    OverlayError,
    PairCounts,
    load_overlay,
    load_replicas,
    merge_overlays,
    replica_dir,
)

log = logging.getLogger("adaptive.online")

LOCK_NAME = "measuring.lock"  # in PROFILE.online.d: the replica measuring a proposed domain


class ReplicaFiles:
    """The other replicas' overlays of ``path`` (the profile's ``PROFILE.online`` and the files in
    ``PROFILE.online.d``, this replica's ``own`` left out), read only when a file changed (by
    modification time and size). ``on_error(path, exc)``: a damaged file, left out."""

    def __init__(self, path: Path, own: Path, replica: str, digest: str | None,
                 on_error: Callable[[Path, OverlayError], None]):
        self.path, self.own, self.replica, self.digest, self.on_error = path, own, replica, digest, on_error
        self.stamps: dict[str, tuple[int, int]] = {}  # file -> (mtime_ns, size) when last read
        self._cache: dict = {}  # load_replicas' cache: file -> ((mtime_ns, size), overlay)

    def changed(self, force: bool = False) -> tuple[dict[str, OnlineOverlay] | None, bool]:
        """``(overlays, any)``: the others' overlays by replica when a file changed since the last read
        (or ``force``), else ``None``; ``any``: other replicas' files exist."""
        stamp = {}
        for f in [self.path] + sorted(replica_dir(self.path).glob("*.online")):
            try:
                st = f.stat()
            except OSError:
                continue
            if f != self.own:
                stamp[str(f)] = (st.st_mtime_ns, st.st_size)
        if stamp == self.stamps and not force:
            return None, bool(stamp)
        others = load_replicas(self.path, self.digest, skip=self.replica, on_error=self.on_error, cache=self._cache)
        self.stamps = stamp
        return others, bool(stamp)


class Others:
    """The other replicas' state as this replica last read it: their overlays by replica
    (``overlays``) and merged (``merged``: :func:`~adaptive.profile.overlay.merge_overlays`). ``files``:
    where they are read (``None``: a learner that is not on disk has no others); ``guard``: the
    learner's lock, held while the new state replaces the old and is folded in. :meth:`merge` reads
    what changed, at most every ``interval`` seconds unless forced, one thread at a time; ``merges``
    and ``seconds`` count them."""

    def __init__(self, files: ReplicaFiles | None, interval: float, guard: AbstractContextManager):
        self.files, self.interval, self._guard = files, interval, guard
        self.overlays: dict[str, OnlineOverlay] = {}
        self.merged = merge_overlays({})
        self.merges = 0
        self.seconds = 0.0
        self._at = 0.0
        self._lock = threading.Lock()
        self._keys: dict[str, int] = {}  # table -> hash of the others' counts it was last given

    def merge(self, force: bool, fold: Callable[[OnlineOverlay], None],
              after: Callable[[OnlineOverlay, bool], None]) -> bool:
        """Read the files that changed; under the guard, take them in and call ``fold(merged)``; then,
        the guard released, ``after(merged, shared)`` (``shared``: other replicas' files exist).
        ``True`` if anything changed. Another thread merging now: ``False`` at once, unless ``force``
        (then this one waits for it and reads again)."""
        if self.files is None or not self._lock.acquire(blocking=force):
            return False
        try:
            now = time.monotonic()
            if not force and now - self._at < self.interval:
                return False
            self._at = now
            t0 = time.perf_counter()
            try:
                overlays, shared = self.files.changed(force)  # only the files that changed are read
                if overlays is None:
                    return False
                merged = merge_overlays(overlays)
                with self._guard:
                    self.overlays, self.merged = overlays, merged
                    fold(merged)
                after(merged, shared)
                self.merges += 1
                return True
            finally:
                self.seconds += time.perf_counter() - t0
        finally:
            self._lock.release()

    def changed_counts(self, names: Iterable[str]) -> list[tuple[str, PairCounts]]:
        """The merged pair counts of the tables among ``names`` whose counts changed since they were
        last returned here (a table is given the others' counts only when they changed)."""
        out = []
        for name in names:
            c = self.merged.counts.get(name)
            if c is None:
                continue
            key = hash((c.prev.tobytes(), c.succ.tobytes(), c.count.tobytes()))
            if self._keys.get(name) != key:
                self._keys[name] = key
                out.append((name, c))
        return out

    def summary(self) -> dict[str, dict]:
        """Each other replica's part, for the learner's state: requests, when saved, generation,
        buffered requests and the domains it learned."""
        return {r: {"requests": ov.requests, "saved": ov.saved, "generation": ov.generation,
                    "buffered": len(ov.buffer), "learned": [d.name for d in ov.learned]}
                for r, ov in sorted(self.overlays.items())}


def near(a: np.ndarray, b: np.ndarray, threshold: float) -> bool:
    """Whether two domains' anchors (unit rows, ``[m, d]`` and ``[n, d]``) come within ``threshold``
    (squared L2, the index's out-of-domain radius): the same traffic learned twice."""
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return bool(d.min() <= threshold)


def adoptable(offered: Iterable[LearnedDomain], held: Mapping[str, LearnedDomain], calibrated: Collection[str],
              threshold: float) -> list[LearnedDomain]:
    """The domains other replicas learned that this one takes in: those of a name it has neither
    learned (``held``) nor calibrated, whose anchors are not within ``threshold`` of a held one's (a
    second domain of the same traffic) nor of one adopted before it in ``offered``."""
    taken = dict(held)
    out = []
    for d in offered:
        if d.name in taken or d.name in calibrated:
            continue
        if any(near(d.anchors, k.anchors, threshold) for k in taken.values()):
            continue  # another replica learned this traffic again: one domain for it
        taken[d.name] = d
        out.append(d)
    return out


def load_own(path: Path, digest: str) -> OnlineOverlay | None:
    """This replica's own overlay at ``path``, read back at start (a replica restarted with its id
    continues from it); ``None`` when there is none or it belongs to another calibration of the
    profile (``digest`` given and different: it starts afresh, and its next save replaces it). A
    damaged file raises :class:`~adaptive.profile.overlay.OverlayError`."""
    ov = load_overlay(path)
    if ov is not None and digest and ov.profile != digest:
        log.warning("%s: belongs to another calibration of the profile; starting afresh (the next save "
                    "replaces it)", path)
        return None
    return ov


class MeasuringLock:
    """``PROFILE.online.d/measuring.lock``: one replica at a time measures a proposed domain. ``path``:
    the lock file (``None``: nothing is shared, the lock is always this replica's); a holder's lock older
    than ``timeout`` seconds is stale (its replica died) and may be taken over."""

    def __init__(self, path: Path | None, replica: str, timeout: float):
        self.path, self.replica, self.timeout = path, replica, timeout

    def held_elsewhere(self) -> bool:
        """Whether another replica holds a live lock."""
        if self.path is None:
            return False
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        return age < self.timeout

    def take(self) -> bool:
        """Take the lock (``True``), or learn that another replica holds it; a stale one is taken over."""
        if self.path is None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"replica": self.replica, "pid": os.getpid(), "time": time.time()}).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    if time.time() - self.path.stat().st_mtime < self.timeout:
                        return False
                    self.path.unlink()  # a dead holder's: take it over
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            return True
        return False

    def release(self) -> None:
        """Give the lock back if this replica holds it."""
        if self.path is None:
            return
        try:
            if json.loads(self.path.read_bytes()).get("replica") == self.replica:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def lock_path(path: Path) -> Path:
    """The measuring lock of the overlay ``path``."""
    return replica_dir(path) / LOCK_NAME


class Publisher:
    """A thread that runs ``publish()`` every ``interval`` seconds (at least 0.5) until ``closing`` is
    set; a failure is logged and handed to ``on_error(message)``, and the thread goes on."""

    def __init__(self, publish: Callable[[], None], interval: float, closing: threading.Event,
                 on_error: Callable[[str], None]):
        def run():
            while not closing.wait(max(interval, 0.5)):
                try:
                    publish()
                except Exception as exc:  # noqa: BLE001 - a background thread must not die silently
                    log.warning("publishing the online overlay failed: %s", exc)
                    on_error(f"publish: {type(exc).__name__}: {exc}")

        self.thread = threading.Thread(target=run, name="adaptive-online-publish", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()


@dataclass(frozen=True)
class MemberShare:
    """What one member's learner of a two-engine runtime shows the other for discovery (a snapshot,
    replaced whole, so the other reads it without this one's lock): ``entries``, the requests pending
    discovery (its own buffer and its replicas', less those its domains took), ``taken``, the ids of
    the requests its domains (held, or being measured) took as members, and ``names``, those domains'
    names. Ids are in the member's own namespace (``REPLICA:N``; the other member's ``ENGINE/REPLICA:N``)."""

    entries: tuple[BufferedRequest, ...] = ()
    taken: frozenset[str] = frozenset()
    names: frozenset[str] = frozenset()


def member_id(rid: str, source: str, target: str) -> str:
    """The id ``rid`` of member ``source``'s namespace as member ``target`` names it: ``target``'s own
    requests (``TARGET/ID`` in ``source``) lose the prefix, ``source``'s own gain ``SOURCE/`` (replica ids
    and engine names hold no ``/``). Example: ``member_id("r1:3", "torch", "llama.cpp")`` is
    ``"torch/r1:3"``, and ``member_id("llama.cpp/r1:4", "torch", "llama.cpp")`` is ``"r1:4"``."""
    prefix = f"{target}/"
    if rid.startswith(prefix):
        return rid[len(prefix):]
    return rid if "/" in rid else f"{source}/{rid}"


def embedding_mismatch(a: AnchorIndex, b: AnchorIndex) -> str | None:
    """Why two members' routing vectors cannot be compared (``None``: they can): a buffered vector of one
    is set beside the other's only where both indexes embed a prompt the same way (the same pooling,
    dimension and centring mean: then the vectors differ only by the engines' numerics, as the same
    model's hidden state in Q4 kernels and in bf16)."""
    if a.pooling != b.pooling:
        return f"they route on different embeddings ({pooling_key(a.pooling)} and {pooling_key(b.pooling)})"
    if a.dim != b.dim:
        return f"their embeddings differ in dimension ({a.dim} and {b.dim})"
    scale = max(float(np.linalg.norm(a.mean)), float(np.linalg.norm(b.mean)), 1e-6)
    if float(np.linalg.norm(a.mean - b.mean)) > 0.05 * scale:
        return "they centre their embeddings on different means"
    return None
