"""Tree drafts: their depths, main chains and validation (literal examples); draft choices and fixed lengths."""

import pytest
import torch

from adaptive.engine.protocol import Draft, DraftChoice, DraftPlan, FixedDraftLength, tree_depths, tree_first_path


def test_tree_depths_and_first_path_worked_examples():
    assert tree_depths((-1, -1, 0, 2)) == [1, 1, 2, 3]
    assert tree_first_path((-1, -1, 0, 0, 3)) == [0, 2]
    assert tree_first_path((-1, 0, 1, 2)) == [0, 1, 2, 3]  # a chain written as a tree is its own path
    assert tree_first_path(()) == []


def test_a_tree_draft_has_a_depth_and_a_main_chain():
    tree = Draft(torch.tensor([5, 6, 7, 8, 9]), parents=(-1, -1, 0, 0, 2), forwards=2)
    assert len(tree) == 5 and tree.depth == 3
    chain = tree.main_chain()
    assert chain.parents is None and chain.tokens.tolist() == [5, 7, 9] and chain.forwards == 2
    plain = Draft(torch.tensor([1, 2]))
    assert plain.depth == 2 and plain.main_chain() is plain


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, -2), (-1,)])
def test_a_tree_draft_needs_earlier_parents_one_per_token(parents):
    with pytest.raises(ValueError, match="parent"):
        Draft(torch.tensor([3, 4]), parents=parents)


def test_a_tree_draft_s_tokens_are_point_masses():
    with pytest.raises(ValueError, match="point masses"):
        Draft(torch.tensor([3, 4]), q=torch.full((2, 8), 0.125), parents=(-1, 0))


def test_a_draft_choice_s_copy_length_and_a_fixed_policy_s():
    assert DraftChoice(2).copy is None and DraftChoice(0, copy=6).copy == 6
    with pytest.raises(ValueError, match="copy"):
        DraftChoice(2, copy=-1)
    assert FixedDraftLength(3).choose(8) == DraftChoice(3)
    assert FixedDraftLength(3, copy=8).choose(8) == DraftChoice(3, copy=8)
    assert FixedDraftLength(3, copy=8).choose(2) == DraftChoice(2, copy=2)  # near the end: the step's limit
    with pytest.raises(ValueError):
        FixedDraftLength(3, copy=-1)
    plan = DraftPlan((0.5, 0.25), (0.1, 0.1), split=1, copy=6)
    assert plan.choice(2) == DraftChoice(2, 1, 6) and DraftPlan((0.5,), (0.1,)).choice(1) == DraftChoice(1)
