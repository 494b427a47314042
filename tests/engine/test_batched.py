"""A server's batch as one static step (issue 64): its pure parts on literal arrays, its equality with
the eager batched forward in fp32 (mixed lengths, drafts per request, padding requests, skip sets;
compiled whole with ``fullgraph=True`` too), acceptance on the device, and the batch path a backbone
picks: batched graphs where CUDA graphs run (stood in for on the CPU by running each "graph" when it is
replayed), the eager forward otherwise."""

import random

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.backbone import Backbone, KVCache, Segment
from adaptive.engine.batched import (
    BATCH_BUCKETS,
    MIN_SPAN,
    NOT_ACCEPTED,
    ROW_BUCKETS,
    BatchedStep,
    Slab,
    accept_greedy,
    accept_sampled,
    batch_bucket,
    per_group,
    per_request,
    row_bucket,
    span_for,
)
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from tests.conftest import char_tokenizer, tiny_model


def test_buckets_and_spans():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert batch_bucket(65) is None and BATCH_BUCKETS[-1] == 64
    assert [row_bucket(t) for t in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8] and row_bucket(9) is None
    assert span_for(41, 2048) == MIN_SPAN == 256 and span_for(256, 2048) == 256 and span_for(257, 2048) == 512
    assert span_for(300, 2048) == 512 and span_for(2000, 2048) == 2048 and span_for(100, 128) == 128
    with pytest.raises(ValueError, match="do not fit"):
        span_for(2049, 2048)


def test_a_slab_hands_out_views_of_its_slots():
    slab = Slab(lambda n: (torch.zeros(2, 1, n, 3), torch.zeros(2, 1, n, 3)), slots=2, capacity=4)
    assert slab.k.shape == (2, 1, 3, 4, 3) and slab.dummy == 2 and slab.free == 2
    a, b = slab.take(), slab.take()
    assert (a, b) == (0, 1) and slab.take() is None
    k, _ = slab.view(b)
    k[1, 0, 2] = 7.0  # a cache's write lands in the slab, in its own slot only
    assert slab.k[1, 0, 1, 2].tolist() == [7.0] * 3 and slab.k[:, :, 0].abs().sum() == 0
    slab.give(a)
    assert slab.free == 1 and slab.take() == 0
    for bad in (2, 5):
        with pytest.raises(ValueError, match="not a taken slot"):
            slab.give(bad)
    with pytest.raises(ValueError, match="at least one slot"):
        Slab(lambda n: (torch.zeros(1, 1, n, 1),) * 2, slots=0, capacity=4)


