"""The static-shape step behind CUDA graphs: its pure parts and its equality with the eager forward on the
CPU (compiled with ``fullgraph=True`` too), and the graphs themselves on CUDA (skipped without a GPU)."""

import gc

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.backbone import Backbone, KVCache
from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.engine import Engine
from adaptive.engine.graphs import (
    BUCKETS,
    PREFILL_BUCKETS,
    Captured,
    SlotPool,
    StepGraphs,
    bucket_for,
    capacity_for,
    prefill_plan,
)
from adaptive.engine.skip import SkipSet
from adaptive.engine.static import ChainedStep, StaticStep
from adaptive.models import LoadedModel
from tests.conftest import char_tokenizer, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_and_capacities():
    assert [bucket_for(t) for t in (1, 2, 3, 5, 9, 16, 17, 32)] == [1, 2, 4, 8, 16, 16, 32, 32]
    assert bucket_for(33) is None
    assert capacity_for(1) == 2048 and capacity_for(2000) == 2048 and capacity_for(2100) == 4096
    assert capacity_for(8190, 8192) == 8448 and capacity_for(300, 8192) == 2048  # capped by the context
    assert capacity_for(100, 512) == 768  # a short context: its positions and the largest bucket's padding
    for n in (1, 200, 2016, 2017, 5000, 9000):  # room for the largest bucket's padding after the last position
        c = capacity_for(n)
        assert c >= n + BUCKETS[-1] and c & (c - 1) == 0 and (c // 2 < n + BUCKETS[-1] or c == 2048)


def test_prefill_plans():
    assert prefill_plan(300, 0, 512) == [(0, 256, 256), (256, 44, 64)]
    assert prefill_plan(100, 400, 512) == [(0, 32, 32), (32, 32, 32), (64, 32, 32), (96, 4, 4)]
    assert prefill_plan(20, 0, 256) == [(0, 20, 32)]
    assert prefill_plan(129, 0, 512) == [(0, 129, 256)]
    for tokens, start in ((1, 0), (700, 3), (1000, 0), (90, 900)):  # every row once, padding inside the slot
        cap = capacity_for(start + tokens)
        plan = prefill_plan(tokens, start, cap)
        assert [o for o, _, _ in plan] == [sum(r for _, r, _ in plan[:i]) for i in range(len(plan))]
        assert sum(r for _, r, _ in plan) == tokens
        assert all(r <= b and start + o + b <= cap for o, r, b in plan)


def test_slot_pool_reuses_a_freed_slot():
    made = []

    def allocate(c):
        made.append(c)
        return torch.zeros(1, 1, c, 1), torch.zeros(1, 1, c, 1)

    pool = SlotPool(allocate)
    k, v = pool.take(256)
    first = KVCache(k=k, v=v, limit=100)
    pool.bind(first, 256)
    ptr = first.k.data_ptr()
    del first, k, v
    gc.collect()
    again = pool.take(256)
    assert again[0].data_ptr() == ptr and made == [256]  # the same tensors, nothing new
    pool.take(256)
    assert made == [256, 256] and pool.allocated == 2  # the pool was empty: a new one


def _eagle_matches_the_eager_run(eager, graphed, head, cfg, prompts):
    """An eagle head drafting chains and trees on ``graphed`` decodes each prompt as plain decoding on ``eager``
    and with the eager run's drafts and acceptance (so the rows it drafts from are the target's)."""
    from adaptive.drafters.eagle import DEFAULT_TREE
    from adaptive.drafters.eagle_drafter import EagleDrafter
    from adaptive.drafters.factory import eagle_vocab
    from adaptive.engine.loop import GenerationStats
    from tests.helpers.decoding import decode_ids

    for prompt in prompts:
        plain = decode_ids(eager, prompt, cfg)
        for tree in (None, DEFAULT_TREE):  # chains, and trees (verified by tree steps where graphs run)
            runs = []
            for bb in (eager, graphed):
                stats = GenerationStats()
                drafter = EagleDrafter(head, eagle_vocab(head, bb, prompt), bb.embed_rows, copy_min=0, tree=tree)
                assert decode_ids(bb, prompt, cfg, drafter, stats=stats) == plain
                runs.append((stats.steps, stats.drafted, stats.accepted))
            assert runs[0] == runs[1] and runs[0][2] > 0, (tree, runs)


def test_an_eagle_head_drafts_over_the_graphs_as_over_the_eager_steps(cpu_step_graphs):
    """A cache with feature rows is a slot whose captured steps write them: an eagle head drafting from them
    decodes plain greedy decoding's tokens with the eager run's drafts and acceptance (so the rows are the
    target's), plain decoding in chains on such a slot writes them too, and a freed slot comes back with them."""
    from adaptive.drafters.eagle import DEFAULT_TREE, TreeShape
    from adaptive.drafters.eagle_drafter import EagleDrafter
    from adaptive.drafters.eagle_static import warm_head
    from adaptive.drafters.factory import eagle_vocab
    from tests.drafters.test_eagle import LAYERS, random_head
    from tests.helpers.decoding import decode_ids

    lm = LoadedModel(tiny_model("llama"), char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    eager, graphed = lm.backbone, cpu_step_graphs(lm.model)
    head = random_head(lm, vocab_ids=torch.arange(0, eager.vocab_size, 2))
    cfg = GenerationConfig(max_new_tokens=40, draft_len=4, features=LAYERS, ignore_eos=True)
    _eagle_matches_the_eager_run(eager, graphed, head, cfg, ([5, 9, 12, 7, 3, 22, 8, 5, 9], [14, 6, 14, 6, 14]))
    levels = graphed.graphs.attached["eagle"]  # the head's own captured levels (HeadGraphs)
    assert len(levels) == 1 and next(iter(levels.values())).replays > 0
    kept = [key for key in graphed.graphs._graphs if key[-1] == LAYERS]
    assert kept and graphed.graphs.replays > 0  # the target's steps replayed, writing the rows
    assert any(key[5] == "tree" for key in kept)  # the trees' verifications replayed tree steps
    # plain greedy decoding in chains on a slot with feature rows writes the rows the eager steps write
    ids = torch.tensor([5, 9, 12, 7, 3, 22, 8])
    slot, plain_cache = graphed.new_cache(40, features=LAYERS), eager.new_cache(40, features=LAYERS)
    assert slot.features.shape[0] == slot.k.shape[2] and slot.feature_layers == LAYERS
    first = int(graphed.forward(ids, slot, 0).logits.argmax())
    assert first == int(eager.forward(ids, plain_cache, 0).logits.argmax())
    chain = graphed.decode_chain(first, slot, 7, 6)
    tokens = [first] + chain[:-1]
    eager.forward(torch.tensor(tokens), plain_cache, 7, logits="all")
    assert torch.allclose(slot.features[:13], plain_cache.features[:13], rtol=1e-4, atol=1e-4)
    made, rows = graphed.graphs.pool.allocated, slot.features
    del slot
    gc.collect()
    again = graphed.new_cache(40, features=LAYERS)
    assert graphed.graphs.pool.allocated == made and again.features is rows  # the freed slot, rows and all
    assert graphed.new_cache(40).features is None  # a cache without rows: another slot
    # a server warms the slot with feature rows (AdaptiveRuntime.warm passes its heads' layers): its first
    # request with a head then captures nothing
    warm = cpu_step_graphs(lm.model)
    assert warm.warm_graphs(features=LAYERS, trees=True) > 0
    before = warm.graphs.captures
    prompt = [5, 9, 12, 7, 3, 22, 8, 5, 9]
    for tree in (None, DEFAULT_TREE):
        drafter = EagleDrafter(head, eagle_vocab(head, warm, prompt), warm.embed_rows, copy_min=0, tree=tree)
        assert decode_ids(warm, prompt, cfg, drafter) == decode_ids(eager, prompt, cfg)
    assert warm.graphs.captures > before  # the head's own levels were not warmed: captured by the first request
    for trees in (None, DEFAULT_TREE):  # a runtime drafting chains warms fewer levels
        warm = cpu_step_graphs(lm.model)
        assert warm.warm_graphs(features=LAYERS, trees=trees is not None) > 0
        # "last" logits of each bucket (blocks of the target's rows, chain drafts); trees' levels of 1, 2 and 4 rows
        assert warm_head(head, warm, trees) == len(BUCKETS) + (3 if trees else 0)
        before = warm.graphs.captures
        for tree in {None, trees}:
            drafter = EagleDrafter(head, eagle_vocab(head, warm, prompt), warm.embed_rows, copy_min=0, tree=tree)
            assert decode_ids(warm, prompt, cfg, drafter) == decode_ids(eager, prompt, cfg)
        assert warm.graphs.captures == before
    assert warm_head(head, cpu_step_graphs(lm.model), TreeShape(40, 60)) == 2 * len(BUCKETS)  # wider than a bucket


class _EagerReplay:
    """A stand-in for a captured graph on the CPU: replaying runs the static step into the output buffer."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        new = self.fn()
        for buf, val in zip(self.out, new) if isinstance(new, tuple) else ((self.out, new),):
            buf.copy_(val)


def test_graph_forward_feeds_prefills_in_chunks(monkeypatch):
    """StepGraphs.forward on the CPU, each 'graph' a static step run when replayed: prompts of one chunk,
    several chunks and a chunk cut near the slot's end give the eager path's tokens (fp32), and the
    captures are one per bucket used."""

    def capture(self, key, cache, Tb, masks, logits, pool_layer=None, chained=False, tree=False):
        cos, sin = self._tables(cache.k.shape[2])
        step = StaticStep(self.backbone, Tb, masks, logits, pool_layer=pool_layer)
        k, v = cache.k, cache.v  # the slot's tensors, not the cache (as a graph holds them)
        if chained:  # plain greedy decoding's chain (Lane.chain), over the chain's buffers
            chain, inputs = ChainedStep(step), self._chain
        else:
            assert not tree  # no tree drafts in this test
            buf = self._inputs[(Tb, False)]
            chain, inputs = step, (buf[:Tb], buf[Tb:])

        def fn():
            return chain(*inputs, k, v, cos, sin)

        cap = self._graphs[key] = Captured(_EagerReplay(fn, fn()), None)
        cap.out = cap.graph.out
        return cap

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    monkeypatch.setattr("adaptive.engine.graphs.MIN_CAPACITY", 256)  # slots of the tiny model's 512 positions
    model = tiny_model("qwen2", n_layers=3)
    lm = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    eager = Engine(lm)
    static_bb = Backbone(model)
    static_bb.graphs = StepGraphs(static_bb)
    lm2 = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    lm2.__dict__["backbone"] = static_bb
    static = Engine(lm2)
    torch.manual_seed(0)
    for n_prompt, new in ((40, 6), (300, 6), (215, 9)):  # 215 + 9 positions: the slot of 256 cuts the last chunk
        prompt = torch.randint(3, static_bb.vocab_size, (n_prompt,)).tolist()
        cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        assert static.generate(prompt, cfg).token_ids == eager.generate(prompt, cfg).token_ids, n_prompt
    assert static_bb.graphs.replays > 0
    assert {key[1] for key in static_bb.graphs._graphs} >= {"chain", 64, 256}  # plain greedy steps: chains
    ids = torch.randint(3, static_bb.vocab_size, (215,))
    slot = static_bb.new_cache(220)  # a slot of 256 positions: 65 rows at 150 are cut into 32 and 33 (bucket 64)
    plain = Backbone(model).new_cache(220)
    assert slot.k.shape[2] == 256 and prefill_plan(65, 150, 256) == [(0, 32, 32), (32, 33, 64)]
    for start, end in ((0, 150), (150, 215)):
        got = static_bb.forward(ids[start:end], slot, start, logits="last").logits
        want = lm.backbone.forward(ids[start:end], plain, start, logits="last").logits
        assert torch.allclose(got, want, atol=1e-5) and torch.equal(got.argmax(-1), want.argmax(-1))
    # a prefill that routes: the pools of one layer (mean and last rows) as the eager forward's, over chunks
    for layer, T in ((0, 20), (1, 300), (3, 70)):
        slot, plain = static_bb.new_cache(T + 4), Backbone(model).new_cache(T + 4)
        ids = torch.randint(3, static_bb.vocab_size, (T,))
        for logits in ("last", "none"):
            got = static_bb.forward(ids, slot, 0, logits=logits, pool_layers=(layer,))
            want = lm.backbone.forward(ids, plain, 0, logits=logits, pool_layers=(layer,))
            assert torch.allclose(got.layer_pools[layer], want.layer_pools[layer], atol=1e-5), (layer, T)
            assert (got.logits is None) == (logits == "none")
            if logits == "last":
                assert torch.allclose(got.logits, want.logits, atol=1e-5)
    assert any(len(key) > 4 and key[4] is not None for key in static_bb.graphs._graphs)  # a routing pool's
    # warming captures every bucket's step on a fresh slot; the next request on that slot captures nothing
    warm_bb = Backbone(model)
    warm_bb.graphs = StepGraphs(warm_bb)
    n_all, n_last = len(BUCKETS) + 1, len(BUCKETS) + len(PREFILL_BUCKETS)  # + 1: the chain
    assert warm_bb.warm_graphs() == n_all + n_last
    lm3 = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    lm3.__dict__["backbone"] = warm_bb
    prompt = torch.randint(3, warm_bb.vocab_size, (100,)).tolist()
    cfg = GenerationConfig(max_new_tokens=5, ignore_eos=True)
    assert Engine(lm3).generate(prompt, cfg).token_ids == eager.generate(prompt, cfg).token_ids
    assert warm_bb.graphs.captures == n_all + n_last  # plain decoding of a new request: all were warm
    assert warm_bb.warm_graphs(Pooling(layer=2, mode="last")) == n_last  # the routing prefill's own
    assert warm_bb.warm_graphs(Pooling(layer=2, mode="last")) == 0
    # a skip set's drafting steps: one token's "last" logits and every bucket's "all" (each distinct set
    # once, an empty one none); then a layer-skip and a cascade request capture nothing more
    skip = SkipSet((1,), (2,))
    assert warm_bb.warm_graphs(skips=[skip, SkipSet(), SkipSet((1,), (2,))]) == 1 + len(BUCKETS)
    assert warm_bb.warm_graphs(skips=[skip]) == 0
    from adaptive.drafters.cascade import CascadePlan
    from adaptive.drafters.ngram import build_bigram_table

    plan = CascadePlan(split=2, draft_len=6, max_split=2)
    specs = (DrafterSpec("ssd", skip=skip),
             DrafterSpec("cascade", skip=skip, cascade=plan, bigram=build_bigram_table([prompt * 2], min_count=1)))
    cold_bb = Backbone(model)  # the check can fail: without the skip set warmed, the same requests capture
    cold_bb.graphs = StepGraphs(cold_bb)
    cold_bb.warm_graphs()
    lm4 = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    lm4.__dict__["backbone"] = cold_bb
    want = eager.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    for spec in specs:
        for bb, lm_, warmed in ((warm_bb, lm3, True), (cold_bb, lm4, False)):
            before = bb.graphs.captures
            got = Engine(lm_).generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True, draft_len=4),
                                       drafter=build_drafter(spec, bb))
            assert got.token_ids == want
            assert (bb.graphs.captures == before) == warmed, (spec.kind, warmed)


def test_warm_graphs_captures_in_inference_mode(monkeypatch):
    """warm_graphs captures in the mode forward captures in (the compiled pieces are guarded on it)."""
    bb = Backbone(tiny_model("llama", n_layers=2))
    modes = []

    class Graphs:
        enabled = True
        slab_slots = 0

        def new_cache(self, max_len, cls):
            k, v = bb.allocate_kv(max_len)
            return cls(k=k, v=v)

        def warm(self, cache, masks, pool_layer=None, drafting=False, trees=False):
            modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return 1

        def warm_batches(self, requests, masks, max_len=1, layers=()):  # the batched steps (none before reserve_batch)
            modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return 0

    monkeypatch.setattr(bb, "graphs", Graphs())
    assert bb.warm_graphs(max_len=8, skips=[SkipSet(attn=(1,))]) == 2
    assert modes == [(True, False)] * 3


def _cuda_engine(family="llama", n_layers=6, graphs=True):
    model = tiny_model(family, n_layers=n_layers).cuda()
    bb = Backbone(model, graphs=graphs)
    lm = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cuda"), torch.float32)
    lm.__dict__["backbone"] = bb  # the cached property, with this backbone
    return Engine(lm), bb


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graphs_decode_as_the_eager_path(family):
    """fp32 on CUDA: plain decoding, layer-skip drafts (buckets 2..32 and the eager path beyond) and
    prompt-lookup drafts give the eager engine's tokens, through replayed graphs."""
    eager, _ = _cuda_engine(family, graphs=False)
    eng, bb = _cuda_engine(family)
    prompt = list(range(3, 20)) * 2
    cfg = GenerationConfig(max_new_tokens=40, draft_len=4, ignore_eos=True)
    ref = eager.generate(prompt, cfg).token_ids
    assert eng.generate(prompt, cfg).token_ids == ref
    assert bb.graphs.replays > 0 and bb.graphs.enabled
    long = [3 + (i * 7) % (bb.vocab_size - 3) for i in range(300)]  # a prefill in chunks of 256 and 44 rows
    assert eng.generate(long, cfg).token_ids == eager.generate(long, cfg).token_ids
    assert {key[1] for key in bb.graphs._graphs} >= {256, 64}
    ids = torch.tensor(long, device="cuda")
    ours = bb.forward(ids, bb.new_cache(310), 0, logits="last", pool_layers=(2,))  # a routing prefill, replayed
    ref_bb = Backbone(bb.model, graphs=False)
    theirs = ref_bb.forward(ids, ref_bb.new_cache(310), 0, logits="last", pool_layers=(2,))
    assert torch.allclose(ours.layer_pools[2], theirs.layer_pools[2], atol=1e-4)
    assert torch.allclose(ours.logits, theirs.logits, atol=1e-4)
    for k in (1, 3, 8, 20, 40):
        c = GenerationConfig(max_new_tokens=40, draft_len=k, ignore_eos=True)
        d = build_drafter(DrafterSpec("ssd", skip=SkipSet(attn=(1, 3), mlp=(4,))), bb)
        assert eng.generate(prompt, c, drafter=d).token_ids == ref, k
        assert eng.generate(prompt, c, drafter=build_drafter(DrafterSpec("pld"), bb)).token_ids == ref, k


@pytest.mark.cuda
@cuda
def test_graphs_are_captured_once_and_reused_across_requests():
    eng, bb = _cuda_engine()
    cfg = GenerationConfig(max_new_tokens=24, draft_len=4, ignore_eos=True)
    d = build_drafter(DrafterSpec("ssd", skip=SkipSet(attn=(1,))), bb)
    first = eng.generate(list(range(3, 30)), cfg, drafter=d).token_ids
    captured, slots = bb.graphs.captures, bb.graphs.pool.allocated
    gc.collect()
    again = eng.generate(list(range(3, 30)), cfg, drafter=d).token_ids
    assert again == first
    assert bb.graphs.captures == captured and bb.graphs.pool.allocated == slots  # same slot, same graphs


@pytest.mark.cuda
@cuda
def test_warmed_graphs_record_no_autograd_and_decode_as_the_eager_path():
    """Graphs captured at startup (warm_graphs, as the server and the bench do) are the inference ones: the
    slot they write requires no grad, and decoding replays them to the eager path's tokens."""
    eng, bb = _cuda_engine()
    eager, _ = _cuda_engine(graphs=False)
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    assert bb.warm_graphs(max_len=64) > 0
    slot = bb.new_cache(64)
    assert not slot.k.requires_grad and not slot.v.requires_grad
    del slot
    ref = eager.generate(list(range(3, 20)), cfg).token_ids
    captured = bb.graphs.captures
    assert eng.generate(list(range(3, 20)), cfg).token_ids == ref
    assert bb.graphs.captures == captured  # the warmed graphs were replayed, none captured inside the request


@pytest.mark.cuda
@cuda
def test_a_chained_decode_on_the_device_gives_plain_decodings_tokens():
    eng, bb = _cuda_engine()
    eager, _ = _cuda_engine(graphs=False)
    cfg = GenerationConfig(max_new_tokens=21, ignore_eos=True)
    prompt = list(range(3, 20))
    ref = eager.generate(prompt, cfg).token_ids  # the prefill's token, then 20 decoded
    cache = bb.new_cache(len(prompt) + 40)
    first = int(bb.forward(torch.tensor(prompt), cache, 0, logits="last").logits[0].argmax())
    got = bb.decode_chain(first, cache, len(prompt), 12)
    got += bb.decode_chain(got[-1], cache, len(prompt) + 12, 8)  # a second chain continues the first
    assert [first] + got == ref


@pytest.mark.cuda
@cuda
def test_a_failed_capture_falls_back_to_eager_once(monkeypatch, capsys):
    eng, bb = _cuda_engine()
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eager, _ = _cuda_engine(graphs=False)
    ref = eager.generate(list(range(3, 12)), cfg).token_ids

    def broken(*a, **kw):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    assert eng.generate(list(range(3, 12)), cfg).token_ids == ref
    assert not bb.graphs.enabled
    assert capsys.readouterr().err.count("CUDA graph capture failed") == 1


def test_plain_greedy_decoding_runs_in_chains_with_the_eager_tokens(cpu_step_graphs):
    """With graphs (stood in for on the CPU), a plain greedy request decodes CHAIN_TOKENS tokens per host
    read (Lane.chain) and gives the eager path's tokens and text: a length that is not a multiple of the
    chain, and a stop string met inside a chain (the tokens decoded past it are not shown)."""
    from adaptive.engine.loop import CHAIN_TOKENS

    model = tiny_model("llama", n_layers=2)
    eager = Engine(LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32))
    bb = cpu_step_graphs(model)
    lm = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    lm.__dict__["backbone"] = bb
    chained = Engine(lm)
    prompt = "the quick brown fox"
    cfg = GenerationConfig(max_new_tokens=2 * CHAIN_TOKENS + 5, ignore_eos=True)
    want = eager.generate(prompt, cfg)
    got = chained.generate(prompt, cfg)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert any(key[1] == "chain" for key in bb.graphs._graphs)
    assert got.stats.steps == want.stats.steps  # a chain counts each of its tokens as a plain step
    stop = want.text[CHAIN_TOKENS + 2:CHAIN_TOKENS + 4]  # met inside the second chain
    assert len(stop) == 2 and stop not in want.text[:CHAIN_TOKENS + 2]
    cfg = GenerationConfig(max_new_tokens=2 * CHAIN_TOKENS + 5, ignore_eos=True, stop=(stop,))
    a, b = eager.generate(prompt, cfg), chained.generate(prompt, cfg)
    assert a.text == b.text and a.finish_reason == b.finish_reason == "stop"
    drafted = chained.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True, draft_len=3),
                               drafter=build_drafter(DrafterSpec("pld"), bb))
    assert drafted.token_ids == eager.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids


