"""The eagle drafter (adaptive/drafters/eagle_drafter.py): greedy decoding with it equals plain decoding,
chains and trees, with and without prompt lookup first; a rewound drafter drafts as a fresh one; a tree's
shape and its main chain; sampling distributed as the target (chi-square). Its head: tests/drafters/test_eagle.py;
its levels as graphs: tests/drafters/test_eagle_static.py."""

import pytest
import torch

from adaptive.drafters.eagle import COPY_MIN, DEFAULT_TREE, TreeShape
from adaptive.drafters.eagle_drafter import EagleDrafter
from adaptive.drafters.factory import DrafterSpec, build_drafter, eagle_vocab
from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import GenerationStats, Lane, decode_steps, new_cache, prefill
from adaptive.engine.protocol import DecodeState, DraftChoice, FixedDraftLength
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm
from tests.drafters.test_eagle import LAYERS, random_head
from tests.helpers.decoding import decode_ids
from tests.helpers.sampling import CFG, V, chi2_pvalue, sample_counts, target_joint


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [None, DEFAULT_TREE, TreeShape(2, 3)])
def test_eagle_greedy_equals_plain_decoding(family, tree):
    lm = tiny_lm(family)
    bb = lm.backbone
    head = random_head(lm, vocab_ids=torch.arange(0, bb.vocab_size, 2))  # half the rows: the prompt adds more
    cfg = GenerationConfig(max_new_tokens=40, draft_len=4, features=LAYERS, ignore_eos=True)
    for prompt in ([5, 9, 12, 7, 3, 22, 8, 5, 9], [14, 6, 14, 6, 14]):
        plain = decode_ids(bb, prompt, cfg)
        for copy_min in (COPY_MIN, 0):  # prompt lookup first (the default), and the head alone
            stats = GenerationStats()
            drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=copy_min, tree=tree)
            assert decode_ids(bb, prompt, cfg, drafter, stats=stats) == plain
            assert stats.drafted > 0 and stats.steps < len(plain)  # it drafted, and some drafts were kept
            depths = sum(k * n for k, n in stats.draft_lengths.items())
            if tree is None:
                assert stats.drafted == depths
            elif copy_min == 0:  # every draft a tree: more nodes than levels
                assert stats.drafted > depths
        drafter = build_drafter(DrafterSpec("eagle", eagle=head, head=eagle_vocab(head, bb, prompt)), bb)
        assert isinstance(drafter, EagleDrafter) and drafter.copy_min == COPY_MIN


def prefilled(prompt: list[int], pending: int | None = None, draft_len: int = 4, max_new_tokens: int = 30):
    """A tiny llama's prompt prefilled (its cache keeping the head's feature rows), a random head and the
    decoding state: ``(lm, head, cfg, state)``, the pending token the target's first unless ``pending``."""
    lm = tiny_lm("llama")
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len, features=LAYERS, ignore_eos=True)
    cache = new_cache(bb, len(prompt), cfg)
    first = prefill(bb, prompt, cache, cfg, None).first
    return lm, random_head(lm, scale=1.0), cfg, DecodeState(bb, cache, prompt + [first if pending is None else pending],
                                                            cfg, None)


def test_a_drafter_rewound_drafts_as_a_fresh_one():
    """A race rewinds the target between its blocks: the drafter then feeds again from the rewound row and
    indexes the lookups again, so it proposes what a new drafter at that state would."""
    prompt = [5, 9, 12, 7, 3, 5, 9, 12, 8, 14]
    lm, head, cfg, state = prefilled(prompt)
    bb, cache = lm.backbone, state.cache
    old = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0)
    steps = decode_steps(bb, state, old, FixedDraftLength(3), cfg)
    for _ in range(4):
        next(steps)
    cache.length = len(prompt) + 2  # rewind, keeping the prompt, the first token and one more
    del state.tokens[len(prompt) + 3:]
    new = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0)
    assert torch.equal(old.propose(state, DraftChoice(3)).tokens, new.propose(state, DraftChoice(3)).tokens)


def test_copies_run_to_the_choice_s_copy_length_marked_as_statistical():
    prompt = [5, 9, 12, 7, 3, 22, 8, 14, 6, 5]
    lm, head, _, state = prefilled(prompt, pending=9, draft_len=8)  # pending 9: [5, 9] occurred at 0, then 12, 7, ...
    bb = lm.backbone
    drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, tree=None)
    long = drafter.propose(state, DraftChoice(1, copy=5))
    assert long.tokens.tolist() == [12, 7, 3, 22, 8] and long.sources == ("statistical",) * 5
    assert drafter.propose(state, DraftChoice(2)).tokens.tolist() == [12, 7]  # no copy length: the draft's
    head_only = drafter.propose(state, DraftChoice(2, copy=0))  # no copy this step: the head drafts
    assert len(head_only) == 2 and head_only.sources == ()
    state.tokens[-1] = 31  # [5, 31] occurs nowhere earlier: nothing to copy
    assert len(drafter.propose(state, DraftChoice(0, copy=5))) == 0  # a copy alone was asked for, and none


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle_greedy_with_long_copies_equals_plain_decoding(family):
    lm = tiny_lm(family)
    bb = lm.backbone
    head = random_head(lm, scale=1.0)
    cfg = GenerationConfig(max_new_tokens=40, draft_len=8, features=LAYERS, ignore_eos=True)
    prompt = [14, 6, 14, 6, 14, 6, 9, 14, 6]
    plain = decode_ids(bb, prompt, cfg)
    stats = GenerationStats()
    # copies of a single token's latest occurrence (copy_min 1): frequent in a random model's text, mostly wrong
    drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=1)
    assert decode_ids(bb, prompt, cfg, drafter, FixedDraftLength(2, copy=8), stats=stats) == plain
    assert max(k for k, n in stats.draft_lengths.items() if n) > 2  # some copies ran past the head's length

    class CopiesOnly(FixedDraftLength):  # the head never pays, copies do: the loop asks for a copy alone
        def choose(self, max_len):
            return DraftChoice(0, copy=min(8, max_len))

    stats = GenerationStats()
    drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=1)
    assert decode_ids(bb, prompt, cfg, drafter, CopiesOnly(1), stats=stats) == plain
    assert stats.drafted > 0 and stats.steps < len(plain)  # copies were drafted, and some kept


