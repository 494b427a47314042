"""How busy the machine was while something was timed: the share arithmetic on literal counters."""

import pytest

import adaptive.costs.busy as busy
from adaptive.costs import BUSY_SHARE, CostModel, CpuWatch, busy_warning, is_busy, others_share

STAT = ("cpu  {user} 0 {system} 9000 10 0 {softirq} {steal} 0 0\n"
        "cpu0 1 0 1 1 0 0 0 0 0 0\ncpu1 1 0 1 1 0 0 0 0 0 0\nintr 5\n")


def _stat(path, user, system=0, softirq=0, steal=0):
    path.write_text(STAT.format(user=user, system=system, softirq=softirq, steal=steal))
    return path


def test_others_share_worked_example_and_clipping():
    # 2 CPUs for 10 s, the machine busy 17 s of which ours 8 s: the others took 9 of 20
    assert others_share(17, 8, 10, 2) == pytest.approx(0.45)
    assert others_share(3, 4, 10, 2) == 0.0  # counters tick at different grains: never below 0
    assert others_share(50, 0, 10, 2) == 1.0
    with pytest.raises(ValueError, match="positive span"):
        others_share(1, 0, 0, 2)


def test_machine_counters_from_proc_stat(tmp_path):
    # busy = user + nice + system + irq + softirq, plus steal; idle and iowait are not busy
    assert busy._machine_jiffies(_stat(tmp_path / "stat", 100, 20, 5, 7)) == (132, 2)
    (tmp_path / "bad").write_text("intr 1 2 3\n")
    assert busy._machine_jiffies(tmp_path / "bad") is None
    assert busy._machine_jiffies(tmp_path / "missing") is None


def test_watch_counts_other_work_and_steal(tmp_path, monkeypatch):
    stat = _stat(tmp_path / "stat", 1000)
    clock = iter([100.0, 110.0])  # a 10 s span
    own = iter([5.0, 13.0])  # this process: 8 s of CPU in it
    monkeypatch.setattr(busy.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(busy, "_own_seconds", lambda: next(own))
    monkeypatch.setattr(busy.os, "sysconf", lambda name: 100)
    with CpuWatch(stat) as w:
        _stat(stat, 1000 + 1500, steal=200)  # 15 s busy and 2 s stolen: 17 s of the machine's 20
    assert w.others_share == pytest.approx(0.45)


def test_watch_without_counters_says_nothing(tmp_path):
    with CpuWatch(tmp_path / "none") as w:
        pass
    assert w.others_share is None


def test_watch_on_this_machine_is_a_share():
    with CpuWatch() as w:
        sum(range(200_000))
    assert w.others_share is None or 0.0 <= w.others_share <= 1.0


def test_busy_warning_above_the_threshold_only():
    assert not is_busy(None) and not is_busy(BUSY_SHARE) and is_busy(0.45)
    assert busy_warning("x", None) is None
    assert busy_warning("x", BUSY_SHARE) is None
    msg = busy_warning("the cost model", 0.45)
    assert msg.startswith("other work used 45% of this machine's CPU while the cost model was timed")


def test_cost_model_keeps_the_share_and_reads_old_profiles():
    cm = CostModel((0.1,), (0.1,), 0.8, (1.0, 1.2), step_ms=9.0, others_share=0.3)
    assert CostModel.from_dict(cm.to_dict()) == cm
    old = cm.to_dict()
    del old["others_share"]  # a profile written before it was measured
    assert CostModel.from_dict(old).others_share is None
    with pytest.raises(ValueError, match="others_share"):
        CostModel((0.1,), (0.1,), 0.8, (1.0,), others_share=1.5)


def test_the_cli_says_a_warning_in_one_line(capsys):
    from adaptive.cli.main import _one_line_warning

    _one_line_warning(UserWarning("the machine was busy"), UserWarning, "f.py", 3)
    assert capsys.readouterr().err == "Warning: the machine was busy\n"


def test_watch_stops_once_per_start(tmp_path):
    w = CpuWatch(tmp_path / "none")
    with pytest.raises(RuntimeError, match="before start"):
        w.stop()
    assert w.start().stop() is None