def test_queries_regrouped_per_request_and_back():
    """KV = 1 head, G = 2 query heads per kv head, B = 2 requests of R = 2 rows: split_heads' row
    g * B * R + b * R + r becomes row g * R + r of batch b, and back."""
    q = torch.arange(8.0).view(1, 8, 1)  # value = g * 4 + b * 2 + r
    got = per_request(q, groups=2, batch=2)
    assert got.shape == (2, 4, 1)
    assert got[:, :, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # request 0: g0 r0, g0 r1, g1 r0, g1 r1
    assert torch.equal(per_group(got, kv_heads=1, groups=2), q)


def _slab_caches(bb, slab, lens, ids):
    """A slab slot and a plain cache per request, both prefilled with its first ``lens[i]`` ids."""
    out = []
    for n, x in zip(lens, ids):
        index = slab.take()
        k, v = slab.view(index)
        slot = KVCache(k=k, v=v, limit=slab.capacity - ROW_BUCKETS[-1])
        plain = bb.new_cache(slab.capacity)
        for c in (slot, plain):
            bb.forward(x[:n], c, 0, logits="none")
        out.append((index, slot, plain))
    return out


def _run_batched(bb, slab, caches, lens, feeds, masks, step_fn=None, batch=None):
    n = len(feeds)
    B, R = batch or batch_bucket(n), row_bucket(max(len(f) for f in feeds))
    A = span_for(max(lens) + R, slab.capacity)
    ids = torch.zeros(B, R, dtype=torch.long)
    slots, starts = torch.full((B,), slab.dummy), torch.zeros(B, dtype=torch.long)
    for b, ((index, _, _), start, f) in enumerate(zip(caches, lens, feeds)):
        ids[b, :len(f)], slots[b], starts[b] = f, index, start
    cos, sin = bb.rope_table(slab.capacity)
    step = step_fn or BatchedStep(bb, B, R, A, masks)
    with torch.inference_mode():
        return step(ids, slots, starts, slab.k, slab.v, cos, sin)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batched_step_equals_the_eager_batched_forward(family):
    """fp32: requests of mixed lengths feeding 1 to 8 rows (a plain step, verifications of different
    draft lengths), in a batch bucket with padding requests, give the eager forward_batch's logits at
    their real rows and write the same keys at their real positions; with a skip set too."""
    bb = Backbone(tiny_model(family, n_layers=4))
    torch.manual_seed(0)
    lens, rows = [30, 7, 300, 61, 140], [4, 1, 3, 8, 2]
    ids = [torch.randint(3, bb.vocab_size, (n + t,)) for n, t in zip(lens, rows)]
    for masks in (bb._full, SkipSet(attn=(1,), mlp=(2,)).masks(4)):
        slab = Slab(bb.allocate_kv, slots=6, capacity=512)
        caches = _slab_caches(bb, slab, lens, ids)
        feeds = [x[n:] for x, n in zip(ids, lens)]
        want = bb.forward_batch([Segment(f, plain, n) for f, n, (_, _, plain) in zip(feeds, lens, caches)],
                                skip_masks=masks)
        got = _run_batched(bb, slab, caches, lens, feeds, masks)
        assert got.shape == (8, 8, bb.vocab_size)  # 5 requests in bucket 8; 8 rows (7 drafts) for all
        for b, (w, t) in enumerate(zip(want, rows)):
            assert torch.allclose(got[b, :t], w, atol=1e-5), (family, b)
            assert torch.equal(got[b, :t].argmax(-1), w.argmax(-1))
        ran = [i for i in range(4) if not masks[0][i]]
        for (_, slot, plain), n, t in zip(caches, lens, rows):
            assert torch.allclose(slot.k[ran][:, :, :n + t], plain.k[ran][:, :, :n + t], atol=1e-5)
            assert torch.allclose(slot.v[ran][:, :, :n + t], plain.v[ran][:, :, :n + t], atol=1e-5)


def test_batched_step_compiles_whole_with_fullgraph():
    """torch.compile(fullgraph=True) traces the batched step with no graph break (no host read, no
    data-dependent shape) and the compiled step gives the eager forward's tokens (fp32). The aot_eager
    backend checks the trace quickly; Inductor's kernels are the slow tier's."""
    bb = Backbone(tiny_model("qwen3", n_layers=2))
    torch.manual_seed(0)
    lens, rows = [20, 45, 9], [3, 1, 4]
    ids = [torch.randint(3, bb.vocab_size, (n + t,)) for n, t in zip(lens, rows)]
    slab = Slab(bb.allocate_kv, slots=3, capacity=512)
    caches = _slab_caches(bb, slab, lens, ids)
    feeds = [x[n:] for x, n in zip(ids, lens)]
    want = bb.forward_batch([Segment(f, plain, n) for f, n, (_, _, plain) in zip(feeds, lens, caches)])
    B, R = batch_bucket(3), row_bucket(4)
    step = torch.compile(BatchedStep(bb, B, R, span_for(max(lens) + R, 512), bb._full), fullgraph=True,
                         backend="aot_eager", dynamic=False)
    got = _run_batched(bb, slab, caches, lens, feeds, bb._full, step_fn=step)
    for b, (w, t) in enumerate(zip(want, rows)):
        assert torch.allclose(got[b, :t], w, atol=1e-5) and torch.equal(got[b, :t].argmax(-1), w.argmax(-1))


@pytest.mark.slow
def test_batched_step_compiled_by_inductor_gives_the_eager_tokens():
    bb = Backbone(tiny_model("llama", n_layers=2))
    torch.manual_seed(1)
    lens, rows = [33, 5], [2, 4]
    ids = [torch.randint(3, bb.vocab_size, (n + t,)) for n, t in zip(lens, rows)]
    slab = Slab(bb.allocate_kv, slots=2, capacity=512)
    caches = _slab_caches(bb, slab, lens, ids)
    feeds = [x[n:] for x, n in zip(ids, lens)]
    want = bb.forward_batch([Segment(f, plain, n) for f, n, (_, _, plain) in zip(feeds, lens, caches)])
    step = torch.compile(BatchedStep(bb, 2, 4, 256, bb._full), fullgraph=True, dynamic=False)
    got = _run_batched(bb, slab, caches, lens, feeds, bb._full, step_fn=step)
    for b, (w, t) in enumerate(zip(want, rows)):
        assert torch.allclose(got[b, :t], w, atol=1e-4) and torch.equal(got[b, :t].argmax(-1), w.argmax(-1))


def test_greedy_acceptance_on_literal_arrays():
    target = torch.tensor([[5, 6, 9, 1], [4, 4, 4, 4], [2, 8, 8, 3], [7, 0, 0, 0]])
    drafts = torch.tensor([[5, 6, 7], [3, 4, 4], [2, 8, 8], [0, 0, 0]])
    n = torch.tensor([3, 3, 3, 0])
    got = accept_greedy(target, drafts, n)
    assert got.tolist() == [[5, 6, 9, -1],  # two drafts taken, then the target's 9
                            [4, -1, -1, -1],  # the first draft rejected: the target's own 4
                            [2, 8, 8, 3],  # all three taken and the bonus token
                            [7, -1, -1, -1]]  # a plain step: no drafts
    assert NOT_ACCEPTED == -1
    assert accept_greedy(target[:1], drafts[:1], torch.tensor([1])).tolist() == [[5, 6, -1, -1]]  # padding drafts
    assert accept_greedy(torch.tensor([[9]]), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0])).tolist() == [[9]]


