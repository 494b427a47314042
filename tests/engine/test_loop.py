"""Tree drafts through the decoding loop: verified as trees alone (the kept path's keys moved where a
chain's would be), as their main chains in a batch or where the cache has no room; greedy output
equal to plain decoding either way (float32)."""

import torch

from adaptive.engine.config import GenerationConfig
from adaptive.engine.loop import GenerationStats, Lane, new_cache, prefill, step
from adaptive.engine.protocol import DecodeState, Draft, DraftChoice, Drafter, FixedDraftLength
from tests.conftest import tiny_lm
from tests.helpers.decoding import decode_ids

PROMPTS = ([5, 9, 12, 7, 3, 22, 8], [14, 6, 14, 6, 14, 30])


class OracleTree(Drafter):
    """Knows plain decoding's ``reference`` output: each step it drafts a wrong first branch (a decoy
    and a child of it) and then the right continuation as the second branch, so that the kept path
    is never the first rows of the verification."""

    name = "oracle-tree"

    def __init__(self, prompt_len: int, reference: list[int], vocab: int):
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab

    def propose(self, state: DecodeState, choice: DraftChoice) -> Draft:
        done = len(state.tokens) - self.prompt_len  # the reference's tokens produced (the pending one counts)
        truth = self.reference[done:done + choice.length]
        decoy = (truth[0] + 1) % self.vocab
        tokens = [decoy, decoy, *truth]
        parents = [-1, 0, -1, *range(2, 2 + len(truth) - 1)]
        return Draft(torch.tensor(tokens), parents=tuple(parents))


def test_a_tree_keeps_its_second_branch_and_decodes_as_plain_decoding():
    lm = tiny_lm("llama")
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=30, draft_len=4, ignore_eos=True)
    for prompt in PROMPTS:
        plain = decode_ids(bb, prompt, cfg)
        stats = GenerationStats()
        out = decode_ids(bb, prompt, cfg, OracleTree(len(prompt), plain, bb.vocab_size), stats=stats)
        assert out == plain
        # every step kept its whole right branch (its depth: 4, fewer at the end) after moving its keys
        assert stats.accepted == sum(k * n for k, n in stats.draft_lengths.items()) >= 20
        assert stats.drafted == sum((k + 2) * n for k, n in stats.draft_lengths.items() if k)  # and two decoys


def _lane(bb, prompt, cfg, drafter):
    cache = new_cache(bb, len(prompt), cfg)
    first = prefill(bb, prompt, cache, cfg, None).first
    return Lane(DecodeState(bb, cache, list(prompt) + [first], cfg, None), drafter, FixedDraftLength(cfg.draft_len),
                cfg, GenerationStats())


def test_a_batch_verifies_each_tree_s_main_chain():
    """Two lanes in one step: each tree is verified as its main chain (the decoy branch), so nothing is
    kept beyond the target's own token, and the tokens are plain decoding's."""
    lm = tiny_lm("qwen2")
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=12, draft_len=3, ignore_eos=True)
    plains = [decode_ids(bb, p, cfg) for p in PROMPTS]
    lanes = [_lane(bb, p, cfg, OracleTree(len(p), ref, bb.vocab_size)) for p, ref in zip(PROMPTS, plains)]
    assert not lanes[0].verifies_tree(Draft(torch.tensor([1, 2]), parents=(-1, -1)), bb, alone=False)
    out = [[lane.state.tokens[-1]] for lane in lanes]
    while not lanes[0].done:
        for got, new in zip(out, step(bb, lanes)):
            got.extend(new)
    assert out == plains
    assert all(lane.stats.accepted == 0 and set(lane.stats.draft_lengths) - {0} == {2} for lane in lanes)


def test_a_tree_without_room_in_the_cache_is_verified_as_its_main_chain():
    lm = tiny_lm("llama")
    bb = lm.backbone
    cfg = GenerationConfig(max_new_tokens=12, draft_len=3, ignore_eos=True)
    lane = _lane(bb, PROMPTS[0], cfg, None)
    big = Draft(torch.arange(8), parents=(-1,) * 8)
    assert lane.verifies_tree(big, bb, alone=True)
    lane.state.cache.length = lane.state.cache.max_len - 8  # 8 positions left: the pending token and 7 nodes
    assert not lane.verifies_tree(big, bb, alone=True)
    sampling = _lane(bb, PROMPTS[0], GenerationConfig(max_new_tokens=12, draft_len=3, temperature=0.7), None)
    assert sampling.verifies_tree(big, bb, alone=True)  # sampling verifies trees too (speculative_accept_tree)
