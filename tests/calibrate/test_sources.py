import json

import pytest

from adaptive.calibrate.prompts import builtin_domains
from adaptive.calibrate.sources import PromptFileError, load_domains, parse_domain_args, read_prompt_rows


def write(path, text, mode="w"):
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_fields_and_text_files(tmp_path):
    f = write(tmp_path / "a.jsonl", "\n".join([
        json.dumps({"prompt": "one", "category": "qa"}),
        "",
        json.dumps({"turns": ["two", "later turn"]}),
        json.dumps({"text": "three"}),
    ]))
    assert read_prompt_rows(f) == [{"prompt": "one", "category": "qa"}, {"prompt": "two"}, {"prompt": "three"}]
    t = write(tmp_path / "b.txt", "first line\n\n second \n")
    assert [r["prompt"] for r in read_prompt_rows(t)] == ["first line", "second"]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', ":2: malformed JSON"),
    ('{"prompt": "ok"}\n{"question": "x"}\n', ":2: no 'prompt', 'turns' or 'text' field"),
    ('["a list"]\n', ":1: expected a JSON object"),
    ('{"turns": []}\n', ":1: 'turns' must be a non-empty list"),
    ('{"prompt": "  "}\n', ":1: the 'prompt' field must be a non-empty string"),
    ("\n\n", "no prompts in the file"),
])
def test_malformed_files_name_file_and_line(tmp_path, content, message):
    f = write(tmp_path / "p.jsonl", content)
    with pytest.raises(PromptFileError, match=message) as exc:
        read_prompt_rows(f)
    assert str(f) in str(exc.value)


def test_missing_binary_and_non_utf8(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        read_prompt_rows(tmp_path / "missing.jsonl")
    with pytest.raises(PromptFileError, match="not a file"):
        read_prompt_rows(tmp_path)
    with pytest.raises(PromptFileError, match="looks binary"):
        read_prompt_rows(write(tmp_path / "bin.txt", b"\x00\x01\x02abc", "wb"))
    with pytest.raises(PromptFileError, match=r":2: not valid UTF-8"):
        read_prompt_rows(write(tmp_path / "latin.txt", "ok\ncaf\xe9\n".encode("latin-1"), "wb"))


def test_domain_arguments(tmp_path):
    assert parse_domain_args(["code=a.jsonl", "maths = b.txt"]) == {"code": tmp_path.__class__("a.jsonl"),
                                                                   "maths": tmp_path.__class__("b.txt")}
    for bad in (["code"], ["=x.jsonl"], ["code="]):
        with pytest.raises(PromptFileError, match="NAME=PATH"):
            parse_domain_args(bad)
    with pytest.raises(PromptFileError, match="given twice"):
        parse_domain_args(["a=x.txt", "a=y.txt"])
    f = write(tmp_path / "c.txt", "p1\np2\n")
    assert load_domains([f"c={f}"]) == {"c": ["p1", "p2"]}


def test_builtin_domains_are_complete():
    d = builtin_domains()
    assert set(d) >= {"code", "math", "translation", "summarization", "qa", "writing", "rag"}
    for name, prompts in d.items():
        assert len(prompts) >= 20, name
        assert len(set(prompts)) == len(prompts), name
    # summarization and rag prompts carry real passages
    assert min(len(p.split()) for p in d["summarization"]) > 120
    assert all("Document 1" in p for p in d["rag"])
    assert load_domains(None) == d


def test_bare_paths_are_named_by_their_stem(tmp_path):
    from pathlib import Path

    got = parse_domain_args(["x/maths.jsonl", "code=a.txt"], "--data", bare=True)
    assert got == {"maths": Path("x/maths.jsonl"), "code": Path("a.txt")}
    for bad in (["=x.jsonl"], ["code="]):
        with pytest.raises(PromptFileError, match=r"--data takes \[NAME=\]PATH"):
            parse_domain_args(bad, "--data", bare=True)
    with pytest.raises(PromptFileError, match="given twice"):
        parse_domain_args(["a/m.txt", "b/m.txt"], "--data", bare=True)  # the same stem twice
