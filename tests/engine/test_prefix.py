"""The prefix cache (:mod:`adaptive.engine.prefix`): the store's bookkeeping on literal ids, and on both
engines a request started from a kept prefix decodes what it decodes from scratch."""

from __future__ import annotations

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.audit import audit_divergence, common_prefix
from adaptive.engine.config import GenerationConfig, Pooling
from adaptive.engine.engine import Engine
from adaptive.engine.prefix import PrefixStore, budget_bytes
from adaptive.errors import ConfigError
from tests.conftest import tiny_lm


class Held:
    """A stand-in handle that records its release."""

    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


def test_common_prefix_on_literal_ids():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7, 8], [7, 8]) == 2


def test_lookup_leaves_the_last_prompt_token_to_prefill():
    store = PrefixStore(1000)
    store.add([5, 6, 7, 8], Held(), 10)
    assert store.peek([5, 6, 9]) == 2
    assert store.peek([5, 6]) == 1  # its last token is prefilled: its logits give the first new token
    assert store.peek([5, 6, 7, 8, 1, 2]) == 4
    assert store.peek([9]) == 0
    m = store.lookup([5, 6, 7, 8, 1])
    assert m.tokens == 4 and m.entry.pins == 1
    store.unpin(m.entry)
    store.restored(m.tokens)
    s = store.stats()
    assert (s.entries, s.tokens, s.nbytes, s.lookups, s.hits, s.cached_tokens) == (1, 4, 10, 1, 1, 4)


def test_least_recently_used_entries_go_first_within_the_budget():
    store = PrefixStore(25)
    a, b, c = Held(), Held(), Held()
    store.add([1, 2, 3], a, 10)
    store.add([4, 5, 6], b, 10)
    store.unpin(store.lookup([1, 2, 3, 9]).entry)  # [1, 2, 3] is now the most recently used
    store.add([7, 8, 9], c, 10)  # 30 bytes > 25: the least recently used, [4, 5, 6], goes
    assert b.released and not a.released and not c.released
    assert store.stats().nbytes == 20 and store.stats().evictions == 1


def test_a_next_turn_replaces_the_entry_it_extends_and_a_held_prefix_is_not_kept_twice():
    store = PrefixStore(100)
    first, second, again = Held(), Held(), Held()
    assert store.add([1, 2, 3], first, 10)
    assert store.add([1, 2, 3, 4, 5], second, 10)  # the conversation's next turn holds the first
    assert first.released and store.stats().entries == 1
    assert not store.add([1, 2, 3], again, 10)  # already held by the longer entry
    assert again.released and store.stats().entries == 1


def test_a_store_pickles_with_its_budget_and_without_its_entries():
    import pickle

    store = PrefixStore(100)
    store.add([1, 2, 3], Held(), 10)
    copy = pickle.loads(pickle.dumps(store))  # a model sent to a worker process carries its backbone's store
    assert copy.budget == 100 and copy.stats().entries == 0 and store.stats().entries == 1
    assert copy.add([4, 5], Held(), 10) and copy.peek([4, 5, 6]) == 2


def test_pinned_entries_are_not_evicted_and_oversized_or_disabled_adds_are_released():
    store = PrefixStore(10)
    a = Held()
    store.add([1, 2], a, 10)
    m = store.lookup([1, 2, 3])
    assert not store.evict_one() and not a.released
    store.unpin(m.entry)
    assert store.evict_one() and a.released
    big = Held()
    assert not store.add([3, 4], big, 11) and big.released
    off, h = PrefixStore(0), Held()
    assert not off.enabled and not off.add([1], h, 1) and h.released
    with pytest.raises(ConfigError):
        PrefixStore(-1)
    kept = PrefixStore(30)
    handles = [Held() for _ in range(3)]
    for i, h in enumerate(handles):
        kept.add([i], h, 10)
    kept.resize(15)  # the two least recently used make way
    assert [h.released for h in handles] == [True, True, False] and kept.stats().budget == 15
    kept.resize(0)
    assert handles[2].released and not kept.enabled
    with pytest.raises(ConfigError):
        budget_bytes(-0.5)
    assert budget_bytes(1) == 2**20


