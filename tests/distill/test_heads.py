"""Training an eagle head on the tiny model: held-out acceptance rises, the head round-trips through
the profile, an interrupted run resumes to the same weights, a budget in minutes sets the steps
(re-paced as the steps slow), and the runtime's ``eagle`` policy decodes exactly what plain decoding
does."""

import shutil
from dataclasses import asdict, replace

import pytest
import torch

from adaptive.costs import best_draft_length
from adaptive.distill.heads import (
    PACE_STEPS,
    HeadConfig,
    HeadData,
    HeadTrainer,
    Pacer,
    budget_steps,
    choose_vocab,
    decode_with_features,
    head_shape,
    repace_every,
)
from adaptive.distill.trainer import DistillError, distill_head
from adaptive.drafters.eagle import DEFAULT_TREE, EagleHead, HeadShape
from adaptive.drafters.eagle_static import warm_head
from adaptive.errors import ConfigError
from adaptive.measure.decision import ROLES, decide
from adaptive.measure.interval import bootstrap_share
from adaptive.profile import Decision, Interval, load_profile, save_profile
from adaptive.runtime import AdaptiveRuntime
from adaptive.runtime.runtime import beta_prior
from tests.conftest import TINY_DOMAINS

FAST = dict(layers=(1, 2, 4), steps=60, new_tokens=16, eval_every=20, checkpoint_every=10, vocab=32, batch=2,
            window=32, warmup=5, held_out=0.25)


def test_decoding_keeps_the_features_of_every_kept_position(lm):
    bb = lm.backbone
    decoded = decode_with_features(bb, [[5, 9, 12], [7, 3]], 6, set(), (0, 4), batch=2)
    for (ids, feats), prompt in zip(decoded, ([5, 9, 12], [7, 3])):
        assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + 5  # the last token chosen is not fed
        cache = bb.new_cache(len(ids), features=(0, 4))  # one forward over the text gives the same rows
        bb.forward(torch.tensor(ids), cache, 0)
        assert torch.allclose(feats.float(), cache.features[:len(ids)], rtol=2e-2, atol=2e-2)  # stored as bf16


def test_sampled_continuations_differ_from_greedy_and_repeat_with_their_seed(lm):
    bb = lm.backbone
    prompts = [[5, 9, 12], [7, 3]]
    greedy = decode_with_features(bb, prompts, 12, set(), (0, 4), batch=2)
    hot = [decode_with_features(bb, prompts, 12, set(), (0, 4), batch=2, temperature=1.5, seed=s) for s in (1, 1, 2)]
    assert [ids for ids, _ in hot[0]] == [ids for ids, _ in hot[1]]  # the same seed: the same text
    assert [ids for ids, _ in hot[0]] != [ids for ids, _ in hot[2]]
    assert [ids for ids, _ in hot[0]] != [ids for ids, _ in greedy]
    for (ids, feats), prompt in zip(hot[0], prompts):  # its features: the target's, over the sampled text
        assert ids[:len(prompt)] == prompt
        cache = bb.new_cache(len(ids), features=(0, 4))
        bb.forward(torch.tensor(ids), cache, 0)
        assert torch.allclose(feats.float(), cache.features[:len(ids)], rtol=2e-2, atol=2e-2)


