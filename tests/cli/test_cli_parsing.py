"""What the command line accepts, without loading a model: choices and help texts come from the
one vocabulary of each kind, invalid combinations do not parse, and bad values are one-line
usage errors (exit code 2)."""

from pathlib import Path

import click
import pytest

from adaptive.bench.runner import BENCH_METHODS
from adaptive.cli.common import Device, LayerList, NameEqualsPath, NameList, SizeList
from adaptive.cli.generate import DECODE_DRAFTERS
from adaptive.cli.main import cli
from adaptive.drafters.factory import DRAFTERS
from adaptive.runtime.policies import DISTILLED, POLICIES
from tests.helpers.cli import commands, run, run_ok


def _help(capsys, *command) -> str:
    out, _ = run_ok(capsys, *command, "--help")
    return out


def _option(command: str, name: str) -> click.Option:
    return next(p for p in commands()[command].params if name in p.opts)


def test_decode_offers_every_drafter_that_needs_no_profile(capsys):
    assert list(DECODE_DRAFTERS) == [k for k in DRAFTERS if k not in DISTILLED] and "ssd" in DECODE_DRAFTERS
    assert list(_option("decode", "--drafter").type.choices) == list(DECODE_DRAFTERS)
    text = _help(capsys, "decode")
    for name, description in DECODE_DRAFTERS.items():
        assert name in text and description.split()[0] in text
    assert "early-exit" not in text.split("Drafters:")[1].split("Examples:")[0]


def test_distill_trains_an_eagle_head_unless_told_otherwise():
    assert _option("distill", "--drafter").default == "eagle"


def test_generate_offers_every_policy(capsys):
    assert list(_option("generate", "--policy").type.choices) == list(POLICIES)
    assert _option("generate", "--profile").required
    text = _help(capsys, "generate")
    listed = text.split("Policies:")[1]
    for name in POLICIES:
        assert f"\n  {name} " in listed, name


def test_bench_lists_every_method(capsys):
    assert _option("bench", "--methods").type.choices == tuple(BENCH_METHODS)
    text = _help(capsys, "bench")
    options, methods = text.split("Methods (* needs --profile):")
    flat = " ".join(options.split())
    for m in BENCH_METHODS.values():
        assert f"\n  {m.name}{' *' if m.needs_profile else ''} " in methods, m.name
        assert m.name in flat.replace("- ", "-")  # click wraps the option's help at hyphens


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_has_examples(capsys, name):
    text = _help(capsys, *name.split())
    examples = text.split("Examples:")[1].strip().splitlines()
    assert len(examples) >= 2 and all(e.strip().startswith(f"adaptive {name}") for e in examples), examples


@pytest.mark.parametrize("command, args, message", [
    ("decode", ["--profile", "p"], "adaptive generate PROMPT --profile DIR"),
    ("decode", ["--policy", "knn-ssd"], "needs --profile"),
    ("decode", ["--full-vocab"], "adaptive generate --profile DIR --full-vocab"),
    ("decode", ["--method", "ssd"], "--drafter"),
    ("decode", ["--drafter", "early-exit"], "'early-exit' is not one of"),
    ("decode", ["--drafter", "knn-ssd"], "'knn-ssd' is not one of"),
    ("decode", ["--drafter", "pld", "--skip-attn", "1"], "--skip-attn/--skip-mlp are for --drafter ssd or cascade"),
    ("generate", [], "Missing option '--profile'; without a profile, `adaptive decode"),
    ("generate", ["--profile", "p", "--skip-attn", "1"], "comes from the profile"),
    ("generate", ["--profile", "p", "--skip-mlp", "1"], "comes from the profile"),
    ("generate", ["--profile", "p", "--draft-len", "3"], "--fixed-draft-len"),
    ("generate", ["--profile", "p", "--raw"], "encoded as at calibration"),
    ("generate", ["--profile", "p", "--drafter", "ssd"], "--policy"),
    ("generate", ["--profile", "p", "--method", "knn-ssd"], "--policy"),
    ("generate", ["--profile", "p", "--policy", "ssd"], "'ssd' is not one of"),
    ("decode", ["--prefill-model", "bf8"], "neither one of auto, off, bf16, f16, q8_0, no-repack nor a GGUF file"),
    ("serve", ["--profile", "p", "--prefill-model", "/no/such.gguf"], "nor a GGUF file"),
])
def test_invalid_combinations_do_not_parse(capsys, tmp_path, command, args, message):
    args = [str(tmp_path / "p") if a == "p" else a for a in args]
    code, out, err = run(capsys, command, "a prompt", "--model", str(tmp_path / "no-model"), *args)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("Error: ")
    assert "loading" not in err  # refused before any model loads