def test_stale_entries_are_evicted_by_the_backbones_rule_pinned_ones_kept():
    store, handles = PrefixStore(100), [Held() for _ in range(3)]
    for i, h in enumerate(handles):
        h.age = i  # the rule's input: here an age in the handle
        store.add([i, i], h, 10)
    m = store.lookup([0, 0, 5])  # the oldest, pinned: a request restores from it now
    assert store.evict_stale(lambda h: h.age < 2) == 0 + 1  # entry 1 only: 0 is pinned, 2 is young
    assert [h.released for h in handles] == [False, True, False] and store.stats().evictions == 1
    store.unpin(m.entry)
    assert store.evict_stale(lambda h: h.age < 2) == 1 and handles[0].released and not handles[2].released


# -- on the engines ------------------------------------------------------------------------------

TURN1 = [5, 9, 14, 22, 9, 14, 22, 31, 7, 9, 14, 22, 40, 12]
NEW_USER_TURN = [3, 17, 9, 14, 2, 28]


def run(engine: Engine, ids: list[int], cfg: GenerationConfig, prefix: bool, drafter=None, chunk: int = 0,
        pool=False):
    task = engine.prefilling(ids, cfg, pool=pool, chunk=chunk, prefix=prefix)
    while (session := task.advance()) is None:
        pass
    result = None
    for item in engine.decode(session, drafter):
        result = item
    return result


def conversation(engine: Engine, cfg: GenerationConfig, drafter_spec=None, chunk: int = 0, pool=False):
    """Turn 1, then turn 2 (turn 1, its answer and a new user turn), both through the prefix cache: the
    second turn's result."""
    first = run(engine, TURN1, cfg, True, chunk=chunk, pool=pool)
    second = TURN1 + first.token_ids + NEW_USER_TURN
    drafter = build_drafter(drafter_spec, engine.backbone) if drafter_spec else None
    return second, run(engine, second, cfg, True, drafter, chunk=chunk, pool=pool)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [0, 4])
def test_torch_a_second_turn_from_the_cached_first_decodes_what_it_decodes_from_scratch(family, chunk):
    lm = tiny_lm(family)
    lm.backbone.prefixes.resize(budget_bytes(64))
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=12, draft_len=3)
    second, cached = conversation(engine, cfg, DrafterSpec("pld"), chunk=chunk, pool=Pooling(2, "last"))
    assert cached.stats.cached_tokens >= len(TURN1)  # turn 1 and (most of) its answer
    fresh = run(Engine(tiny_lm(family)), second, cfg, False)
    assert fresh.stats.cached_tokens == 0
    assert cached.token_ids == fresh.token_ids  # fp32: token for token
    assert lm.backbone.prefixes.stats().entries == 1  # turn 2 replaced turn 1, which it extends


def test_torch_sampling_from_a_cached_prefix_draws_what_it_draws_from_scratch():
    lm = tiny_lm("llama")
    lm.backbone.prefixes.resize(budget_bytes(64))
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=10, temperature=0.8, seed=3)
    second, cached = conversation(engine, cfg)
    assert cached.stats.cached_tokens > 0
    assert cached.token_ids == run(Engine(tiny_lm("llama")), second, cfg, False).token_ids


def test_torch_eagle_feature_rows_come_back_with_the_keys():
    lm = tiny_lm("llama")
    lm.backbone.prefixes.resize(budget_bytes(64))
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=8, features=(1, 2, 4))
    run(engine, TURN1, cfg, True)
    task = engine.prefilling(TURN1 + [3, 4], cfg, prefix=True)
    session = task.advance()
    fresh = Engine(tiny_lm("llama")).prefilling(TURN1 + [3, 4], cfg).advance()
    n = len(TURN1) + 2
    assert task.cached == len(TURN1)
    # the same rows as a prefill from scratch, to the rounding of a forward of another shape
    assert torch.allclose(session.state.cache.features[:n], fresh.state.cache.features[:n], rtol=1e-4, atol=1e-4)
    assert torch.allclose(session.state.cache.k[:, :, :n], fresh.state.cache.k[:, :, :n], rtol=1e-4, atol=1e-4)
    assert session.state.cache.features[:n].abs().sum() > 0
    other = GenerationConfig(max_new_tokens=8, features=(1, 3, 4))  # other layers: nothing restored
    assert Engine(lm).prefilling(TURN1 + [3, 4], other, prefix=True).cached == 0


