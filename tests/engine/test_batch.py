"""Several sessions decoded together (Engine.begin / Engine.step): each output is what it would be alone."""

import random

import pytest

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm

# (drafter kind, skip set, draft length, new tokens): ragged in every way a batch can be
LANES = [
    ("ar", None, 1, 30),
    ("ssd", SkipSet(attn=(1,), mlp=(2,)), 4, 17),
    ("ssd", SkipSet(attn=(0, 2, 3), mlp=(1,)), 2, 25),
    ("pld", None, 5, 9),
    ("ssd", SkipSet(attn=(1, 2, 3), mlp=(0, 3)), 8, 30),
    ("ar", None, 1, 3),
]


def make(lm, kind, skip):
    return None if kind == "ar" else build_drafter(DrafterSpec(kind, skip=skip), lm.backbone)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_greedy_equals_each_alone_with_continuous_admission(family):
    """fp32, greedy: sessions that join and leave a running batch produce exactly their lone outputs."""
    lm = tiny_lm(family, n_layers=4)
    eng = Engine(lm)
    rng = random.Random(7)
    V = lm.model.config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(n)] + [5, 6, 7, 5, 6] for n in (1, 12, 40, 6, 23, 3)]
    cfgs = [GenerationConfig(max_new_tokens=n, draft_len=k, ignore_eos=True) for _, _, k, n in LANES]
    alone = [eng.generate(p, c, drafter=make(lm, kind, skip)).token_ids
             for p, c, (kind, skip, _, _) in zip(prompts, cfgs, LANES)]

    waiting = list(range(len(LANES)))
    running, out, batch_sizes = {}, {}, []
    while waiting or running:
        # admit up to two new sessions per step, while others are mid-decode
        for i in waiting[:2]:
            kind, skip, _, _ = LANES[i]
            running[i] = eng.begin(eng.start(prompts[i], cfgs[i]), make(lm, kind, skip))
        waiting = waiting[2:]
        live = [i for i, d in running.items() if not d.done]
        if live:
            batch_sizes.append(len(live))
            eng.step([running[i] for i in live])
        for i in [i for i, d in running.items() if d.done]:
            out[i] = running.pop(i).result()
    assert max(batch_sizes) >= 4 and 1 in batch_sizes  # batched forwards and a lone one both ran
    for i, ref in enumerate(alone):
        assert out[i].token_ids == ref, (i, LANES[i])
        assert out[i].finish_reason == "length" and out[i].stats.steps >= 1


def test_batched_sampling_keeps_each_sessions_random_stream():
    """Seeded sampling: each session draws from its own generator, so batching does not change its tokens."""
    lm = tiny_lm("llama", n_layers=4)
    eng = Engine(lm)
    skip = SkipSet(attn=(1,), mlp=(2,))
    cfgs = [GenerationConfig(max_new_tokens=20, draft_len=3, temperature=t, top_p=p, seed=s, ignore_eos=True)
            for t, p, s in ((0.8, 1.0, 1), (1.0, 0.9, 2), (0.0, 1.0, None), (1.3, 1.0, 3))]
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 14, 2)]
    alone = [eng.generate(p, c, drafter=make(lm, "ssd", skip)).token_ids for p, c in zip(prompts, cfgs)]
    ds = [eng.begin(eng.start(p, c), make(lm, "ssd", skip)) for p, c in zip(prompts, cfgs)]
    while not all(d.done for d in ds):
        eng.step([d for d in ds if not d.done])
    assert [d.result().token_ids for d in ds] == alone


def test_text_deltas_make_each_text_and_finished_decodings_cannot_step():
    lm = tiny_lm("llama", seed=3)
    eng = Engine(lm)
    cfgs = [GenerationConfig(max_new_tokens=n, ignore_eos=True, stop=stop) for n, stop in ((12, ()), (6, ()))]
    ds = [eng.begin(eng.start(eng.encode(p), c)) for p, c in zip(("hello", "abc"), cfgs)]
    texts = [d.first for d in ds]
    while not all(d.done for d in ds):
        live = [i for i, d in enumerate(ds) if not d.done]
        for i, delta in zip(live, eng.step([ds[i] for i in live])):
            texts[i] += delta
    results = [d.result() for d in ds]
    assert texts == [r.text for r in results]
    assert [len(r.token_ids) for r in results] == [12, 6]
    with pytest.raises(ConfigError, match="finished"):
        eng.step(ds)
    with pytest.raises(ConfigError, match="once"):
        eng.begin(ds[0].session)
