"""Search spaces, the Bayesian loop and the matchness scorer."""

import numpy as np
import pytest
import torch

from adaptive.calibrate.search import (
    Estimate,
    MatchnessScorer,
    RankedSpace,
    SublayerSpace,
    estimate,
    make_space,
    neighbours,
    row_groups,
    run_search,
    suggest,
    top_candidates,
    trial_record,
    trial_skip,
)
from adaptive.costs import CostModel
from adaptive.engine.backbone import Segment
from adaptive.engine.config import GenerationConfig
from adaptive.engine.skip import SkipSet
from tests.conftest import tiny_lm
from tests.helpers.decoding import decode_ids


def test_ranked_space_skips_the_least_influential_first():
    # attention influence: layer 2 least, then 0; MLP: layer 1 least.
    space = RankedSpace(np.array([[0.3, 0.5, 0.1, 0.9], [0.4, 0.05, 0.6, 0.2]]))
    assert space.decode({"n_attn": 2, "n_mlp": 1}) == SkipSet(attn=[2, 0], mlp=[1])
    assert space.decode({"n_attn": 0, "n_mlp": 0}) == SkipSet()
    assert space.decode({"n_attn": 4, "n_mlp": 4}).size == 8
    assert space.pbounds["n_attn"] == (0, 4, int)


def test_sublayer_space_thresholds_at_one_half():
    space = SublayerSpace(3)
    params = {"a0": 0.9, "a1": 0.5, "a2": 0.51, "m0": 0.1, "m1": 0.7, "m2": 0.0}
    assert space.decode(params) == SkipSet(attn=[0, 2], mlp=[1])
    assert len(space.pbounds) == 6


def test_make_space_errors():
    with pytest.raises(ValueError, match="influence"):
        make_space("ranked", 4)
    with pytest.raises(ValueError, match="unknown"):
        make_space("grid", 4)


def _synthetic_score(skip: SkipSet) -> Estimate:
    # a made-up landscape with its optimum at 3 attention + 1 MLP skipped
    na, nm = len(skip.attn), len(skip.mlp)
    s = 1.2 - 0.02 * (na - 3) ** 2 - 0.05 * (nm - 1) ** 2
    return Estimate(0.9, 0.5, 2, s)


def test_suggest_is_deterministic_in_seed_trial_and_history():
    space = RankedSpace(np.arange(16, dtype=float).reshape(2, 8))
    hist = run_search(space, _synthetic_score, trials=6, seed=3, n_init=3)
    a = suggest(space, [{"params": h["params"], "target": h["target"]} for h in hist], 6, 3, 3)
    b = suggest(space, [{"params": h["params"], "target": h["target"]} for h in hist], 6, 3, 3)
    assert a == b
    assert suggest(space, [], 0, 1, 3) == suggest(space, [], 0, 1, 3)


def test_resumed_search_equals_uninterrupted():
    space = RankedSpace(np.arange(16, dtype=float).reshape(2, 8))
    full = run_search(space, _synthetic_score, trials=12, seed=7, n_init=4)
    part = run_search(space, _synthetic_score, trials=5, seed=7, n_init=4)
    calls = []

    def counting(skip):
        calls.append(skip)
        return _synthetic_score(skip)

    resumed = run_search(space, counting, trials=12, seed=7, n_init=4, history=part)
    assert [h["skip"] for h in resumed] == [h["skip"] for h in full]
    assert len(calls) <= 7  # only the 7 remaining trials were scored (repeats are not re-scored)


def test_bayesian_search_finds_the_synthetic_optimum():
    space = RankedSpace(np.arange(16, dtype=float).reshape(2, 8))
    hist = run_search(space, _synthetic_score, trials=20, seed=0, n_init=5)
    best = top_candidates(hist, 1)[0]
    assert best["target"] >= 1.2 - 0.05 - 1e-9  # at most one step from the optimum
    records = []
    run_search(space, _synthetic_score, trials=3, seed=0, n_init=5, on_trial=records.append)
    assert [r["trial"] for r in records] == [0, 1, 2]


def test_a_trial_record_holds_its_skip_set_as_text():
    rec = trial_record(4, {"n_attn": 2, "n_mlp": 1}, SkipSet((1, 2), (3,)), Estimate(0.5, 0.25, 3, 1.2), 0.1)
    assert rec["skip"] == "attn=1-2;mlp=3" and (rec["n_attn"], rec["n_mlp"]) == (2, 1)  # the JSON line's form
    assert trial_skip(rec) == SkipSet((1, 2), (3,)) and trial_skip({"skip": "none"}) == SkipSet()