def test_torch_no_reuse_for_mean_pooling_or_without_the_flag():
    lm = tiny_lm("llama")
    lm.backbone.prefixes.resize(budget_bytes(64))
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=6)
    run(engine, TURN1, cfg, True)
    assert engine.prefilling(TURN1 + [3], cfg, pool=Pooling(2, "mean"), prefix=True).cached == 0
    assert engine.prefilling(TURN1 + [3], cfg).cached == 0
    assert engine.prefilling(TURN1 + [3], cfg, pool=Pooling(2, "last"), prefix=True).cached == len(TURN1)


def test_an_abandoned_decoding_keeps_nothing():
    lm = tiny_lm("llama")
    lm.backbone.prefixes.resize(budget_bytes(64))
    engine = Engine(lm)
    decoding = engine.begin(engine.start(TURN1, GenerationConfig(max_new_tokens=20), prefix=True))
    engine.step([decoding])  # not done: a client that leaves now
    del decoding
    assert lm.backbone.prefixes.stats().entries == 0


llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def cpp_lm(tiny_gguf):
    """The tiny Llama on the llama.cpp engine, with a context of 256 positions (4 sequences)."""
    from adaptive.models import LoadedModel
    from tests.conftest import char_tokenizer

    return LoadedModel(None, char_tokenizer(), "tiny-gguf", str(tiny_gguf[0]), torch.device("cpu"), torch.float32,
                       engine="llama.cpp", threads=1, context=256)


def test_llamacpp_a_second_turn_shares_the_first_turns_cells_and_decodes_the_same(cpp_lm):
    bb = cpp_lm.backbone
    bb.prefixes.resize(budget_bytes(64))
    try:
        engine = Engine(cpp_lm)
        cfg = GenerationConfig(max_new_tokens=10, draft_len=3)
        second, cached = conversation(engine, cfg, DrafterSpec("pld"), pool=Pooling(2, "last"))
        assert cached.stats.cached_tokens >= len(TURN1)
        bb.prefixes.clear()
        assert bb.free_positions() == bb.max_positions  # the entries gave their sequences back
        fresh = run(engine, second, cfg, False)
        # llama.cpp's kernels round by batch shape: the cached keys (computed in other forwards) may make
        # it part from a prefill from scratch, at a near-tie only (the audit's tolerance)
        assert not audit_divergence(bb, second, fresh.token_ids, cached.token_ids).violation
    finally:
        bb.prefixes.resize(0)


def test_llamacpp_requests_sharing_prefixes_part_from_scratch_only_at_near_ties(cpp_lm):
    """Prompts sharing starts of every length (a template, a document, a conversation), greedy and
    drafting: each decodes from the cache what it decodes from scratch, or parts at a near-tie."""
    bb = cpp_lm.backbone
    bb.prefixes.resize(budget_bytes(64))
    try:
        engine = Engine(cpp_lm)
        cfg = GenerationConfig(max_new_tokens=16, draft_len=3)
        prompts = [TURN1[:k] + NEW_USER_TURN[: 1 + k % 5] for k in range(2, len(TURN1), 2)]
        prompts += [TURN1 + NEW_USER_TURN + [9, 14, 22] * k for k in range(1, 4)]
        hits = identical = 0
        for ids in prompts:
            cached = run(engine, ids, cfg, True, build_drafter(DrafterSpec("pld"), bb))
            fresh = run(engine, ids, cfg, False)
            hits += cached.stats.cached_tokens > 0
            identical += cached.token_ids == fresh.token_ids
            assert not audit_divergence(bb, ids, fresh.token_ids, cached.token_ids).violation, ids
        assert hits >= len(prompts) - 1 and identical >= len(prompts) // 2
    finally:
        bb.prefixes.resize(0)


def test_llamacpp_entries_give_their_cells_and_sequences_to_new_requests(cpp_lm):
    bb = cpp_lm.backbone
    bb.prefixes.resize(budget_bytes(64))
    try:
        engine = Engine(cpp_lm)
        cfg = GenerationConfig(max_new_tokens=40)
        for i in range(6):  # more finished prompts than the context's 4 sequences and 256 cells hold
            run(engine, [i + 1] * 30 + TURN1, cfg, True)
        s = bb.prefixes.stats()
        assert 1 <= s.entries <= bb.sequences and s.tokens <= bb.max_positions
        cache = bb.new_cache(bb.max_positions)  # the whole context: every entry makes way
        assert bb.prefixes.stats().entries == 0 and bb.prefixes.stats().evictions >= 6 - bb.sequences
        cache.release()
    finally:
        bb.prefixes.resize(0)


