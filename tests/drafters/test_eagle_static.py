"""The eagle head's static levels (adaptive/drafters/eagle_static.py): the position tensors' worked examples,
a static level equal to the eager one (float32), and the head slots' pool; the drafter over stand-in graphs
is tested with the target's graphs in tests/engine/test_graphs.py."""

import gc

import pytest
import torch

from adaptive.drafters.eagle import HeadCache, lookup_tokens
from adaptive.drafters.eagle_drafter import EagleDrafter
from adaptive.drafters.eagle_static import (
    HEAD_WINDOW,
    StaticHeadStep,
    head_graphs,
    head_meta,
    level_banned,
    level_inputs,
    release_head,
)
from adaptive.drafters.factory import eagle_vocab
from adaptive.engine.config import GenerationConfig
from adaptive.engine.graphs import bucket_for
from tests.conftest import tiny_lm
from tests.drafters.test_eagle import LAYERS, random_head
from tests.helpers.decoding import decode_ids


def test_head_meta_worked_examples():
    assert head_meta(10, 11, 1, 2, window=4) == [10, 11, 0, 11, 12, 1, 1, 0, 0, 0, 0, 1, 0]
    # a tree level: two rows at slots 12 and 13 rotated at position 11, each seeing one of the level before and itself
    assert head_meta(10, 12, 2, 2, positions=[11, 11], seen=[[0, 2], [1, 3]], window=4) == \
        [10, 12, 1, 11, 11, 1, 0, 1, 0, 0, 1, 0, 1]
    assert head_meta(5, 5, 2, 2, window=2) == [5, 5, 1, 5, 6, 1, 0, 1, 1]  # a causal block
    with pytest.raises(ValueError, match="does not fit"):
        head_meta(0, 0, 3, 2)
    with pytest.raises(ValueError, match="window"):
        head_meta(0, 3, 2, 2, window=4)  # rows 3 and 4 pass a window of 4 columns
    with pytest.raises(ValueError, match="cannot see"):
        head_meta(0, 0, 1, 1, seen=[[1]])  # a later column
    with pytest.raises(ValueError, match="masks"):
        head_meta(0, 0, 2, 2, seen=[[0]])


def test_level_inputs_worked_example():
    assert level_inputs([7], [3], [-1], 2, [10, 11, 0], 2).tolist() == [7, 0, 3, -1, -1, -1, 2, 10, 11, 0]


def test_level_banned_worked_examples():
    assert level_banned(1, 2, [[0, 1]]).tolist() == [[False, False, False]]
    assert level_banned(1, 2, [[1]]).tolist() == [[False, True, False]]
    assert level_banned(0, 0, [[0], [0, 1]]).tolist() == [[False, True], [False, False]]  # causal