def test_a_kept_prefix_restores_into_a_slot_made_while_warming(cpu_step_graphs):
    """Warming makes slots in inference mode (inference tensors, which only inference mode may write): a
    later request that gets such a slot and starts from a kept prefix fills it, and decodes as from scratch."""
    model = tiny_model("llama", n_layers=3)
    bb = cpu_step_graphs(model)
    bb.prefixes.resize(1 << 20)
    assert bb.warm_graphs() > 0
    ids = torch.randint(3, bb.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    first = bb.new_cache(40)
    bb.forward(ids[:20], first, 0, logits="none")
    first.length = 20
    assert bb.keep_prefix(first, ids[:20].tolist())
    del first
    gc.collect()
    slot = bb.new_cache(40)  # the warmed slot or the first request's, both pooled
    assert slot.k.is_inference()
    match = bb.prefixes.lookup(ids.tolist())
    assert match.tokens == 20
    assert bb.restore_prefix(match.entry, slot, 20) == 20
    bb.prefixes.unpin(match.entry)
    got = bb.forward(ids[20:], slot, 20, logits="all").logits
    want = Backbone(model).forward(ids, Backbone(model).new_cache(40), 0, logits="all").logits[20:]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.cuda
@cuda
def test_an_eagle_head_drafts_over_captured_graphs_on_cuda():
    """fp32 on CUDA: the target's captured steps write the feature rows an eagle head drafts from; its drafts
    and acceptance are the eager run's, chains and trees (tree steps), its tokens plain decoding's, and the
    steps, the target's and the head's own levels, replayed graphs."""
    from tests.drafters.test_eagle import LAYERS, random_head

    eager_eng, eager = _cuda_engine(graphs=False)
    _, graphed = _cuda_engine()
    head = random_head(eager_eng.lm).to(eager.device)
    cfg = GenerationConfig(max_new_tokens=40, draft_len=4, features=LAYERS, ignore_eos=True)
    prompt = [5, 9, 12, 7, 3, 22, 8, 5, 9]
    _eagle_matches_the_eager_run(eager, graphed, head, cfg, [prompt])
    assert graphed.graphs.replays > 0 and any(key[-1] == LAYERS for key in graphed.graphs._graphs)
    assert any(key[5] == "tree" for key in graphed.graphs._graphs)
    assert sum(levels.replays for levels in graphed.graphs.attached["eagle"].values()) > 0  # the head's own
