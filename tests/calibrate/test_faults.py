"""A calibration killed with SIGKILL at several points resumes to a complete, valid profile with the
same skip sets as an uninterrupted run (each kill in a real subprocess, bounded in time)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaptive.calibrate.runner import calibrate
from adaptive.calibrate.settings import calibration_workdir
from adaptive.costs import CostModel
from adaptive.profile import load_profile
from tests.conftest import TINY_DOMAINS, tiny_settings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(trials=4, init_trials=2, acceptance_floor=0.0, time_gate=0.0)
# fixed (timing noise cannot change the bound or the search), and one in which layer skipping can pay, so
# that every phase runs: the bound, the search, the vocabulary and a race with a skip set
COSTS = CostModel((0.15,) * 4, (0.1,) * 4, 0.0, (1.0,) * 5)

DRIVER = """
import sys
from adaptive.calibrate.runner import calibrate
from adaptive.costs import CostModel
from tests.conftest import TINY_DOMAINS, tiny_settings
model, out, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
calibrate(model, TINY_DOMAINS, out, tiny_settings(trials=4, init_trials=2, acceptance_floor=0.0, time_gate=0.0),
          dtype="float32", progress=False, resume=resume,
          cost_model=CostModel((0.15,) * 4, (0.1,) * 4, 0.0, (1.0,) * 5))
"""


def _start(model_dir, out, resume):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(model_dir), str(out), "1" if resume else "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "p"
    calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(**SETTINGS), dtype="float32", progress=False,
              cost_model=COSTS)
    return load_profile(out)


# kill right after the first file of each phase appears in OUT.work/
@pytest.mark.parametrize("kill_after", ["prep-*.pt", "verify-*.json", "trials-*.jsonl", "vocab-*.json",
                                        "race-*.jsonl"])
def test_sigkill_then_resume_gives_a_complete_profile(tiny_model_dir, tmp_path, reference, kill_after):
    out = tmp_path / "p"
    work = calibration_workdir(out).path
    proc = _start(tiny_model_dir, out, resume=False)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and not (work.exists() and any(work.glob(kill_after))):
            if time.monotonic() > deadline:
                pytest.fail(f"no {kill_after} within 120 s")
            time.sleep(0.005)
        assert proc.poll() is None, f"finished before the kill point {kill_after}: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not (out / "profile.json").exists() and work.exists()  # nothing half-written in OUT

    resumed = _start(tiny_model_dir, out, resume=True)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert not work.exists()
    p = load_profile(out)  # complete and valid (checksums, every domain)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    for name in TINY_DOMAINS:  # same seed and costs: the search's result is an uninterrupted run's
        assert p.domains[name].layer_skip == reference.domains[name].layer_skip, (kill_after, name)
    assert p.global_set.layer_skip == reference.global_set.layer_skip


def test_two_calibrations_of_one_output_never_mix(tiny_model_dir, tmp_path, reference):
    """Started together: one finishes, the other refuses with a clear error (or, if it started after
    the first finished, replaces the profile whole). Never a mixed profile."""
    out = tmp_path / "p"
    procs = [_start(tiny_model_dir, out, resume=False) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    ok = [r for r in results if r[0] == 0]
    assert ok, results
    for code, err in results:
        if code != 0:
            assert "another calibration" in err or "--resume" in err, err[-2000:]
    p = load_profile(out)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    for name in TINY_DOMAINS:
        assert p.domains[name].layer_skip == reference.domains[name].layer_skip