def test_a_static_level_computes_the_eager_level():
    """Three levels as a drafter runs them (a block of the target's rows, a chain's draft row, a tree level of
    two rows with their own masks and positions), padded to their buckets: the static step writes the eager
    step's keys and values and returns its outputs and logits (float32), ``-inf`` past the request's extra rows."""
    lm = tiny_lm("llama")
    bb = lm.backbone
    head = random_head(lm, vocab_ids=torch.arange(0, bb.vocab_size, 2))
    step = head.step(torch.float32)
    ids = [5, 9, 12, 7, 3, 22, 8, 5, 9, 14, 6]
    target = bb.new_cache(len(ids), features=LAYERS)
    bb.forward(torch.tensor(ids), target, 0)
    looks = lookup_tokens(ids, head.shape.lookup)
    index = [t // 2 if t >= 0 and t % 2 == 0 else -1 for t in looks]  # the head's rows: the even ids
    s, C, X = head.shape, 96, 8
    extra = bb.head_rows(torch.tensor([1, 3]))  # two rows beyond the head's own, in a buffer of eight
    buffer = torch.zeros(X, s.hidden)
    buffer[:2] = extra
    eager = HeadCache(s, C, bb.device)
    k, v = torch.zeros(s.kv_heads, C, s.head_dim), torch.zeros(s.kv_heads, C, s.head_dim)
    cos, sin = step.rope(0, C, bb.device)
    fused = step.fuse(target.features[:6])
    # (u, rows j (tokens j + 1, lookups of j), committed, at, positions, seen, logits)
    levels = [(fused, range(0, 6), 0, 0, None, None, "last"), (None, range(6, 7), 6, 6, None, None, "last"),
              (None, range(7, 9), 6, 7, [7, 7], [[0, 1], [0, 2]], "all")]
    g = None
    for u, rows, committed, at, positions, seen, mode in levels:
        u = g[-1:].expand(len(rows), -1) if u is None else u
        toks, lks, idx = [ids[j + 1] for j in rows], [looks[j] for j in rows], [index[j] for j in rows]
        T = len(toks)
        Tb = bucket_for(T)
        emb = bb.embed_rows(torch.tensor(toks + [max(t, 0) for t in lks]))
        banned = None if seen is None else level_banned(committed, at, seen)
        pos = None if positions is None else torch.tensor(positions)
        want_g = step.rows(u, emb[:T], emb[T:], torch.tensor(lks) >= 0, eager, at, pos, banned)
        want = step.logits(want_g[-1:] if mode == "last" else want_g, torch.tensor(idx[-1:] if mode == "last" else idx),
                           extra)
        ubuf = torch.zeros(Tb, s.hidden)
        ubuf[:T] = u
        ints = level_inputs(toks, lks, idx, 2, head_meta(committed, at, T, Tb, positions, seen), Tb)
        got_g, got = StaticHeadStep(step, bb.embed_rows, Tb, mode)(ints, ubuf, k, v, cos, sin, buffer)
        V = len(head.ids) + 2
        assert torch.allclose(got_g[:T], want_g, atol=1e-5, rtol=1e-5)
        assert torch.allclose(got[:len(want), :V], want, atol=1e-4, rtol=1e-5)
        assert torch.isinf(got[:, V:]).all() and (got[:, V:] < 0).all()
        assert torch.allclose(k[:, at:at + T], eager.k[:, at:at + T], atol=1e-6)
        assert torch.allclose(v[:, at:at + T], eager.v[:, at:at + T], atol=1e-6)
        g = want_g
    with pytest.raises(ValueError, match="'all' or 'last'"):
        StaticHeadStep(step, bb.embed_rows, 1, "none")


def test_head_slots_are_pooled_and_levels_they_cannot_serve_run_eagerly(cpu_step_graphs):
    """A freed drafter's head slot is the next request's; a level of more rows than the largest bucket (a long
    prompt's first block) runs eagerly over the same slot, and the drafter still decodes as plain decoding with
    the eager run's drafts; a backbone without graphs has no head graphs."""
    lm = tiny_lm("llama")
    eager, graphed = lm.backbone, cpu_step_graphs(lm.model)
    head = random_head(lm, vocab_ids=torch.arange(0, eager.vocab_size, 2))
    assert head_graphs(head.step(torch.float32), eager, eager.embed_rows) is None
    levels = head_graphs(head.step(torch.float32), graphed, graphed.embed_rows)
    assert levels is head_graphs(head.step(torch.float32), graphed, graphed.embed_rows)  # kept with the graphs
    cfg = GenerationConfig(max_new_tokens=24, draft_len=4, features=LAYERS, ignore_eos=True)
    prompt = [(7 * i) % 23 + 1 for i in range(40)]  # 40 rows in its first block: more than a bucket's 32
    runs = []
    for bb in (eager, graphed):
        drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0, tree=None)
        assert decode_ids(bb, prompt, cfg, drafter) == decode_ids(eager, prompt, cfg)
        runs.append(drafter.cache.k[:, :drafter.cache.length].clone())
    # the same committed keys: the first block's written eagerly into the slot, the later ones by replays
    assert runs[0].shape == runs[1].shape and runs[0].shape[1] > 40
    assert torch.allclose(runs[0], runs[1], atol=1e-5)
    assert drafter.cache.slot is not None and levels.replays > 0
    made, k = levels.pool.allocated, drafter.cache.k
    del drafter
    gc.collect()
    again = levels.cache(graphed.new_cache(40).k.shape[2], torch.zeros(0, head.shape.hidden))
    assert levels.pool.allocated == made and again.k is k  # the freed slot, not a new one
    assert again.k.shape[1] == graphed.new_cache(40).k.shape[2] + HEAD_WINDOW
    with pytest.raises(ValueError, match="extra rows"):
        levels.cache(8, torch.zeros(9, head.shape.hidden))
    # a replaced head's levels are dropped; a request still drafting with them runs its levels eagerly
    captured = graphed.graphs.captures
    assert release_head(head, graphed) == 1 and levels.released and graphed.graphs.captures < captured
    u = torch.zeros(1, head.shape.hidden)
    assert levels.run(again, u, [5], [-1], [-1], 0, 0, 0) is NotImplemented
    # and never captured again: a request planned with the replaced head drafts eagerly
    assert head_graphs(head.step(torch.float32), graphed, graphed.embed_rows) is None


def test_a_failed_capture_of_a_level_leaves_the_targets_graphs_on(capsys):
    """A head level whose capture fails (here: no CUDA to capture on) runs eagerly from then on, said once; the
    backbone's own graphs stay on."""
    from adaptive.engine.backbone import Backbone
    from adaptive.engine.graphs import StepGraphs

    lm = tiny_lm("llama")
    bb = Backbone(lm.model)
    bb.graphs = StepGraphs(bb, compile="none")
    head = random_head(lm)
    levels = head_graphs(head.step(torch.float32), bb, bb.embed_rows)
    cache = levels.cache(256, torch.zeros(0, head.shape.hidden))
    u = torch.zeros(1, head.shape.hidden)
    assert levels.run(cache, u, [5], [-1], [-1], 0, 0, 0) is NotImplemented
    assert levels.failed and bb.graphs.enabled
    assert levels.run(cache, u, [5], [-1], [-1], 0, 0, 0) is NotImplemented  # not tried again
    err = capsys.readouterr().err
    assert err.count("CUDA graph capture failed") == 1 and "this step runs eagerly" in err
