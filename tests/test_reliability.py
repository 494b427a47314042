"""Every bad input in docs/reliability.md: one readable line, a non-zero exit, nothing half-written.

The table in the doc and ``CASES`` below are checked against each other, so neither can drift.
Each case runs the real CLI on the tiny model; library-level typed exceptions are checked below.
"""

import json
import re
from pathlib import Path

import pytest

from adaptive.cli.main import main
from tests.conftest import TINY_DOMAINS

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def _domains(tmp, **override):
    """--domains arguments for the tiny domains, with some files replaced by ``override[name] = bytes``."""
    args = []
    for name, prompts in TINY_DOMAINS.items():
        f = tmp / f"{name}.jsonl"
        f.write_bytes(override.get(name, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts).encode()))
        args += ["--domains", f"{name}={f}"]
    return args


def _damaged_profile(tiny_profile, tmp, fn):
    import shutil

    dst = tmp / "damaged"
    shutil.copytree(tiny_profile, dst)
    fn(dst)
    return str(dst)


def _edit_json(d, fn):
    pj = d / "profile.json"
    data = json.loads(pj.read_text())
    fn(data)
    pj.write_text(json.dumps(data))


def _other_model(tmp):
    from tests.conftest import char_tokenizer, tiny_model

    other = tmp / "other-model"
    tiny_model("llama", seed=11).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    return str(other)


CAL = ["calibrate", "--quick", "--prompts-per-domain", "3", "--trials", "2", "--dtype", "float32", "--quiet"]
GEN = ["generate", "abc", "--dtype", "float32", "--max-new-tokens", "4", "--policy", "ar"]  # with --profile
DEC = ["decode", "abc", "--dtype", "float32", "--max-new-tokens", "4", "--drafter", "ar"]
SSD = ["decode", "abc", "--dtype", "float32", "--max-new-tokens", "4"]
DIS = ["distill", "--drafter", "early-exit", "--dtype", "float32", "--quiet", "--steps", "2"]

