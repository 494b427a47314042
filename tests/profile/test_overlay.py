"""The online overlay: round trip, checksum, versions, atomic saves that survive a kill."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from adaptive.drafters.cascade import CascadePlan
from adaptive.engine.skip import SkipSet
from adaptive.profile import Decision, DomainRecord, Prior, Priors, SkipSearch
from adaptive.profile.overlay import (
    BufferedRequest,
    LearnedDomain,
    OnlineOverlay,
    OverlayError,
    PairCounts,
    decode_overlay,
    encode_overlay,
    load_overlay,
    overlay_path,
    remove_overlay,
    save_overlay,
)


def record(name="learned-1") -> DomainRecord:
    return DomainRecord(name=name, decision=Decision("cascade", 6, 1.4), layer_skip=SkipSearch(SkipSet(), 1),
                        priors=Priors(Prior(0.0, 1.0), Prior(0.4, 0.005), Prior(0.5, 0.005, (0.5, 0.6))),
                        verify=(1.0, 1.02), cascade=CascadePlan(split=0, draft_len=6, max_split=0), prompts=8)


def overlay(generation=1) -> OnlineOverlay:
    rng = np.random.default_rng(generation)
    return OnlineOverlay(
        profile="ab" * 32, generation=generation, saved="2026-11-24T12:00:00", requests=40,
        counts={"math": PairCounts(np.array([1, 1, 5]), np.array([2, 3, 1]), np.array([3.0, 1.0, 2.5])),
                "global": PairCounts(np.zeros(0), np.zeros(0), np.zeros(0))},
        bandits={"knn-ssd:math": {"kind": "length", "acceptance": [5.0, 2.0]}},
        buffer=(BufferedRequest(rng.normal(size=8).astype(np.float32), (1, 2, 3), (4, 5)),),
        learned=(LearnedDomain("learned-1", rng.normal(size=(2, 8)).astype(np.float32), record(), 8, "now"),))


def test_round_trip():
    ov = overlay()
    back = decode_overlay(encode_overlay(ov))
    assert (back.profile, back.generation, back.requests, back.bandits) == (ov.profile, 1, 40, ov.bandits)
    assert back.counts["math"].prev.tolist() == [1, 1, 5] and back.counts["math"].count.tolist() == [3.0, 1.0, 2.5]
    assert len(back.counts["global"]) == 0
    assert back.buffer[0].prompt == (1, 2, 3) and back.buffer[0].output == (4, 5)
    np.testing.assert_array_equal(back.buffer[0].vector, ov.buffer[0].vector)
    d = back.learned[0]
    assert d.name == "learned-1" and d.members == 8 and d.record == record()
    np.testing.assert_array_equal(d.anchors, ov.learned[0].anchors)
    s = back.summary()
    assert s["learned"][0]["decision"] == "cascade" and s["tables"]["math"]["pairs"] == 3 and s["buffered"] == 1


def test_damage_is_reported(tmp_path):
    data = encode_overlay(overlay())
    path = tmp_path / "p.online"
    for bad, msg in [(data[:-10], "checksum"), (data[:-1] + bytes([data[-1] ^ 1]), "checksum"),
                     (b"hello\n" + data, "not an adaptive online overlay"), (b"", "not an adaptive online overlay"),
                     (data.replace(b'"version": 1', b'"version": 9', 1), "version 9")]:
        path.write_bytes(bad)
        with pytest.raises(OverlayError, match=msg):
            load_overlay(path)
    path.write_bytes(data)
    assert load_overlay(path, profile="ab" * 32).generation == 1
    with pytest.raises(OverlayError, match="another calibration"):
        load_overlay(path, profile="cd" * 32)
    assert load_overlay(tmp_path / "absent.online") is None


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = save_overlay(overlay(1), tmp_path / "p.online")

    def torn(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", torn)
    with pytest.raises(OSError):
        save_overlay(overlay(2), path)
    monkeypatch.undo()
    assert load_overlay(path).generation == 1  # the previous complete overlay
    assert remove_overlay(path) and not path.exists()
    assert not list(tmp_path.glob("p.online.tmp-*"))  # remove_overlay also cleans a failed save's leftovers
    assert not remove_overlay(path)


def test_overlay_path_is_beside_the_profile(tmp_path):
    assert overlay_path(tmp_path / "prof") == tmp_path / "prof.online"


SAVER = r"""
import sys, numpy as np
sys.path.insert(0, {root!r})
from tests.profile.test_overlay import overlay
from adaptive.profile.overlay import save_overlay
from dataclasses import replace
base = overlay()
big = np.arange(200_000)
for g in range(1, 10**6):
    big_counts = type(base.counts["math"])(big, big, np.ones(big.size))
    ov = replace(base, generation=g, counts={{**base.counts, "big": big_counts}})
    save_overlay(ov, {path!r})
    print(g, flush=True)
"""


def test_a_kill_during_saves_leaves_the_last_complete_overlay(tmp_path):
    """SIGKILL a process that saves overlays back to back (each ~2 MB) at a random moment, five times:
    the overlay always loads, whole, at a generation at least the last one the process reported."""
    path = tmp_path / "p.online"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rng = np.random.default_rng(0)
    last = 0
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", SAVER.format(root=root, path=str(path))],
                                stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # at least one save completed
        assert first.strip(), "the saver did not start"
        time.sleep(float(rng.uniform(0.0, 0.5)))
        proc.send_signal(signal.SIGKILL)
        out = first + proc.stdout.read()
        proc.wait()
        reported = int(out.split()[-1])
        ov = load_overlay(path)
        assert ov.generation >= reported >= 1  # the rename after the last print may have happened too
        assert ov.generation <= reported + 1
        assert len(ov.counts["big"]) == 200_000
        last = ov.generation
    assert last >= 1
