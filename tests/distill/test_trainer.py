"""Distillation on tiny models: acceptance rises, the result round-trips through the profile, an
interrupted run resumes to the same weights, and the trained drafters decode losslessly."""

import json
import shutil

import pytest
import torch

from adaptive.distill.trainer import DistillConfig, DistillError, distill, split_prompts
from adaptive.errors import ConfigError
from adaptive.models import load_model
from adaptive.profile import ProfileError, load_profile
from tests.conftest import TINY_DOMAINS, char_tokenizer, tiny_model

FAST = dict(steps=40, new_tokens=12, eval_every=20, checkpoint_every=10, exit_layer=2, lr=3e-3, refresh_every=20)


def test_split_prompts_holds_out_the_last_quarter_of_each_domain():
    train, held = split_prompts({"a": [[1]] * 4, "b": [[2]] * 8}, per_domain=8, held_out=0.25)
    assert [n for n, _ in train] == ["a"] * 3 + ["b"] * 6
    assert [n for n, _ in held] == ["a"] + ["b"] * 2
    with pytest.raises(ConfigError, match="at least 2"):
        split_prompts({"a": [[1]]}, per_domain=8, held_out=0.25)


@pytest.mark.parametrize("source", ["teacher", "on-policy"])
def test_training_raises_held_out_acceptance(lm, prof, source):
    r = distill(lm, prof, TINY_DOMAINS, DistillConfig(**{**FAST, "data_source": source, "steps": 60}), progress=False)
    b, a = r.record.before, r.record.after
    # measured (seed 0): greedy 0.25 -> ~0.4, sampling 0.56 -> ~0.68; margins well inside those gains
    assert a["greedy"] >= b["greedy"] + 0.08, (b, a)
    assert a["sampling"] >= b["sampling"] + 0.05, (b, a)
    assert a["loss"] < 0.8 * b["loss"]
    assert r.plot is not None and r.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (prof.parent / "prof.distill-early-exit.work").exists()


@pytest.mark.parametrize("div", ["rkl", "jsd", "tvd"])
def test_every_divergence_trains(lm, prof, div):
    r = distill(lm, prof, TINY_DOMAINS, DistillConfig(**{**FAST, "divergence": div, "data_source": "teacher"}),
                progress=False)
    assert r.record.after["loss"] < r.record.before["loss"]


@pytest.mark.parametrize("source", ["fixed", "mixed"])
def test_other_data_sources(lm, prof, source):
    r = distill(lm, prof, TINY_DOMAINS, DistillConfig(**{**FAST, "data_source": source}), progress=False)
    assert r.record.config["data_source"] == source and r.record.train_positions > 0
    assert r.record.after["loss"] < r.record.before["loss"]


def test_profile_round_trip(lm, prof):
    from adaptive.drafters.early_exit import ExitBlock

    r = distill(lm, prof, TINY_DOMAINS, DistillConfig(**FAST, data_source="teacher"), progress=False)
    p = load_profile(prof)
    rec, weights = p.distilled_drafter("early-exit")
    assert rec.exit_layer == 2 and rec.model.weights_hash == lm.fingerprint().weights_hash
    assert rec.after == r.record.after and 0 < rec.draft_cost < 2
    assert rec.acceptance == r.record.after["greedy"] and rec.kind == "early-exit"
    assert rec == r.record  # the typed record round-trips through the profile
    assert r.to_dict()["after"] == r.record.after and "history" not in r.to_dict()
    block = ExitBlock.from_state(rec.block, weights)
    assert float(block.down.weight.abs().sum()) > 0  # trained, not the zero-initialised identity
    h = torch.randn(3, block.hidden)
    assert torch.equal(block(h), ExitBlock.from_state(rec.block, weights)(h))
    # the rest of the profile is intact, and saving it again keeps the drafter
    assert set(p.domains) == set(TINY_DOMAINS)
    from adaptive.profile import save_profile

    save_profile(p, prof)
    assert torch.equal(load_profile(prof).distilled_weights["early-exit"]["down.weight"], weights["down.weight"])


def test_damaged_distilled_file_is_reported(lm, prof):
    distill(lm, prof, TINY_DOMAINS, DistillConfig(**{**FAST, "steps": 2}), progress=False)
    f = prof / "distilled.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ProfileError, match="checksum"):
        load_profile(prof)
    f.unlink()
    with pytest.raises(ProfileError, match="distilled.safetensors: missing"):
        load_profile(prof)


class Stop(Exception):
    pass


def test_interrupted_run_resumes_to_the_same_weights(lm, prof, tmp_path):
    cfg = DistillConfig(**{**FAST, "data_source": "on-policy", "steps": 24, "checkpoint_every": 5,
                           "refresh_every": 8, "eval_every": 6})
    other = tmp_path / "uninterrupted"
    shutil.copytree(prof, other)
    ref = distill(lm, other, TINY_DOMAINS, cfg, progress=False)

    def kill_at_13(step):
        if step == 13:
            raise Stop

    with pytest.raises(Stop):
        distill(lm, prof, TINY_DOMAINS, cfg, progress=False, on_step=kill_at_13)
    work = prof.parent / "prof.distill-early-exit.work"
    assert (work / "checkpoint.pt").exists()
    assert "distilled" not in json.loads((prof / "profile.json").read_text())  # nothing half-written
    with pytest.raises(DistillError, match="--resume"):
        distill(lm, prof, TINY_DOMAINS, cfg, progress=False)
    with pytest.raises(DistillError, match="different config"):
        distill(lm, prof, TINY_DOMAINS, DistillConfig(**{**cfg.to_dict(), "lr": 1e-2}), progress=False, resume=True)
    logs = []
    got = distill(lm, prof, TINY_DOMAINS, cfg, progress=False, resume=True, log=logs.append)
    assert any("resuming from step 10" in m for m in logs)  # the last checkpoint before the kill
    w1 = load_profile(prof).distilled_weights["early-exit"]
    w2 = load_profile(other).distilled_weights["early-exit"]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert got.record.after == ref.record.after
    assert not work.exists()


def test_a_profile_for_another_model_is_refused(prof, tmp_path):
    other = tmp_path / "other"
    tiny_model("llama", seed=11).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    with pytest.raises(ProfileError, match="calibrated for"):
        distill(load_model(str(other), dtype="float32"), prof, TINY_DOMAINS, DistillConfig(**FAST), progress=False)


def test_a_prompt_too_long_for_the_context_is_refused_before_anything_is_written(lm, prof):
    from adaptive.errors import PromptTooLongError

    domains = {**TINY_DOMAINS, "long": ["a" * 600, "b", "c"]}
    with pytest.raises(PromptTooLongError, match="domain 'long', prompt 1: .* distillation needs 13 more"):
        distill(lm, prof, domains, DistillConfig(**FAST), progress=False)
    assert not (prof.parent / "prof.distill-early-exit.work").exists()


def test_config_validation():
    for bad in (dict(divergence="kl"), dict(data_source="web"), dict(jsd_beta=0.0), dict(steps=-1),
                dict(lr=0.0), dict(batch_size=0), dict(exit_layer=0)):
        with pytest.raises(ConfigError):
            DistillConfig(**bad)