def test_the_stale_horizon_follows_the_reuses_seen():
    from adaptive.engine.llamacpp import MIN_STALE_ROWS, STALE_ROWS, stale_horizon

    assert stale_horizon([]) == stale_horizon([5, 5, 5], [True] * 3) == STALE_ROWS == 4096  # too few seen
    assert stale_horizon([], [True, True] + [False] * 6) == 1024  # a quarter reused: a quarter of the break-even
    assert stale_horizon([], [False] * 8) == MIN_STALE_ROWS == 256  # nothing reused (single turns): soon
    assert stale_horizon(range(100, 900, 100), [True] * 8) == 1600  # reuses come early: twice their p90
    assert stale_horizon([10] * 8, [True] * 8) == 256 and stale_horizon([5000] * 8, [True] * 8) == STALE_ROWS


def test_llamacpp_entries_not_reused_for_stale_rows_are_given_back(cpp_lm, monkeypatch):
    """Every llama.cpp decode attends over every cell in use: an entry not restored within the stale horizon
    (rows fed to the context; here 60) goes at the next request; one a request is restoring from stays."""
    import adaptive.engine.llamacpp as cpp

    monkeypatch.setattr(cpp, "stale_horizon", lambda ages, reused: 60)  # the rule itself: the test above
    bb = cpp_lm.backbone
    bb.prefixes.resize(budget_bytes(64))
    try:
        engine = Engine(cpp_lm)
        cfg = GenerationConfig(max_new_tokens=8)
        before = bb.prefixes.stats().evictions  # the module's earlier tests used this store too
        run(engine, [7] * 20 + TURN1, cfg, True)  # entry A
        run(engine, TURN1, cfg, True)  # entry B
        assert bb.prefixes.stats().entries == 2 and bb.prefixes.stats().evictions == before
        run(engine, [3] * 40 + TURN1, cfg, True)  # 40 + rows more: A and B are past 60 rows unused now
        # the next turn of B: its lookup pins B (restored, so young again); A goes at this request's start
        second = run(engine, TURN1 + NEW_USER_TURN, cfg, True)
        assert second.stats.cached_tokens >= len(TURN1) - 1
        starts = [tuple(e.ids[:3]) for e in bb.prefixes._entries]
        assert (7, 7, 7) not in starts and (3, 3, 3) in starts and bb.prefixes.stats().evictions == before + 1
    finally:
        bb.prefixes.resize(0)


def test_llamacpp_a_store_swapped_out_still_gives_its_cells_to_new_requests(cpp_lm):
    """A benchmark swaps stores per method: the cells an idle store's entries hold are evicted from it
    (through it: its entries go) when the context needs them."""
    bb = cpp_lm.backbone
    idle, current = PrefixStore(budget_bytes(64)), PrefixStore(budget_bytes(64))
    try:
        engine = Engine(cpp_lm)
        bb.prefixes = idle
        for i in range(bb.sequences):
            run(engine, [i + 1] * 30 + TURN1, GenerationConfig(max_new_tokens=8), True)
        assert idle.stats().entries >= 2
        bb.prefixes = current
        cache = bb.new_cache(bb.max_positions)
        assert idle.stats().entries == 0 and current.stats().entries == 0
        cache.release()
    finally:
        idle.resize(0)
        bb.prefixes = PrefixStore(0)


def test_the_budget_holds_over_many_requests_and_eviction_loses_only_speed():
    """Sixty requests (some extending earlier ones) through a budget that holds a few entries: the kept
    bytes never exceed it, entries are evicted, and every request still decodes what plain decoding does."""
    lm = tiny_lm("llama")
    per_token = lm.backbone.kv_bytes_per_token()
    budget = 3 * 40 * per_token  # about three 40-token entries
    lm.backbone.prefixes.resize(budget)
    engine, plain = Engine(lm), Engine(tiny_lm("llama"))
    cfg = GenerationConfig(max_new_tokens=6)
    history: list[list[int]] = []
    for i in range(60):
        ids = (history[-1] + [3, 4]) if i % 3 == 2 and history else [5 + i % 7] * (10 + i % 17) + TURN1
        out = run(engine, ids, cfg, True)
        history.append(ids + out.token_ids)
        assert lm.backbone.prefixes.stats().nbytes <= budget
        if i % 10 == 0:
            assert out.token_ids == run(plain, ids, cfg, False).token_ids
    s = lm.backbone.prefixes.stats()
    assert s.evictions > 0 and s.hits > 0 and 1 <= s.entries <= 3
