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


def test_a_candidate_replaces_the_default_only_when_clearly_better():
    default, other = Pooling(10, "last"), Pooling(20, "mean")
    # 8 prompts: the default right on at most 2 of them, the other on all 8: b - c >= 6 >= 2 sqrt(b + c)
    chosen, scores = choose_pooling([default, other], [MIXED, SEPARATE], per_domain=2, k=1)
    assert chosen == other and scores == {"last@10": scores["last@10"], "mean@20": 1.0}
    assert scores["last@10"] <= 0.25
    chosen, scores = choose_pooling([default, other], [SEPARATE, SEPARATE], per_domain=2, k=1)
    assert chosen == default and scores == {"last@10": 1.0, "mean@20": 1.0}  # a tie keeps the default


def test_clearly_better_is_a_sign_test_on_the_prompts_where_two_differ():
    from adaptive.index.choice import clearly_better

    def pair(b, c, same=20):  # b prompts right only in the first, c only in the second
        x = np.array([True] * b + [False] * c + [True] * same)
        y = np.array([False] * b + [True] * c + [True] * same)
        return x, y

    assert not clearly_better(*pair(5, 2))  # 3 < 2 sqrt(7) = 5.3: noise
    assert clearly_better(*pair(9, 1))  # 8 >= 2 sqrt(10) = 6.3
    assert not clearly_better(*pair(1, 9)) and not clearly_better(*pair(0, 0))


def test_a_candidate_list_needs_its_tables():
    with pytest.raises(ValueError, match="one embedding table per candidate"):
        choose_pooling([Pooling(10, "last")], [])


def test_pooling_keys():
    assert pooling_key(Pooling(10, "last")) == "last@10" and pooling_key(Pooling()) == "mean@final"
