"""The static-shape step behind CUDA graphs: its pure parts and its equality with the eager forward on the
CPU (compiled with ``fullgraph=True`` too), and the graphs themselves on CUDA (skipped without a GPU)."""

import gc

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.backbone import Backbone, KVCache
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.graphs import BUCKETS, SlotPool, StaticStep, bucket_for, capacity_for
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from tests.conftest import char_tokenizer, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_and_capacities():
    assert [bucket_for(t) for t in (1, 2, 3, 5, 9, 16, 17, 32)] == [1, 2, 4, 8, 16, 16, 32, 32]
    assert bucket_for(33) is None
    assert capacity_for(1) == 256 and capacity_for(100) == 256 and capacity_for(250) == 512
    assert capacity_for(8190, 8192) == 8448 and capacity_for(300, 8192) == 512  # capped by the context
    for n in (1, 200, 224, 225, 1000, 5000):  # room for the largest bucket's padding after the last position
        c = capacity_for(n)
        assert c >= n + BUCKETS[-1] and c & (c - 1) == 0 and (c // 2 < n + BUCKETS[-1] or c == 256)


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


def _static_run(bb, step, ids, start, cache):
    cap = cache.k.shape[2]
    cos, sin = bb.rope_table(cap)
    Tb = step.bucket
    buf = torch.zeros(Tb, dtype=torch.long)
    buf[:len(ids)] = ids
    meta = torch.tensor([start, len(ids) - 1])
    return step(buf, meta, cache.k, cache.v, cos, sin)


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
    """StepOps.compiled (what CUDA graphs capture by default) traces each piece whole and gives the plain
    pieces' logits, for two buckets (automatic dynamic shapes) and a skip set."""
    from adaptive.engine.graphs import StepOps

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
