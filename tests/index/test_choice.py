"""Choosing the routing embedding by held-out routing accuracy on the calibration prompts."""

import numpy as np
import pytest

from adaptive.engine.config import Pooling
from adaptive.index.choice import choose_pooling, held_out_accuracy, pooling_key

# two domains of four prompts: "a" near the first axis, "b" near the second
SEPARATE = {"a": np.array([[1.0, 0.1, 0.0], [0.9, 0.0, 0.1], [1.0, 0.0, 0.0], [0.95, 0.05, 0.05]]),
            "b": np.array([[0.1, 1.0, 0.0], [0.0, 0.9, 0.1], [0.0, 1.0, 0.0], [0.05, 0.95, 0.05]])}
# the same prompts with the domains' vectors interleaved: fitted on one half, the other half lands on
# the other domain's anchors
MIXED = {"a": np.array([[1.0, 0.1, 0.0], [0.1, 1.0, 0.0], [1.0, 0.0, 0.1], [0.0, 1.0, 0.1]]),
         "b": np.array([[0.1, 1.0, 0.05], [1.0, 0.1, 0.05], [0.0, 1.0, 0.15], [1.0, 0.0, 0.15]])}


def test_held_out_accuracy_routes_each_fold_with_an_index_fitted_without_it():
    assert held_out_accuracy(SEPARATE, folds=2, per_domain=2, k=1) == (8, 8)
    right, routed = held_out_accuracy(MIXED, folds=2, per_domain=2, k=1)
    assert routed == 8 and right <= 2
    with pytest.raises(ValueError, match="at least 2 folds"):
        held_out_accuracy(SEPARATE, folds=1)


def test_a_domain_too_small_to_split_is_fitted_on_and_never_routed():
    one = {"a": SEPARATE["a"], "b": SEPARATE["b"][:1]}
    assert held_out_accuracy(one, folds=2, per_domain=2, k=1) == (4, 4)


def test_the_best_candidate_wins_and_a_tie_keeps_the_default():
    default, other = Pooling(10, "last"), Pooling(20, "mean")
    chosen, scores = choose_pooling([default, other], [MIXED, SEPARATE], per_domain=2, k=1)
    assert chosen == other and scores == {"last@10": scores["last@10"], "mean@20": 1.0}
    assert scores["last@10"] <= 0.25
    chosen, scores = choose_pooling([default, other], [SEPARATE, SEPARATE], per_domain=2, k=1)
    assert chosen == default and scores == {"last@10": 1.0, "mean@20": 1.0}
    with pytest.raises(ValueError, match="one embedding table per candidate"):
        choose_pooling([default], [])


def test_pooling_keys():
    assert pooling_key(Pooling(10, "last")) == "last@10" and pooling_key(Pooling()) == "mean@final"
