"""``adaptive distill`` end to end on the tiny model, then the trained drafter through generate and bench."""

import json
import re
import shutil

import pytest

from tests.conftest import TINY_DOMAINS
from tests.helpers.cli import run, run_ok


@pytest.fixture
def files(tmp_path):
    out = []
    for name, prompts in TINY_DOMAINS.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        out.append(f)
    return out


def test_distill_then_generate_and_bench(capsys, tiny_model_dir, tiny_profile, files, data_file, tmp_path):  # noqa: F811
    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    png = tmp_path / "curve.png"
    out, err = run_ok(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(prof), "--drafter",
                      "early-exit", "--exit-layer", "2",
                      "--data", str(files[0]), "--data", f"chat={files[1]}", "--data", str(files[2]),
                      "--divergence", "tvd", "--data-source", "teacher", "--steps", "12", "--eval-every", "6",
                      "--new-tokens", "8", "--lr", "3e-3", "--plot", str(png), "--dtype", "float32", "--json")
    obj = json.loads(out)
    assert obj["kind"] == "early-exit" and obj["exit_layer"] == 2 and obj["domains"] == ["chat", "code", "math"]
    assert obj["config"]["divergence"] == "tvd" and obj["after"]["step"] == 12
    assert png.read_bytes()[:4] == b"\x89PNG" and obj["plot"] == str(png)
    shown, _ = run_ok(capsys, "profile", "show", str(prof), "--json")
    assert "early-exit" in json.loads(shown)["distilled"]
    text, _ = run_ok(capsys, "profile", "show", str(prof))
    assert "distilled early-exit (exit after layer 2; tvd, teacher, 12 steps)" in text

    gen = ["generate", "what is 2 plus 5? answer:", "--model", str(tiny_model_dir), "--profile", str(prof),
           "--max-new-tokens", "12", "--dtype", "float32", "--json"]
    ee, _ = run_ok(capsys, *gen, "--policy", "early-exit")
    ar, _ = run_ok(capsys, "decode", *gen[1:4], "--drafter", "ar", *gen[6:])
    assert json.loads(ee)["token_ids"] == json.loads(ar)["token_ids"]
    assert json.loads(ee)["decision"] == "early-exit"

    report = tmp_path / "report.json"
    run_ok(capsys, "bench", "--data", str(data_file), "--profile", str(prof), "--model", str(tiny_model_dir),
           "--methods", "ar,early-exit,early-exit-fixed", "--max-new-tokens", "10", "--dtype", "float32",
           "--out", str(report), "--quiet")
    res = json.loads(report.read_text())["results"]
    assert res["early-exit"]["identical_to_ar"] and res["early-exit-fixed"]["identical_to_ar"]
    assert res["early-exit-fixed"]["acceptance_rate"] > 0


def test_distill_human_output_and_resume_message(capsys, tiny_model_dir, tiny_profile, files, tmp_path):
    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    data = [x for f in files for x in ("--data", str(f))]
    out, err = run_ok(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(prof), "--steps", "3",
                      "--drafter", "early-exit", "--new-tokens", "6", "--dtype", "float32", "--quiet", *data)
    assert "held-out greedy agreement" in out and "stored in" in out
    assert (tmp_path / "prof.early-exit-distill.png").exists()
    (tmp_path / "prof.distill-early-exit.work").mkdir()
    (tmp_path / "prof.distill-early-exit.work" / "state.json").write_text("{}")
    code, _, err = run(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(prof), "--steps", "3",
                       "--drafter", "early-exit", "--dtype", "float32", "--quiet", *data)
    assert code == 1 and "pass --resume" in err.strip().splitlines()[-1]


def test_distill_an_eagle_head_then_generate_show_and_bench(capsys, tiny_model_dir, tiny_profile, files, data_file,
                                                           tmp_path):  # noqa: F811
    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    data = [x for f in files for x in ("--data", str(f))]
    out, _ = run_ok(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(prof), "--drafter", "eagle",
                    "--layers", "1,2,4", "--steps", "20", "--new-tokens", "12", "--vocab", "32", "--batch-size", "2",
                    "--head-width", "24", "--dtype", "float32", "--json", *data)
    obj = json.loads(out)
    assert obj["kind"] == "eagle" and obj["shape"]["layers"] == [1, 2, 4] and obj["vocab"] == 32
    assert obj["shape"]["intermediate"] == 24  # a head narrower than the target's MLP, decoded below
    assert len(obj["positions"]) == 3 and obj["domains"] == ["chat", "code", "math"]
    low, high = obj["interval"]["low"], obj["interval"]["high"]  # the first draft's interval over the held-out answers
    assert low <= obj["acceptance"] <= high and set(obj["domain_intervals"]) == set(obj["by_domain"])
    text, _ = run_ok(capsys, "profile", "show", str(prof))
    assert "distilled eagle (features after layers 1,2,4; 32 rows" in text
    assert f"-> {obj['acceptance']:.3f} [{low:.3f}, {high:.3f}], drafts 1..s kept" in text
    gen = ["generate", "what is 2 plus 5? answer:", "--model", str(tiny_model_dir), "--profile", str(prof),
           "--max-new-tokens", "12", "--dtype", "float32", "--json"]
    eagle, _ = run_ok(capsys, *gen, "--policy", "eagle")
    ar, _ = run_ok(capsys, *gen, "--policy", "ar")
    assert json.loads(eagle)["decision"] == "eagle"
    assert json.loads(eagle)["token_ids"] == json.loads(ar)["token_ids"]
    report = tmp_path / "report.json"
    run_ok(capsys, "bench", "--data", str(data_file), "--profile", str(prof), "--model", str(tiny_model_dir),
           "--methods", "ar,eagle,eagle-fixed", "--max-new-tokens", "10", "--dtype", "float32", "--out", str(report),
           "--quiet")
    res = json.loads(report.read_text())["results"]
    assert res["eagle"]["identical_to_ar"] and res["eagle-fixed"]["identical_to_ar"]
    assert res["eagle-fixed"]["position_acceptance"]  # drafted, and its acceptance by position reported
    code, _, err = run(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(prof), "--drafter", "eagle",
                       "--layers", "1,2", "--steps", "2", "--dtype", "float32", "--quiet", *data)
    assert code != 0 and "top one" in err


