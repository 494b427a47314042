"""The model lock and background work's share of it (:mod:`adaptive.runtime.turns`)."""

import threading
import time
from types import SimpleNamespace

import pytest

from adaptive.runtime.turns import ShareGuard, TurnLock


def test_turn_lock_is_reentrant_and_takes_turns():
    lock = TurnLock()
    with lock, lock:  # re-entrant
        pass
    order, stop = [], threading.Event()

    def greedy():  # re-acquires at once after each release, like a decoding loop
        while not stop.is_set():
            with lock:
                order.append("loop")
                time.sleep(0.002)

    t = threading.Thread(target=greedy)
    t.start()
    time.sleep(0.01)
    got = []
    for _ in range(5):
        with lock:
            got.append(len(order))
    stop.set()
    t.join()
    assert len(got) == 5 and got[-1] - got[0] <= 8  # a waiting thread gets every other turn, roughly
    with pytest.raises(RuntimeError):
        lock.release()


def test_share_guard_worked_example():
    now = [0.0]
    busy = SimpleNamespace(others_active=lambda idle_s: True, acquire=lambda: True, release=lambda: None)
    g = ShareGuard(busy, share=0.1, clock=lambda: now[0])
    assert g.may_run()  # the first block starts the clock
    g.used_s, now[0] = 0.9, 10.0
    assert g.may_run()  # 0.9 s of 10: within 10%
    g.used_s, now[0] = 1.2, 10.3
    assert not g.may_run()
    now[0] = 12.0
    assert g.may_run()
    busy.others_active = lambda idle_s: False  # serving went idle: run at once whatever was used
    g.used_s = 100.0
    assert g.may_run()
    with pytest.raises(ValueError):
        ShareGuard(busy, share=0.0)


def blocks(guard: ShareGuard, seconds: float, block_s: float = 0.02) -> float:
    """Background blocks for ``seconds`` of wall time; the wall time taken."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        with guard:
            time.sleep(block_s)
    return time.monotonic() - t0


def test_share_guard_runs_freely_when_idle():
    g = ShareGuard(TurnLock(), share=0.1, idle_s=0.05)
    wall = blocks(g, 0.3)
    assert g.waits == 0 and g.used_s > 0.8 * wall


def test_share_guard_keeps_its_share_under_load():
    lock, stop = TurnLock(), threading.Event()
    served = [0.0]  # seconds the decoding loop held the model

    def serving():  # a decoding loop: re-acquires at once after each 5 ms step
        while not stop.is_set():
            with lock:
                t0 = time.monotonic()
                time.sleep(0.005)
                served[0] += time.monotonic() - t0

    t = threading.Thread(target=serving)
    t.start()
    try:
        time.sleep(0.05)
        g = ShareGuard(lock, share=0.1, idle_s=0.05)
        wall = blocks(g, 1.5)
    finally:
        stop.set()
        t.join()
    assert g.waits > 0
    assert g.used_s <= 0.1 * wall + 0.02 + 0.05  # its share, one block over, timer slack
    assert served[0] > 0.7 * wall  # serving kept most of the model (its time holding it, measured)