def test_more_samples_train_on_more_text_and_evaluate_on_the_same(lm, prof, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(prof, other)
    one = distill_head(lm, prof, TINY_DOMAINS, HeadConfig(**{**FAST, "steps": 2}), progress=False, race=False).record
    two = distill_head(lm, other, TINY_DOMAINS, HeadConfig(**{**FAST, "steps": 2, "samples": 3}), progress=False,
                       race=False).record
    assert two.train_prompts == one.train_prompts and two.eval_positions == one.eval_positions
    assert two.train_positions > 2.5 * one.train_positions  # three continuations of each training prompt
    assert two.config["samples"] == 3


def test_the_vocabulary_is_the_most_frequent_training_tokens():
    feats = torch.zeros(5, 1, 2)
    train = HeadData.build([([3, 3, 3, 4, 4], feats), ([3, 5, 5], feats[:3])], [2, 2], ["a", "a"], 2)
    held = HeadData.build([([1, 3, 5, 6], feats[:4])], [2], ["a"], 2)
    ids, coverage = choose_vocab(train, held, 2, 8)
    assert ids.tolist() == [3, 4]  # 3 four times, then 4 and 5 twice: 4 has the smaller id
    assert coverage == 0.0  # the answer [5, 6]: neither is among them
    ids, coverage = choose_vocab(train, held, 3, 8)
    assert ids.tolist() == [3, 4, 5] and coverage == 0.5


def test_a_sequence_drafts_over_the_head_rows_and_its_prompt_tokens(lm):
    # as a request's drafter does (eagle_vocab): the head's rows, then its prompt's tokens outside them;
    # a training batch shares its sequences' rows
    bb = lm.backbone
    cfg = HeadConfig(**FAST)
    run = HeadTrainer(bb, head_shape(bb, cfg), torch.tensor([1, 2, 3]), cfg)
    ids, rows, mapping = run.rows_for([torch.tensor([5, 6, 2, 5]), torch.tensor([7])])
    assert ids.tolist() == [1, 2, 3, 5, 6, 7]
    assert torch.equal(rows, torch.cat([run.head.lm, bb.head_rows(torch.tensor([5, 6, 7])).float()]))
    assert mapping[torch.tensor([1, 3, 5, 6, 7, 9])].tolist() == [0, 2, 3, 4, 5, -1]
    ids, rows, _ = run.rows_for([torch.tensor([2, 3])])
    assert ids.tolist() == [1, 2, 3] and rows is run.head.lm
    # a text whose answer is its prompt's tokens outside the head's rows: the loss is finite (they are
    # among its rows), and the head, which copies the lookup token, keeps drafts of them
    feats = torch.randn(12, 3, bb.hidden_size)
    text = HeadData.build([([5, 6, 7, 9, 5, 6, 7, 9, 5, 6, 7, 9], feats)], [4], ["a"], 2)
    loss = run.loss(text.window([0], 10, None, bb.device))
    assert torch.isfinite(loss) and loss > 0
    with torch.no_grad():
        run.head.bonus.bias.fill_(1e4)  # the lookup token always wins: every answer token is a copy
    assert run.evaluate(text)["positions"][0] == 1.0
    run.rows_for = lambda prompts: HeadTrainer.rows_for(run, [p[:0] for p in prompts])  # the head's rows alone
    assert run.evaluate(text)["positions"][0] == 0.0  # none of 5, 6, 7, 9 among them


def test_the_first_drafts_interval_resamples_the_held_out_sequences(lm):
    # a head that always drafts the lookup token keeps every draft of an answer that repeats its prompt and
    # none of one that does not: the mix's interval is the bootstrap over the sequences' own counts
    bb = lm.backbone
    cfg = HeadConfig(**FAST)
    run = HeadTrainer(bb, head_shape(bb, cfg), torch.tensor([1, 2, 3]), cfg)
    with torch.no_grad():
        run.head.bonus.bias.fill_(1e4)
    texts = [([5, 6, 7, 9] * 3, "a"), ([5, 6, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37], "a"), ([6, 7, 9, 5] * 3, "b")]
    alone = []
    for ids, domain in texts:
        one = run.evaluate(HeadData.build([(ids, torch.randn(12, 3, bb.hidden_size))], [4], [domain], 2))
        alone.append((round(one["positions"][0] * one["rows"]), one["rows"]))
    # copies kept; the second answer's tokens are outside the rows it drafts over (the head's and its prompt's)
    assert alone == [(7, 7), (0, 7), (7, 7)]
    data = HeadData.build([(ids, torch.randn(12, 3, bb.hidden_size)) for ids, _ in texts], [4, 4, 4],
                          [d for _, d in texts], 2)
    ev = run.evaluate(data)
    iv = bootstrap_share(*zip(*alone), seed=cfg.seed)[1]
    assert ev["interval"] == iv.to_dict() and iv.low < ev["positions"][0] < iv.high and iv.blocks == 3
    a = bootstrap_share(*zip(*alone[:2]), seed=cfg.seed)[1]
    assert ev["domain_intervals"] == {"a": a.to_dict(), "b": Interval(1.0, 1.0, 0.9, 1).to_dict()}


def test_training_raises_acceptance_and_stores_the_head(lm, prof):
    # The tiny model's text is random characters: what comes two tokens on cannot be learnt from a few
    # hundred positions of it, so here the held-out prompts repeat the training ones and the check is
    # that the head learns its training text (generalisation is measured on the real model:
    # docs/results.md)
    seen = {n: [ps[0]] * 4 for n, ps in TINY_DOMAINS.items()}
    r = distill_head(lm, prof, seen, HeadConfig(**{**FAST, "steps": 150, "lr": 1e-2}), progress=False, race=False)
    rec = r.record
    assert rec.kind == "eagle" and rec.shape["layers"] == [1, 2, 4]
    # measured (seed 0): first draft kept 0.02 -> ~0.45 (0.33 after 100 steps); the margin is inside that gain
    assert rec.acceptance >= rec.before["greedy"] + 0.15, (rec.before, rec.acceptance)
    assert len(rec.positions) == 3 and rec.positions[0] >= rec.positions[1] >= rec.positions[2]
    assert rec.tau == pytest.approx(1 + sum(rec.positions), abs=1e-3)
    assert set(rec.by_domain) == set(TINY_DOMAINS)
    assert 0 < rec.draft_cost < 1
    assert not (prof.parent / "prof.distill-eagle.work").exists()
    again = load_profile(prof)
    assert again.distilled["eagle"].acceptance == rec.acceptance
    iv = rec.interval  # the first draft's interval over the held-out sequences, kept in the profile
    assert iv.low <= rec.acceptance <= iv.high and iv.level == 0.9 and iv.blocks == rec.eval_prompts
    assert again.distilled["eagle"].interval == iv and again.distilled["eagle"].domain_intervals == rec.domain_intervals
    assert set(rec.domain_intervals) == set(rec.by_domain)
    assert again.distilled["eagle"].kept_text() == f"{rec.acceptance:.3f} [{iv.low:.3f}, {iv.high:.3f}]"
    assert replace(rec, interval=None).kept_text() == f"{rec.acceptance:.3f}"  # a profile distilled before intervals
    head = EagleHead.from_state(HeadShape.from_dict(rec.shape), again.distilled_weights["eagle"])
    assert len(head.ids) == rec.vocab == 32


def test_an_interrupted_run_resumes_to_the_same_head(lm, prof, tmp_path):
    whole = tmp_path / "whole"
    shutil.copytree(prof, whole)
    cfg = HeadConfig(**{**FAST, "steps": 30})
    distill_head(lm, whole, TINY_DOMAINS, cfg, progress=False, race=False)

    def stop(step):
        if step == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False, on_step=stop)
    with pytest.raises(DistillError, match="--resume"):
        distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False)
    distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False, resume=True)
    a, b = load_profile(whole).distilled_weights["eagle"], load_profile(prof).distilled_weights["eagle"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_budget_in_minutes_fixes_the_number_of_steps(lm, prof):
    cfg = HeadConfig(**{**FAST, "steps": None, "minutes": 0.05})
    r = distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False)
    steps = [h["step"] for h in r.record.history if "train_loss" in h]
    evals = [h["step"] for h in r.record.history if "positions" in h]
    assert steps[-1] >= PACE_STEPS and evals[-1] == steps[-1]  # paced, then trained to the fixed length


