"""benchmarks/engine_choice_replay.py on literal prompts: the totals of each way of choosing an engine,
and the expected value of knowing a prompt's domain before the choice."""

import pytest

from tests.helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("engine_choice_replay")


def test_totals_of_each_way_of_choosing(script):
    prompts = [{"measured": {"a": 1.0, "b": 2.0}, "chosen": 1.1, "routed_first": "a"},
               {"measured": {"a": 3.0, "b": 1.0}, "chosen": 2.9, "routed_first": "b"}]
    assert script.totals(prompts) == {"chosen": 4.0, "routed-first": 2.0, "oracle": 2.0, "a": 4.0, "b": 3.0}
    wrong = [{**prompts[0], "routed_first": "b"}, prompts[1]]
    assert script.totals(wrong)["routed-first"] == 3.0


def test_routing_value_is_what_knowing_the_domain_saves(script):
    expected = {"d1": {"a": 1.0, "b": 2.0}, "d2": {"a": 2.0, "b": 1.5}}
    assert script.routing_value(expected, {"d1": 1, "d2": 1}) == pytest.approx(0.25)
    # d2 three times as common: b is least blind (1.625 against 1.75), informed (1 + 3 * 1.5) / 4 = 1.375
    assert script.routing_value(expected, {"d1": 1, "d2": 3}) == pytest.approx(0.25)
    agree = {"d1": {"a": 1.0, "b": 2.0}, "d2": {"a": 1.5, "b": 3.0}}  # a wins in every domain: nothing to learn
    assert script.routing_value(agree, {"d1": 1, "d2": 1}) == 0.0
