import json

import pytest

from adaptive.engine.skip import SkipSet
from adaptive.profile import DECISIONS
from tests.helpers.cli import run, run_ok


def test_decode_json(capsys, tiny_model_dir):
    out, _ = run_ok(capsys, "decode", "abc", "--model", str(tiny_model_dir), "--drafter", "ssd", "--skip-attn", "1-2",
                    "--max-new-tokens", "12", "--dtype", "float32", "--json")
    obj = json.loads(out)
    assert set(obj) >= {"text", "token_ids", "stats", "drafter"}
    assert obj["stats"]["steps"] >= 1 and 1 <= len(obj["token_ids"]) <= 12
    assert obj["stats"]["drafted"] >= 1  # ssd drafted
    ar, _ = run_ok(capsys, "decode", "abc", "--model", str(tiny_model_dir), "--drafter", "ar",
                   "--max-new-tokens", "12", "--dtype", "float32", "--json")
    assert json.loads(ar)["token_ids"] == obj["token_ids"]


def test_decode_with_quantized_weights(capsys, tiny_model_dir):
    runs = {}
    for drafter in ("ar", "pld"):
        out, _ = run_ok(capsys, "decode", "abcabcabc", "--model", str(tiny_model_dir), "--drafter", drafter,
                        "--weights", "int4", "--max-new-tokens", "12", "--dtype", "float32", "--json")
        runs[drafter] = json.loads(out)["token_ids"]
    assert runs["pld"] == runs["ar"]  # lossless against plain decoding with the same (int4) weights
    dense, _ = run_ok(capsys, "decode", "abcabcabc", "--model", str(tiny_model_dir), "--drafter", "ar",
                      "--max-new-tokens", "12", "--dtype", "float32", "--json")
    assert len(json.loads(dense)["token_ids"]) == len(runs["ar"])
    code, _, err = run(capsys, "decode", "abc", "--model", str(tiny_model_dir), "--weights", "int3")
    assert code != 0 and "int3" in err and "Traceback" not in err


def test_decode_stream_prints_text(capsys, tiny_model_dir):
    out, err = run_ok(capsys, "decode", "abc", "--model", str(tiny_model_dir), "--drafter", "ar", "--stream",
                      "--max-new-tokens", "10", "--dtype", "float32")
    assert "tok/s" in err and out.strip() != ""


