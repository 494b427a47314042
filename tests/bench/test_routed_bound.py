"""benchmarks/routed_bound.py on literal records: the best raced drafter of a domain and the overall
bound, which must equal what the bench's own aggregation reports for runs at those speedups."""


import pytest

from adaptive.bench.report import summarize
from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("routed_bound")


def test_the_best_raced_drafter_and_none(script):
    domain = {"measurements": [
        {"role": "lookup", "speedup": 1.16, "interval": {"low": 1.06, "high": 1.28}},
        {"role": "cascade", "speedup": 1.18, "interval": {"low": 1.11, "high": 1.25}},
        {"role": "candidate", "speedup": 1.07}]}
    assert script.best_raced(domain) == ("cascade", 1.18, 1.25)
    assert script.best_raced({"measurements": [{"role": "lookup", "speedup": 0.9}]}) == ("ar", 1.0, 1.0)


def test_the_bound_is_the_benchs_overall_speedup_at_those_speedups(script):
    ar = [{"id": "a1", "group": "a", "method": "ar", "tokens_per_s": 10.0},
          {"id": "b1", "group": "b", "method": "ar", "tokens_per_s": 2.0},
          {"id": "a2", "group": "a", "method": "ar", "tokens_per_s": 6.0}]
    speedups = {"a": 2.0, "b": 1.5}
    fast = [{**r, "method": "x", "tokens_per_s": r["tokens_per_s"] * speedups[r["group"]]} for r in ar]
    expected = summarize(ar + fast, ["x"])["x"]["speedup"]
    assert script.bound(ar, speedups) == pytest.approx(expected, abs=1e-4)
    assert script.bound(ar, speedups) == pytest.approx((20 + 3 + 12) / 18)
    assert script.bound(ar, {}) == 1.0  # a group with no record runs at ar's speed
