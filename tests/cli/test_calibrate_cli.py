"""``adaptive calibrate``, ``profile show`` and ``route`` end to end on the tiny model."""

import json

import pytest

from adaptive.profile import DECISIONS, SCHEMA_VERSION
from tests.conftest import TINY_DOMAINS
from tests.helpers.cli import run, run_ok

SMALL = ["--prompts-per-domain", "3", "--anchors-per-domain", "2", "--trials", "3", "--dtype", "float32", "--quiet"]


@pytest.fixture
def domain_files(tmp_path):
    args = []
    for name, prompts in TINY_DOMAINS.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"prompt": p, "category": name}) + "\n" for p in prompts))
        args += ["--domains", f"{name}={f}"]
    return args


def test_calibrate_then_show_then_route(capsys, tiny_model_dir, domain_files, tmp_path):
    out_dir = tmp_path / "prof"
    out, err = run_ok(capsys, "calibrate", "--model", str(tiny_model_dir), *domain_files, "--out", str(out_dir),
                      "--quick", *SMALL, "--vocab-sizes", "16,32")
    assert "profile written to" in out
    assert "vocab" in out and "casc.x" in out
    for name in TINY_DOMAINS:
        assert name in out
    assert "global" in out and "casc.x [90%]" in out and "bound" in out

    shown, _ = run_ok(capsys, "profile", "show", str(out_dir), "--json")
    data = json.loads(shown)
    assert data["schema_version"] == SCHEMA_VERSION and sorted(data["domains"]) == sorted(TINY_DOMAINS)
    assert data["settings"]["trials"] == 3 and data["settings"]["vocab_sizes"] == [16, 32]
    text, _ = run_ok(capsys, "profile", "show", str(out_dir))
    assert "skip sets:" in text and "anchors" in text and f"schema {SCHEMA_VERSION}" in text
    assert "embedded by the last position after 1 of 4 layers" in text  # a third of the tiny model's 4 layers

    # --data with --json: one object per line with the domain and the input's category
    data_file = tmp_path / "mixed.jsonl"
    rows = [{"prompt": TINY_DOMAINS[n][-1], "category": n} for n in TINY_DOMAINS]
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    routed, _ = run_ok(capsys, "route", "--profile", str(out_dir), "--model", str(tiny_model_dir), "--data",
                       str(data_file), "--json", "--dtype", "float32")
    lines = [json.loads(x) for x in routed.strip().splitlines()]
    assert len(lines) == 3
    for line, row in zip(lines, rows):
        assert line["category"] == row["category"]
        assert "domain" in line and line["neighbours"] and line["decision"] in DECISIONS
        assert line["domain"] in (*TINY_DOMAINS, None)
    one, _ = run_ok(capsys, "route", "--profile", str(out_dir), "--model", str(tiny_model_dir), "hello friend",
                    "--dtype", "float32")
    assert "nearest:" in one and "decode with" in one


def test_calibrate_json(capsys, tiny_model_dir, domain_files, tmp_path):
    out, _ = run_ok(capsys, "calibrate", "--model", str(tiny_model_dir), *domain_files, "--out",
                    str(tmp_path / "p"), *SMALL, "--json")
    data = json.loads(out)
    assert data["profile"] == str(tmp_path / "p") and "global" in data and data["routing"]["anchors"] == 6


@pytest.mark.parametrize("extra, message", [
    (["--domains", "x=/nonexistent/file.jsonl"], "no such file"),
    (["--domains", "x"], "NAME=PATH"),
    (["--jobs", "0"], "jobs"),
    (["--trials", "0"], "trials"),
    (["--prompts-per-domain", "1"], "prompts-per-domain"),
    (["--scheduler", "tcp://h:1"], "--scheduler"),
    (["--vocab-sizes", "4k"], "--vocab-sizes"),
    (["--vocab-sizes", "8"], "vocab-sizes must be distinct integers >= 16"),
])
def test_calibrate_errors_are_one_line(capsys, tiny_model_dir, tmp_path, extra, message):
    code, _, err = run(capsys, "calibrate", "--model", str(tiny_model_dir), "--out", str(tmp_path / "p"),
                       "--quiet", *extra)
    assert code != 0 and message in err and "Traceback" not in err
    assert not (tmp_path / "p").exists()


