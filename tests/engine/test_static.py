"""The static steps (:mod:`adaptive.engine.static`) run eagerly on the CPU: each equals the eager forward (fp32),
keeps feature rows, verifies trees and decodes in chains as plain decoding does; CUDA graphs replay them
(tests/engine/test_graphs.py)."""

import pytest
import torch

from adaptive.engine.backbone import Backbone, KVCache
from adaptive.engine.formulas import StepOps
from adaptive.engine.graphs import bucket_for, capacity_for
from adaptive.engine.skip import SkipSet
from adaptive.engine.static import CHAIN_MAX, ChainedStep, StaticStep, tree_meta
from tests.conftest import tiny_model


def _static_run(bb, step, ids, start, cache):
    cap = cache.k.shape[2]
    cos, sin = bb.rope_table(cap)
    Tb = step.bucket
    buf = torch.zeros(Tb, dtype=torch.long)
    buf[:len(ids)] = ids
    meta = torch.tensor([start, len(ids) - 1])
    return step(buf, meta, cache.k, cache.v, cos, sin, cache.features)


def _slot_cache(bb, max_len):
    k, v = bb.allocate_kv(capacity_for(max_len))
    return KVCache(k=k, v=v, limit=max_len)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_static_step_equals_the_eager_forward(family):
    """Every bucket's padded step gives the eager forward's logits for its real rows (fp32), with the full
    model and with a skip set, 'all' and 'last' logits, and writes the same keys at the real positions."""
    bb = Backbone(tiny_model(family, n_layers=4))
    V = bb.vocab_size
    torch.manual_seed(0)
    ids = torch.randint(3, V, (60,))
    for masks in (None, SkipSet(attn=(1,), mlp=(2,)).masks(4)):
        for T in (1, 2, 3, 7, 9, 20):
            eager_cache, slot = bb.new_cache(60), _slot_cache(bb, 60)
            bb.forward(ids[:30], eager_cache, 0, logits="none")
            bb.forward(ids[:30], slot, 0, logits="none")
            ref = bb.forward(ids[30:30 + T], eager_cache, 30, skip_masks=masks, logits="all").logits
            for logits in ("all", "last"):
                step = StaticStep(bb, bucket_for(T), masks or bb._full, logits)
                out = _static_run(bb, step, ids[30:30 + T], 30, slot)
                want = ref if logits == "all" else ref[-1:]
                got = out[:T] if logits == "all" else out
                assert torch.allclose(got, want, atol=1e-5), (family, T, logits)
                assert torch.equal(got.argmax(-1), want.argmax(-1))
            ran = [i for i in range(4) if masks is None or not masks[0][i]]
            assert torch.allclose(slot.k[ran][:, :, :30 + T], eager_cache.k[ran][:, :, :30 + T], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_steps_write_the_eager_forwards_feature_rows(family):
    """fp32: a prefill chunk ('last' logits, padded) and a verification ('all') over a slot with feature rows
    write the eager forward's rows at their real positions (the embeddings, a middle layer and the last);
    a skip set's step may not write them (a draft's residual stream is not the target's)."""
    bb = Backbone(tiny_model(family, n_layers=4))
    layers = (0, 2, 4)
    torch.manual_seed(0)
    ids = torch.randint(3, bb.vocab_size, (40,))
    eager = bb.new_cache(48, features=layers)
    bb.forward(ids[:30], eager, 0, logits="none")
    want = bb.forward(ids[30:35], eager, 30, logits="all").logits
    k, v = bb.allocate_kv(capacity_for(48))
    rows = torch.zeros(k.shape[2], len(layers), bb.hidden_size)
    slot = KVCache(k=k, v=v, limit=48, features=rows, feature_layers=layers)
    _static_run(bb, StaticStep(bb, 32, bb._full, "last", keep=layers), ids[:30], 0, slot)
    got = _static_run(bb, StaticStep(bb, 8, bb._full, "all", keep=layers), ids[30:35], 30, slot)
    assert torch.allclose(got[:5], want, atol=1e-5)
    assert torch.allclose(slot.features[:35], eager.features[:35], rtol=1e-4, atol=1e-4)  # another product order
    assert torch.equal(slot.features[:35, 0], eager.features[:35, 0])  # the embeddings, exactly
    assert slot.features[35:40].abs().sum() > 0  # the padding rows' (positions 35..37) are written, as their keys
    assert not slot.features[:35, 2].equal(slot.features[:35, 1])  # each layer's own rows
    with pytest.raises(ValueError, match="full model"):
        StaticStep(bb, 1, SkipSet(attn=(1,)).masks(4), "last", keep=layers)
    with pytest.raises(ValueError, match="feature rows"):
        step = StaticStep(bb, 1, bb._full, "last", keep=layers)
        step(ids[:1], torch.tensor([0, 0]), k, v, *bb.rope_table(k.shape[2]))  # no feature rows given


def test_tree_meta_worked_example():
    assert tree_meta([-1, 0, 0], 5, 4) == [5, 2, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1]
    assert tree_meta([-1], 9, 1) == [9, 0, 0, 1]  # a tree of the pending token alone: a plain step
    with pytest.raises(ValueError, match="bucket"):
        tree_meta([-1, 0, 0], 5, 2)
    with pytest.raises(ValueError, match="parent"):
        tree_meta([-1, 2, 0], 5, 4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tree_step_equals_the_eager_tree_forward(family):
    """fp32: a tree step (rows at their depths' positions, each seeing its ancestors, padded to its bucket)
    gives the eager tree forward's logits at every real row and writes its keys and feature rows at the rows'
    slots; then the kept path moved, the cache is the chain's."""
    bb = Backbone(tiny_model(family, n_layers=4))
    layers = (0, 4)
    torch.manual_seed(0)
    ids = torch.randint(3, bb.vocab_size, (40,))
    for tree in ([-1, 0, 0, 1, 2, 1], [-1, 0, 1, 2], list(range(-1, 8)), [-1] + [0] * 9):
        T = len(tree)
        eager = bb.new_cache(48, features=layers)
        bb.forward(ids[:30], eager, 0, logits="none")
        feed = ids[30:30 + T]
        want = bb.forward(feed, eager, 30, logits="all", tree=tree).logits
        k, v = bb.allocate_kv(capacity_for(48))
        slot = KVCache(k=k, v=v, limit=48, features=torch.zeros(k.shape[2], 2, bb.hidden_size), feature_layers=layers)
        _static_run(bb, StaticStep(bb, 32, bb._full, "last", keep=layers), ids[:30], 0, slot)
        Tb = bucket_for(T)
        buf = torch.zeros(Tb, dtype=torch.long)
        buf[:T] = feed
        meta = torch.tensor(tree_meta(tree, 30, Tb))
        got = StaticStep(bb, Tb, bb._full, "all", keep=layers, tree=True)(buf, meta, k, v, *bb.rope_table(k.shape[2]),
                                                                         slot.features)
        assert torch.allclose(got[:T], want, atol=1e-5), tree
        assert torch.allclose(slot.k[:, :, :30 + T], eager.k[:, :, :30 + T], atol=1e-5)
        assert torch.allclose(slot.features[:30 + T], eager.features[:30 + T], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="verification"):
        StaticStep(bb, 8, bb._full, "last", tree=True)


@pytest.mark.slow
def test_static_step_compiles_whole_on_the_cpu():
    """torch.compile(fullgraph=True) traces the static step with no graph break (a host read such as
    .item() would be one) and the compiled step gives the eager forward's tokens (fp32)."""
    bb = Backbone(tiny_model("qwen3", n_layers=2))
    torch.manual_seed(0)
    ids = torch.randint(3, bb.vocab_size, (40,))
    eager_cache, slot = bb.new_cache(40), _slot_cache(bb, 40)
    bb.forward(ids[:20], eager_cache, 0, logits="none")
    bb.forward(ids[:20], slot, 0, logits="none")
    ref = bb.forward(ids[20:25], eager_cache, 20, logits="all").logits
    step = torch.compile(StaticStep(bb, 8, bb._full, "all"), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        out = _static_run(bb, step, ids[20:25], 20, slot)[:5]
    assert torch.allclose(out, ref, atol=1e-4) and torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_the_compiled_pieces_give_the_plain_step():
    """StepOps.compiled (what CUDA graphs capture by default) traces each piece whole, the split that writes
    the cache included (no graph break), and gives the plain pieces' logits and cache writes, for two buckets
    (automatic dynamic shapes) and a skip set."""

    bb = Backbone(tiny_model("qwen3", n_layers=3))
    torch.manual_seed(0)
    ids = torch.randint(3, bb.vocab_size, (40,))
    ops = StepOps.compiled()
    with torch.inference_mode():
        for T, masks in ((1, bb._full), (3, bb._full), (5, SkipSet(attn=(0,), mlp=(2,)).masks(3))):
            plain_cache, slot = _slot_cache(bb, 40), _slot_cache(bb, 40)
            for c in (plain_cache, slot):
                bb.forward(ids[:20], c, 0, logits="none")
            want = _static_run(bb, StaticStep(bb, bucket_for(T), masks, "all"), ids[20:20 + T], 20, plain_cache)
            got = _static_run(bb, StaticStep(bb, bucket_for(T), masks, "all", ops), ids[20:20 + T], 20, slot)
            assert torch.allclose(got[:T], want[:T], atol=1e-4) and torch.equal(got[:T].argmax(-1),
                                                                                 want[:T].argmax(-1))
            assert torch.allclose(slot.k[:, :, :20 + T], plain_cache.k[:, :, :20 + T], atol=1e-4)
            assert torch.allclose(slot.v[:, :, :20 + T], plain_cache.v[:, :, :20 + T], atol=1e-4)


def test_steps_record_no_autograd_whatever_the_grad_mode():
    """The backbone's weights require no grad, so a step run with grad on (as warm_graphs once captured the
    server's graphs) leaves a cache and logits that record nothing: with grad recorded, Inductor's pieces
    compiled training graphs (on an H100 the embedded model decoded at ~600 instead of ~700 tok/s)."""
    bb = Backbone(tiny_model("llama", n_layers=2))
    assert not any(p.requires_grad for p in bb.model.parameters())
    ids = torch.randint(3, bb.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
    slot = _slot_cache(bb, 40)
    bb.forward(ids[:20], slot, 0, logits="none")
    with torch.enable_grad():
        out = _static_run(bb, StaticStep(bb, 1, bb._full, "all"), ids[20:], 20, slot)
    assert not out.requires_grad and not slot.k.requires_grad and not slot.v.requires_grad


def test_a_chained_step_decodes_as_plain_greedy_steps():
    """ChainedStep (what StepGraphs.chain replays back to back) feeds each argmax to the next position:
    its tokens, state and cache writes are plain greedy decoding's, step by step on the eager forward (fp32)."""
    bb = Backbone(tiny_model("qwen3", n_layers=2))
    ids = torch.randint(3, bb.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    ref_cache, slot = bb.new_cache(40), _slot_cache(bb, 40)
    first = int(bb.forward(ids, ref_cache, 0, logits="last").logits[0].argmax())
    bb.forward(ids, slot, 0, logits="none")
    want, tok = [], first
    for pos in range(20, 26):  # plain decoding: feed the token, take the argmax
        tok = int(bb.forward(torch.tensor([tok]), ref_cache, pos, logits="all").logits[0].argmax())
        want.append(tok)
    chained = ChainedStep(StaticStep(bb, 1, bb._full, "all"))
    state, out = torch.tensor([first, 20, 0, 0]), torch.zeros(CHAIN_MAX, dtype=torch.long)
    cos, sin = bb.rope_table(slot.k.shape[2])
    with torch.inference_mode():
        for _ in range(6):
            chained(state, out, slot.k, slot.v, cos, sin)
    assert out[:6].tolist() == want and state.tolist() == [want[-1], 26, 0, 6]
    assert torch.allclose(slot.k[:, :, :26], ref_cache.k[:, :, :26], atol=1e-5)
    with pytest.raises(ValueError, match="one-token step"):
        ChainedStep(StaticStep(bb, 2, bb._full, "all"))
    assert bb.decode_chain(first, slot, 20, 4) is None  # no CUDA graphs here: the caller decodes step by step
