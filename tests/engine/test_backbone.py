import copy

import pytest
import torch

from adaptive.engine.backbone import Backbone
from adaptive.engine.skip import SkipSet
from adaptive.errors import PromptTooLongError, UnsupportedModelError
from tests.conftest import tiny_model


def test_wide_forwards_of_a_bf16_model_on_the_cpu_attend_in_bf16():
    """A bf16 model on the CPU (float32 cache) attends in bf16 from WIDE_ATTN_ROWS queries (a prefill, a prompt
    chunk): close to the float32 attention, and no different below it (a step, a verification); a float32
    model never does."""
    from adaptive.engine.backbone import WIDE_ATTN_ROWS

    assert Backbone(tiny_model("llama")).wide_attention is None  # float32: its attention stays float32
    model = tiny_model("qwen2", n_layers=3).to(torch.bfloat16)
    exact = Backbone(copy.deepcopy(model).float())  # the same (bf16-rounded) weights in float32
    bb = Backbone(model)
    assert bb.wide_attention == torch.bfloat16 and bb.cache_dtype == torch.float32
    ids = torch.randint(0, bb.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    ref = exact.forward(ids[:290], exact.new_cache(320), 0, logits="all").logits
    out = {}
    for wide in (torch.bfloat16, None):
        bb.wide_attention = wide
        cache = bb.new_cache(320)
        prefill = bb.forward(ids[:290], cache, 0, logits="all").logits  # wide: 290 queries, in blocks
        verify = bb.forward(ids[290:296], cache, 290, logits="all").logits  # 6 queries: float32 either way
        chunk = bb.forward(ids[296:296 + WIDE_ATTN_ROWS - 28], cache, 296, logits="all").logits  # 4 queries
        out[wide] = prefill, verify, chunk, cache.k[:, :, :300].clone()
    (p1, v1, c1, k1), (p0, v0, c0, k0) = out[torch.bfloat16], out[None]
    # the wide attention ran in bf16: it moves the logits by what bf16 itself does (the model's weights and
    # products in bf16 against float32), not more than twice that (on the embedded model: +13% of its KL)
    bf16 = (p0 - ref).abs().mean()
    assert not torch.equal(p1, p0) and (p1 - p0).abs().mean() < 2 * bf16
    assert (p1.argmax(-1) == p0.argmax(-1)).float().mean() > 0.9
    # the few rows after it attend in float32 over the keys the prefill wrote (which differ a little)
    assert (v1 - v0).abs().mean() < 2 * bf16 and (c1 - c0).abs().mean() < 2 * bf16
    assert torch.equal(k1[0], k0[0]) and not torch.equal(k1[1:], k0[1:])  # layer 0's keys precede any attention
    bb.wide_attention = torch.bfloat16  # below the threshold: bit for bit the float32 attention
    for wide in (torch.bfloat16, None):
        bb.wide_attention = wide
        cache = bb.new_cache(40)
        out[wide] = torch.cat([bb.forward(ids[:WIDE_ATTN_ROWS - 1], cache, 0, logits="all").logits,
                               bb.forward(ids[31:34], cache, WIDE_ATTN_ROWS - 1, logits="all").logits])
    assert torch.equal(out[torch.bfloat16], out[None])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_forward_matches_hf_full_and_incremental(family):
    model = tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    with torch.no_grad():
        ref = model(ids).logits[0]
    bb = Backbone(model)
    full = bb.forward(ids, bb.new_cache(32), 0, logits="all").logits
    assert torch.allclose(full, ref, atol=1e-5)
    cache = bb.new_cache(32)
    bb.forward(ids[:, :11], cache, 0, logits="none")
    rest = bb.forward(ids[:, 11:], cache, 11, logits="all").logits
    assert torch.allclose(rest, ref[11:], atol=1e-5)
    last = bb.forward(ids[:, 11:], cache, 11, logits="last").logits
    assert last.shape == (1, model.config.vocab_size) and torch.allclose(last[0], ref[-1], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_long_forwards_attend_in_blocks_and_match_hf(family):
    """More than ATTN_BLOCK queries attend block by block: a 300-token prefill from position 0 and a
    200-token chunk after 100 cached positions give HF's logits."""
    from adaptive.engine.backbone import ATTN_BLOCK

    model = tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    assert ids.shape[1] > 2 * ATTN_BLOCK
    with torch.no_grad():
        ref = model(ids).logits[0]
    bb = Backbone(model)
    full = bb.forward(ids, bb.new_cache(400), 0, logits="all").logits  # room beyond the prompt, as decoding has
    assert torch.allclose(full, ref, atol=1e-4)
    cache = bb.new_cache(400)
    bb.forward(ids[:, :100], cache, 0, logits="none")
    rest = bb.forward(ids[:, 100:], cache, 100, logits="all").logits
    assert torch.allclose(rest, ref[100:], atol=1e-4)


def test_qwen2_attention_biases_and_tied_head_match_hf():
    """Qwen2's q/k/v biases (zero at HF's init, so the test above cannot see them) and a head tied
    to the embedding (as in Qwen2.5-1.5B) go through the fused projection and the head exactly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0, 0.5)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits[0]
    bb = Backbone(model)
    got = bb.forward(ids, bb.new_cache(24), 0, logits="all").logits
    assert ref.abs().max() > 0.1 and torch.allclose(got, ref, atol=1e-5)
    cache = bb.new_cache(24)
    bb.forward(ids[:, :9], cache, 0, logits="none")
    assert torch.allclose(bb.forward(ids[:, 9:], cache, 9, logits="all").logits, ref[9:], atol=1e-5)


def test_stale_keys_beyond_length_are_overwritten():
    """A rejected draft leaves keys (from the layers it ran) beyond the valid length; the next
    full forward at those positions must give exactly what a clean cache gives."""
    model = tiny_model("llama")
    bb = Backbone(model)
    ids = torch.randint(0, model.config.vocab_size, (14,))
    clean = bb.new_cache(32)
    bb.forward(ids[:10], clean, 0)
    ref = bb.forward(ids[10:], clean, 10, logits="all").logits
    dirty = bb.new_cache(32)
    bb.forward(ids[:10], dirty, 0)
    masks = SkipSet(attn=(1, 2), mlp=(0,)).masks(4)
    for j, t in enumerate([5, 9, 3, 7, 1]):  # a draft that will be "rejected"
        bb.forward(torch.tensor([t]), dirty, 10 + j, skip_masks=masks)
    dirty.k[:, :, 16:] = 1e4  # garbage far beyond, never to be read
    out = bb.forward(ids[10:], dirty, 10, logits="all").logits
    assert torch.equal(out, ref)


def test_pooled_embedding_is_mean_of_final_hidden():
    model = tiny_model("llama")
    bb = Backbone(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0]
    pooled = bb.forward(ids, bb.new_cache(9), 0, logits="none", pool=True).pooled
    assert torch.allclose(pooled, hidden.mean(0), atol=1e-5)


def test_cache_too_long_is_a_clear_error():
    bb = Backbone(tiny_model("llama"))
    with pytest.raises(PromptTooLongError, match="context is 512"):
        bb.new_cache(10_000)
    cache = bb.new_cache(8)
    with pytest.raises(PromptTooLongError):
        bb.forward(torch.arange(10), cache, 0)


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedModelError, match="not supported"):
        Backbone(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)))


def test_layer_pools_match_the_pooled_embedding_and_the_hidden_state():
    from tests.conftest import tiny_lm

    lm = tiny_lm("llama")
    bb = lm.backbone
    ids = torch.tensor([3, 7, 11, 5, 9])
    out = bb.forward(ids, bb.new_cache(5), 0, logits="none", pool=True, hidden=True,
                     pool_layers=(0, 2, bb.n_layers))
    assert set(out.layer_pools) == {0, 2, bb.n_layers}
    assert all(v.shape == (2, bb.config.hidden_size) and v.dtype == torch.float32 for v in out.layer_pools.values())
    final = out.layer_pools[bb.n_layers]
    torch.testing.assert_close(final[0], out.pooled)  # the mean after every layer is the routing embedding
    from adaptive.engine.formulas import rms_norm

    last = rms_norm(out.hidden, bb.norm.weight, bb.norm_eps).float()[-1]
    torch.testing.assert_close(final[1], last)
    assert bb.forward(ids, bb.new_cache(5), 0, logits="none").layer_pools is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_forward_equals_one_sequence_at_a_time(family):
    """Ragged segments (1, 3 and 2 tokens at different positions, each with its own cache) give the
    logits and the cached keys that forward() gives each sequence alone."""
    bb = Backbone(tiny_model(family))
    V = bb.vocab_size
    torch.manual_seed(0)
    prompts = [torch.randint(0, V, (n,)) for n in (7, 20, 12)]
    fed = [torch.randint(0, V, (n,)) for n in (1, 3, 2)]
    batched, alone = [], []
    for p in prompts:
        for caches in (batched, alone):
            c = bb.new_cache(len(p) + 8 + len(caches))  # caches of different sizes
            bb.forward(p, c, 0, logits="none")
            caches.append(c)
    from adaptive.engine.backbone import Segment

    got = bb.forward_batch([Segment(f, c, len(p)) for f, c, p in zip(fed, batched, prompts)])
    for f, c, p, g in zip(fed, alone, prompts, got):
        ref = bb.forward(f, c, len(p), logits="all").logits
        assert g.shape == ref.shape == (len(f), V)
        assert torch.allclose(g, ref, atol=1e-5) and torch.equal(g.argmax(-1), ref.argmax(-1))
    for b, a, p, f in zip(batched, alone, prompts, fed):
        end = len(p) + len(f)
        # a row multiplied together with others may round differently in its last bits
        assert torch.allclose(b.k[:, :, :end], a.k[:, :, :end], atol=1e-5)
        assert torch.allclose(b.v[:, :, :end], a.v[:, :, :end], atol=1e-5)
        assert b.length == 0  # the caller owns the lengths


@pytest.mark.parametrize("read_only", [False, True])
def test_batched_forward_with_a_skip_set_equals_one_sequence_at_a_time(read_only):
    """With sublayers skipped (and reading the cache without writing it, as the calibrator scores
    skip sets), each segment's logits are what forward() gives it alone with the same masks; a
    read-only batch leaves every cache as it was."""
    from adaptive.engine.backbone import Segment
    from adaptive.engine.skip import SkipSet

    bb = Backbone(tiny_model("qwen2"))
    V, L = bb.vocab_size, bb.n_layers
    masks = SkipSet(attn=[0], mlp=[L - 1]).masks(L)
    torch.manual_seed(1)
    known = [torch.randint(0, V, (n,)) for n in (9, 14)]  # full-model keys, the fed tokens' own included
    caches = []
    for ids in known:
        c = bb.new_cache(len(ids))
        bb.forward(ids, c, 0, logits="none")
        caches.append(c)
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    starts = [5, 10]
    segs = [Segment(ids[s:], c, s) for ids, c, s in zip(known, caches, starts)]
    got = bb.forward_batch(segs, skip_masks=masks, read_only=read_only)
    if read_only:
        for c, (k, v) in zip(caches, before):
            assert torch.equal(c.k, k) and torch.equal(c.v, v)
    for ids, c, (k, v), s, g in zip(known, caches, before, starts, got):
        c.k.copy_(k)
        c.v.copy_(v)
        ref = bb.forward(ids[s:], c, s, skip_masks=masks, logits="all", read_only=read_only).logits
        full = bb.forward(ids[s:], c, s, logits="all", read_only=True).logits
        assert g.shape == ref.shape == (len(ids) - s, V)
        assert torch.allclose(g, ref, atol=1e-5)
        assert not torch.allclose(g, full, atol=1e-3)  # the masks took effect


def test_batched_forward_refuses_bad_segments():
    from adaptive.engine.backbone import Segment

    bb = Backbone(tiny_model("llama"))
    assert bb.forward_batch([]) == []
    with pytest.raises(ValueError, match="no tokens"):
        bb.forward_batch([Segment(torch.tensor([], dtype=torch.long), bb.new_cache(4), 0)])
    with pytest.raises(PromptTooLongError):
        bb.forward_batch([Segment(torch.tensor([1, 2, 3]), bb.new_cache(4), 2)])


@pytest.mark.parametrize("T,start", [(1, 9), (4, 0), (4, 12), (7, 3)])
def test_attention_masks_only_the_new_keys_and_equals_a_full_causal_softmax(T, start):
    """_attend_block masks only its last t columns (the only keys a query may not see): the same
    output as a softmax over the whole causal mask, for a verification after ``start`` positions."""
    bb = Backbone(tiny_model("llama"))
    KV, G, D, n = 2, 3, 8, start + T
    q, k, v = torch.randn(KV, G, T, D), torch.randn(KV, n, D), torch.randn(KV, n, D)
    out = bb._attend_block(q, k, v, bb._banned(T, start))
    allowed = torch.arange(n)[None, :] <= (start + torch.arange(T))[:, None]  # [T, n]
    scores = torch.einsum("kgtd,knd->kgtn", q, k) * bb.scaling
    ref = torch.einsum("kgtn,knd->kgtd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_tree_layout_worked_example():
    bb = Backbone(tiny_model("llama"))
    positions, banned = bb.tree_layout([-1, 0, 0, 1], 5)
    assert positions.tolist() == [5, 6, 6, 7]
    assert banned.shape == (4, 9) and not banned[:, :5].any()
    assert banned[:, 5:].tolist() == [[False, True, True, True], [False, False, True, True],
                                      [False, True, False, True], [False, False, True, False]]
    with pytest.raises(ValueError, match="root"):
        bb.tree_layout([0, 0], 5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tree_verification_computes_its_kept_path_as_a_chain_would(family):
    """The path's rows of a tree's forward give the logits a chain of that path gives, and once
    :meth:`Backbone.keep_rows` has moved them, the cache holds what the chain's forward wrote (keys,
    values, feature rows); the next forward then reads the same cache."""
    model = tiny_model(family)
    bb = Backbone(model)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (9,))
    pending, a, b, c, d = 11, 20, 21, 22, 23
    # rows: 0 pending, 1 a (decoy), 2 b, 3 c (under a), 4 d (under b): the kept path is pending, b, d
    tree, ids = [-1, 0, 0, 1, 2], torch.tensor([pending, a, b, c, d])
    caches = []
    for _ in range(2):
        cache = bb.new_cache(24, features=(0, 2, 4))
        bb.forward(prompt, cache, 0)
        caches.append(cache)
    chain_cache, tree_cache = caches
    chain = bb.forward(torch.tensor([pending, b, d]), chain_cache, 9, logits="all").logits
    out = bb.forward(ids, tree_cache, 9, logits="all", tree=tree).logits
    assert torch.allclose(out[[0, 2, 4]], chain, atol=1e-5)
    bb.keep_rows(tree_cache, 9, [0, 2, 4])
    assert torch.allclose(tree_cache.k[:, :, :12], chain_cache.k[:, :, :12], atol=1e-5)
    assert torch.allclose(tree_cache.v[:, :, :12], chain_cache.v[:, :, :12], atol=1e-5)
    assert torch.allclose(tree_cache.features[:12], chain_cache.features[:12], atol=1e-4)
    nxt = [bb.forward(torch.tensor([7]), cache, 12, logits="all").logits for cache in (chain_cache, tree_cache)]
    assert torch.allclose(nxt[0], nxt[1], atol=1e-5)
    assert bb.verifies_trees