# id -> (argv builder (tmp, model_dir, tiny_profile) -> argv, expected text in the message)
CASES = {
    "prompt-file-missing": (lambda t, m, p: [*CAL, "--model", m, "--domains", "a=/nonexistent/a.jsonl"],
                            "no such file"),
    "prompt-file-empty": (lambda t, m, p: [*CAL, "--model", m, *_domains(t, math=b"")], "no prompts in the file"),
    "prompt-file-blank-lines": (lambda t, m, p: [*CAL, "--model", m, *_domains(t, math=b"\n  \n")],
                                "no prompts in the file"),
    "prompt-file-binary": (lambda t, m, p: [*CAL, "--model", m, *_domains(t, math=b"\x00\x01\x02PK")], "looks binary"),
    "prompt-file-not-utf8": (lambda t, m, p: [*CAL, "--model", m, *_domains(t, math=b'{"prompt": "ok"}\n\xff\xfe\n')],
                             "math.jsonl:2: not valid UTF-8"),
    "prompt-file-malformed-line": (lambda t, m, p: [*CAL, "--model", m,
                                                    *_domains(t, math=b'{"prompt": "a"}\n{"prompt": \n')],
                                   "math.jsonl:2: malformed JSON"),
    "prompt-file-no-prompt-field": (lambda t, m, p: [*CAL, "--model", m, *_domains(t, math=b'{"question": "a"}\n')],
                                    "math.jsonl:1: no 'prompt', 'turns' or 'text' field"),
    "domain-too-few-prompts": (lambda t, m, p: [*CAL, "--model", m,
                                                *_domains(t, math=b'{"prompt": "a"}\n{"prompt": "b"}\n')],
                               "calibration needs at least 3"),
    "domain-argument": (lambda t, m, p: [*CAL, "--model", m, "--domains", "math"], "NAME=PATH"),
    "domain-reserved-name": (lambda t, m, p: [*CAL, "--model", m, *_domains(t),
                                              "--domains", f"global={t / 'math.jsonl'}"],
                             "reserved"),
    "prompt-too-long-calibrate": (lambda t, m, p: [*CAL, "--model", m,
                                                   *_domains(t, math=("".join(json.dumps({"prompt": "a" * 600}) + "\n"
                                                                              for _ in range(3))).encode())],
                                  "domain 'math', prompt 1"),
    "prompt-too-long-generate": (lambda t, m, p: ["decode", "x" * 600, "--model", m, "--dtype", "float32",
                                                  "--drafter", "ar"],
                                 "the model's context is 512"),
    "model-unknown": (lambda t, m, p: [*DEC, "--model", str(t / "no-such-model")], "cannot load model"),
    "profile-other-model": (lambda t, m, p: [*GEN, "--profile", str(p), "--model", _other_model(t)], "calibrated for"),
    "profile-missing": (lambda t, m, p: [*GEN, "--model", m, "--profile", str(t / "nope")], "no such profile"),
    "profile-newer-schema": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: _edit_json(d, lambda x: x.update(schema_version=99)))], "newer than this adaptive reads"),
    "profile-unknown-schema": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: _edit_json(d, lambda x: x.update(schema_version=0)))], "unknown schema version"),
    "profile-json-corrupt": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: (d / "profile.json").write_text('{"format": '))], "not valid JSON"),
    "profile-index-truncated": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: (d / "anchors.faiss").write_bytes((d / "anchors.faiss").read_bytes()[:-20]))], "checksum"),
    "profile-file-missing": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: (d / "anchors.json").unlink())], "anchors.json: missing"),
    "profile-bigrams-corrupt": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: (d / "bigrams.npz").write_bytes(b"not a zip"))],
        "bigrams.npz: does not match its checksum"),
    "profile-skip-set-invalid": (lambda t, m, p: [*GEN, "--model", m, "--profile", _damaged_profile(
        p, t, lambda d: _edit_json(d, lambda x: x["domains"]["math"]["layer_skip"]["skip"].update(attn=[99])))],
        "malformed"),
    "skip-set-out-of-range": (lambda t, m, p: [*SSD, "--model", m, "--skip-attn", "40"], "has 4 layers"),
    "skip-set-malformed": (lambda t, m, p: [*SSD, "--model", m, "--skip-attn", "1,x"], "cannot read"),
    "max-new-tokens-zero": (lambda t, m, p: ["decode", "abc", "--model", m, "--max-new-tokens", "0"], "max_new_tokens"),
    "max-new-tokens-negative": (lambda t, m, p: ["decode", "abc", "--model", m, "--max-new-tokens", "-3"],
                                "max_new_tokens"),
    "temperature-negative": (lambda t, m, p: [*DEC, "--model", m, "--temperature", "-0.5"], "temperature"),
    "top-p-zero": (lambda t, m, p: [*DEC, "--model", m, "--top-p", "0"], "top_p"),
    "top-p-above-one": (lambda t, m, p: [*DEC, "--model", m, "--top-p", "1.5"], "top_p"),
    "draft-len-zero": (lambda t, m, p: [*SSD, "--model", m, "--skip-attn", "1", "--draft-len", "0"], "draft_len"),
    "jobs-zero": (lambda t, m, p: [*CAL, "--model", m, *_domains(t), "--jobs", "0"], "jobs"),
    "jobs-more-than-domains": (lambda t, m, p: [*CAL, "--model", m, *_domains(t), "--jobs", "9"], "use at most 3"),
    "trials-zero": (lambda t, m, p: [*CAL, "--model", m, *_domains(t), "--trials", "0"], "trials"),
    "vocab-sizes-malformed": (lambda t, m, p: [*CAL, "--model", m, *_domains(t), "--vocab-sizes", "4k"],
                              "--vocab-sizes"),
    "calibrate-out-not-a-profile": (lambda t, m, p: [*CAL, "--model", m, *_domains(t), "--out", str(_user_dir(t))],
                                    "exists and is not a profile"),
    "bench-method-unknown": (lambda t, m, p: ["bench", "--data", str(t / "math.jsonl"), "--model", m,
                                              "--methods", "fast", *_touch_data(t)], "unknown method"),
    "bench-method-needs-profile": (lambda t, m, p: ["bench", "--data", str(t / "math.jsonl"), "--model", m,
                                                    "--methods", "ar,cascade", *_touch_data(t)], "need --profile"),
    "bench-no-distilled-drafter": (lambda t, m, p: ["bench", "--data", str(t / "math.jsonl"), "--model", m, "--profile",
                                                    str(p), "--methods", "ar,early-exit", *_touch_data(t)],
                                   "no distilled early-exit drafter"),
    "generate-no-distilled-drafter": (lambda t, m, p: [*GEN[:-2], "--model", m, "--profile", str(p),
                                                       "--policy", "early-exit"],
                                      "no distilled early-exit drafter"),
    "distill-profile-missing": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(t / "nope")], "no such profile"),
    "distill-profile-other-model": (lambda t, m, p: [*DIS, "--model", _other_model(t), "--profile", str(p)],
                                    "calibrated for"),
    "distill-data-missing": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p),
                                              "--data", "/nonexistent/a.jsonl"],
                             "no such file"),
    "distill-too-few-prompts": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p), "--data",
                                                 str(_one_prompt(t))], "needs at least 2"),
    "distill-drafter-skip": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p), "--drafter", "skip"],
                             "not built"),
    "distill-drafter-other-tokenizer": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p), "--drafter",
                                                         _other_vocab_model(t)], "share the target's tokenizer"),
    "distill-exit-layer-too-large": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p), "--exit-layer", "4"],
                                     "leaves no layer to skip"),
    "distill-steps-negative": (lambda t, m, p: ["distill", "--model", m, "--profile", str(p), "--steps", "-1"],
                               "steps must be"),
    "distill-jsd-beta-out-of-range": (lambda t, m, p: [*DIS, "--model", m, "--profile", str(p), "--divergence", "jsd",
                                                       "--jsd-beta", "1.5"], "--jsd-beta"),
}