@pytest.mark.parametrize("args, message", [
    (["decode", "x", "--skip-attn", "1,x"], "Invalid value for '--skip-attn': cannot read 'x'"),
    (["decode", "x", "--skip-mlp", "5-3"], "Invalid value for '--skip-mlp': range '5-3' runs backwards"),
    (["decode", "x", "--dtype", "float8"], "Invalid value for '--dtype'"),
    (["decode", "x", "--device", "tpu"], "Invalid value for '--device'"),
    (["calibrate", "--domains", "math"], "Invalid value for '--domains': takes NAME=PATH, got 'math'"),
    (["calibrate", "--domains", "=a.jsonl"], "takes NAME=PATH"),
    (["calibrate", "--domains", "a=x.txt", "--domains", "a=y.txt"], "domain 'a' is given twice"),
    (["calibrate", "--vocab-sizes", "4k"], "Invalid value for '--vocab-sizes'"),
    (["calibrate", "--space", "grid"], "Invalid value for '--space'"),
    (["calibrate", "--backend", "mpi"], "Invalid value for '--backend'"),
    (["distill", "--profile", "p", "--data", "a="], "Invalid value for '--data': takes [NAME=]PATH"),
    (["distill", "--profile", "p", "--divergence", "kl"], "Invalid value for '--divergence'"),
    (["distill", "--profile", "p", "--drafter", "eagle", "--head-width", "0"], "Invalid value for '--head-width'"),
    (["distill", "--profile", "p", "--drafter", "early-exit", "--head-width", "64"],
     "--head-width are for --drafter eagle"),
    (["distill", "--profile", "p", "--divergence", "tvd"], "--refresh-every are for --drafter early-exit or a draft"),
    (["distill", "--profile", "p", "--exit-layer", "3"], "--exit-layer is for --drafter early-exit"),
    (["bench", "--data", "d.jsonl", "--methods", "ar,warp"], "unknown method(s) warp"),
    (["bench", "--data", "d.jsonl", "--methods", "ar,pld,ar"], "listed twice"),
    (["bench", "--data", "d.jsonl", "--methods", ","], "no method given"),
    (["bench", "--data", "d.jsonl", "--methods", "ar,knn-ssd"], "knn-ssd need --profile DIR"),
    (["route", "--profile", "p", "x", "--k", "0"], "Invalid value for '--k'"),
    (["route", "--profile", "p"], "give either PROMPT or --data FILE"),
    (["demo", "--repeats", "0"], "Invalid value for '--repeats'"),
    (["demo", "--max-new-tokens", "0"], "Invalid value for '--max-new-tokens'"),
])
def test_bad_values_are_one_line_usage_errors(capsys, tmp_path, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("Error: ")


def test_layer_list():
    t = LayerList()
    assert t.convert("3,5,10-14", None, None) == (3, 5, 10, 11, 12, 13, 14)
    assert t.convert("", None, None) == () and t.convert("none", None, None) == ()
    for bad in ("1,x", "5-3", "1,,2", "-1"):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)


def test_name_equals_path():
    t, bare = NameEqualsPath(), NameEqualsPath(bare=True)
    assert t.convert("code=a/b.jsonl", None, None) == ("code", Path("a/b.jsonl"))
    assert t.convert(" x = p.txt ", None, None) == ("x", Path("p.txt"))
    assert bare.convert("data/maths.jsonl", None, None) == ("maths", Path("data/maths.jsonl"))
    assert bare.convert("chat=c.txt", None, None) == ("chat", Path("c.txt"))
    for bad in ("code", "=a.txt", "code=", " = "):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)
    with pytest.raises(click.BadParameter):
        bare.convert("a=", None, None)


def test_size_list():
    t = SizeList()
    assert t.convert("2048,4096", None, None) == (2048, 4096)
    assert t.convert("none", None, None) == () and t.convert("NONE", None, None) == ()
    for bad in ("4k", "1.5", "a,b"):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)


def test_name_list():
    t = NameList(("ar", "pld", "knn-ssd"), noun="method")
    assert t.convert("pld, ar", None, None) == ("pld", "ar")
    for bad, why in (("ar,warp", "unknown method(s) warp"), ("ar,ar", "listed twice"), ("", "no method")):
        with pytest.raises(click.BadParameter, match=why.replace("(", r"\(").replace(")", r"\)")):
            t.convert(bad, None, None)


def test_top_level_help_names_the_two_decoding_commands(capsys):
    text = _help(capsys)
    assert "adaptive decode PROMPT" in text and "adaptive generate PROMPT --profile DIR" in text
    assert set(cli.commands) >= {"decode", "generate", "calibrate", "route", "profile", "bench", "distill", "demo"}


def test_device_type():
    t = Device()
    assert [t.convert(v, None, None) for v in ("auto", "CPU", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    for bad in ("tpu", "cuda:", "cuda:x", "cpu:0"):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)