def test_sampled_acceptance_on_literal_arrays():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.0, 1.0]]])
    one = torch.tensor([1])
    assert accept_sampled(p, torch.tensor([[1]]), one, torch.tensor([[0.3]])).tolist() == [[1, 2]]  # taken, then p_1
    assert accept_sampled(p, torch.tensor([[1]]), one, torch.tensor([[0.7]])).tolist() == [[2, -1]]  # residual: 2
    assert accept_sampled(p, torch.tensor([[0]]), one, torch.tensor([[0.0]])).tolist()[0][1] == -1  # p(d) = 0: never
    sure = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])  # p all on the draft: always taken
    assert accept_sampled(sure, torch.tensor([[1]]), one, torch.tensor([[0.999]])).tolist() == [[1, 0]]


def test_sampled_acceptance_keeps_the_target_distribution():
    """Statistical: over many draws, the first token a request emits is distributed as the target's p_0,
    whatever the (deterministic) draft, and the second (after an accepted first) as p_1; chi-square at
    99.9% per case (fixed seed: the test is reproducible)."""
    g = torch.Generator().manual_seed(0)
    V, N = 5, 40_000
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    probs = torch.stack([p0, p1, p1]).expand(N, 3, V).contiguous()
    crit = 18.47  # chi-square, 4 degrees of freedom, 99.9%
    for draft in (1, 4):
        drafts = torch.tensor([[draft, 0]]).expand(N, 2)
        out = accept_sampled(probs, drafts, torch.full((N,), 1), torch.rand(N, 2, generator=g), generator=g)
        first = torch.bincount(out[:, 0], minlength=V).double()
        assert ((first - N * p0) ** 2 / (N * p0)).sum() < crit, draft
        taken = out[:, 0] == draft
        second = torch.bincount(out[taken, 1], minlength=V).double()
        m = int(taken.sum())
        assert ((second - m * p1) ** 2 / (m * p1)).sum() < crit, draft
        assert abs(m / N - float(p0[draft])) < 0.01  # a draft is taken with probability p_0(draft)


def _lm(model, backbone=None):
    lm = LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32)
    if backbone is not None:
        lm.__dict__["backbone"] = backbone
    return lm


# (drafter kind, skip set, draft length, new tokens): a 7-draft verification (8 rows, the largest row
# bucket) and a 9-draft one (past it: that step runs eagerly) among plain steps and short verifications
LANES = [("ar", None, 1, 20), ("ssd", SkipSet(attn=(1,), mlp=(2,)), 3, 14), ("pld", None, 7, 9),
         ("ssd", SkipSet(attn=(0, 2), mlp=(1,)), 9, 16), ("ar", None, 1, 4)]


