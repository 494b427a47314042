"""The cost model: worked examples and a real measurement on a tiny model."""

import pytest

from adaptive.costs import CostModel, measure_costs
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm


def test_draft_cost_worked_example():
    # 2 layers; skipping attention 0 leaves 0.1 + 0.3 + 0.15 + 0.15 = 0.7 of a step.
    cm = CostModel(attn=(0.3, 0.3), mlp=(0.15, 0.15), base=0.1, verify=(1.0, 1.1))
    assert cm.draft_cost(SkipSet(attn=[0]).masks(2)) == pytest.approx(0.7)
    assert cm.draft_cost(SkipSet().masks(2)) == pytest.approx(1.0)
    assert cm.draft_cost(SkipSet(attn=[0, 1], mlp=[0, 1]).masks(2)) == pytest.approx(0.1)


def test_verify_cost_measured_then_extrapolated():
    cm = CostModel(attn=(0.4,), mlp=(0.4,), base=0.2, verify=(1.0, 1.1, 1.3))
    assert cm.verify_cost(0) == 1.0
    assert cm.verify_cost(2) == pytest.approx(1.3)
    # beyond 3 tokens: the last slope (0.2 per token) continues
    assert cm.verify_cost(4) == pytest.approx(1.7)


def test_cost_model_validation_and_round_trip():
    with pytest.raises(ValueError):
        CostModel(attn=(0.1,), mlp=(), base=0.1, verify=(1.0,))
    with pytest.raises(ValueError):
        CostModel(attn=(0.1,), mlp=(0.1,), base=-0.1, verify=(1.0,))
    with pytest.raises(ValueError):
        CostModel(attn=(0.1,), mlp=(0.1,), base=0.1, verify=())
    cm = CostModel.uniform(4, verify=(1.0, 1.05))
    assert CostModel.from_dict(cm.to_dict()) == cm
    assert sum(cm.attn) + sum(cm.mlp) + cm.base == pytest.approx(1.0)


def test_measure_costs_on_a_tiny_model():
    lm = tiny_lm("llama", n_layers=4)
    cm = measure_costs(lm.backbone, context=32, max_verify=5, repeats=5)
    assert cm.n_layers == 4 and len(cm.verify) == 5
    assert cm.verify[0] == 1.0 and cm.step_ms > 0 and cm.context == 32
    assert CostModel.from_dict(cm.to_dict()) == cm
