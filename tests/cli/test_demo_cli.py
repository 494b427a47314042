"""``adaptive demo`` with a ready profile (the calibration half is covered by the calibrate tests)."""

import json
import shutil

from tests.helpers.cli import run, run_ok


def test_demo_reuses_a_profile_routes_and_reports_speedup(capsys, tiny_model_dir, tiny_profile, tmp_path):
    prof = tmp_path / "p"
    shutil.copytree(tiny_profile, prof)
    out, err = run_ok(capsys, "demo", "--model", str(tiny_model_dir), "--profile", str(prof), "--dtype", "float32",
                      "--max-new-tokens", "8", "--repeats", "1", "--json")
    assert "reusing the profile" in err
    data = json.loads(out)
    assert data["route"]["applied"] in ("math", "chat", "code", "global")
    assert set(data["speedup"]) >= {"routed"} and data["speedup"]["routed"] > 0
    assert all(data["identical"].values())  # fp32: token for token
    assert data["lossless_violations"] == 0
    text, _ = run_ok(capsys, "demo", "--model", str(tiny_model_dir), "--profile", str(prof), "--dtype", "float32",
                     "--max-new-tokens", "8", "--repeats", "1")
    assert "speedup" in text and "routed to" in text and "casc.x [90%]" in text


def test_demo_refuses_a_profile_of_another_model(capsys, tiny_profile, tmp_path):
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp_path / "m"
    tiny_model("llama", seed=9).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    code, _, err = run(capsys, "demo", "--model", str(other), "--profile", str(tiny_profile), "--dtype", "float32")
    assert code == 1 and "calibrated for" in err and "--recalibrate" in err