def test_a_batch_of_sessions_replays_batched_graphs_and_decodes_as_each_alone(cpu_step_graphs):
    """Greedy, fp32: sessions that join and leave a running batch on a backbone whose caches are slab
    slots (reserve_batch) step through the batched graphs and produce exactly their lone eager outputs."""
    model = tiny_model("qwen2", n_layers=4)
    eager = Engine(_lm(model))
    bb = cpu_step_graphs(model)
    assert bb.reserve_batch(4) and bb.graphs.slab_slots == 4
    eng = Engine(_lm(model, bb))
    rng = random.Random(3)
    V = model.config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(n)] + [5, 6, 7, 5, 6] for n in (2, 30, 11, 50, 7)]
    cfgs = [GenerationConfig(max_new_tokens=n, draft_len=k, ignore_eos=True) for _, _, k, n in LANES]

    def drafter(lm, kind, skip):
        return None if kind == "ar" else build_drafter(DrafterSpec(kind, skip=skip), lm.backbone)

    alone = [eager.generate(p, c, drafter=drafter(eager.lm, kind, skip)).token_ids
             for p, c, (kind, skip, _, _) in zip(prompts, cfgs, LANES)]
    waiting, running, out = list(range(len(LANES))), {}, {}
    while waiting or running:
        for i in waiting[:2]:  # two join per step, while others are mid-decode
            kind, skip, _, _ = LANES[i]
            running[i] = eng.begin(eng.start(prompts[i], cfgs[i]), drafter(eng.lm, kind, skip))
        waiting = waiting[2:]
        live = [i for i, d in running.items() if not d.done]
        if live:
            eng.step([running[i] for i in live])
        for i in [i for i, d in running.items() if d.done]:
            out[i] = running.pop(i).out.ids
    assert [out[i] for i in range(len(LANES))] == alone
    assert bb.graphs.batched_replays > 0  # the batches' verifications replayed batched steps
    assert any(key[0] == "batch" for key in bb.graphs._graphs)
    assert len(bb.graphs.slabs.slabs) == 1 and all(s.slots == 4 for s in next(iter(bb.graphs.slabs.slabs.values())))


def test_the_batch_path_is_the_graphs_where_they_run_and_eager_elsewhere(cpu_step_graphs):
    """A CPU backbone has no graphs: reserve_batch changes nothing and the eager forward runs every batch.
    With graphs (here stood in for), caches made after reserve_batch are slab slots, warming captures
    the batched steps of every batch bucket up to the server's and every row bucket, and a batch of
    such caches replays them; a cache of its own (made before) sends its batch to the eager forward."""
    model = tiny_model("llama", n_layers=2)
    cpu = Backbone(model)
    assert cpu.graphs is None and not cpu.reserve_batch(8) and cpu.new_cache(40).slot is None
    with pytest.raises(ValueError, match="at least one request"):
        cpu.reserve_batch(0)
    bb = cpu_step_graphs(model)
    before = bb.new_cache(40)
    assert before.slot is None  # no slabs reserved yet
    bb.reserve_batch(3)
    caches = [bb.new_cache(40) for _ in range(4)]  # four: a second slab of three
    assert all(c.slot is not None for c in caches) and caches[3].slot.slab is not caches[0].slot.slab
    assert bb.batch_step_costs(3) is None  # not timed yet: the eager pricing
    n = bb.graphs.warm_batches(3, bb._full, 40)
    assert n == 3 * len(ROW_BUCKETS)  # batch buckets 1, 2 and 4, each row bucket, the smallest span
    assert bb.graphs.warm_batches(3, bb._full, 40) == 0
    costs = bb.batch_step_costs(3)  # timed as warmed: batch bucket 4's steps in plain steps of one request
    assert sorted(costs) == list(ROW_BUCKETS) and all(c > 0 for c in costs.values())
    assert bb.batch_step_costs(1)[1] == 1.0 and bb.batch_step_costs(65) is None
    assert cpu.batch_step_costs(3) is None
    torch.manual_seed(0)
    ids = torch.randint(3, bb.vocab_size, (12,))
    plain = [Backbone(model).new_cache(40) for _ in range(5)]
    for c in caches + [before]:
        bb.forward(ids[:8], c, 0, logits="none")
    for c in plain:
        Backbone(model).forward(ids[:8], c, 0, logits="none")
    segs = [Segment(ids[8:8 + t], c, 8) for t, c in zip((1, 3, 2, 4), caches)]  # two slabs: two batched steps
    want = Backbone(model).forward_batch([Segment(s.ids, p, 8) for s, p in zip(segs, plain)])
    got = bb.forward_batch(segs)
    assert bb.graphs.batched_replays == 2
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    got = bb.forward_batch([Segment(ids[8:10], caches[0], 8), Segment(ids[8:9], before, 8)])
    assert bb.graphs.batched_replays == 2  # not a slab slot: eager
    assert torch.allclose(got[1], want[0], atol=1e-5)