def test_top_candidates_are_distinct_and_ordered():
    hist = [{"skip": "attn=1", "target": 1.0, "n_attn": 1, "n_mlp": 0, "trial": 0, "matchness": 0.9},
            {"skip": "attn=1", "target": 1.0, "n_attn": 1, "n_mlp": 0, "trial": 3, "matchness": 0.9},
            {"skip": "attn=1-2", "target": 1.1, "n_attn": 2, "n_mlp": 0, "trial": 1, "matchness": 0.8},
            {"skip": "attn=0-2", "target": 1.0, "n_attn": 3, "n_mlp": 0, "trial": 2, "matchness": 0.3}]
    top = top_candidates(hist, 3)
    assert [t["skip"] for t in top] == ["attn=1-2", "attn=1", "attn=0-2"]  # ties: fewer skipped first
    # below the acceptance floor a skip set is never a candidate, whatever its estimate
    assert [t["skip"] for t in top_candidates(hist, 3, floor=0.5)] == ["attn=1-2", "attn=1"]


def _sequences(lm, n=3, cont=12):
    seqs = []
    for i in range(n):
        prompt = [3 + (i * 7 + j) % 30 for j in range(10 + i)]
        seqs.append((prompt, decode_ids(lm.backbone, prompt, GenerationConfig(max_new_tokens=cont))))
    return seqs


def test_matchness_of_the_full_model_on_its_own_greedy_output_is_one():
    lm = tiny_lm("llama", n_layers=4)
    scorer = MatchnessScorer(lm.backbone, _sequences(lm))
    assert scorer(None) == 1.0
    assert scorer.total == 36
    everything = SkipSet(attn=range(4), mlp=range(4)).masks(4)
    assert scorer(everything) < 0.5  # embeddings straight to the head rarely agree


def test_chain_matchness_matches_a_brute_force_count():
    lm = tiny_lm("qwen2", n_layers=4)
    seqs = _sequences(lm, n=2, cont=8)
    skip = SkipSet(attn=[1, 3], mlp=[2])
    masks = skip.masks(4)
    bb = lm.backbone
    hits = total = 0
    for prompt, cont in seqs:  # full-model prompt keys, then the skipped model on its own continuation keys
        cache = bb.new_cache(len(prompt) + len(cont))
        bb.forward(torch.tensor(prompt[:-1]), cache, 0, logits="none")
        for j in range(len(cont)):
            tok = prompt[-1] if j == 0 else cont[j - 1]
            logits = bb.forward(torch.tensor([tok]), cache, len(prompt) - 1 + j, skip_masks=masks).logits[0]
            hits += int(logits.argmax()) == cont[j]
            total += 1
    assert MatchnessScorer(bb, seqs, mode="chain")(masks) == pytest.approx(hits / total)


def test_context_matchness_is_first_draft_token_acceptance():
    # Each position drafted as the first token after a verification: full-model keys for
    # everything up to it, one skipped-model forward of one token that reads them.
    lm = tiny_lm("llama", n_layers=4)
    seqs = _sequences(lm, n=2, cont=8)
    masks = SkipSet(attn=[0, 2], mlp=[3]).masks(4)
    bb = lm.backbone
    hits = total = 0
    for prompt, cont in seqs:
        for j in range(len(cont)):
            ctx = list(prompt) + list(cont[:j])
            cache = bb.new_cache(len(ctx))
            bb.forward(torch.tensor(ctx), cache, 0, logits="none")  # full keys incl. the pending token
            logits = bb.forward(torch.tensor(ctx[-1:]), cache, len(ctx) - 1, skip_masks=masks,
                                read_only=True).logits[0]
            hits += int(logits.argmax()) == cont[j]
            total += 1
    assert MatchnessScorer(bb, seqs)(masks) == pytest.approx(hits / total)
    with pytest.raises(ValueError, match="mode"):
        MatchnessScorer(bb, seqs, mode="other")


