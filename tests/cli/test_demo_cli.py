"""``adaptive demo`` with a ready profile (the calibration half is covered by the calibrate tests)."""

import json
import shutil

from tests.helpers.cli import run, run_ok


def test_demo_reuses_a_profile_routes_and_reports_speedup(capsys, tiny_model_dir, tiny_profile, tmp_path):
    prof = tmp_path / "p"
    shutil.copytree(tiny_profile, prof)
    out, err = run_ok(capsys, "demo", "--model", str(tiny_model_dir), "--profile", str(prof), "--dtype", "float32",
                      "--max-new-tokens", "8", "--repeats", "1", "--head-minutes", "0", "--json")
    assert "reusing the profile" in err
    data = json.loads(out)
    assert data["route"]["applied"] in ("math", "chat", "code", "global")
    assert set(data["speedup"]) >= {"routed"} and data["speedup"]["routed"] > 0
    assert all(data["identical"].values())  # fp32: token for token
    assert data["lossless_violations"] == 0 and "head" not in data
    text, _ = run_ok(capsys, "demo", "--model", str(tiny_model_dir), "--profile", str(prof), "--dtype", "float32",
                     "--max-new-tokens", "8", "--repeats", "1", "--head-minutes", "0")
    assert "speedup" in text and "routed to" in text and "casc.x [90%]" in text


def test_the_demo_trains_a_head_once_and_decodes_with_it_as_plain_decoding_does(tiny_model_dir, tiny_profile, tmp_path):
    from adaptive.cli import demo
    from adaptive.distill.heads import HeadConfig
    from tests.conftest import TINY_DOMAINS

    prof = tmp_path / "p"
    shutil.copytree(tiny_profile, prof)
    cfg = HeadConfig(layers=(1, 2, 4), steps=10, new_tokens=8, vocab=32, batch=2, window=32, warmup=2, held_out=0.25)
    prompt = TINY_DOMAINS["math"][-1]
    h = demo.head_demo(prof, str(tiny_model_dir), "cpu", cfg, TINY_DOMAINS, prompt, 8, 1, quiet=True)
    assert h["trained_now"] and h["before"] is not None and set(h["decisions"]) == set(h["before"])
    assert 0 <= h["acceptance"] <= 1 and h["tau"] >= 1 and 0 < h["draft_cost"] < 1
    assert set(h["tokens_per_s"]) == {"ar", "eagle", "routed"} and h["tokens_per_forward"]["eagle"] >= 1
    assert h["audit"]["violation"] == 0 and all(a["identical"] for a in h["audits"].values())  # fp32
    text = demo.head_text(h)
    assert "an eagle head on the torch engine" in text and "this run" in text and "identical to ar" in text
    assert "held-out first draft kept {:.2f} [{:.2f}, {:.2f}], tau".format(h["acceptance"], *h["interval"]) in text
    again = demo.head_demo(prof, str(tiny_model_dir), "cpu", cfg, TINY_DOMAINS, prompt, 8, 1, quiet=True)
    assert not again["trained_now"] and again["acceptance"] == h["acceptance"]  # kept in the profile
    assert "kept in the profile" in demo.head_text(again)


def test_demo_refuses_a_profile_of_another_model(capsys, tiny_profile, tmp_path):
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp_path / "m"
    tiny_model("llama", seed=9).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    code, _, err = run(capsys, "demo", "--model", str(other), "--profile", str(tiny_profile), "--dtype", "float32")
    assert code == 1 and "calibrated for" in err and "--recalibrate" in err


def test_demo_shows_where_a_short_and_a_long_prompt_ran_on_a_two_engine_profile(two_engine_profile, monkeypatch):
    from adaptive.cli import demo
    from adaptive.profile import load_profile
    from adaptive.runtime import AdaptiveRuntime

    out, lms = two_engine_profile
    monkeypatch.setattr(demo, "load", lambda *a, **kw: lms["torch"])  # the tiny model is built in-process
    primary = AdaptiveRuntime(load_profile(out), lms["llama.cpp"], online=False)
    rows = demo.engine_choices(out, primary, "tiny", "cpu", max_new_tokens=8, repeats=1)
    assert [r["prompt"] for r in rows] == ["short", "long"] and rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]
    for r in rows:
        assert r["engine"] in ("llama.cpp", "torch") and r["reason"].startswith("expected ")
        assert {e["engine"] for e in r["estimates"]} == {"llama.cpp", "torch"}
        assert set(r["plain_s"]) == {"llama.cpp", "torch"} and r["measured_s"] > 0
        assert r["identical"] and r["audit"]["identical"] and not r["audit"]["violation"]  # fp32: plain decoding's


def test_audit_text_names_where_an_output_parts_and_why():
    from adaptive.cli.demo import _audit_text
    from adaptive.engine.audit import AuditResult

    assert _audit_text(AuditResult(True).to_dict(), "ar") == "identical to ar"
    tie = AuditResult(False, 17, 5, 9, 0.125, 0.75).to_dict()
    assert _audit_text(tie, "plain decoding there") == (
        "parts from plain decoding there at token 17, margin 0.125: a near-tie within the engine's rounding")
    assert _audit_text(AuditResult(False, 3, 5, 9, 2.5, 0.75).to_dict(), "ar").endswith(
        "margin 2.500: LOSSLESS VIOLATION")
    assert _audit_text(AuditResult(False, 4, None, None, float("inf"), 0.75).to_dict(), "ar") == (
        "parts from ar at token 4: LOSSLESS VIOLATION")  # one output stopped early