def test_a_slab_with_feature_rows_and_its_batched_step_write_the_eager_rows():
    """fp32: a slab whose caches keep feature rows holds them per slot, and the batched step writes the rows
    the eager forward_batch writes, at each request's real positions (a draft's step may not write them)."""
    bb = Backbone(tiny_model("llama", n_layers=4))
    layers = (0, 2, 4)
    rows = lambda positions, n: torch.zeros(positions, n, bb.hidden_size)  # noqa: E731
    slab = Slab(bb.allocate_kv, slots=3, capacity=512, layers=layers, rows=rows)
    assert slab.features.shape == (4, 512, 3, bb.hidden_size) and slab.rows_of(1).shape == (512, 3, bb.hidden_size)
    torch.manual_seed(0)
    lens, fed = [30, 7, 61], [4, 1, 3]
    ids = [torch.randint(3, bb.vocab_size, (n + t,)) for n, t in zip(lens, fed)]
    caches = []
    for n, x in zip(lens, ids):
        index = slab.take()
        k, v = slab.view(index)
        slot = KVCache(k=k, v=v, limit=512 - ROW_BUCKETS[-1], features=slab.rows_of(index), feature_layers=layers)
        plain = bb.new_cache(512, features=layers)
        for c in (slot, plain):
            bb.forward(x[:n], c, 0, logits="none")
        caches.append((index, slot, plain))
    feeds = [x[n:] for x, n in zip(ids, lens)]
    want = bb.forward_batch([Segment(f, plain, n) for f, n, (_, _, plain) in zip(feeds, lens, caches)])
    B, R = batch_bucket(3), row_bucket(4)
    step = BatchedStep(bb, B, R, span_for(max(lens) + R, 512), bb._full, keep=layers)
    ids_, slots, starts = torch.zeros(B, R, dtype=torch.long), torch.full((B,), slab.dummy), torch.zeros(B).long()
    for b, ((index, _, _), start, f) in enumerate(zip(caches, lens, feeds)):
        ids_[b, :len(f)], slots[b], starts[b] = f, index, start
    with torch.inference_mode():
        got = step(ids_, slots, starts, slab.k, slab.v, *bb.rope_table(512), slab.features)
    for b, (w, t) in enumerate(zip(want, fed)):
        assert torch.allclose(got[b, :t], w, atol=1e-5)
    for (_, slot, plain), n, t in zip(caches, lens, fed):
        assert torch.allclose(slot.features[:n + t], plain.features[:n + t], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="full model"):
        BatchedStep(bb, B, R, 256, SkipSet(attn=(1,)).masks(4), keep=layers)
    with pytest.raises(ValueError, match="maker"):
        Slab(bb.allocate_kv, slots=1, capacity=64, layers=layers)


def test_eagle_sessions_in_a_batch_replay_batched_steps_that_write_their_feature_rows(cpu_step_graphs):
    """Greedy, fp32: requests drafting with an eagle head step together through the batched graphs (their
    caches slab slots with feature rows) with the drafts, acceptance and tokens of the same batch run eagerly."""
    from adaptive.drafters.eagle_drafter import EagleDrafter
    from adaptive.drafters.factory import eagle_vocab
    from tests.drafters.test_eagle import LAYERS, random_head

    model = tiny_model("llama")
    eager_lm = _lm(model)
    head = random_head(eager_lm, vocab_ids=torch.arange(0, model.config.vocab_size, 2))
    bb = cpu_step_graphs(model)
    assert bb.reserve_batch(4)
    prompts = [[5, 9, 12, 7, 3, 22, 8, 5, 9], [14, 6, 14, 6, 14], [3, 4, 5, 6, 7, 8, 9, 10]]
    cfg = GenerationConfig(max_new_tokens=24, draft_len=3, features=LAYERS, ignore_eos=True)
    runs = []
    for eng in (Engine(eager_lm), Engine(_lm(model, bb))):
        b = eng.lm.backbone
        sessions = [eng.begin(eng.start(p, cfg), EagleDrafter(head, eagle_vocab(head, b, p), b.embed_rows, copy_min=0))
                    for p in prompts]
        while not all(s.done for s in sessions):
            eng.step([s for s in sessions if not s.done])
        runs.append([(s.out.ids, s.session.stats.drafted, s.session.stats.accepted) for s in sessions])
    assert runs[0] == runs[1] and sum(r[2] for r in runs[0]) > 0
    plain = [Engine(eager_lm).generate(p, cfg).token_ids for p in prompts]
    assert [r[0] for r in runs[1]] == plain
    assert bb.graphs.batched_replays > 0
    assert any(key[0] == "batch" and key[-1] == LAYERS for key in bb.graphs._graphs)
