"""Who uses the model when: the runtime's model lock and the online learner's share of it.

:class:`TurnLock` is the model lock: re-entrant and granted in arrival order. ``threading.RLock``
lets a thread that releases and at once re-acquires (a server's decoding loop) win again and again
over a waiting one; here a waiting thread gets the next turn.

:class:`ShareGuard` is how background work (the online learner's race against ``ar``) takes the
model: one block at a time, at once while serving has left the lock alone for ``idle_s`` seconds,
otherwise only while the background's own time on the model stays within ``share`` of the wall
time since it began. Under load a measurement therefore costs serving about ``share`` of its
throughput (plus at most one block beyond the budget), and on an idle server it runs at full speed.

Worked example (``share=0.1``): a race that began 10 s ago and has held the model 0.9 s may take
its next block now, even under load; after that block (say 0.3 s, 1.2 s in all) it waits until
12 s have passed, unless serving goes idle first.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class TurnLock:
    """A re-entrant lock granted in arrival order; it also notes when a thread last released it."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[int] = deque()
        self._released: dict[int, float] = {}  # thread ident -> when it last released (monotonic)

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._queue.append(me)
            while self._owner is not None or self._queue[0] != me:
                self._cond.wait()
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            me = threading.get_ident()
            if self._owner != me:
                raise RuntimeError("release of a TurnLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._released[me] = time.monotonic()
                self._cond.notify_all()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def others_active(self, idle_s: float) -> bool:
        """Another thread holds the lock, waits for it, or released it less than ``idle_s`` s ago."""
        me = threading.get_ident()
        with self._cond:
            if (self._owner is not None and self._owner != me) or any(t != me for t in self._queue):
                return True
            now = time.monotonic()
            return any(t != me and now - at < idle_s for t, at in self._released.items())


class ShareGuard:
    """Background work's turns on a :class:`TurnLock`: ``with guard:`` around each block (see the
    module doc). ``used_s``: model time the blocks took; ``waits``: blocks that waited for budget."""

    POLL_S = 0.01

    def __init__(self, lock: TurnLock, share: float = 0.1, idle_s: float = 0.2, clock=time.monotonic):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if idle_s < 0:
            raise ValueError(f"idle_s must be >= 0, got {idle_s}")
        self.lock, self.share, self.idle_s, self.clock = lock, share, idle_s, clock
        self.began: float | None = None
        self.used_s = 0.0
        self.waits = 0
        self._t0 = 0.0

    def may_run(self) -> bool:
        """Serving is idle, or the blocks so far are within their share of the time since the first."""
        now = self.clock()
        if self.began is None:
            self.began = now
        return self.used_s <= self.share * (now - self.began) or not self.lock.others_active(self.idle_s)

    def __enter__(self):
        if not self.may_run():
            self.waits += 1
            while not self.may_run():
                time.sleep(self.POLL_S)
        self.lock.acquire()
        self._t0 = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.used_s += self.clock() - self._t0
        self.lock.release()