def test_malformed_prompt_file_names_file_and_line(capsys, tiny_model_dir, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": broken\n')
    code, _, err = run(capsys, "calibrate", "--model", str(tiny_model_dir), "--domains", f"a={f}",
                       "--out", str(tmp_path / "p"))
    assert code == 1 and f"{f}:2" in err and "malformed JSON" in err


def test_route_errors(capsys, tiny_profile, tmp_path):
    code, _, err = run(capsys, "route", "--profile", str(tmp_path / "none"), "x")
    assert code == 1 and "no such profile" in err
    code, _, err = run(capsys, "route", "--profile", str(tiny_profile))
    assert code != 0 and "PROMPT or --data" in err
    code, _, err = run(capsys, "profile", "show", str(tmp_path))
    assert code == 1 and "profile.json: missing" in err


def test_route_refuses_a_profile_of_another_model(capsys, tiny_profile, tmp_path):
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp_path / "other-model"
    tiny_model("llama", seed=5).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    code, _, err = run(capsys, "route", "--profile", str(tiny_profile), "--model", str(other), "hi",
                       "--dtype", "float32")
    assert code == 1 and "calibrated for" in err


def test_profile_show_and_reset_online(capsys, tiny_profile, tiny_model_dir, tmp_path):
    """What serving learned is shown beside the profile, `generate` uses it without saving, and
    `reset-online` removes it; a damaged overlay is a one-line error."""
    import shutil

    from adaptive.models import load_model
    from adaptive.profile.overlay import overlay_path, replica_path
    from adaptive.runtime import AdaptiveRuntime, OnlineSettings

    prof = tmp_path / "prof"
    shutil.copytree(tiny_profile, prof)
    text, _ = run_ok(capsys, "profile", "show", str(prof))
    assert f"nothing learned yet (no overlay at {prof}.online or in {prof}.online.d)" in text
    model = load_model(str(tiny_model_dir), dtype="float32")
    for replica in ("web-1", "web-2"):  # two replicas over one profile: each its own file, shown merged
        rt = AdaptiveRuntime.from_profile(prof, model=model, online=OnlineSettings(replica=replica))
        rt.generate(TINY_DOMAINS["code"][0], max_new_tokens=8)
        rt.close()
    own = replica_path(overlay_path(prof), "web-1")
    before = own.read_bytes()
    text, _ = run_ok(capsys, "profile", "show", str(prof))
    assert "online  2 replica(s) merged" in text and "2 requests learned from" in text
    assert "replica web-1: 1 requests, generation 1" in text and "replica web-2: 1 requests" in text
    assert "accepted tokens" in text
    data = json.loads(run_ok(capsys, "profile", "show", str(prof), "--json")[0])
    assert data["online"]["requests"] == 2 and data["online"]["stale"] == []
    assert set(data["online"]["replicas"]) == {"web-1", "web-2"}
    # heads a server refined on its traffic (adaptive.distill.refine): listed, another calibration's as stale
    import torch
    from safetensors.torch import save_file

    from adaptive.distill.refine import REFINED_FORMAT, REFINED_VERSION, head_file
    from adaptive.profile.overlay import profile_digest

    for replica, digest in (("web-1", profile_digest(prof)), ("web-2", "0" * 64)):
        save_file({"x": torch.zeros(1)}, str(head_file(own.parent, replica, "code")),
                  metadata={"format": REFINED_FORMAT, "version": REFINED_VERSION, "profile": digest, "domain": "code",
                            "before": "0.3100", "after": "0.3600", "rounds": "2", "created": "2026-11-29T07:00:00"})
    (own.parent / "web-3.head-math.safetensors").write_bytes(b"garbage")
    text, _ = run_ok(capsys, "profile", "show", str(prof))
    assert "refined head of code (replica web-1, round 2, 2026-11-29T07:00:00): held-out first draft kept 0.310 " \
           "-> 0.360\n" in text
    assert "refined head of code (replica web-2, round 2, 2026-11-29T07:00:00): held-out first draft kept 0.310 " \
           "-> 0.360 (STALE" in text
    assert "refined head web-3.head-math.safetensors: unreadable" in text
    heads = json.loads(run_ok(capsys, "profile", "show", str(prof), "--json")[0])["refined_heads"]
    assert [(h.get("replica"), h.get("stale")) for h in heads] == [("web-1", False), ("web-2", True), (None, None)]
    out, _ = run_ok(capsys, "generate", "hello", "--profile", str(prof), "--model", str(tiny_model_dir),
                    "--dtype", "float32", "--max-new-tokens", "4", "--json")
    assert "online" in json.loads(out)
    assert own.read_bytes() == before and len(list(own.parent.glob("*.online"))) == 2  # generate saves nothing
    _, err = run_ok(capsys, "profile", "reset-online", str(prof))
    assert f"removed {prof}.online" in err and not own.parent.exists()
    _, err = run_ok(capsys, "profile", "reset-online", str(prof))
    assert "nothing to remove" in err
    overlay_path(prof).write_bytes(before[:-5])  # a damaged file of an earlier version: said, in one line
    code, _, err = run(capsys, "profile", "show", str(prof))
    assert code == 1 and "does not match its checksum" in err and "Traceback" not in err
    assert (prof / "profile.json").is_file()  # the profile itself is untouched


def test_profile_show_says_costs_timed_on_a_busy_machine(capsys, tiny_profile, tmp_path):
    import dataclasses

    from adaptive.profile import load_profile, save_profile

    p = load_profile(tiny_profile)
    text, _ = run_ok(capsys, "profile", "show", str(tiny_profile))
    assert "timed while other work used" not in text  # not measured (a cost model given to calibration)
    busy = dataclasses.replace(p, cost_model=dataclasses.replace(p.cost_model, others_share=0.45))
    save_profile(busy, tmp_path / "busy")
    text, _ = run_ok(capsys, "profile", "show", str(tmp_path / "busy"))
    assert "timed while other work used 45% of the CPU (they read slow)" in text


def test_profile_show_names_a_two_engine_profiles_members(capsys, two_engine_profile):
    out_dir, _ = two_engine_profile
    text, _ = run_ok(capsys, "profile", "show", str(out_dir))
    assert "two-engine profile" in text and "showing llama.cpp (--engine torch for the other)" in text
    assert "prefill 32 tokens" in text and "a new token over the domains" in text
    text, _ = run_ok(capsys, "profile", "show", str(out_dir), "--engine", "torch")
    assert "showing torch" in text and "torch engine" in text
    data = json.loads(run_ok(capsys, "profile", "show", str(out_dir), "--json")[0])
    assert data["engines"]["engines"] == ["llama.cpp", "torch"] and data["cost_model"]["prefill"]
    code, _, err = run(capsys, "profile", "show", str(out_dir), "--engine", "vllm")
    assert code == 1 and "not on vllm" in err


def test_profile_show_finds_a_two_engine_servers_overlays_under_online_path(capsys, two_engine_profile, tmp_path):
    """With ``--online-path PATH`` a two-engine server keeps each member's learning in PATH.ENGINE:
    `profile show` and `reset-online` read and remove the member's file, not PATH itself."""
    from adaptive.profile import load_profile, member_online_path
    from adaptive.runtime import AdaptiveRuntime, OnlineSettings

    out_dir, lms = two_engine_profile
    learned = tmp_path / "learned"
    rt = AdaptiveRuntime(load_profile(out_dir, "torch"), lms["torch"],
                         online=OnlineSettings(path=member_online_path(learned, "torch")))
    rt.generate(TINY_DOMAINS["code"][0], max_new_tokens=8)
    rt.close()
    assert member_online_path(learned, "torch") == tmp_path / "learned.torch"
    assert (tmp_path / "learned.torch.d").is_dir() and not learned.exists()  # this replica's file in there
    text, _ = run_ok(capsys, "profile", "show", str(out_dir), "--engine", "torch", "--online-path", str(learned))
    assert "1 requests learned from" in text
    text, _ = run_ok(capsys, "profile", "show", str(out_dir), "--online-path", str(learned))  # the default member
    assert f"nothing learned yet (no overlay at {learned}.llama.cpp" in text
    _, err = run_ok(capsys, "profile", "reset-online", str(out_dir), "--engine", "torch", "--online-path", str(learned))
    assert f"{learned}.torch" in err and not (tmp_path / "learned.torch.d").exists()


def test_calibrate_with_heads_trains_and_races_an_eagle_head(capsys, tiny_model_dir, domain_files, tmp_path):
    out, err = run_ok(capsys, "calibrate", "--model", str(tiny_model_dir), *domain_files, "--out",
                      str(tmp_path / "p"), *SMALL, "--engine", "torch", "--heads", "--head-minutes", "0.02", "--json")
    data = json.loads(out)
    # the default feature layers of the 4-layer model: the middle and the top
    assert "eagle" in data["distilled"] and data["distilled"]["eagle"]["shape"]["layers"] == [2, 4]
    for d in [*data["domains"].values(), data["global"]]:  # raced in every domain
        assert any(m["role"] == "eagle" for m in d["measurements"])
    assert "eagle head: held-out first draft kept" in err
    code, _, err = run(capsys, "calibrate", "--model", str(tiny_model_dir), *domain_files, "--out",
                       str(tmp_path / "q"), *SMALL, "--engine", "llama.cpp", "--heads")
    assert code != 0 and "--heads" in err