@pytest.mark.parametrize("args, message", [
    (["--drafter", "ssd"], "skip set"),
    (["--drafter", "pld", "--skip-attn", "1"], "--skip-attn/--skip-mlp are for --drafter ssd or cascade"),
    (["--skip-attn", "1,x"], "cannot read"),
    (["--skip-attn", "40"], "has 4 layers"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--draft-len", "0"], "draft_len"),
])
def test_decode_errors_are_one_line(capsys, tiny_model_dir, args, message):
    code, out, err = run(capsys, "decode", "abc", "--model", str(tiny_model_dir), "--dtype", "float32", *args)
    assert code != 0
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


def test_decode_cascade(capsys, tiny_model_dir):
    ar, _ = run_ok(capsys, "decode", "ab ab ab ab", "--model", str(tiny_model_dir), "--drafter", "ar",
                   "--max-new-tokens", "12", "--dtype", "float32", "--json")
    for skip in ([], ["--skip-attn", "1"]):
        out, _ = run_ok(capsys, "decode", "ab ab ab ab", "--model", str(tiny_model_dir), "--drafter", "cascade",
                        *skip, "--max-new-tokens", "12", "--dtype", "float32", "--json")
        obj = json.loads(out)
        assert obj["token_ids"] == json.loads(ar)["token_ids"]
        assert obj["drafter"]["split"] == (1 if skip else 0)


def test_unknown_model_is_clear(capsys, tmp_path):
    code, _, err = run(capsys, "decode", "abc", "--model", str(tmp_path / "nope"), "--drafter", "ar")
    assert code == 1 and "cannot load model" in err and "tried" in err


def test_generate_with_a_profile_routes_and_is_lossless(capsys, tiny_model_dir, tiny_profile):
    out, err = run_ok(capsys, "generate", "what is 4 plus 7?", "--model", str(tiny_model_dir), "--profile",
                      str(tiny_profile), "--max-new-tokens", "12", "--dtype", "float32", "--json")
    obj = json.loads(out)
    assert obj["policy"] == "knn-ssd" and "route" in obj and obj["decision"] in DECISIONS
    ar, _ = run_ok(capsys, "decode", "what is 4 plus 7?", "--model", str(tiny_model_dir), "--drafter", "ar",
                   "--max-new-tokens", "12", "--dtype", "float32", "--json")
    assert json.loads(ar)["token_ids"] == obj["token_ids"]
    static, _ = run_ok(capsys, "generate", "what is 4 plus 7?", "--model", str(tiny_model_dir), "--profile",
                       str(tiny_profile), "--policy", "ssd-static", "--max-new-tokens", "12", "--dtype", "float32",
                       "--json")
    static = json.loads(static)
    assert static["applied"] == "global"
    # the global skip set drafted: in the JSON as text and as an object, and as text on stderr
    assert static["decision"] == "ssd" and static["skip"] == SkipSet.from_text(static["skip_text"]).to_dict()
    _, err = run_ok(capsys, "generate", "what is 4 plus 7?", "--model", str(tiny_model_dir), "--profile",
                    str(tiny_profile), "--policy", "ssd-static", "--max-new-tokens", "6", "--dtype", "float32")
    assert f"(skip {static['skip_text']}, " in err
    casc, _ = run_ok(capsys, "generate", "what is 4 plus 7?", "--model", str(tiny_model_dir), "--profile",
                     str(tiny_profile), "--policy", "cascade", "--max-new-tokens", "12", "--dtype", "float32", "--json")
    casc = json.loads(casc)
    assert casc["decision"] == "cascade" and casc["drafter"]["name"] == "cascade"
    assert casc["token_ids"] == obj["token_ids"]
    _, err = run_ok(capsys, "generate", "hello", "--model", str(tiny_model_dir), "--profile", str(tiny_profile),
                    "--max-new-tokens", "6", "--dtype", "float32")
    assert "decoded with" in err


@pytest.mark.parametrize("command, args, message", [
    ("decode", ["--policy", "knn-ssd"], "needs --profile"),
    ("decode", ["--profile", "PROFILE"], "adaptive generate PROMPT --profile DIR"),
    ("generate", [], "Missing option '--profile'"),
    ("generate", ["--profile", "PROFILE", "--skip-attn", "1"], "comes from the profile"),
    ("generate", ["--profile", "PROFILE", "--raw"], "--raw"),
    ("generate", ["--profile", "PROFILE", "--drafter", "ssd"], "--policy"),
])
def test_profile_options_belong_to_generate(capsys, tiny_model_dir, tiny_profile, command, args, message):
    args = [str(tiny_profile) if a == "PROFILE" else a for a in args]
    code, _, err = run(capsys, command, "abc", "--model", str(tiny_model_dir), "--dtype", "float32", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_model_named_explicitly_is_not_ignored_with_a_profile(capsys, tiny_profile, monkeypatch, command):
    """``--model NAME`` means that model even when NAME is the default's (it used to be taken as 'not
    given', and the profile's own model was loaded instead); without ``--model``, the profile's."""
    from adaptive.errors import ConfigError
    from adaptive.models import DEFAULT_MODEL
    from adaptive.runtime import AdaptiveRuntime

    asked = []

    def from_profile(cls, directory, model=None, **kw):
        asked.append(model)
        raise ConfigError("stopped here")

    monkeypatch.setattr(AdaptiveRuntime, "from_profile", classmethod(from_profile))
    tail = ["hi"] if command == "generate" else []
    for extra in (["--model", DEFAULT_MODEL], []):
        code, _, err = run(capsys, command, "--profile", str(tiny_profile), *extra, *tail)
        assert code != 0 and "stopped here" in err
    assert asked == [DEFAULT_MODEL, None]


def test_generate_a_conversation_reuses_each_turns_keys_and_decodes_what_it_would_from_scratch(
        capsys, monkeypatch, tiny_model_dir, tiny_profile, tmp_path):
    import io

    base = ["--model", str(tiny_model_dir), "--profile", str(tiny_profile), "--max-new-tokens", "8",
            "--dtype", "float32", "--json", "--no-online"]
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 4 plus 7?\n\nand 5 plus 9?\n"))
    out, _ = run_ok(capsys, "generate", "--chat", *base)
    turns = [json.loads(line) for line in out.splitlines()]
    assert len(turns) == 2  # one object per turn; the blank line is no turn
    assert turns[0]["stats"]["cached_tokens"] == 0
    assert turns[1]["stats"]["cached_tokens"] > turns[0]["stats"]["prompt_tokens"]  # turn 1 and its reply
    conversation = [{"role": "user", "content": "what is 4 plus 7?"},
                    {"role": "assistant", "content": turns[0]["text"]},
                    {"role": "user", "content": "and 5 plus 9?"}]
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(conversation))
    fresh, _ = run_ok(capsys, "generate", "--messages", str(path), *base, "--prefix-cache", "0")
    fresh = json.loads(fresh)
    assert fresh["stats"]["cached_tokens"] == 0
    assert fresh["token_ids"] == turns[1]["token_ids"]  # fp32: the cached turn decodes what a fresh one does


@pytest.mark.parametrize("args, content, message", [
    (["hello", "--messages", "FILE"], "[{\"role\": \"user\", \"content\": \"hi\"}]", "not both"),
    ([], None, "give a PROMPT, --messages FILE or --chat"),
    (["--messages", "FILE"], "{\"role\": \"user\"}", "non-empty JSON list"),
    (["--messages", "FILE"], "[{\"role\": \"user\", \"content\": 3}]", "string fields"),
    (["--messages", "FILE"], "not json", "is not JSON"),
    (["--messages", "MISSING"], None, "cannot read"),
    (["hello", "--prefix-cache", "-1"], None, "prefix-cache"),
])
def test_generate_conversation_errors_are_one_line(capsys, tiny_model_dir, tiny_profile, tmp_path, args, content,
                                                   message):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    args = [str(path) if a == "FILE" else str(tmp_path / "none.json") if a == "MISSING" else a for a in args]
    code, _, err = run(capsys, "generate", *args, "--model", str(tiny_model_dir), "--profile", str(tiny_profile))
    assert code != 0 and message in err and "Traceback" not in err