def test_a_head_trained_on_a_busy_machine_is_said(monkeypatch):
    """Other work slows the head's steps (a minutes budget buys fewer) and its race: `adaptive distill
    --drafter eagle` and `calibrate --heads` say so in one warning, and not on an idle machine."""
    import warnings

    import adaptive.cli.distill as cli_distill

    class Watch:
        def __init__(self, share):
            self.others_share = share

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(cli_distill, "distill_head", lambda *a, **k: "result")
    for share, said in ((0.45, True), (0.05, False), (None, False)):
        monkeypatch.setattr(cli_distill, "CpuWatch", lambda share=share: Watch(share))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_distill.train_head_watched(None, "p", {}, None) == "result"
        texts = [str(w.message) for w in caught]
        assert bool(texts) == said, (share, texts)
        if said:
            assert texts == ["other work used 45% of this machine's CPU while the eagle head's training and race was "
                             "timed: its timings read slow (and the engine choice and decisions they price with "
                             "them); time it again on an idle machine"]


def test_distill_on_a_two_engine_profile_trains_into_its_torch_member(capsys, tiny_model_dir, tiny_profile, files,
                                                                      tmp_path):
    """`adaptive calibrate`'s default profile has two members; a drafter is trained through the torch engine's
    layers and drafts there, so `distill` on the pair trains into that member (and says so); a pair without a
    torch member is refused in one line."""
    from adaptive.profile import EngineSet, write_engines

    two = tmp_path / "two"
    for member in ("llama.cpp", "torch"):  # the members' contents: distill reads the torch one alone
        shutil.copytree(tiny_profile, two / member)
    write_engines(two, EngineSet(("llama.cpp", "torch"), "llama.cpp"))
    data = [x for f in files for x in ("--data", str(f))]
    out, err = run_ok(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(two), "--drafter", "eagle",
                      "--layers", "1,2,4", "--steps", "2", "--new-tokens", "6", "--vocab", "32", "--batch-size", "2",
                      "--dtype", "float32", "--no-race", "--quiet", *data)
    assert f"training into its torch member, {two / 'torch'}" in err and str(two / "torch") in out
    assert re.search(r"held-out first draft kept  [0-9.]+ -> [0-9.]+ \[[0-9.]+, [0-9.]+\] \(90% interval over \d+ "
                     r"held-out answers\)", out), out
    shown, _ = run_ok(capsys, "profile", "show", str(two / "torch"), "--json")
    assert "eagle" in json.loads(shown)["distilled"]
    shown, _ = run_ok(capsys, "profile", "show", str(two / "llama.cpp"), "--json")
    assert "eagle" not in json.loads(shown).get("distilled", {})
    text, _ = run_ok(capsys, "profile", "show", str(two))  # the pair shows its default member, and where the head is
    assert "showing llama.cpp (--engine torch for the other); its torch member holds distilled eagle" in text
    shown, _ = run_ok(capsys, "profile", "show", str(two), "--json")
    assert json.loads(shown)["engines"]["distilled"] == {"llama.cpp": [], "torch": ["eagle"]}
    code, _, err = run(capsys, "bench", "--data", str(files[0]), "--profile", str(two), "--methods", "ar,eagle",
                       "--quiet")  # the pair loads its llama.cpp member, which has no head
    assert code == 2 and "bench it with --engine torch" in err
    write_engines(two, EngineSet(("llama.cpp", "vllm"), "llama.cpp"))
    code, _, err = run(capsys, "distill", "--model", str(tiny_model_dir), "--profile", str(two), "--drafter", "eagle",
                       "--steps", "2", "--dtype", "float32", "--quiet", *data)
    assert code == 1 and "not on torch" in err.strip().splitlines()[-1]