def _one_prompt(t):
    f = t / "one.jsonl"
    f.write_text(json.dumps({"prompt": "only one"}) + "\n")
    return f


def _other_vocab_model(t):
    from tests.conftest import char_tokenizer, tiny_model

    d = t / "other-vocab"
    tiny_model("llama", n_layers=2, vocab=60).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return str(d)


def _user_dir(t):
    d = t / "mine"
    d.mkdir(exist_ok=True)
    (d / "notes.txt").write_text("keep me")
    return d


def _touch_data(t):
    _domains(t)
    return []


def _doc_ids() -> list[str]:
    return re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(encoding="utf-8"), flags=re.M)


def test_the_doc_table_and_the_cases_are_the_same():
    assert sorted(_doc_ids()) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(case, capsys, tmp_path, tiny_model_dir, tiny_profile, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out (adaptive-profile) would land here
    build, message = CASES[case]
    argv = build(tmp_path, str(tiny_model_dir), tiny_profile)
    if "calibrate" in argv and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code not in (0, None)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("Error:")]
    # one readable line, last (before it, at most progress such as "loading MODEL ...")
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert message in errors[0] and "Traceback" not in err, err
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert after == before, sorted(set(after) ^ set(before))  # nothing written, nothing changed


def test_library_errors_are_typed(tiny_model_dir, tiny_profile, tmp_path):
    """The same problems raised from the library: a specific subclass of AdaptiveError each."""
    from adaptive import errors
    from adaptive.calibrate.runner import CalibrationSettings, calibrate
    from adaptive.calibrate.sources import PromptFileError, read_prompt_rows
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.engine.skip import SkipSet
    from adaptive.models import load_model
    from adaptive.profile import ProfileError, load_profile

    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"\xff\n")
    with pytest.raises(PromptFileError):
        read_prompt_rows(f)
    with pytest.raises(ProfileError):
        load_profile(tmp_path / "none")
    with pytest.raises(errors.ModelNotFoundError):
        load_model(str(tmp_path / "none"))
    with pytest.raises(errors.ConfigError):
        GenerationConfig(top_p=0.0)
    with pytest.raises(errors.ConfigError):
        CalibrationSettings(trials=0)
    with pytest.raises(errors.SkipSetError):
        SkipSet.from_text("attn=40", 4)
    lm = load_model(str(tiny_model_dir), dtype="float32")
    with pytest.raises(errors.PromptTooLongError):
        Engine(lm).generate("x" * 600, GenerationConfig(max_new_tokens=4))
    with pytest.raises(errors.PromptTooLongError, match="domain 'math', prompt 2"):
        calibrate(str(tiny_model_dir), {**TINY_DOMAINS, "math": ["ok", "y" * 600, "fine"]}, tmp_path / "o",
                  CalibrationSettings.quick(prompts_per_domain=3), dtype="float32", progress=False)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.work").exists()
    with pytest.raises(errors.ConfigError, match="use at most"):
        calibrate(str(tiny_model_dir), TINY_DOMAINS, tmp_path / "o", CalibrationSettings.quick(prompts_per_domain=3),
                  jobs=9, dtype="float32", progress=False)