def test_budget_steps_worked_example():
    assert budget_steps(10, 100, 80.0, 0.9) == 677  # 100 taken, (600 - 80) / 0.9 = 577 more
    assert budget_steps(1, 100, 90.0, 0.5) == 101  # the budget spent: one more step, which ends the run


def test_steps_that_slow_down_shorten_the_schedule(lm, prof, monkeypatch):
    """The first steps' pace sets the length; steps that then run slower (here: 0.05 s each, once
    the pace is taken) are re-paced at each evaluation, so the run ends near its budget, not at the
    first estimate's length (hundreds of steps at 0.05 s: tens of seconds)."""
    import time

    real = HeadTrainer.train_step

    def slower(self, data):
        loss = real(self, data)
        if self.step > PACE_STEPS:
            time.sleep(0.05)
        return loss

    monkeypatch.setattr(HeadTrainer, "train_step", slower)
    cfg = HeadConfig(**{**FAST, "steps": None, "minutes": 0.05})  # 3 s
    r = distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False)
    steps = [h["step"] for h in r.record.history if "train_loss" in h]
    assert r.record.train_seconds < 3 + 2.5  # the budget, and at most about one evaluation window past it
    assert steps[-1] < 3 / 0.05 + 2 * FAST["eval_every"]


def test_pacer_worked_example():
    """A 1-minute budget: 10 steps in 10 s set 60; 15 steps at 0.5 s grow it to 25 + 42.5 / 0.5 = 110; an
    evaluation of 2 s and 5 more steps at 0.5 s: 0.5 + 2 / 100 s a step, 30 + 38 / 0.52 = 103."""
    pacer = Pacer(minutes=1, eval_every=100, eval_seconds=0.0, start=0.0, spent=0.0, step=0)
    assert pacer.length(9, None, 9.0, False) is None
    assert pacer.length(10, None, 10.0, False) == 60 and pacer.pace == 1.0
    assert pacer.length(24, 60, 17.0, False) == 60  # 14 steps: a re-pacing is due every 15 (repace_every(60))
    assert pacer.length(25, 60, 17.5, False) == 110
    pacer.evaluated(2.0)
    assert pacer.length(30, 110, 22.0, True) == 103


