"""The calibration's one bar: budgets per phase and task, advancing by items, catching up, never past full."""

import pytest

from adaptive.calibrate.progress import PREFILL_TOKENS_PER_STEP, Phase, Progress, budgets
from tests.conftest import tiny_settings


def test_budgets_cover_every_phase_of_every_task():
    s = tiny_settings()
    b = budgets(s, {"a": [24, 48], "b": [12]}, ["a", "b", "__global__"])
    assert b[("prepare", "a")] == pytest.approx(72 / PREFILL_TOKENS_PER_STEP + 2 * s.continuation_tokens)
    assert {k for k, _ in b} == {"costs", "prepare", "verify", "search", "race"}
    assert all(("race", t) in b and ("search", t) in b for t in ("a", "b", "__global__"))
    assert ("prepare", "__global__") not in b


def test_progress_advances_by_items_and_catches_up():
    p = Progress(False, {("search", "a"): 10.0, ("race", "a"): 30.0})
    ph = p.phase("search", "a", items=5, done=2)  # resumed after 2 of 5 trials
    assert p.spent[("search", "a")] == pytest.approx(4.0)
    ph.update(1)
    assert p.spent[("search", "a")] == pytest.approx(6.0)
    ph.close()  # the bound stopped the search early: the rest of its budget counts as done
    assert p.spent[("search", "a")] == pytest.approx(10.0)
    ph.update(3)
    assert p.spent[("search", "a")] == pytest.approx(10.0)  # never past the budget
    p.finish("race", "a")  # raced in another process
    assert sum(p.spent.values()) == pytest.approx(40.0)
    Phase(None, "race", "a", 3).update(2)  # a worker process's phase does nothing


def test_progress_bar_on_stderr(capsys):
    p = Progress(True, {("costs", ""): 5.0, ("race", "x"): 5.0})
    p.finish("costs", "")
    p.phase("race", "x", 2).update(1, best=0.5)
    p.close()
    err = capsys.readouterr().err
    assert "calibrate" in err and "race x" in err and "100%" in err


def test_a_phase_is_named_on_the_bar_when_it_opens(capsys):
    """Before its first item reports: a search's first trial builds the scorer (a minute on long
    prompts), which the bar must not show as the phase before."""
    p = Progress(True, {("verify", "x"): 5.0, ("search", "x"): 5.0})
    p.phase("verify", "x", 1).close()
    p.phase("search", "x", 3)
    assert p.bar.postfix == "search x"
    assert p.spent[("search", "x")] == 0.0
    p.close()
    assert "search x" in capsys.readouterr().err
