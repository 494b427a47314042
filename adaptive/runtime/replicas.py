"""What the online learner's replicas share on disk (issue 45), apart from what is learned: which of the
other replicas' overlay files changed since they were last read, the lock that lets one replica at
a time measure a proposed domain, and the thread that merges and publishes an idle replica's state.

The learner (:mod:`adaptive.runtime.online`) folds what these give it into its tables, bandits and
domains; the file formats and the merge of overlays are :mod:`adaptive.profile.overlay`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from adaptive.profile.overlay import OnlineOverlay, OverlayError, load_replicas, replica_dir

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