def test_a_copy_longer_than_the_step_allows_is_refused():
    prompt = [5, 9, 12, 7, 5, 9]
    lm, head, cfg, state = prefilled(prompt, max_new_tokens=10)
    bb = lm.backbone
    drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows)
    lane = Lane(state, drafter, FixedDraftLength(2), cfg, GenerationStats())
    assert lane.max_draft == 4 and len(lane.propose(DraftChoice(2, copy=4))) >= 1
    with pytest.raises(ValueError, match="exceeds"):  # past cfg.draft_len: past what the cache was sized for
        lane.propose(DraftChoice(2, copy=5))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tree_draft_branches_within_its_shape_and_its_main_chain_is_the_chain_s_draft(family):
    """A tree (:class:`TreeShape`) has at most ``nodes`` nodes over at most the chosen depth, its first
    level the head's ``width`` likeliest tokens; the path of first children is what the chain drafter
    drafts, as far as the tree goes (the same head rows, computed a level at a time)."""
    lm = tiny_lm(family)
    bb = lm.backbone
    head = random_head(lm, scale=1.0)
    prompt = [5, 9, 12, 7, 3, 22, 8, 5, 9, 30]
    cfg = GenerationConfig(max_new_tokens=20, draft_len=4, features=LAYERS, ignore_eos=True)
    for depth in (1, 3, 4):
        cache = new_cache(bb, len(prompt), cfg)
        first = prefill(bb, prompt, cache, cfg, None).first
        state = DecodeState(bb, cache, prompt + [first], cfg, None)
        shape = TreeShape(3, 7)
        tree = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0, tree=shape)
        chain = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0, tree=None)
        t, c = tree.propose(state, DraftChoice(depth)), chain.propose(state, DraftChoice(depth))
        assert t.parents is not None and c.parents is None
        assert len(t) <= shape.nodes and t.depth <= depth and t.parents.count(-1) == min(3, shape.nodes)
        assert len(set(zip(t.tokens.tolist(), t.parents))) == len(t)  # no node twice
        main = t.main_chain().tokens.tolist()
        assert main and main == c.tokens.tolist()[:len(main)]
        if depth == 1:  # one level: the width's likeliest first tokens
            assert t.depth == 1 and len(t) == 3
    # no alternative is likelier than one half (the token it stands beside is likelier still): a floor above
    # that leaves the main chain alone
    floor = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0, tree=TreeShape(3, 7, 0.51))
    only = floor.propose(state, DraftChoice(4))
    assert only.parents == tuple(range(-1, len(only) - 1)) and only.tokens.tolist() == main
    with pytest.raises(ConfigError, match="min_prob"):
        TreeShape(3, 7, 1.0)
    sampling = GenerationConfig(max_new_tokens=20, draft_len=4, features=LAYERS, temperature=0.8, seed=1)
    state = DecodeState(bb, cache, prompt + [first], sampling, torch.Generator().manual_seed(0))
    assert tree.propose(state, DraftChoice(3)).parents is not None  # sampling drafts trees too (point masses)


def test_eagle_needs_the_features_in_the_cache():
    lm = tiny_lm("llama")
    drafter = build_drafter(DrafterSpec("eagle", eagle=random_head(lm)), lm.backbone)
    with pytest.raises(ConfigError, match="features"):
        decode_ids(lm.backbone, [5, 9, 12], GenerationConfig(max_new_tokens=5, draft_len=2), drafter)
    with pytest.raises(ConfigError, match="trained head"):
        DrafterSpec("eagle")


@pytest.mark.parametrize("tree", [None, DEFAULT_TREE, TreeShape(3, 6)])
def test_eagle_sampling_matches_the_target(tree):
    """Chains sample from the head's distribution; trees propose its likeliest tokens as point masses and
    verify them by speculative_accept_tree: both keep the target's distribution."""
    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    head = random_head(lm, seed=3, scale=1.0)
    cfg = GenerationConfig(**{**CFG.__dict__, "features": LAYERS})
    counts = sample_counts(lm, lambda: build_drafter(DrafterSpec("eagle", eagle=head, tree=tree), lm.backbone),
                           cfg=cfg)
    assert chi2_pvalue(counts, target_joint(lm)) > 1e-3