def test_repace_every_worked_example():
    assert repace_every(90) == 22 and repace_every(30) == PACE_STEPS


def test_steps_that_speed_up_lengthen_the_schedule_between_evaluations(lm, prof, monkeypatch):
    """First steps slower than the rest (here: 0.15 s each while the pace is taken, as a cold start is)
    set too short a schedule; with no evaluation before its end (``eval_every`` past it) the run is
    re-paced every quarter of its schedule all the same (:func:`repace_every`), so it trains for most of its budget
    rather than stopping at the first estimate's length (a fraction of it)."""
    import time

    real = HeadTrainer.train_step

    def cold(self, data):
        loss = real(self, data)
        if self.step <= PACE_STEPS:
            time.sleep(0.15)
        return loss

    monkeypatch.setattr(HeadTrainer, "train_step", cold)
    cfg = HeadConfig(**{**FAST, "steps": None, "minutes": 0.1, "eval_every": 100_000})  # 6 s, no evaluation
    r = distill_head(lm, prof, TINY_DOMAINS, cfg, progress=False, race=False)
    steps = [h["step"] for h in r.record.history if "train_loss" in h]
    first = budget_steps(0.1, PACE_STEPS, PACE_STEPS * 0.15, 0.15)  # at most what the cold steps set: 40
    assert steps[-1] > 1.5 * first and r.record.train_seconds > 0.8 * 6


def test_bad_options_are_refused(lm, prof):
    with pytest.raises(ConfigError, match="top one"):
        distill_head(lm, prof, TINY_DOMAINS, HeadConfig(**{**FAST, "layers": (1, 2)}), progress=False, race=False)
    with pytest.raises(ConfigError, match="unroll"):
        HeadConfig(unroll=9)
    with pytest.raises(ConfigError, match="minutes"):
        HeadConfig(minutes=0)
    with pytest.raises(ConfigError, match="samples"):
        HeadConfig(samples=0)
    with pytest.raises(ConfigError, match="temperature"):
        HeadConfig(samples=2, temperature=0.0)


def test_the_eagle_policy_decodes_as_plain_decoding(lm, prof):
    distill_head(lm, prof, TINY_DOMAINS, HeadConfig(**FAST), progress=False, race=False)
    rt = AdaptiveRuntime.from_profile(prof, dtype="float32", online=False, bandit=False)  # its bandit may not draft
    chains = AdaptiveRuntime(rt.profile, rt.lm, online=False, bandit=False, tree=None)  # bench's eagle-chain
    assert rt.features == (1, 2, 4)
    for prompt in ("what is 3 plus 6? answer:", "hello there friend number 2"):
        plain = rt.generate(prompt, max_new_tokens=24, policy="ar")
        eagle = rt.generate(prompt, max_new_tokens=24, policy="eagle")
        chain = chains.generate(prompt, max_new_tokens=24, policy="eagle")
        assert eagle.decision == chain.decision == "eagle" and eagle.text == plain.text == chain.text
        assert eagle.stats.drafted > 0 and chain.stats.drafted > 0
        assert eagle.drafter_info["tree"] == asdict(DEFAULT_TREE) and "tree" not in chain.drafter_info
    # the head's length fixed, its copies' too: as long as the lookup's calibrated acceptance pays for
    g, most = rt.profile.global_set, rt.max_draft_len
    copy = best_draft_length(g.priors.lookup.acceptance, g.priors.lookup.draft_cost, g.verify_table(most), most)[0]
    assert g.copy_length(most) == copy and eagle.draft_policy.endswith(f", copies {copy}")
    # with bandits: the copies learn in a posterior of their own, from the lookup's prior
    bandits = AdaptiveRuntime(rt.profile, rt.lm, online=False, seed=0)
    prompt = "one two three one two three one two three one two"
    r_text = bandits.generate(prompt, max_new_tokens=24, policy="eagle").text
    assert r_text == rt.generate(prompt, max_new_tokens=24, policy="ar").text
    (key, bandit), = bandits._live_bandits().items()
    prior = beta_prior(rt.profile.global_set.priors.lookup.acceptance)
    assert key.startswith("eagle:") and bandit.copies is not None and bandit.copies.prior == prior
    state = bandit.state()  # every step chose a copy length too (the tiny profile's lookup prior: rarely kept)
    assert sum(state["copies"]["chosen"].values()) == sum(state["chosen"].values()) > 0