def test_scoring_in_groups_of_any_size_gives_the_same_matchness():
    lm = tiny_lm("qwen2", n_layers=4)
    seqs = _sequences(lm, n=3, cont=8)
    masks = SkipSet(attn=[1], mlp=[0, 2]).masks(4)
    for mode in MatchnessScorer.MODES:
        whole = MatchnessScorer(lm.backbone, seqs, mode=mode)
        alone = MatchnessScorer(lm.backbone, seqs, mode=mode, max_rows=1)  # one sequence per forward
        assert [len(g) for g in whole.groups] == [3] and [len(g) for g in alone.groups] == [1, 1, 1]
        assert whole(masks) == pytest.approx(alone(masks))
    with pytest.raises(ValueError, match="max_rows"):
        MatchnessScorer(lm.backbone, seqs, max_rows=0)


def test_groups_keep_order_and_fill_up_to_max_rows():
    segs = [Segment(torch.zeros(n, dtype=torch.long), None, 0) for n in (300, 200, 100, 600, 512)]
    sizes = [[int(s.ids.numel()) for s in g] for g in row_groups(segs, 512)]
    assert sizes == [[300, 200], [100], [600], [512]]  # a longer one alone; nothing reordered


def test_read_only_forward_writes_nothing():
    lm = tiny_lm("llama", n_layers=2)
    bb = lm.backbone
    cache = bb.new_cache(12)
    bb.forward(torch.arange(3, 15), cache, 0, logits="none")
    k, v = cache.k.clone(), cache.v.clone()
    out = bb.forward(torch.arange(5, 9), cache, 6, skip_masks=SkipSet(mlp=[0]).masks(2), logits="all", read_only=True)
    assert out.logits.shape[0] == 4
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_estimate_uses_the_cost_model():
    lm = tiny_lm("llama", n_layers=4)
    scorer = MatchnessScorer(lm.backbone, _sequences(lm, n=2))
    cm = CostModel.uniform(4, verify=(1.0, 1.0, 1.0, 1.0, 1.0))
    none = estimate(SkipSet(), scorer, cm, max_draft_len=4)
    assert none.matchness == 1.0 and none.draft_cost == pytest.approx(1.0)
    # a = 1, draft cost 1, verify 1: k tokens per (k + 1) cost units, i.e. exactly 1x for every k
    assert none.speedup == pytest.approx(1.0)
    half = estimate(SkipSet(attn=[0, 1]), scorer, cm, max_draft_len=4)
    assert half.draft_cost == pytest.approx(1.0 - 0.24)


def test_search_does_not_spend_trials_on_one_point_or_on_the_empty_set():
    space = RankedSpace(np.arange(8, dtype=float).reshape(2, 4))

    def flat(skip):  # a landscape whose best point is the corner the optimiser keeps proposing
        return Estimate(1.0, 1.0, 1, 1.0 if skip.size == 1 else 0.5)

    hist = run_search(space, flat, trials=15, seed=0, n_init=3)
    skips = [h["skip"] for h in hist]
    assert len(set(skips)) == 15  # every trial scored a new skip set
    for h in hist:
        if h["skip"] == "none":
            assert h["target"] == 0.0
    assert all(c["skip"] != "none" for c in top_candidates(hist, 5))


def test_neighbours_keep_one_sublayer_or_add_the_domains_next():
    space = RankedSpace(torch.tensor([[0.1, 0.5, 0.2, 0.9], [0.8, 0.3, 0.4, 0.1]]))  # attn: 0, 2, 1, 3; mlp: 3, 1, 2, 0
    got = neighbours(SkipSet(attn=[0], mlp=[1, 2]), space)
    assert got == [SkipSet(attn=[0], mlp=[1, 2]), SkipSet(mlp=[1, 2]), SkipSet(attn=[0], mlp=[2]),
                   SkipSet(attn=[0], mlp=[1]), SkipSet(attn=[0, 2], mlp=[1, 2]), SkipSet(attn=[0], mlp=[1, 2, 3])]
    # one sublayer: its smaller neighbour is empty (not a drafter), left out; every sublayer skipped: none added
    assert neighbours(SkipSet(mlp=[3]), space) == [SkipSet(mlp=[3]), SkipSet(attn=[0], mlp=[3]), SkipSet(mlp=[3, 1])]
    full = SkipSet(attn=[0, 1, 2, 3], mlp=[0, 1, 2, 3])
    assert neighbours(full, space)[0] == full and len(neighbours(full, space)) == 9
    # another space adds nothing: only the set and its smaller neighbours
    assert neighbours(SkipSet(mlp=[3]), SublayerSpace(4)) == [SkipSet(mlp=[3])]