def test_the_race_adds_the_head_to_each_domain_and_a_decision_for_it_decodes_losslessly(lm, prof, cpu_step_graphs):
    r = distill_head(lm, prof, TINY_DOMAINS, HeadConfig(**FAST), progress=False)
    profile = load_profile(prof)
    for d in [*profile.domains.values(), profile.global_set]:
        eagle = [m for m in d.measurements if m.role == "eagle"]
        assert len(eagle) == 1 and eagle[0].drafter == "eagle" and eagle[0].draft_len >= 1
        assert d.decision == decide({m.role: m for m in d.measurements if m.role in ROLES},
                                    profile.settings.acceptance_floor)
    # a domain decided for the head: knn-ssd drafts with it, and decodes what plain decoding does
    profile.domains["math"] = replace(profile.domains["math"], decision=Decision("eagle", 3, 1.5))
    save_profile(profile, prof)
    rt = AdaptiveRuntime.from_profile(prof, dtype="float32", online=False, bandit=False)
    prompt = TINY_DOMAINS["math"][0]
    routed, plain = rt.generate(prompt, max_new_tokens=24), rt.generate(prompt, max_new_tokens=24, policy="ar")
    if routed.domain == "math":  # the tiny index routes its own calibration prompt home
        assert routed.decision == "eagle" and routed.stats.drafted > 0
    assert routed.text == plain.text
    assert r.record.kind == "eagle"
    # a runtime whose steps replay CUDA graphs (stood in for on the CPU: each capture a step run when replayed)
    # keeps the feature rows in its slots, drafts with the head where a domain decided it, and decodes plainly's text
    rt2 = AdaptiveRuntime.from_profile(prof, dtype="float32", online=False, bandit=False)
    bb = cpu_step_graphs(rt2.lm.model)
    rt2.lm.__dict__["backbone"] = bb
    rt3 = AdaptiveRuntime(rt2.profile, rt2.lm, online=False, bandit=False)
    assert rt3.features == tuple(r.record.shape["layers"])
    assert rt3.warm() > 0  # the slot with feature rows among what a server warms, and the head's own levels
    captured = bb.graphs.captures
    again = rt3.generate(prompt, max_new_tokens=24)
    if again.domain == "math":
        assert again.decision == "eagle" and again.stats.drafted > 0
    assert again.text == plain.text
    forced = rt3.generate(prompt, max_new_tokens=24, policy="eagle")
    assert forced.text == plain.text and forced.stats.drafted > 0
    assert any(key[-1] == rt3.features for key in bb.graphs._graphs) and bb.graphs.replays > 0
    assert bb.graphs.captures == captured  # nothing captured inside the requests
    assert sum(levels.replays for levels in bb.graphs.attached["eagle"].values()) > 0  # the head's levels replayed
    # a refined head replacing another: the replaced one's captured levels are dropped with it
    rec, weights = rt3.profile.distilled_drafter("eagle")
    first, second = (EagleHead.from_state(HeadShape.from_dict(rec.shape), weights) for _ in range(2))
    rt3.set_eagle_head("math", first)
    assert rt3.generate(prompt, max_new_tokens=24, policy="eagle").text == plain.text
    warm_head(first, bb, rt3.tree)
    with_first = bb.graphs.captures
    rt3.set_eagle_head("math", second)
    steps = first.built_steps()
    assert steps and bb.graphs.captures < with_first
    assert not any(levels.step in steps for levels in bb.graphs.attached["eagle"].values())


def test_a_head_stores_its_rows_in_bf16_only_where_that_holds_them_exactly():
    shape = HeadShape(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=(1, 2), eps=1e-6,
                      rope_theta=1e4, lookup=3)
    rows = torch.randn(5, 8)
    exact = EagleHead(shape, torch.arange(5), rows.to(torch.bfloat16).float(), torch.ones(8))  # a bf16 target's
    state = exact.state()
    assert state["lm"].dtype == torch.bfloat16
    back = EagleHead.from_state(shape, state)
    assert back.lm.dtype == torch.float32 and torch.equal(back.lm, exact.lm)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), exact.state_dict().values()))
    fine = EagleHead(shape, torch.arange(5), rows, torch.ones(8))  # float32 rows bf16 would round: kept as they are
    assert fine.state()["lm"].dtype == torch.float32
    assert torch.equal(EagleHead.from_state(shape, fine.state()).lm, rows)
